"""Where a speculative decoding step's *host* time goes (cProfile over real engine steps).

Usage: python scripts/profile_spec_host.py SPEC_JSON [BATCH_SIZES] [OUT_DIR]

Fills the batch with greedy requests (EOS ignored), warms up, times ``STEPS`` unprofiled ``LLMEngine.step()``
calls (wall ms per step), then runs ``STEPS`` more under cProfile and prints the functions with the most own
time and the most cumulative time. On a GPU the time the host waits for the device shows up in the sync calls
(``tolist``, ``synchronize``); everything else is host work the device may wait for. ``OUT_DIR`` gets one
pstats text file per batch size, ``host_{plain|METHOD[-EXECUTION]}_b{B}.txt``. ``SPEC_JSON`` ``null`` profiles the plain
engine.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

from profile_spec_step import filled_engine, sync_device  # scripts/ is sys.path[0] when run as a script

STEPS = int(os.environ.get("STEPS", "100"))


def main() -> None:
    spec = json.loads(sys.argv[1])
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,64").split(",")]
    out_dir = sys.argv[3] if len(sys.argv) > 3 else None
    for bs in sizes:
        eng = filled_engine(spec, bs, max_model_len=2048)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            eng.step()
        sync_device()
        wall = (time.perf_counter() - t0) / STEPS * 1000
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(STEPS):
            eng.step()
        sync_device()
        prof.disable()
        wall_prof = (time.perf_counter() - t0) / STEPS * 1000
        mal = eng.spec_metrics.as_dict().get("mean_acceptance_length") if spec else None
        text = io.StringIO()
        text.write(
            f"batch {bs}: {wall:.3f} ms per step unprofiled, {wall_prof:.3f} under cProfile, MAL {mal}\n"
        )
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        label = (
            "plain" if not spec else "-".join(str(spec[k]) for k in ("method", "execution") if spec.get(k))
        )
        path = f"{out_dir}/host_{label}_b{bs}.txt" if out_dir else None
        if path:
            with open(path, "w") as f:
                f.write(text.getvalue())
        # the first 6,000 characters on screen; the whole profile goes to the file
        cut = text.getvalue()[:6000]
        print(
            cut
            + (
                "\n... (cut; the whole profile: " + path + ")"
                if path and len(cut) < len(text.getvalue())
                else ""
            )
        )
        del eng


if __name__ == "__main__":
    main()
