"""Skinny fused GEMMs (``kernels.skinny_linear``) vs the unfused ops they replace, inside CUDA graphs.

    python -m bench.skinny_bench --output skinny.json [--rows 1,2,4,8,16] [--sweep]

For each GEMM of a decoder layer of the default model (hidden 576, intermediate 1536, 9 / 3 heads of 64) and
each row count: the time per call of the fused op and of the unfused sequence (Triton RMSNorm / activation /
residual add + cuBLAS ``F.linear``), both measured as a CUDA graph of ``--repeat`` back-to-back calls (what a
decode step replays; launch overhead from Python would otherwise dominate a ~2 us kernel). ``--sweep`` also
times other tile configurations (block_n, block_k, num_warps). JSON out, with the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch
import torch.nn.functional as F

from bench.common import environment
from kernels.activation import act_and_mul_triton
from kernels.norm import rms_norm_triton
from kernels.skinny_linear import skinny_linear_triton

SHAPES = {  # name -> (N, K, fusion)
    "qkv+norm": (960, 576, "norm"),
    "o+residual": (576, 576, "residual"),
    "gate_up+norm+silu": (3072, 576, "norm_act"),
    "down+residual": (576, 1536, "residual"),
}


def graph_time_us(fn, repeat: int) -> float:
    """Median per-call time of ``fn`` replayed ``repeat`` times in one CUDA graph, in microseconds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeat)
    return sorted(times)[len(times) // 2]


def measure(name: str, n: int, k: int, fusion: str, m: int, repeat: int, sweep: bool) -> dict:
    """One GEMM at ``m`` rows: error vs the unfused ops, fused and unfused us per call (optionally a sweep)."""
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dt) * k**-0.5
    nw = torch.rand(k, device=dev, dtype=dt) + 0.5
    x = torch.randn(m, k, device=dev, dtype=dt)
    out_n = n // 2 if fusion == "norm_act" else n
    res = torch.randn(m, out_n, device=dev, dtype=dt)
    kw = {}
    if fusion in ("norm", "norm_act"):
        kw["norm_weight"] = nw
    if fusion == "norm_act":
        kw["activation"] = "silu"

    def unfused():
        if fusion == "norm":
            return F.linear(rms_norm_triton(x, nw, 1e-5), w)
        if fusion == "norm_act":
            return act_and_mul_triton(F.linear(rms_norm_triton(x, nw, 1e-5), w))
        return rms_norm_triton(F.linear(x, w), nw, 1e-5, residual=res)  # the unfused add (+ the next norm)

    def fused(**cfg):
        extra = {"residual": res} if fusion == "residual" else {}
        return lambda: skinny_linear_triton(x, w, eps=1e-5, **kw, **extra, **cfg)

    # correctness against the unfused ops (a fresh residual copy: the fused op adds in place)
    want = (res + F.linear(x, w)) if fusion == "residual" else unfused()
    got = skinny_linear_triton(
        x, w, eps=1e-5, **kw, **({"residual": res.clone()} if fusion == "residual" else {})
    )
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
    point = {"gemm": name, "rows": m, "n": n, "k": k, "max_rel_err": err,
             "unfused_us": graph_time_us(unfused, repeat), "fused_us": graph_time_us(fused(), repeat)}  # fmt: skip
    point["speedup"] = point["unfused_us"] / point["fused_us"]
    if sweep:
        times = {}
        for bn, bk, nwarps in itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8)):
            key = f"bn{bn}_bk{bk}_w{nwarps}"
            try:
                times[key] = graph_time_us(fused(block_n=bn, block_k=bk, num_warps=nwarps), repeat)
            except Exception as e:  # noqa: BLE001 -- a config the compiler rejects (e.g. out of shared memory)
                times[key] = repr(e)[:120]
        best = min((v, key) for key, v in times.items() if isinstance(v, float))
        point["sweep_us"], point["best"] = times, {"config": best[1], "us": best[0]}
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for name, (n, k, fusion) in SHAPES.items():
        for m in map(int, args.rows.split(",")):
            point = measure(name, n, k, fusion, m, args.repeat, args.sweep)
            results.append(point)
            print(json.dumps({q: v for q, v in point.items() if q != "sweep_us"}), flush=True)
    with open(args.output, "w") as f:
        json.dump({"environment": environment(), "repeat": args.repeat, "points": results}, f, indent=1)


if __name__ == "__main__":
    main()
