"""Replay the per-batch execution policy over recorded acceptance traces and measured step times.

    python -m bench.policy_replay --traces traces.json --step-times bench/results/.../spec_bench.json \\
        --output replay.json

What ``auto`` would have gained against always-plain and always-speculative decoding, without a GPU: each
request's acceptance at every output position comes from ``bench.acceptance_trace`` (the real drafter, T=0),
each step's duration from a table measured on the target machine (a ``bench.spec_bench`` JSON: the plain
system's and the always-``decoupled`` / always-``parallel`` systems' mean decode-step time per batch size,
and the ``auto`` system's warm-up profile as the policy's starting estimates), times a seeded log-normal noise
(``--noise``). The real ``SpeculationPolicy`` decides every step; the replay runs the schedule of
``bench.spec_bench`` (closed loop, ``batch_size`` requests in flight, the same warm-up first, then every
dataset x batch size on one policy, whose state carries over between points as in one engine).

The replay's model of a step: a request that was drafted for in the previous step verifies its drafts and
emits ``accepted + 1`` tokens (capped at its remaining ``max_tokens``), otherwise 1; the step costs a
speculative step if any request verifies or is drafted for, else a plain step (the plain engine's; step times
that drift during a run are not modelled, but ``--spells`` adds slow spells: a few consecutive steps of every mode
cost some milliseconds more, and ``--ranking-cost-ms`` the host time of each decision that ranks the options);
``--switch-costs`` prices the step entering speculation and the one leaving it as multiples of a speculative
step (they cost more where the drafter catches up on the context plain steps left), ``--after-exit-cost`` the
plain step after the one leaving it (not launched ahead) as a multiple of a plain step.
A step in which requests join (their prompts prefill; they start with their first token, without drafts)
costs that mode's mean time of steps that prefill in the same spec_bench run (``step_time.all_steps`` less
``decode_steps``), timed by the policy as that mode's join step, as in the engine (``--no-prefill-cost``: as a
decode step). Use it to compare policy settings on the same traces; the GPU's spec_bench reports throughput.
Output JSON: per (dataset, batch size) the tokens/s of plain, of each always-speculative mode and of auto,
auto's ratios, and the share of auto's steps per mode.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import JsonReport, cycle_to, environment, int_list, log, output_path, positive_int
from bench.replay_options import apply_overrides, check_step_costs, parse_spells, parse_switch_costs

SCHEMA = "flexspec.bench.policy_replay/1"


@dataclass
class _Seq:
    """The per-request fields ``SpeculationPolicy`` reads and writes (as on ``engine.sequence.Sequence``)."""

    trace: list[int | None]
    max_tokens: int
    num_emitted: int = 1  # the first token comes from prefill
    has_drafts: bool = False
    draft_length: int = 0  # the most drafts its option allowed when they were proposed
    spec_tokens_per_step: float | None = None
    spec_estimate_weight: float = 1.0
    spec_num_verifications: int = 0

    @property
    def remaining(self) -> int:
        return min(self.max_tokens, len(self.trace)) - self.num_emitted


@dataclass
class _Scheduled:
    seq: _Seq


@dataclass
class _Sched:
    scheduled: list[_Scheduled]
    preempted: list = field(default_factory=list)
    num_prefills: int = 0  # requests joining in this step (their prompts prefill)


class StepTimes:
    """Seconds per step of (mode, batch size) measured on the target machine, looked up by batch bucket."""

    def __init__(
        self,
        table: dict[str, dict[int, float]],
        noise: float,
        rng: random.Random,
        prefill: dict[str, dict[int, float]] | None = None,
        spells: tuple[float, int, float] = (0.0, 0, 0.0),
    ) -> None:
        self.table, self.noise, self.rng = table, noise, rng
        self.prefill = prefill or {}  # {mode: {batch: seconds}} of steps that prefill
        self.spell_rate, self.spell_steps, self.spell_extra = spells  # see --spells
        self.spell_left = 0  # steps of the running spell still to come

    def modes(self) -> list[str]:
        return list(self.table)

    def mean(self, mode: str, num_seqs: int, prefill: bool = False) -> float:
        """Seconds of a step of ``mode`` at the measured batch size nearest ``num_seqs`` (log scale); with
        ``prefill``, of a step that also prefills (a decode step's where that was not measured)."""
        row = self.prefill.get(mode) if prefill else None
        row = row or self.table[mode]
        near = min(row, key=lambda b: (abs(math.log2(b) - math.log2(num_seqs)), -b))
        return row[near]

    def sample(self, mode: str, num_seqs: int, prefill: bool = False) -> float:
        """One step's seconds: the mean times log-normal noise, plus a spell's extra time while one runs."""
        t = self.mean(mode, num_seqs, prefill) * math.exp(self.rng.gauss(0.0, self.noise))
        if self.spell_left == 0 and self.spell_rate > 0 and self.rng.random() < self.spell_rate:
            self.spell_left = self.spell_steps
        if self.spell_left > 0:
            self.spell_left -= 1
            t += self.spell_extra
        return t


def _runs_by_mode(doc: dict[str, Any], method: str, dataset: str | None, k: int | None = None):
    """(mode, run) for every run with step times of the plain system ("plain") and of ``method``'s systems
    (their ``execution``: "decoupled", "parallel", or "auto" / None), of ``dataset`` or all. A decoupled
    system of fewer drafts than ``k`` is the policy's option "decoupled/N" (N its ``num_speculative_tokens``)."""
    for r in doc["runs"]:
        if "step_time" not in r or (dataset and r["dataset"] != dataset):
            continue
        cfg = r.get("speculative_config") or {}
        if r["system"] != "plain" and cfg.get("method") != method:
            continue
        mode = "plain" if r["system"] == "plain" else cfg.get("execution")
        n = r.get("num_speculative_tokens")
        if mode == "decoupled" and k is not None and n is not None and n < k:
            mode = f"decoupled/{n}"
        yield mode, r


def step_times_from_spec_bench(
    doc: dict[str, Any], method: str, dataset: str | None = None, k: int | None = None
) -> tuple[dict, dict]:
    """(truth table {mode: {batch: seconds}}, warm-up profile {(mode, bucket): seconds}) from a spec_bench JSON:
    the plain system's and ``method``'s fixed-execution systems' mean decode-step time per batch size (averaged
    over datasets unless ``dataset``; systems of fewer drafts than ``k`` as "decoupled/N", see
    ``_runs_by_mode``), and ``method``'s first ``auto`` system's ``speculation_profile_ms``.

    Raises:
        ValueError: no plain system, or no fixed-execution system of ``method``."""
    sums: dict[str, dict[int, list[float]]] = {}
    profile: dict[tuple[str, int], float] = {}
    for mode, r in _runs_by_mode(doc, method, dataset, k):
        if mode in (None, "auto"):  # an auto system: its warm-up profile only
            if not profile and r.get("speculation_profile_ms"):
                for key, ms in r["speculation_profile_ms"].items():
                    m, b = key.split("@")
                    profile[(m, int(b))] = ms / 1e3
            continue
        ms = r["step_time"]["decode_steps"]["step_ms"]
        sums.setdefault(mode, {}).setdefault(r["batch_size"], []).append(ms / 1e3)
    table = {m: {b: sum(v) / len(v) for b, v in row.items()} for m, row in sums.items()}
    if "plain" not in table or len(table) < 2:
        raise ValueError(
            f"the spec_bench JSON needs a plain system and an always-decoupled or -parallel {method} system"
        )
    return table, profile


def prefill_step_times_from_spec_bench(
    doc: dict[str, Any], method: str, dataset: str | None = None, k: int | None = None
) -> dict[str, dict[int, float]]:
    """{mode: {batch: seconds}}: the mean time of the steps that also prefilled, per fixed-mode system of
    ``method`` and the plain system, from each run's ``step_time`` (all steps' total less the decode steps';
    averaged over datasets unless ``dataset``). Runs without step counts or without such steps are skipped."""
    sums: dict[str, dict[int, list[float]]] = {}
    for mode, r in _runs_by_mode(doc, method, dataset, k):
        every, decode = r["step_time"].get("all_steps"), r["step_time"]["decode_steps"]
        if mode in (None, "auto") or not every or "num_steps" not in decode:
            continue
        n = every["num_steps"] - decode["num_steps"]
        if n > 0:
            ms = (every["step_ms"] * every["num_steps"] - decode["step_ms"] * decode["num_steps"]) / n
            sums.setdefault(mode, {}).setdefault(r["batch_size"], []).append(ms / 1e3)
    return {m: {b: sum(v) / len(v) for b, v in row.items()} for m, row in sums.items()}


class Replay:
    """One policy over a series of closed-loop points (see the module doc)."""

    def __init__(
        self,
        spec_config: dict,
        times: StepTimes,
        k: int,
        switch_costs: tuple[float, float] = (1.0, 1.0),
        after_exit_cost: float = 1.0,
        ranking_cost_s: float = 0.0,
    ) -> None:
        from configs import EngineConfig
        from flexspec.spec.policy import SpeculationPolicy

        self.k, self.times = k, times
        self.enter_cost, self.exit_cost = switch_costs
        self.after_exit_cost = after_exit_cost  # the plain step after an exit step, times a plain step
        self.ranking_cost_s = ranking_cost_s  # host time of a decision that ranks the options (not held)
        self.policy = SpeculationPolicy(
            EngineConfig(speculative_config={**spec_config, "num_speculative_tokens": k})
        )
        self.policy.options = [m for m in self.policy.options if m in times.modes()]

    def warm_up_profile(self, trace: list[int | None], profile: dict, max_batch_size: int) -> None:
        """``LLMEngine.profile_speculation``: at every bucket up to ``max_batch_size``, copies of one request
        (``trace``: the engine uses one fixed prompt) decode a few steps in each mode, forced, and the policy
        sees them as in the engine (``finish_profile`` decides what it keeps). The step times it starts from are
        the measured ``profile``'s where given ({(mode, bucket): seconds}), else the replay's own."""
        from flexspec.spec.policy_tuning import WARMUP_SAMPLES

        b = 1
        while b <= max_batch_size:
            for mode in self.policy.options:
                self.policy.forced = mode
                self.run([trace] * b, 1 + (WARMUP_SAMPLES + 2) * (self.k + 1), b, None)
                if mode != "plain":  # the engine's profile times both switch steps once per bucket
                    t = self.times.mean(mode, b)
                    self.policy.profile[(f"enter:{mode}", b)] = [t * self.enter_cost]
                    self.policy.profile[(f"exit:{mode}", b)] = [t * self.exit_cost]
            b *= 2
        for key, t in profile.items():
            if key[0].split(":")[-1] in self.policy.options:
                self.policy.profile[key] = [t] * (1 if ":" in key[0] else WARMUP_SAMPLES)
        self.policy.finish_profile()

    def run(self, traces: list[list[int | None]], max_tokens: int, batch_size: int, mode: str | None) -> dict:
        """Closed loop over ``traces`` with ``batch_size`` in flight; ``mode`` None = the policy decides."""
        from flexspec.spec.metrics import SpecDecodingMetrics

        pending = deque(traces)
        running: list[_Seq] = []
        clock = 0.0
        tokens = 0
        counts: dict[str, int] = {}
        prev = prev_prev = None
        entries = single = 0
        while pending or running:
            num_joined = 0  # prompts prefill in this step
            while pending and len(running) < batch_size:
                running.append(_Seq(pending.popleft(), max_tokens))
                num_joined += 1
            joined = num_joined > 0
            n = len(running)
            ranked = self.policy.num_rankings
            if mode is None:
                chosen = self.policy.decide(_Sched([_Scheduled(s) for s in running], [], num_joined)).option
            else:
                chosen = mode
            length = self.policy.lengths.get(chosen, self.k)  # drafts it allows ("decoupled/3": 3)
            counts[chosen] = counts.get(chosen, 0) + 1
            metrics = SpecDecodingMetrics()
            verifying = [s.has_drafts for s in running]
            cost_mode = chosen
            if chosen == "plain" and any(verifying):
                cost_mode = prev if prev in self.times.modes() and prev != "plain" else self._spec_mode()
            elif any(verifying) and chosen.startswith("decoupled") and str(prev).startswith("decoupled"):
                cost_mode = prev  # another chain length (or the same): the step verifies prev's drafts
            seconds = self.times.sample(cost_mode, n, prefill=joined)
            if prev == "plain" and chosen != "plain":
                seconds *= self.enter_cost
            elif chosen == "plain" and cost_mode != "plain":
                seconds *= self.exit_cost
            elif chosen == "plain" and prev == "plain" and prev_prev not in (None, "plain"):
                seconds *= self.after_exit_cost  # not launched ahead of the exit step's result
            seconds += self.ranking_cost_s * (self.policy.num_rankings - ranked)
            clock += seconds
            verified_length = 0
            for s, verifies in zip(running, verifying):
                drafts = min(s.draft_length, max(s.remaining - 1, 0)) if verifies else 0
                accepted = 0
                if drafts:
                    a = s.trace[s.num_emitted]
                    accepted = min(a if a is not None else 0, drafts)
                emit = min(accepted + 1, s.remaining)
                s.num_emitted += emit
                tokens += emit
                metrics.observe(drafts, accepted)
                if mode is None and (drafts or chosen == "plain"):  # as the engine: entry steps age nothing
                    self.policy.observe_request(s, drafts, accepted, s.draft_length if drafts else None)
                    verified_length = max(verified_length, s.draft_length if drafts else 0)
                s.has_drafts, s.draft_length = chosen != "plain", length
            if prev == "plain" and chosen != "plain":
                entries += 1
            elif prev not in (None, "plain") and chosen == "plain" and prev_prev == "plain":
                single += 1  # left speculation right after entering it
            if mode is None:
                self.policy.observe(
                    chosen,
                    n,
                    seconds,
                    metrics.per_position_acceptance,
                    previous=prev,
                    verified_length=verified_length or None,
                    prefill=joined,  # as the engine: timed apart from decode steps
                )
            prev_prev, prev = prev, chosen
            running = [s for s in running if s.remaining > 0]
        return {
            "tokens": tokens,
            "seconds": clock,
            "tokens_per_s": tokens / clock,
            "steps": counts,
            "entries": entries,  # switches from plain decoding to a speculative mode
            "one_step_stretches": single,  # of which left again at the next decision
        }

    def _spec_mode(self) -> str:
        return next(m for m in self.times.modes() if m != "plain")


def build_parser(prog: str = "python -m bench.policy_replay") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", required=True, help="bench.acceptance_trace JSON")
    p.add_argument("--step-times", required=True, help="bench.spec_bench JSON measured on the target machine")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument(
        "--datasets",
        default=None,
        help="comma-separated datasets of the traces, in the order they are replayed on the one policy "
        "(default: the traces' own order); the first is also the warm-up's",
    )
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--requests-per-batch", type=positive_int, default=16)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument(
        "--profile-trace",
        default=None,
        metavar="DATASET:INDEX",
        help="the request the warm-up profile decodes (default: the first dataset's first; the engine uses "
        "one fixed prompt whose drafts may be worse or better than the workload's)",
    )
    p.add_argument("--noise", type=float, default=0.05, help="sigma of the log-normal step-time noise")
    p.add_argument(
        "--no-prefill-cost",
        action="store_true",
        help="price steps in which requests join as decode steps (the replay before session 21)",
    )
    p.add_argument(
        "--switch-costs",
        default="1,1",
        metavar="ENTER,EXIT",
        help="a step entering speculation from plain decoding, and the step leaving it (verifying the last "
        "drafts), cost these multiples of the speculative mode's step (H100, session 30's final logs, "
        "bench.step_log_report, b=16-64: ~0.9-1.3 and ~1.0-1.2; earlier runs, b=1-4: ~0.5-1.3 and ~1.8-2.6)",
    )
    p.add_argument(
        "--after-exit-cost",
        type=float,
        default=1.0,
        metavar="F",
        help="the plain step right after the step leaving speculation costs F plain steps: it is not launched "
        "ahead (H100, session 43's logs, b = 16-32: 1.8-2.2 ms against 0.9-1.1 steady; e.g. 1.6)",
    )
    p.add_argument(
        "--ranking-cost-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="host time each ranking decision adds to its step (H100, session 45, b=1: ~0.07-0.09 ms)",
    )
    p.add_argument(
        "--spells",
        default="0,0,0",
        metavar="RATE,STEPS,EXTRA_MS",
        help="slow spells: each step starts one with probability RATE (unless one runs); for STEPS steps every "
        "step, whatever its mode, takes EXTRA_MS more (H100, session 42, batch 1: ~1 per 1000 steps in the "
        "plain engine's own logs as in auto's, 3-17 steps at ~1-3.5 ms instead of 0.47; e.g. 0.001,8,2)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a constant of flexspec.spec.policy_tuning for this replay (e.g. REQUEST_PRIOR_WEIGHT=32)",
    )
    p.add_argument("--output", type=output_path, default=None)
    return p


def _load(path: str, schema: str) -> dict[str, Any]:
    """A result JSON of the given schema family. Raises ValueError (missing, not JSON, another schema)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith(schema):
        raise ValueError(
            f"{path} is not a {schema.rstrip('/')} result (its schema: {doc.get('schema') if isinstance(doc, dict) else None!r})"
        )
    return doc


def replay(args: argparse.Namespace) -> dict[str, Any]:
    apply_overrides(args.set)
    traces_doc, bench_doc = (
        _load(args.traces, "flexspec.bench.acceptance_trace/"),
        _load(args.step_times, "flexspec.bench.spec/"),
    )
    spec = json.loads(traces_doc["config"]["speculative_config"])
    k = traces_doc["num_speculative_tokens"]
    table, profile = step_times_from_spec_bench(bench_doc, spec["method"], k=k)
    prefill = (
        {} if args.no_prefill_cost else prefill_step_times_from_spec_bench(bench_doc, spec["method"], k=k)
    )
    rng = random.Random(args.seed)
    times = StepTimes(table, args.noise, rng, prefill, parse_spells(args.spells))
    traces = {d: [t["accepted"] for t in ts] for d, ts in traces_doc["traces"].items()}
    if args.datasets is not None:
        order = [d.strip() for d in args.datasets.split(",") if d.strip()]
        missing = [d for d in order if d not in traces]
        if missing or not order:
            raise ValueError(f"--datasets {args.datasets!r}: the traces hold {sorted(traces)}")
        traces = {d: traces[d] for d in order}
    costs = check_step_costs(args.after_exit_cost, args.ranking_cost_ms)
    rep = Replay(spec, times, k, parse_switch_costs(args.switch_costs), *costs)
    first = next(iter(traces.values()))
    max_bs = max(args.batch_sizes)
    if args.profile_trace:
        name, _, index = args.profile_trace.partition(":")
        if name not in traces:
            raise ValueError(
                f"--profile-trace {args.profile_trace!r}: no dataset {name!r} among {sorted(traces)}"
            )
        try:
            dummy = traces[name][int(index or 0)]
        except (ValueError, IndexError):
            raise ValueError(
                f"--profile-trace {args.profile_trace!r}: {name} has requests 0..{len(traces[name]) - 1}"
            ) from None
    else:
        dummy = first[0]
    rep.warm_up_profile(dummy, profile, max_bs)
    rep.run(cycle_to(first, max_bs), 64, max_bs, None)  # spec_bench's warm-up
    for b in args.batch_sizes:
        rep.run(cycle_to(first, 2 * b), 8, b, None)
    points = []
    for d, ts in traces.items():
        for b in args.batch_sizes:
            reqs = cycle_to(ts, max(args.num_prompts, args.requests_per_batch * b))
            point: dict[str, Any] = {"dataset": d, "batch_size": b}
            for m in times.modes():
                point[m] = rep.run(reqs, args.max_tokens, b, m)["tokens_per_s"]
            auto = rep.run(reqs, args.max_tokens, b, None)
            point["auto"] = auto["tokens_per_s"]
            point["auto_steps"] = auto["steps"]
            point["auto_entries"] = auto["entries"]
            point["auto_one_step_stretches"] = auto["one_step_stretches"]
            best = max(point[m] for m in times.modes())
            point["auto_vs_plain"] = point["auto"] / point["plain"]
            point["auto_vs_best"] = point["auto"] / best
            points.append(point)
    return {
        "table_ms": {m: {b: t * 1e3 for b, t in row.items()} for m, row in table.items()},
        "prefill_table_ms": {m: {b: t * 1e3 for b, t in row.items()} for m, row in prefill.items()},
        "points": points,
    }


def main(argv: list[str] | None = None, prog: str = "python -m bench.policy_replay") -> dict[str, Any]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        doc = {"schema": SCHEMA, "env": environment(), "config": vars(args), **replay(args)}
    except ValueError as e:  # a bad file, --set name or --profile-trace: one line, exit code 2
        parser.error(str(e))
    if args.output:
        report = JsonReport(args.output, doc)
        report.save()
    for p in doc["points"]:
        log(
            f"{p['dataset']:9s} b={p['batch_size']:<3d} auto/plain {p['auto_vs_plain']:.3f}  "
            f"auto/best {p['auto_vs_best']:.3f}  "
            + "  ".join(
                f"{m} {p[m]:.0f}"
                for m in p
                if m == "plain" or m == "auto" or m.startswith(("decoupled", "parallel"))
            )
            + f"  steps {p['auto_steps']}"
        )
    return doc


if __name__ == "__main__":
    main_entry(main)
