"""Mean / worst (over seeds) of auto / best fixed mode per point, per setting and replay order:
python bench/results/cpu-2026-12-05-s30/summarize.py bench/results/cpu-2026-12-05-s30/prior-half-life
(files r_{setting}_{first dataset}_{seed}.json written by bench.policy_replay)."""

import collections
import json
import statistics as st
import sys
from pathlib import Path

rows = collections.defaultdict(list)
for f in Path(sys.argv[1]).glob("r_*.json"):
    setting, rest = f.stem[2:].split("_", 1)
    first, _seed = rest.rsplit("_", 1)
    for p in json.loads(f.read_text())["points"]:
        rows[(setting, first, p["dataset"], p["batch_size"])].append(p["auto_vs_best"])
settings = sorted({k[0] for k in rows}, key=float, reverse=True)
for first in sorted({k[1] for k in rows}):
    print(f"replayed first: {first}")
    print("point".ljust(16), " ".join(s.rjust(13) for s in settings))
    every = {s: [] for s in settings}
    for ds, b in sorted({(k[2], k[3]) for k in rows if k[1] == first}):
        cells = []
        for s in settings:
            v = rows.get((s, first, ds, b), [])
            every[s] += v
            cells.append(f"{st.mean(v):.3f}/{min(v):.3f}" if v else "-")
        print(f"{ds} b={b}".ljust(16), " ".join(c.rjust(13) for c in cells))
    print("mean/worst".ljust(16), " ".join(f"{st.mean(every[s]):.3f}/{min(every[s]):.3f}".rjust(13) for s in settings))
