"""Acceptance traces: for every output position of every request, how many drafts the real drafter's block
would have had accepted had it been verified there (T=0).

    python -m bench.acceptance_trace --speculative-config '{"method": "dflash", "model": "smollm2-135m-instruct-dflash"}' \\
        --dataset gsm8k,mt_bench,humaneval --num-prompts 32 --max-tokens 128 --output traces.json

The engine decodes with drafts every step (``execution: decoupled``, host verification) but emits only the
first verified token of each step (the target's own greedy token), so every output position gets verified
once and the request's output is exactly plain decoding's. The number of drafts that verification accepted
is recorded as ``accepted[request][L]``: the step emitting output token L would emit ``accepted + 1`` tokens
starting there (None where it had no drafts: L = 0, the prefill step, and steps whose drafts were cut to the
request's remaining ``max_tokens``). At T=0 a greedy drafter's
block at a position depends only on the tokens before it (DFlash: on the target's hidden states of those
tokens), not on which steps speculated before, so a trace is each request's acceptance at every position
under any schedule of plain and speculative steps; ``bench.policy_replay`` replays the per-batch policy over it.

``--top-r R`` (DFlash: its block at a position is one forward of the target's context, every depth's
distribution independent of the drafts chosen at the others; 1 <= R <= 64) also records, per output position L, where the target's tokens L, L+1, ... ranked in the drafter's block that
was verified there: ``ranks[L][i]`` = rank of output token L+i at block depth i (0 = the draft itself; R = not
in the top R), and ``probs[L][i]`` = the block's top-R probabilities at depth i. That is what a verification
of a draft *tree* (several candidates per depth) would have accepted there: ``bench.tree_replay``.

Output JSON: ``{"schema": "flexspec.bench.acceptance_trace/1", "env", "config", "num_speculative_tokens",
"traces": {dataset: [{"prompt_len", "num_output_tokens", "accepted": [int, ...]}]}}`` with
``len(accepted) == num_output_tokens`` (with ``--top-r``, also ``ranks`` and ``probs``, None where
``accepted`` is None).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.cli import main_entry
from bench.common import (
    JsonReport,
    datasets_arg,
    environment,
    log,
    output_path,
    positive_int,
    prompt_token_ids,
)

SCHEMA = "flexspec.bench.acceptance_trace/1"
MAX_TOP_R = 64


def build_parser(prog: str = "python -m bench.acceptance_trace") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--speculative-config", required=True, help="vLLM-style JSON (method, model, ...)")
    p.add_argument("--dataset", type=datasets_arg, default=["gsm8k", "mt_bench", "humaneval"])
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--max-prompt-len", type=positive_int, default=1024)
    p.add_argument("--batch-size", type=positive_int, default=8, help="requests decoded together")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--top-r",
        type=int,
        default=0,
        help="also record each block's top-R candidates per depth (ranks, probs; DFlash; 0 = off, at most 64)",
    )
    p.add_argument("--output", type=output_path, required=True)
    return p


def collect(
    engine: Any, prompts: list[list[int]], max_tokens: int, batch_size: int, top_r: int = 0
) -> list[dict[str, Any]]:
    """Decode ``prompts`` in batches of ``batch_size`` with every step's emission cut to its first token;
    returns one trace per prompt (see the module doc; ``top_r`` > 0 adds ``ranks`` and ``probs``)."""
    from configs import SamplingParams
    from flexspec.spec import spec_worker

    real_verify = spec_worker.verify
    current: dict[str, Any] = {}
    accepted: dict[int, list[int]] = {}

    def first_token_only(logits, meta, num_drafts, drafts, probs=None, trees=None):
        emitted = real_verify(logits, meta, num_drafts, drafts, probs, trees)
        inp = current["inp"]
        emit_seq_ids = [sid for sid, smp in zip(inp.seq_ids, inp.samples) if smp]
        for sid, d, e in zip(emit_seq_ids, num_drafts, emitted):
            accepted.setdefault(sid, []).append(len(e) - 1 if d else None)
        return [e[:1] for e in emitted]

    worker = engine.executor.runner.spec_worker
    real_execute = worker.execute

    def execute(inp):
        current["inp"] = inp
        return real_execute(inp)

    spec_worker.verify, worker.execute = first_token_only, execute
    blocks: dict[int, dict[int, tuple[list[list[int]], list[list[float]]]]] = {}
    drafter = worker.drafter
    real_select = getattr(drafter, "_select", None)
    if top_r > 0:
        if real_select is None:
            raise ValueError(f"--top-r: the {drafter.method} drafter has no block of candidates to rank")
        graphs = drafter._graphs
        drafter._graphs = None  # the captured block forward returns drafts only, not the logits

        def select(items, hidden, logits):  # logits [S, K, V] fp32: the block's distributions
            top = logits.softmax(-1).topk(top_r, dim=-1)
            ids, probs = top.indices.tolist(), top.values.tolist()
            for s, b in enumerate(items):  # keyed by the bonus token's position
                blocks.setdefault(b.seq_id, {})[len(b.token_ids) - 1] = (ids[s], probs[s])
            return real_select(items, hidden, logits)

        drafter._select = select
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    traces: list[dict[str, Any]] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            rids = [engine.add_request(p, params) for p in chunk]
            seq_ids = {rid: engine.seqs[rid].seq_id for rid in rids}
            final: dict[str, Any] = {}
            while engine.has_unfinished:
                for o in engine.step():
                    if o.finished:
                        final[o.request_id] = o
            for p, rid in zip(chunk, rids):
                acc = accepted.pop(seq_ids[rid], [])
                n = len(final[rid].token_ids)
                if len(acc) != n:
                    raise RuntimeError(f"trace of {len(acc)} steps for {n} output tokens")
                trace = {"prompt_len": len(p), "num_output_tokens": n, "accepted": acc}
                if top_r > 0:
                    trace.update(
                        block_ranks(blocks.pop(seq_ids[rid], {}), len(p), final[rid].token_ids, acc, top_r)
                    )
                traces.append(trace)
    finally:
        spec_worker.verify, worker.execute = real_verify, real_execute
        if top_r > 0:
            drafter._select, drafter._graphs = real_select, graphs
    return traces


def block_ranks(
    blocks: dict[int, tuple[list[list[int]], list[list[float]]]],
    prompt_len: int,
    output: list[int],
    accepted: list[int | None],
    top_r: int,
) -> dict[str, list]:
    """Per output position L with a verification (``accepted[L]`` not None): ``ranks[L]`` [depth] = rank of
    output token L+i among the top-R candidates of the block whose bonus was output token L-1 (``top_r`` when
    not among them), for every depth up to the output's end, and ``probs[L]`` [depth][R] = those candidates'
    probabilities (4 decimals). ``blocks``: bonus position -> (ids [K][R], probs [K][R]).

    Raises:
        RuntimeError: a verified position without its block, or whose leading rank-0 run is shorter than what
            the verification accepted within the output (the ranks would then not describe the drafts that
            were verified).
    """
    ranks: list[list[int] | None] = []
    probs: list[list[list[float]] | None] = []
    for L, acc in enumerate(accepted):
        if acc is None:
            ranks.append(None)
            probs.append(None)
            continue
        block = blocks.get(prompt_len + L - 1)
        if block is None:
            raise RuntimeError(f"no drafter block recorded for output position {L}")
        ids, ps = block
        depth = min(len(ids), len(output) - L)
        row = [ids[i].index(output[L + i]) if output[L + i] in ids[i] else top_r for i in range(depth)]
        lead = next((i for i, r in enumerate(row) if r != 0), len(row))
        if lead < min(
            acc, depth
        ):  # at the end a verification may accept drafts past EOS, cut from the output
            raise RuntimeError(f"position {L}: {acc} drafts accepted but only {lead} ranked first")
        ranks.append(row)
        probs.append([[round(x, 4) for x in ps[i]] for i in range(depth)])
    return {"ranks": ranks, "probs": probs}


def main(argv: list[str] | None = None, prog: str = "python -m bench.acceptance_trace") -> dict[str, Any]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.top_r:
        if not 0 < args.top_r <= MAX_TOP_R:
            parser.error(f"--top-r: expected 0 (off) or 1..{MAX_TOP_R}, got {args.top_r}")
        cfg = json.loads(args.speculative_config)
        method = cfg.get("method") if isinstance(cfg, dict) else None
        if method != "dflash":  # DSpark's drafts add a Markov term per depth: not the block's ranks
            parser.error(f"--top-r: needs method 'dflash' (one block of candidates per step), not {method!r}")
    from transformers import AutoTokenizer

    from configs import EngineConfig
    from flexspec.engine.llm_engine import LLMEngine
    from flexspec.models.loader import resolve_model_dir

    spec = {**json.loads(args.speculative_config), "execution": "decoupled", "device_verification": False}
    model_dir = str(resolve_model_dir(args.model))
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.batch_size,
            speculative_config=spec,
            async_scheduling=False,
        )
    )
    k = engine.config.speculative_config.num_speculative_tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    report = JsonReport(
        args.output,
        {
            "schema": SCHEMA,
            "env": environment(),
            "config": {k_: v for k_, v in vars(args).items() if k_ != "output"},
            "num_speculative_tokens": k,
            "traces": {},
        },
    )
    for d in args.dataset:
        prompts = prompt_token_ids(tokenizer, d, args.num_prompts, args.max_prompt_len)
        traces = collect(engine, prompts, args.max_tokens, args.batch_size, args.top_r)
        report.doc["traces"][d] = traces
        report.save()
        acc = [a for t in traces for a in t["accepted"] if a is not None]
        log(
            f"{d}: {len(traces)} requests, {len(acc)} positions with drafts, mean accepted + 1 = "
            + (f"{1 + sum(acc) / len(acc):.3f}" if acc else "n/a")
        )
    engine.shutdown()
    return report.doc


if __name__ == "__main__":
    main_entry(main)
