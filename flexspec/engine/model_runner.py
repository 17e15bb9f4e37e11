"""Loads one TP shard of the model, owns its KV cache, and runs batches (eager or CUDA graph)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from configs.engine import EngineConfig
from flexspec.distributed import TPGroup
from flexspec.engine.cuda_graphs import DecodeGraphs, MixedGraphs
from flexspec.engine.graph_inputs import gather_prev_tokens
from flexspec.engine.kv_cache import bind_kv_cache, move_kv_slots
from flexspec.engine.model_input import ModelInput, ModelOutput
from flexspec.engine.sampler import SamplingMetadata, attach_logprobs, sample
from flexspec.errors import ConfigError
from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec.layers.rotary import RotaryEmbedding
from flexspec.models.loader import load_config, load_weights, resolve_model_dir
from flexspec.models.registry import build_model
from flexspec.models.spec import ModelSpec
from flexspec.spec.tree import tree_mask
from flexspec_kernels import pack_masks
from flexspec_kernels.attention_split import split_kv_setting
from flexspec_kernels.pdl import pdl_setting
from flexspec_kernels.skinny_linear import dot_preload

log = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A launched plain step: sampled ids land in ``tokens`` (host) once ``event`` completes."""

    tokens: torch.Tensor  # [N] int64, pinned host memory
    event: torch.cuda.Event | None  # None on CPU (the step ran synchronously)
    logits: torch.Tensor  # [N, V] fp32 on the device (for logprobs at collect time)
    num_logprobs: int | None
    inp: ModelInput | None = None  # kept with a drafter (its histories take the sampled ids at collect time)
    followed_ahead: bool = False  # the next step was launched before this one's ids were read back


MIXED_GRAPH_MAX_ERROR = 0.1  # graph vs eager logits, per row: bf16 tile-order noise ~1e-2; a wrong layout ~1

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def verification_query_lens(num_speculative_tokens: int) -> list[int]:
    """Query lengths that get verification graphs: powers of two below 1 + K, and 1 + K (K=15: 2, 4, 8, 16)."""
    lens, q = [], 2
    while q < 1 + num_speculative_tokens:
        lens.append(q)
        q *= 2
    return [*lens, 1 + num_speculative_tokens]


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA/ROCm device is visible", param="device")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        # bf16 GEMMs are ~300x slower than fp32 on the AVX2 CPUs we run on.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    """One rank's model shard + KV cache.

    Args:
        config: engine settings (model, memory, batching).
        tp: this process's tensor-parallel group (``TPGroup()`` for a single process).
        extra_kv_bytes: bytes reserved outside the KV cache (e.g. a drafter's weights and buffers).
    """

    def __init__(
        self, config: EngineConfig, tp: TPGroup | None = None, device: torch.device | None = None
    ) -> None:
        self.config = config
        # FLEXSPEC_SPLIT_KV, _PDL and _DOT_PRELOAD checked at start on every device (EnvSettingError naming it)
        split_kv_setting()
        pdl_setting()
        dot_preload()
        self.tp = tp or TPGroup()
        self.device = device or resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        t0 = time.perf_counter()
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = load_config(self.model_dir)
        self.spec = ModelSpec.from_hf(self.hf_config)
        problem = self.spec.context_problem(config.max_model_len)
        if problem is not None:
            raise ConfigError(f"max_model_len {problem}", param="max_model_len")
        self.model = build_model(self.spec, self.tp)
        load_weights(self.model, self.model_dir)
        self.model.to(device=self.device, dtype=self.dtype)
        for m in self.model.modules():  # RoPE tables stay fp32 whatever the weight dtype
            if isinstance(m, RotaryEmbedding):
                m.cos, m.sin = m.cos.float(), m.sin.float()
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0
        if self.device.type == "cuda" and self.tp.size == 1 and hasattr(self.model, "tune_skinny"):
            self._tune_skinny()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.block_size = config.kv_block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.num_kv_blocks = 0
        self.kv_cache: torch.Tensor | None = None  # all layers' K/V in one tensor (``allocate_kv_cache``)
        self.graphs: list[DecodeGraphs] = []  # by query length: plain decode (1) and verification (1 + K)
        self.mixed_graphs: MixedGraphs | None = None  # steps that prefill (any split of <= N tokens)
        self.spec_worker = None
        # Pinned readback buffers of sampled token ids, used in turn: with async scheduling a step is launched
        # before the previous one's ids are read.
        self._tokens_host: list[torch.Tensor] = []
        self._num_launched = 0
        # [N] int64 on the device: the last plain step's sampled ids, which a step scheduled ahead gathers its
        # input ids from (set only on this runner's plain launch path; the engine schedules ahead only after
        # plain steps, and never after one with logprobs: the next replay overwrites the graph's logits)
        self._last_tokens: torch.Tensor | None = None
        self._last_pending: PendingStep | None = None
        if config.speculative_config is not None:
            from flexspec.spec.spec_worker import SpecDecodeWorker

            self.spec_worker = SpecDecodeWorker(self, config.speculative_config)

    def _tune_skinny(self) -> None:
        """Which decode / small verification steps take the skinny fused GEMMs ("auto": measured here)."""
        from flexspec.layers import fused

        if fused.SKINNY != "auto" or not fused.ENABLED:
            return
        try:
            rows = self.model.tune_skinny()
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile here must not stop serving
            log.warning("skinny fused GEMMs disabled (%s: %s)", type(e).__name__, e)
            self.model.skinny_max_rows = 0
            return
        log.info(
            "skinny fused GEMMs for steps of <= %d tokens (us per layer: %s)", rows, self.model.skinny_timing
        )

    # ---- memory -------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        per_layer = sum(2 * self.block_size * a.num_kv_heads * a.head_dim for a in self.attn_layers)
        return per_layer * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, reserved_bytes: int = 0) -> int:
        """Size the KV cache from the memory budget and bind it to every attention layer. Returns blocks.

        The drafter's weights and buffers are counted against the same budget.
        """
        cfg = self.config
        per_block = self.kv_bytes_per_block()
        if self.spec_worker is not None:
            reserved_bytes += self.spec_worker.drafter.memory_bytes()
            per_block += self.spec_worker.drafter.kv_bytes_per_block()  # a drafter cache sized after ours
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self.device.type == "cuda":
            self._profile_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * cfg.gpu_memory_utilization - used - reserved_bytes
            num_blocks = int(budget // per_block)
        else:
            num_blocks = int((cfg.cpu_kv_cache_gib * 2**30 - reserved_bytes) // per_block)
        # Never more than the batch can use, and at least one full-length sequence.
        num_blocks = min(num_blocks, cfg.max_num_seqs * self.max_blocks_per_seq + 1)
        if num_blocks < self.max_blocks_per_seq:
            raise ConfigError(
                f"KV cache of {num_blocks} blocks cannot hold one sequence of max_model_len "
                f"{cfg.max_model_len}; lower max_model_len or raise the memory budget",
                param="max_model_len",
            )
        # [L, 2, blocks, block_size, Hkv, D] when every layer's shape is the same, else None
        self.kv_cache = bind_kv_cache(self.attn_layers, num_blocks, self.block_size, self.dtype, self.device)
        self.num_kv_blocks = num_blocks
        if self.spec_worker is not None:
            self.spec_worker.drafter.allocate(num_blocks)
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self.capture_cuda_graphs()
        return num_blocks

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs (1 token per sequence) and, with a drafter, verification graphs for query
        lengths 2, 4, 8, ... up to 1 + K (selective verification sends fewer drafts: a step replays the smallest
        graph its longest query fits; query length 1 too when launched plain steps must capture the drafter's
        target layers), then the drafter's own graphs, then the graphs of steps that prefill (``MixedGraphs``,
        last: they matter least if memory runs out). The activation memory cached by ``_profile_peak`` is
        released first, so the graph pools reuse what the KV-cache budget left for activations."""
        torch.cuda.empty_cache()
        sizes = self.config.cuda_graph_batch_sizes
        try:
            self.graphs = [DecodeGraphs(self, sizes)]
        except Exception as e:  # noqa: BLE001 - never fail serving because capture failed: run eagerly
            log.warning("decode CUDA graphs not captured (%s: %s); running eagerly", type(e).__name__, e)
            self.graphs = []
            return
        self._capture_spec_graphs(sizes)
        self.capture_mixed_graphs()

    def _capture_spec_graphs(self, sizes: list[int]) -> None:
        if self.spec_worker is None:
            return
        drafter = self.spec_worker.drafter
        layers = tuple(drafter.capture_layers)
        pool = None
        query_lens = verification_query_lens(drafter.max_chain_drafts)
        if drafter.observes_plain_steps:  # launched plain steps capture the drafter's layers
            query_lens = [1, *query_lens]
        for q in reversed(query_lens):  # largest first: one pool
            try:
                graphs = DecodeGraphs(self, sizes, query_len=q, capture_layers=layers, pool=pool)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory for large K x batch: verify eagerly
                log.warning(
                    "verification CUDA graphs (query length %d) not captured (%s); eager instead", q, e
                )
                continue
            pool = graphs.pool
            self.graphs.append(graphs)
        q_tree = 1 + drafter.num_speculative_tokens
        trees = getattr(drafter, "tree_topk", 1) > 1  # draft trees: one graph family, masks as inputs
        if trees and q_tree > 63:
            log.warning("draft trees of %d nodes: no CUDA graphs (62 at most); verified eagerly", q_tree - 1)
        elif trees:
            try:
                tree = DecodeGraphs(
                    self, sizes, query_len=q_tree, capture_layers=layers, pool=pool, tree=True
                )
                self.graphs.append(tree)
            except Exception as e:  # noqa: BLE001 - trees are then verified eagerly
                log.warning(
                    "draft-tree CUDA graphs (query length %d) not captured (%s); eager instead", q_tree, e
                )
        self.graphs.sort(key=lambda g: (g.q, g.tree))  # forward() replays the first graph that fits
        try:
            drafter.capture_graphs(sizes)
        except Exception as e:  # noqa: BLE001 - the drafter keeps drafting eagerly
            log.warning("drafter CUDA graphs not captured (%s: %s); drafting eagerly", type(e).__name__, e)
        self.spec_worker.capture_fused(self.graphs)

    def mixed_graph_num_tokens(self) -> list[int]:
        """Token counts to capture as ``MixedGraphs``: ``cuda_graph_num_tokens`` below the step token budget,
        plus the budget itself so that every step fits (empty when the setting is empty)."""
        budget = self.config.max_num_batched_tokens
        sizes = [n for n in self.config.cuda_graph_num_tokens if n < budget]
        return sorted({*sizes, budget}) if self.config.cuda_graph_num_tokens else []

    def capture_mixed_graphs(self) -> None:
        """Capture ``MixedGraphs`` (steps that prefill) with the drafter's target layers, then check one replay
        of a chunked-prefill + decode + verification step against the eager forward; on any failure those
        steps run eagerly."""
        sizes = self.mixed_graph_num_tokens()
        if not sizes:
            return
        layers = tuple(self.spec_worker.drafter.capture_layers) if self.spec_worker is not None else ()
        graphs, err, why = None, float("inf"), ""
        try:
            graphs = MixedGraphs(self, sizes, capture_layers=layers, pool=self.graphs[0].pool)
            err = self._check_mixed_graphs(graphs)
            why = f"relative logits error {err:.3g} against the eager forward"
        except Exception as e:  # noqa: BLE001 - never fail serving because capture failed: run eagerly
            why = f"{type(e).__name__}: {e}"
        ok = err < MIXED_GRAPH_MAX_ERROR
        # Every rank replays or none does (a replay on one rank only would hang the others' collectives).
        if self.tp.size > 1:
            ok = bool(self.tp.all_reduce(torch.tensor([0.0 if ok else 1.0], device=self.device)).item() == 0)
        if not ok:
            log.warning("mixed-step CUDA graphs not used (%s); steps that prefill run eagerly", why)
            return
        self.mixed_graphs = graphs

    @torch.inference_mode()
    def _check_mixed_graphs(self, graphs: MixedGraphs) -> float:
        """Largest relative error (L2, per row) of graph vs eager logits on a step that reads and writes the KV
        cache: sequence 0 prefills a context (up to 40 tokens) eagerly, then one step holds its next token
        (decode), a query of up to 4 tokens on the same context (verification; slots -1) and a prompt of up to
        23 tokens written to fresh blocks, as many of the three as ``max_num_seqs`` allows, and fewer tokens than
        the graph it replays (so the pad tokens' dummy sequence is there too). Nothing else is in the cache yet:
        the blocks written here are overwritten before any request reads them. 0.0 when no such step fits the
        configuration (the capture is trusted then)."""
        bs, cfg = self.block_size, self.config
        ids = lambda n, o: [(7 * i + o) % self.spec.vocab_size for i in range(n)]
        slots = lambda blocks, start, n: [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        ctx = min(40, cfg.max_model_len - 1)
        n_verify = min(4, cfg.max_model_len - ctx)
        n_prompt = min(23, cfg.max_model_len, graphs.max_tokens - 2 - n_verify)
        ctx_blocks = list(range(-(-(ctx + 1) // bs)))
        new_blocks = [len(ctx_blocks) + i for i in range(-(-max(n_prompt, 0) // bs))]
        if ctx < 1 or n_prompt < 1 or len(ctx_blocks) + len(new_blocks) > self.num_kv_blocks:
            return 0.0
        self.forward(
            ModelInput(
                input_ids=ids(ctx, 1), positions=list(range(ctx)), slot_mapping=slots(ctx_blocks, 0, ctx),
                block_tables=[ctx_blocks], context_lens=[0], query_lens=[ctx], logits_indices=[ctx - 1],
            )
        )  # fmt: skip
        seqs = [  # (input ids, positions, slots, block table, context length)
            ([11], [ctx], slots(ctx_blocks, ctx, 1), ctx_blocks, ctx),
            (ids(n_verify, 3), list(range(ctx, ctx + n_verify)), [-1] * n_verify, ctx_blocks, ctx),
            (ids(n_prompt, 5), list(range(n_prompt)), slots(new_blocks, 0, n_prompt), new_blocks, 0),
        ][-cfg.max_num_seqs :]
        step = ModelInput(
            input_ids=[t for q in seqs for t in q[0]],
            positions=[p for q in seqs for p in q[1]],
            slot_mapping=[x for q in seqs for x in q[2]],
            block_tables=[q[3] for q in seqs],
            context_lens=[q[4] for q in seqs],
            query_lens=[len(q[0]) for q in seqs],
            logits_indices=list(range(sum(len(q[0]) for q in seqs))),
            capture_layers=graphs.capture_layers,
        )
        if not graphs.can_run(step):
            return 0.0
        rows, _ = graphs.run(step)
        got = self.model.compute_logits(rows)
        want, _ = self.forward(step)  # eager: self.mixed_graphs is not set yet
        want = want.float()
        return float(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).max())

    @torch.inference_mode()
    def _profile_peak(self) -> None:
        """Run a max-size prefill once so activation memory is counted before the KV cache takes the rest."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        for a in self.attn_layers:  # a 1-block stand-in cache (nothing is written: all slots are -1)
            shape = (1, self.block_size, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        inp = ModelInput(
            input_ids=[0] * n,
            positions=list(range(n)),
            slot_mapping=[-1] * n,
            block_tables=[[]],
            context_lens=[0],
            query_lens=[n],
            logits_indices=list(range(min(n, self.config.max_num_seqs))),
        )
        self.forward(inp)
        for a in self.attn_layers:
            a.k_cache = a.v_cache = torch.empty(0)
        torch.cuda.synchronize(self.device)

    def move_kv(self, src_slots: list[int] | torch.Tensor, dst_slots: list[int] | torch.Tensor) -> None:
        """Copy the K/V (and feature-cache rows, when a drafter keeps them) of KV slots ``src_slots`` to
        ``dst_slots``, in every layer: draft-tree verification keeps the accepted nodes at their positions'
        slots (``flexspec.engine.kv_cache.move_kv_slots``). Sync-free."""
        features = getattr(self.model, "feature_cache", None)
        move_kv_slots(self.attn_layers, self.kv_cache, features, src_slots, dst_slots)

    # ---- execution ----------------------------------------------------------------------------------------
    def build_metadata(self, inp: ModelInput) -> tuple[torch.Tensor, AttentionMetadata]:
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        width = max((len(b) for b in inp.block_tables), default=0) or 1
        tables = [b + [0] * (width - len(b)) for b in inp.block_tables]
        qsl = [0]
        for q in inp.query_lens:
            qsl.append(qsl[-1] + q)
        meta = AttentionMetadata(
            positions=t(inp.positions, torch.int64),
            slot_mapping=t(inp.slot_mapping, torch.int64),
            block_tables=t(tables, torch.int32),
            context_lens=t(inp.context_lens, torch.int32),
            query_start_loc=t(qsl, torch.int32),
            max_query_len=max(inp.query_lens, default=1),
            logits_indices=t(inp.logits_indices, torch.int64),
        )
        if (
            inp.draft_parents is not None
        ):  # draft trees: every sequence gets its [n, n] mask (causal: no tree)
            masks = [
                tree_mask(tree, q - d) if tree is not None else tree_mask((), q)
                for tree, q, d in zip(inp.draft_parents, inp.query_lens, inp.num_draft_tokens)
            ]
            mask, mask_start_loc = pack_masks(masks)
            meta.mask = mask.to(dev, non_blocking=True)
            meta.mask_start_loc = mask_start_loc.to(dev, non_blocking=True)
        return t(inp.input_ids, torch.int64), meta

    @torch.inference_mode()
    def forward(
        self, inp: ModelInput, side=None, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the model; returns (logits [N, V] fp32 for ``logits_indices``, captured hidden [T, H] each).

        ``side`` (a ``SideStream``) adds tokens that join at a later layer (FlexDraft parallel mode).
        ``prev_tokens`` ([N'] int64 on the device, the previous step's sampled ids) gives the input ids when
        ``inp.prev_token_rows`` is set (async scheduling).

        Raises:
            ValueError: ``inp.prev_token_rows`` without ``prev_tokens`` or not one row per token.
        """
        if inp.prev_token_rows is not None and (
            prev_tokens is None or len(inp.prev_token_rows) != inp.num_tokens
        ):
            raise ValueError(
                "prev_token_rows needs the previous step's sampled ids and one row per input token"
            )
        if side is None and all(inp.samples or [True]):  # draft trees replay tree graphs only (can_run)
            for graphs in self.graphs:
                if graphs.can_run(inp):
                    return graphs.run(inp, prev_tokens)
        # Steps that prefill, also with chunks that emit nothing yet (their rows are not in logits_indices).
        mixed = self.mixed_graphs
        if side is None and inp.draft_parents is None and mixed is not None and mixed.can_run(inp):
            rows, captured = mixed.run(inp, prev_tokens)
            return self.model.compute_logits(rows, upcast=False), captured
        input_ids, meta = self.build_metadata(inp)
        if inp.prev_token_rows is not None:
            rows = torch.tensor(inp.prev_token_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            gather_prev_tokens(input_ids, rows, prev_tokens)
        kwargs = {"side": side} if side is not None else {}
        hidden, captured = self.model(input_ids, meta, capture_layers=inp.capture_layers, **kwargs)
        logits = self.model.compute_logits(hidden[meta.logits_indices], upcast=False)
        return logits, captured

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> ModelOutput | None:
        """Forward + sampling (or verification + drafting). Every rank runs the forward; rank 0 returns."""
        if self.spec_worker is not None:
            return self.spec_worker.execute(inp)
        if not self.tp.is_first:
            self.forward(inp)
            return None
        return self.collect(self.launch(inp))

    @torch.inference_mode()
    def launch(self, inp: ModelInput):
        """Enqueue a plain step (forward + sampling) without waiting for the device: the sampled token ids are
        copied to pinned host memory behind an event. ``collect`` must run before the next ``launch`` (graph
        logits are static buffers the next replay overwrites). With a drafter, only steps its worker allows:
        plain ones (``SpecDecodeWorker.can_run_plain``) and device-side verification steps, which the worker
        enqueues itself (``SpecDecodeWorker.can_launch``; returns its ``PendingSpecStep``)."""
        worker = self.spec_worker
        if worker is not None and not worker.can_run_plain(inp):
            return worker.launch(inp)  # a device-side verification step (SpecDecodeWorker.can_launch)
        if worker is not None:
            worker.note_plain_step(inp)
        prev = None
        if inp.prev_token_rows is not None:
            if self._last_tokens is None:
                raise RuntimeError("prev_token_rows given but no step was launched before")
            prev = self._last_tokens
            if self._last_pending is not None:
                self._last_pending.followed_ahead = True
        logits, captured = self.forward(inp, prev_tokens=prev)
        meta = SamplingMetadata(inp.sampling_rows, self.device, inp.num_logprobs)
        tokens = sample(logits, meta)  # [N] int64
        self._last_tokens = tokens
        if worker is not None:  # host bookkeeping while the device runs the step
            worker.commit_plain_step(inp)
            if worker.drafter.observes_plain_steps:
                worker.drafter.observe_plain_step(inp, captured)  # e.g. DFlash's context, enqueued
        n = tokens.shape[0]
        buffers = self._tokens_host
        if not buffers or buffers[0].shape[0] < n:
            cuda = self.device.type == "cuda"
            size = max(n, self.config.max_num_seqs)
            buffers[:] = [torch.empty(size, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._num_launched += 1
        host = buffers[self._num_launched % 2][:n]
        host.copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        pending = PendingStep(host, event, logits, inp.num_logprobs, inp if worker is not None else None)
        self._last_pending = pending
        return pending

    def collect(self, pending) -> ModelOutput:
        """Wait for a launched step and return its output (rank 0)."""
        if not isinstance(pending, PendingStep):
            return self.spec_worker.collect(pending)  # type: ignore[union-attr]
        if pending.event is not None:
            pending.event.synchronize()
        tokens = pending.tokens.tolist()
        out = ModelOutput(token_ids=[[t] for t in tokens])
        if pending.inp is not None and pending.followed_ahead:  # placeholders only then
            self.spec_worker.record_sampled(pending.inp, tokens)  # type: ignore[union-attr]
        if pending.num_logprobs is not None:
            attach_logprobs(out, pending.logits, list(range(len(out.token_ids))), pending.num_logprobs)
        return out
