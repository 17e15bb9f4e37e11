"""Synthetic-acceptance PROJECTION (like vLLM's synthetic rejection sampling): what speculative decoding would
give on a large target whose trained weights we do not have here.

A Qwen3-8B-shaped target is built with OUR model classes from an HF-style config (random bf16 weights on the
GPU); its forward is timed on our paged-KV kernels for plain decode steps (1 token per sequence) and
verification steps (K + 1 tokens per sequence), and a drafter's cost is timed the same way. Acceptance is not
measured but replayed from a given per-position profile p_i = P(accepted length >= i) (vLLM's per-position
acceptance: accepted at position i / drafts): each step, each sequence accepts draft i with probability
p_i / p_(i-1) while the previous ones passed, emits accepted + 1 tokens and advances its context by that much.

    projected ratio = (emitted tokens / sum(verify + draft step time)) / (B * steps / sum(plain step time))

Every number this writes is a PROJECTION: random weights, replayed (not real) acceptance, forward time only
(CUDA-graph replays; host overhead excluded unless ``--host-overhead-ms`` adds it per step).

    python -m bench.synthetic --profile '[0.8,0.65,0.5,0.4,0.3]' --batch-sizes 1,4,16,64,256 --output synth.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import JsonReport, environment, int_list, log, median, output_path

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": {  # Qwen/Qwen3-8B config.json (shape fields)
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "tiny": {  # CPU smoke tests
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
}
BLOCK_SIZE = 16


def build_random_model(cfg: dict[str, Any], device: Any, dtype: Any, num_layers: int | None = None) -> Any:
    """Our model class for ``cfg`` (optionally with ``num_layers`` layers), random N(0, 0.02) weights made
    directly on ``device`` in ``dtype``; norm weights 1."""
    import torch

    from flexspec.distributed import TPGroup
    from flexspec.layers.rotary import RotaryEmbedding
    from flexspec.models.registry import build_model
    from flexspec.models.spec import ModelSpec

    spec = ModelSpec.from_hf(cfg if num_layers is None else {**cfg, "num_hidden_layers": num_layers})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(spec, TPGroup())
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.cos, m.sin = m.cos.float(), m.sin.float()
    return model.eval()


class StepGraph:
    """One step shape of ``model``: ``B`` sequences x ``q`` new tokens each, logits for the last
    ``num_logits`` tokens of every sequence; static buffers, replayed as a CUDA graph when possible.

    Sequence s owns KV blocks [s * max_blocks, (s + 1) * max_blocks), so slots follow from positions."""

    def __init__(
        self,
        model: Any,
        batch: int,
        q: int,
        num_logits: int,
        max_blocks: int,
        use_graph: bool,
        pool: Any = None,
    ) -> None:
        import torch

        from flexspec.layers.attention import AttentionMetadata

        self.torch, self.model = torch, model
        dev = next(model.parameters()).device
        self.batch, self.q, self.max_blocks = batch, q, max_blocks
        T = batch * q
        self.input_ids = torch.randint(0, 100, (T,), device=dev)  # [T]
        self.offsets = torch.arange(q, device=dev).repeat(batch)  # [T] token index inside its sequence
        self.seq_of_token = torch.arange(batch, device=dev).repeat_interleave(q)  # [T]
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)  # [T]
        self.slot_mapping = torch.zeros(T, dtype=torch.int64, device=dev)  # [T]
        blocks = torch.arange(batch * max_blocks, dtype=torch.int32, device=dev)
        self.block_tables = blocks.view(batch, max_blocks)  # [B, max_blocks]
        self.context_lens = torch.zeros(batch, dtype=torch.int32, device=dev)  # [B]
        rows = torch.arange(batch, device=dev)[:, None] * q + torch.arange(q - num_logits, q, device=dev)
        self.meta = AttentionMetadata(
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            context_lens=self.context_lens,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev) * q,  # [B+1]
            max_query_len=q,
            logits_indices=rows.reshape(-1),  # [B * num_logits]
        )
        self.set_context([1] * batch)
        for _ in range(2):  # Triton JIT / autotune outside the graph
            self._forward()
        self.graph = None
        if use_graph and dev.type == "cuda":
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.logits = self._forward()
            torch.cuda.synchronize()

    @property
    def pool(self) -> Any:
        return self.graph.pool() if self.graph is not None else None

    def _forward(self) -> Any:
        with self.torch.inference_mode():
            hidden, _ = self.model(self.input_ids, self.meta)
            return self.model.compute_logits(hidden[self.meta.logits_indices])  # [B * num_logits, V]

    def set_context(self, ctx: list[int]) -> None:
        """Sequence s has ``ctx[s]`` tokens cached; the step's tokens sit at positions ctx[s] .. ctx[s] + q - 1."""
        torch = self.torch
        c = torch.tensor(ctx, dtype=torch.int64).to(self.positions.device, non_blocking=True)  # [B]
        pos = c[self.seq_of_token] + self.offsets  # [T]
        self.positions.copy_(pos)
        self.slot_mapping.copy_(self.seq_of_token * (self.max_blocks * BLOCK_SIZE) + pos)
        self.context_lens.copy_(c.to(torch.int32))

    def timed(self) -> float:
        """Run once; seconds (CUDA events on GPU)."""
        torch = self.torch
        if self.positions.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay() if self.graph is not None else self._forward()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        self._forward()
        return time.perf_counter() - t0


def bind_kv_cache(model: Any, num_blocks: int, dtype: Any) -> None:
    import torch

    from flexspec.layers.attention import Attention

    dev = next(model.parameters()).device
    for a in model.modules():
        if isinstance(a, Attention):
            shape = (num_blocks, BLOCK_SIZE, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=dtype, device=dev)
            a.v_cache = torch.zeros(shape, dtype=dtype, device=dev)


def sample_accepted(profile: list[float], rng: random.Random) -> int:
    """Accepted length under P(a >= i) = profile[i-1] (conditional rate profile[i-1] / profile[i-2])."""
    prev = 1.0
    for i, p in enumerate(profile):
        cond = min(1.0, p / prev) if prev > 0 else 0.0
        if rng.random() >= cond:
            return i
        prev = p
    return len(profile)


def load_profile(args: argparse.Namespace) -> list[float]:
    text = args.profile
    if Path(text).is_file():
        text = Path(text).read_text()
    data = json.loads(text)
    if isinstance(data, dict):  # a spec_bench results file: sum one system's counters over its runs
        runs = [
            r
            for r in data.get("runs", [])
            if r.get("system") == args.profile_system
            and r.get("spec_decode")
            and (args.profile_dataset is None or r.get("dataset") == args.profile_dataset)
        ]
        if not runs:
            raise SystemExit(
                f"no runs of system {args.profile_system!r} with spec_decode counters in {args.profile}"
            )
        drafts = sum(r["spec_decode"]["num_drafts"] for r in runs)
        n = max(len(r["spec_decode"]["num_accepted_tokens_per_pos"]) for r in runs)
        acc = [
            sum((r["spec_decode"]["num_accepted_tokens_per_pos"] + [0] * n)[i] for r in runs)
            for i in range(n)
        ]
        data = [a / drafts for a in acc] if drafts else []
    if not isinstance(data, list) or not data or any(not 0 <= float(x) <= 1 for x in data):
        raise SystemExit("--profile must be a non-empty JSON list of acceptance rates in [0, 1]")
    return [float(x) for x in data]


def build_parser(prog: str = "python -m bench.synthetic") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--profile", required=True, help="JSON list p_1..p_K, a file with one, or a spec_bench JSON."
    )
    p.add_argument(
        "--profile-system", default=None, help="With a spec_bench JSON: the system label to replay."
    )
    p.add_argument("--profile-dataset", default=None, help="With a spec_bench JSON: only this dataset.")
    p.add_argument("--label", default=None, help="Name of this projection in plots.")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument(
        "--config-json", default=None, help="HF config.json to take the target shape from instead."
    )
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--context-len", type=int, default=1024, help="Cached tokens per sequence at the start.")
    p.add_argument("--steps", type=int, default=24, help="Replayed steps per batch size and step type.")
    p.add_argument(
        "--drafter-layers", type=int, default=1, help="Drafter = this many target-shaped layers; 0 = free."
    )
    p.add_argument(
        "--drafter-style",
        choices=["parallel", "autoregressive"],
        default="parallel",
        help="parallel: one forward over K+1 tokens (DFlash-like); autoregressive: K 1-token forwards.",
    )
    p.add_argument(
        "--host-overhead-ms", type=float, default=0.0, help="Added to every step (engine overhead)."
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--eager", action="store_true", help="No CUDA graphs.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=output_path, default=None)
    return p


def project_batch(
    target: Any,
    drafter: Any,
    b: int,
    profile: list[float],
    args: argparse.Namespace,
    dtype: Any,
    rng: random.Random,
) -> dict[str, Any]:
    import torch

    K = len(profile)
    max_len = args.context_len + args.steps * (K + 1) + K + 2
    max_blocks = -(-max_len // BLOCK_SIZE)
    use_graph = not args.eager
    bind_kv_cache(target, b * max_blocks, dtype)
    plain = StepGraph(target, b, 1, 1, max_blocks, use_graph)
    verify = StepGraph(target, b, K + 1, K + 1, max_blocks, use_graph, pool=plain.pool)
    draft = None
    if drafter is not None:
        bind_kv_cache(drafter, b * max_blocks, dtype)
        q = K + 1 if args.drafter_style == "parallel" else 1
        draft = StepGraph(drafter, b, q, K if q > 1 else 1, max_blocks, use_graph, pool=plain.pool)
    over = args.host_overhead_ms / 1e3
    ctx = [args.context_len] * b
    t_plain = []
    for _ in range(args.steps):
        plain.set_context(ctx)
        t_plain.append(plain.timed() + over)
        ctx = [c + 1 for c in ctx]
    ctx = [args.context_len] * b
    t_verify, t_draft, emitted, accepted = [], [], 0, []
    for _ in range(args.steps):
        verify.set_context(ctx)
        t_verify.append(verify.timed() + over)
        td = 0.0
        if draft is not None:
            for j in range(1 if args.drafter_style == "parallel" else K):
                draft.set_context([c + j for c in ctx])
                td += draft.timed()
        t_draft.append(td)
        acc = [sample_accepted(profile, rng) for _ in range(b)]
        accepted.extend(acc)
        emitted += sum(a + 1 for a in acc)
        ctx = [c + a + 1 for c, a in zip(ctx, acc)]
    plain_tps = b * len(t_plain) / sum(t_plain)
    spec_tps = emitted / (sum(t_verify) + sum(t_draft))
    expected = 1 + sum(profile)
    analytic = expected * median(t_plain) / (median(t_verify) + median(t_draft))
    del plain, verify, draft
    for m in (target, drafter):
        if m is not None:
            bind_kv_cache(m, 0, dtype)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "batch_size": b,
        "plain_step_ms_p50": round(median(t_plain) * 1e3, 4),
        "verify_step_ms_p50": round(median(t_verify) * 1e3, 4),
        "draft_ms_p50": round(median(t_draft) * 1e3, 4),
        "plain_tokens_per_s": round(plain_tps, 2),
        "projected_spec_tokens_per_s": round(spec_tps, 2),
        "projected_throughput_ratio": round(spec_tps / plain_tps, 4),
        "analytic_throughput_ratio": round(analytic, 4),
        "replayed_mal": round(1 + sum(accepted) / len(accepted), 4),
    }


def main(argv: list[str] | None = None, prog: str = "python -m bench.synthetic") -> dict[str, Any]:
    import torch

    args = build_parser(prog).parse_args(argv)
    profile = load_profile(args)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = json.loads(Path(args.config_json).read_text()) if args.config_json else SHAPES[args.shape]
    report = JsonReport(
        args.output,
        {
            "schema": "flexspec.bench.synthetic/1",
            "projection": True,
            "note": "PROJECTION, not a measurement: random weights, acceptance replayed from the given per-position "
            "profile, forward time only (CUDA-graph replays on GPU) plus --host-overhead-ms per step.",
            "env": environment(),
            "config": {
                "shape": args.config_json or args.shape,
                "label": args.label,
                "target_config": cfg,
                "profile": profile,
                "num_speculative_tokens": len(profile),
                "expected_mal": round(1 + sum(profile), 4),
                "device": str(device),
                "dtype": str(dtype),
                **{k: v for k, v in vars(args).items() if k not in ("profile", "output", "config_json")},
            },
            "points": [],
        },
    )
    t0 = time.perf_counter()
    target = build_random_model(cfg, device, dtype)
    drafter = build_random_model(cfg, device, dtype, args.drafter_layers) if args.drafter_layers > 0 else None
    report.doc["config"]["target_params_b"] = round(sum(p.numel() for p in target.parameters()) / 1e9, 3)
    report.doc["config"]["build_s"] = round(time.perf_counter() - t0, 2)
    rng = random.Random(args.seed)
    for b in args.batch_sizes:
        try:
            point = project_batch(target, drafter, b, profile, args, dtype, rng)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest batch: record and go on
            point = {"batch_size": b, "error": f"{type(e).__name__}: {e}"[:500]}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        report.doc["points"].append(point)
        report.save()
        log(f"PROJECTION b={b}: {point}")
    return report.doc


if __name__ == "__main__":
    main_entry(main)
