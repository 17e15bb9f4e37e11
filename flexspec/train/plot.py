"""``DIR/loss_curve.png`` from ``DIR/train_log.jsonl``: loss, and per-position accuracy / acceptance estimate.

matplotlib is optional (not a flexspec dependency): without it the PNG is skipped with one warning.
"""

from __future__ import annotations

import json
from pathlib import Path

from flexspec.train.progress import log

_warned = False


def plot_loss_curve(root: Path) -> Path | None:
    global _warned
    path = root / "train_log.jsonl"
    if not path.is_file():
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _warned:
            log.warning("matplotlib is not installed: skipping loss_curve.png (pip install matplotlib)")
            _warned = True
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["loss"] for r in rows])
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_yscale("log")
    ax1.grid(alpha=0.3)
    acc = [r.get("acc_per_pos") or [] for r in rows]
    for k in sorted({0, 1, 3, 7, 14} & set(range(max(len(a) for a in acc)))):
        ax2.plot(steps, [a[k] if len(a) > k else float("nan") for a in acc], label=f"acc pos {k + 1}")
    if any("est_mal" in r for r in rows):
        ax2b = ax2.twinx()
        ax2b.plot(steps, [r.get("est_mal", float("nan")) for r in rows], "k--", label="est. MAL")
        ax2b.set_ylabel("teacher-forced acceptance length")
    ax2.set_xlabel("step")
    ax2.set_ylabel("draft accuracy")
    ax2.legend(loc="lower right", fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(root.name)
    fig.tight_layout()
    out = root / "loss_curve.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
