"""Session 40: what the auto policy predicted for its speculative decisions against what the next step realized.

    python bench/results/h100-2026-12-06-s40/policy-logs/predicted_vs_realized.py policy-logs/*.json.gz

For every decision of a speculative option in a ``scripts/policy_log.py`` log: the predicted tokens per sequence
(the option's expected rate x its step time, as the policy computed them; no margin, no switch costs) and the
realized ones (1 + the mean accepted drafts of the next step, which verifies those drafts; counted only where that
step's recorded mode is the same option). Per option: count, mean predicted, mean realized, mean prior G.
"""

import gzip
import json
import statistics as S
import sys

for f in sys.argv[1:]:
    d = json.load(gzip.open(f) if f.endswith(".gz") else open(f))
    log, steps, s = d["log"], d["steps"], d["summary"]
    by: dict[str, list[tuple[float, float, float, float]]] = {}
    for i, e in enumerate(log):
        m = e["mode"]
        if m == "plain" or i + 1 >= len(steps) or steps[i + 1]["accepted"] is None or steps[i + 1]["mode"] != m:
            continue
        pred = e["rates"][m] * e["step_ms"][m] / 1000
        by.setdefault(m, []).append((pred, 1 + steps[i + 1]["accepted"], e["prior"], e["rates"][m] / e["rates"]["plain"]))
    print(f"{f}: {s['decisions']} decisions, plain share {s['plain_share']}, {s['tokens_per_s']} tok/s, MAL {s['mal']}")
    for m, v in sorted(by.items()):
        print(
            f"  {m:12s} n={len(v):3d} predicted {S.fmean(p for p, *_ in v):.3f} realized {S.fmean(r for _, r, *_ in v):.3f}"
            f" prior G {S.fmean(g for *_, g, _ in v):.3f} predicted rate / plain's (median) {S.median(x for *_, x in v):.3f}"
        )
