"""Closed-loop load on an in-process ``LLMEngine``: keep ``concurrency`` requests in flight, record when every
request's tokens come out, and split step time into draft / verify / other.

Step-time split (light hooks on public objects, installed by :class:`StepTimers`):

- *executor* = ``engine.executor.execute`` (target forward + sampling or verification + drafting, including the
  token readback, which synchronizes the device, so host timers see device time);
- *draft* = ``runner.spec_worker.drafter.propose`` (the drafter's own work; 0 for plain decoding);
- *verify* = executor - draft (target forward over bonus + drafts, rejection sampling, readback; for plain
  decoding: target forward + sampling + readback);
- *other* = engine step wall - executor (scheduling, building inputs, detokenizing, stop checks).

For FlexDraft's parallel mode the drafting forward is fused into the target forward, so it counts as verify.
Latencies follow vLLM's benchmark definitions: TTFT = first token time - request add time; ITL = gaps between
successive outputs of one request (one output may carry several tokens); TPOT = (last - first) / (n - 1).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bench.common import median, progress, summarize_ms
from flexspec.spec.step_times import batch_bucket

_request_ids = itertools.count()


@dataclass
class StepRecord:
    wall_s: float = 0.0  # engine.step() wall time
    exec_s: float = 0.0  # executor.execute (or launch + collect: the wait for the device when overlapped)
    draft_s: float = 0.0  # drafter.propose (0 in device-side verification steps: drafting is inside exec_s)
    num_seqs: int = 0
    num_tokens: int = 0
    decode: bool = False  # every sequence decodes (1 token, or bonus + drafts); no prefill chunk
    mode: str = "plain"  # the policy's decision for the step ("plain" | "decoupled" | "parallel")
    reason: str = ""  # why the policy chose it (``Decision.reason``: best, warmup, measure, probe, ...)
    # where the policy ranked its options: {option: expected tokens/s per sequence} (margins and switch costs
    # applied), its E[tokens per speculative step] and {option: estimated decode step ms at the batch's bucket
    # (``SpeculationPolicy.step_time``)}; None otherwise. Filled by ``describe_ranking`` from ``ranking``.
    rates: dict[str, float] | None = None
    spec_tokens: float | None = None
    est_ms: dict[str, float] | None = None
    # (rates, E[tokens], step_time lookups, bucket): the policy's own objects, referenced while the step runs and
    # converted afterwards; computing est_ms inside the timed step (mean_step_time per option) cost ~6-10 us per
    # step on a 2-core AMD EPYC, time that only `auto` paid and that its throughput counted (session 45)
    ranking: tuple[Any, ...] | None = field(default=None, repr=False)
    launched: bool = False  # enqueued by ``launch`` (collected later) rather than run by ``execute``
    ahead: bool = False  # launched before the previous step was collected (async scheduling)
    num_launched: int = 0  # model steps started in this call (2: a prefill, then the next step)

    def describe_ranking(self) -> None:
        """Convert ``ranking`` into ``rates`` / ``spec_tokens`` / ``est_ms`` (rounded), and drop it."""
        if self.ranking is None:
            return
        rates, tokens, lookups, bucket = self.ranking
        self.ranking = None
        self.rates = {k: round(v, 1) for k, v in rates.items()}
        self.spec_tokens = round(tokens, 3)
        if lookups is not None:
            self.est_ms = {k: round((lookups.get((k, bucket)) or 0.0) * 1e3, 4) for k in rates}


class StepTimers:
    """Wraps ``engine.executor.execute`` (``launch`` / ``collect`` when the engine overlaps output processing)
    and (when speculating) the drafter's ``propose`` with host timers. With overlap, a step record describes
    the step launched during that ``engine.step()`` call.

    Also keeps the last pure-decode ``ModelInput`` seen, so a caller can replay one decode step in isolation.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []
        self.current: StepRecord | None = None
        self.last_decode_input: Any = None
        self._outstanding = 0  # launched steps not collected yet
        executor = engine.executor
        self._orig_execute = executor.execute
        executor.execute = self._execute
        self._orig_launch = getattr(executor, "launch", None)
        self._orig_collect = getattr(executor, "collect", None)
        if self._orig_launch is not None and self._orig_collect is not None:
            executor.launch, executor.collect = self._launch, self._collect
        runner = getattr(executor, "runner", None)
        worker = getattr(runner, "spec_worker", None)
        self.drafter = getattr(worker, "drafter", None)
        if self.drafter is not None:
            self._orig_propose = self.drafter.propose
            self.drafter.propose = self._propose

    def remove(self) -> None:
        """Restore the original methods (instance attributes shadowed the class methods)."""
        del self.engine.executor.execute
        if self._orig_launch is not None and self._orig_collect is not None:
            del self.engine.executor.launch, self.engine.executor.collect
        if self.drafter is not None:
            del self.drafter.propose

    def _timed(self, fn: Any, arg: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(arg)
        if self.current is not None:
            self.current.exec_s += time.perf_counter() - t0
        return out

    def _launch(self, inp: Any) -> Any:
        self._describe(inp)
        if self.current is not None:
            self.current.launched, self.current.ahead = True, self._outstanding > 0
        self._outstanding += 1
        return self._timed(self._orig_launch, inp)

    def _collect(self, pending: Any) -> Any:
        self._outstanding -= 1
        return self._timed(self._orig_collect, pending)

    def _execute(self, inp: Any) -> Any:
        self._describe(inp)
        return self._timed(self._orig_execute, inp)

    def _describe(self, inp: Any) -> None:
        """Describe the step ``inp`` started in this ``engine.step()`` call; a call that starts two (a call
        that finds nothing in flight - the first of a run, or after every running request finished and new ones
        joined - starts their prefill, then, after or ahead of its readback, the next step) is one record of both:
        not a decode step (its wall time holds the prefill), their tokens summed, the second's mode and launch
        flags."""
        rec = self.current if self.current is not None else StepRecord()
        drafts = inp.num_draft_tokens or [0] * len(inp.query_lens)
        decode = (
            bool(inp.query_lens)
            and all(inp.samples or [True])
            and all(q == d + 1 for q, d in zip(inp.query_lens, drafts))
        )
        if decode and len(inp.query_lens) == 1:
            self.last_decode_input = inp
        first = rec.num_launched == 0
        rec.num_launched += 1
        rec.num_seqs = len(inp.query_lens) if first else max(rec.num_seqs, len(inp.query_lens))
        rec.num_tokens = inp.num_tokens if first else rec.num_tokens + inp.num_tokens
        rec.decode = decode if first else rec.decode and decode
        policy = getattr(self.engine, "policy", None)
        modes = getattr(policy, "last_modes", None)  # [-1]: this input's option
        rec.mode = "plain" if modes is None else modes[-1] if modes else inp.spec_mode
        rec.reason = getattr(policy, "last_reason", "")
        rates = getattr(policy, "last_rates", None)
        if rates is not None:  # references only (see StepRecord.ranking)
            bucket = batch_bucket(len(inp.query_lens))
            rec.ranking = (rates, policy.last_spec_tokens, getattr(policy, "last_step_times", None), bucket)
        rec.launched = rec.ahead = False

    def _propose(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._orig_propose(*args, **kwargs)
        if self.current is not None:
            self.current.draft_s += time.perf_counter() - t0
        return out

    def step(self) -> list[Any]:
        """One ``engine.step()`` under the timers."""
        self.current = rec = StepRecord()
        t0 = time.perf_counter()
        outs = self.engine.step()
        rec.wall_s = time.perf_counter() - t0
        self.current = None
        if rec.num_seqs:
            self.steps.append(rec)
        return outs

    def summary(self, steps: list[StepRecord] | None = None) -> dict[str, Any]:
        """Mean step-time split (ms) over decode steps and over all steps, and per mode of the policy when a
        speculative engine ran (``auto`` mixes plain and speculative steps; with overlapped steps a record is
        the step launched during that ``engine.step()`` call, so a mode switch shifts one step's time):
        ``by_mode`` = {mode: {"decode_steps", "all_steps", "launched_share", "ahead_share"}}."""
        steps = self.steps if steps is None else steps

        def split(recs: list[StepRecord]) -> dict[str, Any] | None:
            if not recs:
                return None
            n = len(recs)
            wall = sum(r.wall_s for r in recs) / n
            ex = sum(r.exec_s for r in recs) / n
            dr = sum(r.draft_s for r in recs) / n
            return {
                "num_steps": n,
                "mean_batch": round(sum(r.num_seqs for r in recs) / n, 3),
                "mean_tokens_per_step": round(sum(r.num_tokens for r in recs) / n, 3),
                "step_ms": round(wall * 1e3, 4),
                "step_ms_p50": round(median(r.wall_s for r in recs) * 1e3, 4),
                "draft_ms": round(dr * 1e3, 4),
                "verify_ms": round((ex - dr) * 1e3, 4),
                "other_ms": round((wall - ex) * 1e3, 4),
            }

        out: dict[str, Any] = {
            "decode_steps": split([r for r in steps if r.decode]),
            "all_steps": split(steps),
        }
        modes = sorted({r.mode for r in steps})
        if modes and modes != ["plain"]:
            out["by_mode"] = {}
            for m in modes:
                recs = [r for r in steps if r.mode == m]
                out["by_mode"][m] = {
                    "decode_steps": split([r for r in recs if r.decode]),
                    "all_steps": split(recs),
                    "launched_share": round(sum(r.launched for r in recs) / len(recs), 4),
                    "ahead_share": round(sum(r.ahead for r in recs) / len(recs), 4),
                }
        return out


@dataclass
class LoadResult:
    wall_s: float
    num_requests: int
    output_tokens: int
    steps: list[StepRecord]
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # per request, in prompt order

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def latency(self) -> dict[str, Any]:
        return {
            "ttft_ms": summarize_ms(self.ttft_s),
            "itl_ms": summarize_ms(self.itl_s),
            "tpot_ms": summarize_ms(self.tpot_s),
            "e2e_ms": summarize_ms(self.e2e_s),
        }


def run_closed_loop(
    engine: Any,
    timers: StepTimers,
    prompts: list[list[int]],
    params: list[Any],
    concurrency: int,
    desc: str = "",
    show_progress: bool = True,
) -> LoadResult:
    """Run every prompt to completion with at most ``concurrency`` requests in the engine at once (a new one
    is added as soon as one finishes). Returns throughput, latencies and the step records of this run."""
    if engine.has_unfinished:
        raise RuntimeError("engine has unfinished requests before the benchmark run")
    pending = deque(range(len(prompts)))
    added: dict[str, float] = {}
    index: dict[str, int] = {}
    chunk_times: dict[str, list[float]] = {}
    num_tokens: dict[str, int] = {}
    final: dict[int, list[int]] = {}
    first_step = len(timers.steps)
    bar = progress(sum(p.max_tokens for p in params), desc, show_progress)
    inflight = 0
    total = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished:
        while pending and inflight < concurrency:
            i = pending.popleft()
            rid = f"bench-{next(_request_ids)}"
            engine.add_request(prompts[i], params[i], request_id=rid)
            added[rid], index[rid] = time.perf_counter(), i
            chunk_times[rid], num_tokens[rid] = [], 0
            inflight += 1
        outs = timers.step()
        now = time.perf_counter()
        for o in outs:
            rid = o.request_id
            if rid not in index:
                continue
            n = len(o.new_token_ids)
            if n:
                chunk_times[rid].append(now)
                num_tokens[rid] += n
                total += n
                bar.update(n)
            if o.finished:
                inflight -= 1
                final[index[rid]] = list(o.token_ids)
    wall = time.perf_counter() - t0
    bar.close()
    res = LoadResult(
        wall_s=wall,
        num_requests=len(prompts),
        output_tokens=total,
        steps=timers.steps[first_step:],
        token_ids=[final.get(i, []) for i in range(len(prompts))],
    )
    for rid, times in chunk_times.items():
        if not times:
            continue
        res.ttft_s.append(times[0] - added[rid])
        res.e2e_s.append(times[-1] - added[rid])
        res.itl_s.extend(b - a for a, b in itertools.pairwise(times))
        if num_tokens[rid] > 1:
            res.tpot_s.append((times[-1] - times[0]) / (num_tokens[rid] - 1))
    return res


def spec_metrics_snapshot(engine: Any) -> dict[str, Any]:
    m = engine.spec_metrics
    return {
        "num_drafts": m.num_drafts,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(m.num_accepted_tokens_per_pos),
    }


def spec_metrics_delta(before: dict[str, Any], after: dict[str, Any], k: int | None) -> dict[str, Any]:
    """Counters of one run (after - before) and the derived MAL / acceptance rate / per-position acceptance.

    Definitions (DESIGN.md section 3, vLLM's): MAL = 1 + accepted / drafts; acceptance rate = accepted / draft
    tokens; per-position acceptance[i] = accepted at position i / drafts. The per-position list is padded with
    zeros to ``k`` (positions never drafted were never accepted)."""
    drafts = after["num_drafts"] - before["num_drafts"]
    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    a, b = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    n = max(len(a), len(b), k or 0)
    a = a + [0] * (n - len(a))
    b = b + [0] * (n - len(b))
    per_pos = [x - y for x, y in zip(a, b)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": round(1.0 + accepted / drafts, 4) if drafts else 1.0,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
        "per_position_acceptance": [round(x / drafts, 4) if drafts else 0.0 for x in per_pos],
    }


def release_device_memory() -> None:
    """Collect dropped engines / models and give their device memory back (call after deleting every
    reference to them, timers included). Unfreezes first: a frozen dropped engine is never collected."""
    import gc

    import torch

    from flexspec.engine.gc_heap import release_frozen

    release_frozen()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
