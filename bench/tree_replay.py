"""Mean acceptance length (MAL) of draft *trees* replayed over acceptance traces: how many tokens per step a
block drafter (DFlash) would emit at T=0 if each step verified several candidates per depth instead of one chain.

    python -m bench.acceptance_trace --speculative-config '{"method": "dflash", "model": "smollm2-135m-instruct-dflash"}' \\
        --dataset gsm8k,mt_bench,humaneval --num-prompts 40 --max-tokens 128 --top-r 8 --output traces.json
    python -m bench.tree_replay traces.json --budgets 15,31,63 --output tree_replay.json

A DFlash block is one forward over the target's context: its distribution at every depth is known before any
draft is chosen, and it does not depend on which candidate is taken at an earlier depth. A tree of N draft nodes
(each node a path of per-depth ranks, e.g. ``(0, 1)`` = the first draft's top candidate, then the second
candidate at depth 2; prefix-closed) is verified in one target forward of N + 1 tokens under a tree attention
mask (SpecInfer, arXiv 2305.09781; Medusa, arXiv 2401.10774), and at T=0 the step accepts the longest path
whose tokens are the target's greedy tokens. A trace's ``ranks[L]`` (``--top-r``) say where the target's tokens
L, L+1, ... ranked at each depth of the block verified at output position L, so any tree's acceptance there is
the longest prefix of ``ranks[L]`` that is a node of the tree; the replay walks each request from its first
verified position, a step at a time (accepted + 1 tokens per step), as decoding would.

Trees compared, each with at most N draft nodes per step (the chain of k drafts has k nodes):

- ``chain``: the engine's chain as verified in the trace (selective verification included), and
  ``chain_all``: every one of the k drafts verified (the leading rank-0 run of ``ranks[L]``);
- ``static``: one fixed tree: the N rank paths that occurred most often as prefixes of the fit requests' rank
  rows (the first half of each dataset's requests; every tree is evaluated on the second half). Because a path's
  frequency never exceeds its prefix's, the N most frequent paths are prefix-closed, and they maximise the fit
  set's summed acceptance among trees of N nodes (Sequoia, arXiv 2402.12374, builds static trees from the same
  acceptance statistics);
- ``dynamic``: per step, the N paths of highest product of the block's own probabilities along the path
  (EAGLE-2's confidence-ordered expansion, arXiv 2406.16858), from the recorded top-R probabilities; no fitting.
  Near a request's end the recorded depths stop at its last token, so there the tree spends its nodes on the
  depths left, which an engine would not know (at most a few steps per request; a small optimistic bias).

Output JSON (``schema`` flexspec.bench.tree_replay/1): per dataset and tree, MAL over the evaluated requests,
steps, tokens and the number of draft nodes verified per step; the static tree's paths. Bad input (a trace
without ``--top-r`` ranks, an unreadable file) is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import JsonReport, environment, int_list, log, output_path
from flexspec.spec.tree import top_paths

SCHEMA = "flexspec.bench.tree_replay/1"
Path_ = tuple[int, ...]  # per-depth ranks of one tree node, root excluded
Accept = Callable[[int], int]  # output position L -> drafts a step verifying there accepts


def build_parser(prog: str = "python -m bench.tree_replay") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "traces", type=Path, help="bench.acceptance_trace JSON (or .json.gz) recorded with --top-r"
    )
    p.add_argument("--budgets", type=int_list, default=[15, 31, 63], help="draft nodes per step (comma list)")
    p.add_argument("--output", type=output_path, default=None, help="write the results as JSON here")
    return p


def replay(trace: dict[str, Any], accept: Accept) -> tuple[int, int]:
    """Decode one request along its trace: from its first verified position L, each step accepts
    ``accept(L)`` drafts and emits that many + 1 tokens; a position without drafts (the last token when the
    request ends at ``max_tokens``: nothing left to draft for) is a one-token step. Returns (steps, tokens)."""
    ranks = trace["ranks"]
    L = next((i for i, r in enumerate(ranks) if r is not None), len(ranks))
    steps = tokens = 0
    while L < len(ranks):
        a = 0 if ranks[L] is None else min(accept(L), len(ranks) - L - 1)
        steps += 1
        tokens += a + 1
        L += a + 1
    return steps, tokens


def leading(ranks: list[int], nodes: set[Path_] | None = None) -> int:
    """Drafts accepted: the longest prefix of ``ranks`` that is a node (``nodes`` None: the chain of rank 0)."""
    n = 0
    for d, r in enumerate(ranks):
        if (r != 0) if nodes is None else (tuple(ranks[: d + 1]) not in nodes):
            break
        n += 1
    return n


def fit_static_tree(traces: list[dict[str, Any]], budget: int, top_r: int) -> list[Path_]:
    """The ``budget`` rank paths most often a prefix of the traces' rank rows (ties: shallower, then
    lexicographic); prefix-closed (see the module doc)."""
    counts: Counter[Path_] = Counter()
    for t in traces:
        for row in t["ranks"]:
            if row is None:
                continue
            for d, r in enumerate(row):
                if r >= top_r:
                    break
                counts[tuple(row[: d + 1])] += 1
    return sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]


def evaluate(traces: list[dict[str, Any]], accept_for: Callable[[dict[str, Any]], Accept]) -> dict[str, Any]:
    """MAL of ``traces`` replayed with ``accept_for(trace)`` as each request's acceptance."""
    steps = tokens = 0
    for t in traces:
        s, n = replay(t, accept_for(t))
        steps, tokens = steps + s, tokens + n
    return {"mal": round(tokens / steps, 4) if steps else None, "steps": steps, "tokens": tokens}


def run(doc: dict[str, Any], budgets: list[int]) -> dict[str, Any]:
    top_r = int(doc["config"].get("top_r") or 0)
    k = int(doc["num_speculative_tokens"])
    halves = {}
    for name, traces in doc["traces"].items():
        if top_r <= 0 or any("ranks" not in t for t in traces):
            raise ValueError(f"{name}: the trace has no ranks; record it with --top-r R")
        half = len(traces) // 2
        halves[name] = (traces[:half], traces[half:])
    fit = [t for first, _ in halves.values() for t in first]
    if not fit:
        raise ValueError("no request to fit the static trees on: each dataset needs at least 2 requests")
    static = {n: fit_static_tree(fit, n, top_r) for n in budgets}
    results: dict[str, Any] = {}
    for name, (_, held_out) in halves.items():
        rows = {
            f"chain (k={k}, as verified)": evaluate(held_out, lambda t: t["accepted"].__getitem__),
            f"chain_all (k={k})": evaluate(held_out, lambda t: lambda L: leading(t["ranks"][L])),
        }
        for n in budgets:
            nodes = set(static[n])
            rows[f"static (N={n})"] = evaluate(
                held_out, lambda t, s=nodes: lambda L: leading(t["ranks"][L], s)
            )
            rows[f"dynamic (N={n})"] = evaluate(
                held_out, lambda t, n=n: lambda L: leading(t["ranks"][L], set(top_paths(t["probs"][L], n)))
            )
        results[name] = {"num_requests": len(held_out), "trees": rows}
    return {
        "num_speculative_tokens": k,
        "top_r": top_r,
        "fit_requests": len(fit),
        "static_trees": {str(n): [list(p) for p in static[n]] for n in budgets},
        "datasets": results,
    }


def main(argv: list[str] | None = None, prog: str = "python -m bench.tree_replay") -> dict[str, Any]:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        raw = args.traces.read_bytes()
        doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)  # .json or .json.gz
        if not isinstance(doc, dict) or doc.get("schema") != "flexspec.bench.acceptance_trace/1":
            what = (
                f"schema {doc.get('schema')!r}" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
            )
            raise ValueError(f"not an acceptance trace ({what})")
        out = run(doc, args.budgets)
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        parser.error(f"{args.traces}: {e}")
    for name, res in out["datasets"].items():
        cells = ", ".join(f"{tree} {r['mal']}" for tree, r in res["trees"].items())
        log(f"{name} ({res['num_requests']} requests) MAL: {cells}")
    report = {"schema": SCHEMA, "env": environment(), "config": vars(args), "source": doc.get("env"), **out}
    if args.output:
        JsonReport(args.output, report).save()
    return report


if __name__ == "__main__":
    main_entry(main)
