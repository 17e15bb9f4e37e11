"""Markdown tables for the README from benchmark JSON files, each headed by the command and commit that made it.

    python -m bench.table engine_bench.json spec.json [synthetic.json ...]

- engine bench: output tokens/s per system x batch size, and our speedup over the best transformers setting;
- spec bench: per dataset x system, ``ratio (MAL)`` per batch size (ratio = tokens/s over its baseline; with
  ``--repeats`` the median of the rounds' paired ratios, ``bench.common.reported_ratio``);
- synthetic: projected ratio per batch size, marked PROJECTION.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import reported_ratio


def _head(doc: dict[str, Any]) -> list[str]:
    env = doc.get("env", {})
    m = env.get("machine", {})
    where = m.get("gpu") or m.get("cpu") or "?"
    return [
        f"Command: `{env.get('command', '?')}`  ",
        f"Commit: `{env.get('git_commit')}`, {where}, torch {env.get('versions', {}).get('torch')}",
        "",
    ]


def engine_table(doc: dict[str, Any]) -> list[str]:
    res = doc["results"]
    sizes = [str(b) for b in doc["config"]["batch_sizes"]]
    lines = _head(doc)
    lines += ["| system | " + " | ".join(f"b={b} tok/s" for b in sizes) + " |"]
    lines += ["|---" * (len(sizes) + 1) + "|"]
    for system, per in res.items():
        cells = []
        for b in sizes:
            r = per.get(b, {})
            cells.append(
                f"{r['output_tokens_per_s']:.1f}"
                if r.get("output_tokens_per_s")
                else ("error" if "error" in r else "skipped" if "skipped" in r else "-")
            )
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    sp = doc.get("summary", {}).get("speedup_vs_best_hf", {})
    lines.append(
        "| **speedup vs best transformers** | "
        + " | ".join(f"{sp[b]:.2f}x" if b in sp else "-" for b in sizes)
        + " |"
    )
    step = doc.get("decode_step_batch1")
    if step:
        lines += [
            "",
            (
                f"Batch-1 decode step: engine step {step.get('engine_step_ms')} ms, execute "
                f"{step.get('execute_ms')} ms, forward {step.get('forward_ms')} ms ({step.get('timer')})."
            ),
        ]
    return lines


def spec_table(doc: dict[str, Any]) -> list[str]:
    runs = [r for r in doc["runs"] if r.get("output_tokens_per_s") and "batch_size" in r]
    sizes = sorted({r["batch_size"] for r in runs})
    lines = _head(doc)
    if any("paired_ratio_median" in r for r in runs):
        lines += [
            "Ratios: median over the rounds of each round's tokens/s over the baseline's round (`--repeats`).",
            "",
        ]
    lines += ["| dataset | system | " + " | ".join(f"b={b} ratio (MAL)" for b in sizes) + " |"]
    lines += ["|---" * (len(sizes) + 2) + "|"]
    peer_of = {r["system"]: r.get("peer") or "" for r in runs}
    baselines = {"plain", "hf_dynamic", "vllm"}  # each group's baseline row first: ours, transformers, vLLM
    keys = sorted(
        {(r["dataset"], r["mode"], r["system"]) for r in runs},
        key=lambda k: (k[0], k[1], peer_of[k[2]], k[2] not in baselines, k[2]),
    )
    for ds, mode, system in keys:
        cells = []
        for b in sizes:
            r = next(
                (
                    x
                    for x in runs
                    if (x["dataset"], x["mode"], x["system"], x["batch_size"]) == (ds, mode, system, b)
                ),
                None,
            )
            if r is None:
                cells.append("-")
                continue
            ratio = reported_ratio(r)
            mal = (r.get("spec_decode") or {}).get("mean_acceptance_length")
            cell = f"{ratio:.2f}x" if ratio else f"{r['output_tokens_per_s']:.0f} tok/s"
            cells.append(cell + (f" ({mal:.2f})" if mal else ""))
        name = system + (" (server)" if mode == "server" else "")
        lines.append(f"| {ds} | {name} | " + " | ".join(cells) + " |")
    return lines


def synthetic_table(doc: dict[str, Any]) -> list[str]:
    pts = [p for p in doc["points"] if "projected_throughput_ratio" in p]
    lines = _head(doc) + [
        (
            f"**PROJECTION** (random weights, replayed acceptance, expected MAL "
            f"{doc['config']['expected_mal']}): {doc['config'].get('label') or ''}"
        ),
        "",
    ]
    lines += [
        "| batch | " + " | ".join(str(p["batch_size"]) for p in pts) + " |",
        "|---" * (len(pts) + 1) + "|",
    ]
    lines += [
        "| projected ratio | " + " | ".join(f"{p['projected_throughput_ratio']:.2f}x" for p in pts) + " |"
    ]
    return lines


def render(docs: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for doc in docs:
        schema = doc.get("schema", "")
        kind = schema.split("/")[0].rsplit(".", 1)[-1]  # flexspec.bench.<kind>/<version>
        fn = {"engine": engine_table, "spec": spec_table, "synthetic": synthetic_table}[kind]
        out += fn(doc) + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str = "python -m bench.table") -> str:
    p = argparse.ArgumentParser(prog=prog, description="Markdown tables from benchmark JSON.")
    p.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    text = render([json.loads(Path(f).read_text()) for f in args.results])
    print(text)
    return text


if __name__ == "__main__":
    main_entry(main)
