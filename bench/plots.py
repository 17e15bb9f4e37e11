"""PNG plots from benchmark JSON files (``spec_bench``, ``engine_bench``, ``synthetic``):

- ``speedup_vs_batch.png``: throughput ratio vs batch size, one line per method / mode / peer, one panel per
  dataset; synthetic projections dashed and labelled as projections;
- ``per_position_acceptance.png``: acceptance at draft position i (accepted at i / drafts), counters summed
  over batch sizes;
- ``mal_vs_k.png``: MAL vs number of speculative tokens (from ``--sweep-num-speculative-tokens``);
- ``engine_vs_hf.png``: output tokens/s vs batch size of our engine and the transformers settings.

    python -m bench.plots results.json [more.json ...] --out-dir plots/
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.cli import main_entry
from bench.common import reported_ratio


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log2_batch_axis(ax: Any, xs: list[int]) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _name(r: dict[str, Any]) -> str:
    parts = [r["system"]]
    if r.get("mode") == "server":
        parts.append("(server)")
    return " ".join(parts)


def _spec_runs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r for d in docs if d.get("schema", "").startswith("flexspec.bench.spec") for r in d.get("runs", [])
    ]


def _panels(plt: Any, keys: list[str], title: str) -> tuple[Any, list[Any]]:
    n = max(1, len(keys))
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def plot_speedup(docs: list[dict[str, Any]], out: Path) -> Path | None:
    runs = [r for r in _spec_runs(docs) if reported_ratio(r) and r.get("baseline") != r.get("system")]
    synth = [d for d in docs if d.get("schema", "").startswith("flexspec.bench.synthetic")]
    if not runs and not synth:
        return None
    plt = _plt()
    datasets = sorted({r["dataset"] for r in runs}) or ["projection"]
    fig, axes = _panels(plt, datasets, "Throughput ratio (speculative / plain) vs batch size")
    for ax, ds in zip(axes, datasets):
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in runs:
            if r["dataset"] == ds:
                lines[_name(r)].append((r["batch_size"], reported_ratio(r)))
        for name, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for d in synth:
            pts = sorted(
                (p["batch_size"], p["projected_throughput_ratio"])
                for p in d.get("points", [])
                if p.get("projected_throughput_ratio")
            )
            if pts:
                lbl = f"PROJECTION {d['config'].get('label') or d['config'].get('shape')} (synthetic)"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", marker="x", label=lbl)
        ax.axhline(1.0, color="gray", lw=0.8)
        xs = [r["batch_size"] for r in runs] + [p["batch_size"] for d in synth for p in d.get("points", [])]
        _log2_batch_axis(ax, xs)
        ax.set_xlabel("batch size (concurrency)")
        ax.set_ylabel("throughput ratio")
        ax.set_title(ds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path = out / "speedup_vs_batch.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _aggregate(runs: list[dict[str, Any]], key: Any) -> dict[Any, dict[str, Any]]:
    """Sum spec-decode counters of runs sharing ``key(run)`` (i.e. over batch sizes)."""
    agg: dict[Any, dict[str, Any]] = {}
    for r in runs:
        sd = r.get("spec_decode")
        if not sd or not sd.get("num_drafts"):
            continue
        a = agg.setdefault(
            key(r), {"drafts": 0, "accepted": 0, "per_pos": [], "k": r.get("num_speculative_tokens")}
        )
        a["drafts"] += sd["num_drafts"]
        a["accepted"] += sd["num_accepted_tokens"]
        pp = sd["num_accepted_tokens_per_pos"]
        n = max(len(pp), len(a["per_pos"]))
        a["per_pos"] = [
            x + y for x, y in zip(a["per_pos"] + [0] * (n - len(a["per_pos"])), pp + [0] * (n - len(pp)))
        ]
    return agg


def plot_per_position(docs: list[dict[str, Any]], out: Path) -> Path | None:
    agg = _aggregate(_spec_runs(docs), lambda r: (r["dataset"], _name(r)))
    if not agg:
        return None
    plt = _plt()
    datasets = sorted({k[0] for k in agg})
    fig, axes = _panels(plt, datasets, "Per-position acceptance (accepted at position i / drafts)")
    for ax, ds in zip(axes, datasets):
        for (d, name), a in sorted(agg.items()):
            if d == ds:
                ys = [x / a["drafts"] for x in a["per_pos"]]
                ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
        _integer_x(ax)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1.02)
        ax.set_title(ds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path = out / "per_position_acceptance.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_mal_vs_k(docs: list[dict[str, Any]], out: Path) -> Path | None:
    runs = [r for r in _spec_runs(docs) if r.get("num_speculative_tokens")]
    agg = _aggregate(
        runs,
        lambda r: (
            r["dataset"],
            r.get("config_label") or r["method"],
            r.get("mode"),
            r.get("peer"),
            r["num_speculative_tokens"],
        ),
    )
    if not agg:
        return None
    plt = _plt()
    datasets = sorted({k[0] for k in agg})
    fig, axes = _panels(plt, datasets, "MAL (tokens per verification step) vs speculative tokens K")
    for ax, ds in zip(axes, datasets):
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for (d, label, mode, peer, k), a in agg.items():
            if d == ds:
                name = " ".join(
                    x
                    for x in (label, f"({peer})" if peer else "", "(server)" if mode == "server" else "")
                    if x
                )
                lines[name].append((k, 1 + a["accepted"] / a["drafts"]))
        for name, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        _integer_x(ax)
        ax.set_xlabel("num_speculative_tokens K")
        ax.set_ylabel("MAL")
        ax.set_title(ds)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path = out / "mal_vs_k.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_engine_vs_hf(docs: list[dict[str, Any]], out: Path) -> Path | None:
    eng = [d for d in docs if d.get("schema", "").startswith("flexspec.bench.engine")]
    if not eng:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    machine = eng[0]["env"]["machine"]
    fig.suptitle(f"Output tokens/s vs batch size ({machine.get('gpu') or machine.get('cpu')})")
    xs = []
    for system, per_batch in eng[0]["results"].items():
        pts = sorted(
            (int(b), r["output_tokens_per_s"]) for b, r in per_batch.items() if r.get("output_tokens_per_s")
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
            xs += [p[0] for p in pts]
    _log2_batch_axis(ax, xs or [1])
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    path = out / "engine_vs_hf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(docs: list[dict[str, Any]], out_dir: str | Path) -> list[str]:
    """Write every plot the documents have data for; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = [f(docs, out) for f in (plot_speedup, plot_per_position, plot_mal_vs_k, plot_engine_vs_hf)]
    return [str(p) for p in made if p is not None]


def main(argv: list[str] | None = None, prog: str = "python -m bench.plots") -> list[str]:
    p = argparse.ArgumentParser(prog=prog, description="PNG plots from benchmark JSON files.")
    p.add_argument("results", nargs="+", help="JSON files written by spec_bench / engine_bench / synthetic.")
    p.add_argument("--out-dir", default="plots")
    args = p.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in args.results]
    paths = make_plots(docs, args.out_dir)
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main_entry(main)
