"""Per-step GPU busy vs idle from a torch.profiler chrome trace (gz ok): kernels on the GPU stream, gaps > 2us."""
import gzip, json, sys, collections
p = sys.argv[1]
d = json.load(gzip.open(p) if p.endswith(".gz") else open(p))
ev = [e for e in d["traceEvents"] if e.get("ph") == "X"]
k = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
t0, t1 = k[0]["ts"], k[-1]["ts"] + k[-1]["dur"]
busy = 0.0; end = t0; gaps = []
for e in k:
    if e["ts"] > end:
        gaps.append((e["ts"] - end, e["name"][:60], prev))
    busy += e["dur"]; end = max(end, e["ts"] + e["dur"]); prev = e["name"][:60]
span = t1 - t0
print(f"kernels {len(k)}, span {span/1e3:.2f} ms, sum of kernel time {busy/1e3:.2f} ms, idle {sum(g[0] for g in gaps)/1e3:.2f} ms")
big = collections.Counter()
for g, n, pv in gaps:
    if g > 5: big[(pv, n)] += g
print("largest idle gaps by (before -> after) kernel, us total:")
for (pv, n), g in big.most_common(25): print(f"  {g:8.1f}  {pv} -> {n}")
cpu = collections.Counter()
for e in ev:
    if e.get("cat") == "cpu_op" or e.get("cat") == "cuda_runtime": cpu[e["name"][:50]] += e["dur"]
print("top CPU ops/runtime (us total):")
for n, t in cpu.most_common(15): print(f"  {t:8.1f}  {n}")
