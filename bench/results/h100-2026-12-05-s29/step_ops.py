"""One engine step's host timeline from a chrome trace: top-level CPU ops (not nested in another op) in order,
with their duration and the kernels/graph launches they issued; totals of launches per step."""
import json, sys, collections
d = json.load(open(sys.argv[1]))
ev = [e for e in d["traceEvents"] if e.get("ph") == "X"]
steps = sorted([e for e in ev if e["name"] == "engine_step"], key=lambda e: e["ts"])
cpu = sorted([e for e in ev if e.get("cat") == "cpu_op"], key=lambda e: (e["ts"], -e["dur"]))
rt = sorted([e for e in ev if e.get("cat") == "cuda_runtime"], key=lambda e: e["ts"])
for st in steps[-3:]:
    a, b = st["ts"], st["ts"] + st["dur"]
    ops = [e for e in cpu if a <= e["ts"] < b and e["name"] != "engine_step"]
    top, end = [], -1
    for e in ops:
        if e["ts"] >= end:
            top.append(e); end = e["ts"] + e["dur"]
    rts = [e for e in rt if a <= e["ts"] < b]
    c = collections.Counter(e["name"] for e in rts)
    print(f"--- step {st['dur']:.0f} us, runtime calls {dict(c)}")
    for e in top:
        n = sum(1 for r in rts if e["ts"] <= r["ts"] < e["ts"] + e["dur"] and r["name"] in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch", "cudaMemcpyAsync"))
        print(f"  {e['ts']-a:8.1f} {e['dur']:7.1f}  L{n:<3d} {e['name'][:70]}")
