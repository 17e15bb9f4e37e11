"""Skinny fused GEMMs (``flexspec_kernels.skinny_linear``) vs the unfused ops they replace, inside CUDA graphs.

    python -m bench.skinny_bench --output skinny.json [--rows 1,2,4,8,16] [--sweep [--sweep-rows 1,4,16]]

For each GEMM of a decoder layer of the default model (hidden 576, intermediate 1536, 9 / 3 heads of 64) and
each row count: the time per call of the fused op (and of each form: ``gemv``, ``dot`` and the opt-in split-K
``splitk``, with its error) and of the unfused sequence (Triton RMSNorm / activation / residual add + cuBLAS
``F.linear``), each measured as a CUDA graph of ``--repeat`` back-to-back calls (what a decode step replays;
launched from Python, overhead would dominate a ~2 us kernel). Each call reuses one weight (1-3.5 MB,
L2-resident after the first call), so this is an upper bound of the fused gain: the engine's start-up
measurement (``LlamaForCausalLM.tune_skinny``) reads every layer's weights from HBM. ``--sweep`` also times
other tile configurations (block_n, block_k, num_warps; for ``splitk``, block_k is the K per program:
cdiv(K, block_k) programs per feature tile).
JSON out, with the machine.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch
import torch.nn.functional as F

from bench.common import environment, output_path
from flexspec.layers.fused import graph_time_us
from flexspec_kernels.activation import act_and_mul_triton
from flexspec_kernels.norm import rms_norm_triton
from flexspec_kernels.skinny_linear import skinny_linear_triton

SHAPES = {  # name -> (N, K, fusion)
    "qkv+norm": (960, 576, "norm"),
    "o+residual": (576, 576, "residual"),
    "gate_up+norm+silu": (3072, 576, "norm_act"),
    "down+residual": (576, 1536, "residual"),
}


def measure(name: str, n: int, k: int, fusion: str, m: int, repeat: int, sweep: bool) -> dict:
    """One GEMM at ``m`` rows: error vs the unfused ops, fused and unfused us per call (optionally a sweep)."""
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dt) * k**-0.5
    nw = torch.rand(k, device=dev, dtype=dt) + 0.5
    nw_out = torch.rand(n, device=dev, dtype=dt) + 0.5  # the next norm, over the residual's features
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
        return rms_norm_triton(F.linear(x, w), nw_out, 1e-5, residual=res)  # the unfused add (+ next norm)

    def fused(**cfg):
        extra = {"residual": res} if fusion == "residual" else {}
        return lambda: skinny_linear_triton(x, w, eps=1e-5, **kw, **extra, **cfg)

    # correctness against the unfused ops (a fresh residual copy: the fused op adds in place)
    want = (res + F.linear(x, w)) if fusion == "residual" else unfused()

    def rel_err(**cfg) -> float:
        extra = {"residual": res.clone()} if fusion == "residual" else {}
        got = skinny_linear_triton(x, w, eps=1e-5, **kw, **extra, **cfg)
        return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()

    err = rel_err()
    point = {"gemm": name, "rows": m, "n": n, "k": k, "max_rel_err": err,
             "unfused_us": graph_time_us(unfused, repeat), "fused_us": graph_time_us(fused(), repeat)}  # fmt: skip
    point["speedup"] = point["unfused_us"] / point["fused_us"]
    for variant in ("gemv", "dot", "splitk"):
        point[f"{variant}_us"] = graph_time_us(fused(variant=variant), repeat)
    point["splitk_max_rel_err"] = rel_err(variant="splitk")  # fp32 atomics, summed in arrival order
    if sweep:
        times = {}
        configs = [("gemv", bn, 0, w) for bn in (4, 8, 16) for w in (2, 4, 8)] if m <= 8 else []
        configs += [("dot", bn, bk, w) for bn in (16, 32) for bk in (64, 128, 256) for w in (2, 4)]
        configs += [("splitk", bn, bk, w) for bn in (16, 32) for bk in (32, 64, 128) for w in (1, 2, 4)]
        for variant, bn, bk, nwarps in configs:
            key = f"{variant}_bn{bn}_bk{bk}_w{nwarps}"
            cfg = {"variant": variant, "block_n": bn, "num_warps": nwarps, **({"block_k": bk} if bk else {})}
            try:
                times[key] = graph_time_us(fused(**cfg), repeat)
            except Exception as e:  # noqa: BLE001 -- a config the compiler rejects (e.g. out of registers)
                times[key] = repr(e)[:120]
        ok = [(v, key) for key, v in times.items() if isinstance(v, float)]
        best = min(ok) if ok else (None, None)
        point["sweep_us"], point["best"] = times, {"config": best[1], "us": best[0]}
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", type=output_path, required=True)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-rows", default="1,4,16", help="Row counts that --sweep covers.")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for name, (n, k, fusion) in SHAPES.items():
        for m in map(int, args.rows.split(",")):
            sweep = args.sweep and str(m) in args.sweep_rows.split(",")
            point = measure(name, n, k, fusion, m, args.repeat, sweep)
            results.append(point)
            with open(args.output, "w") as f:
                json.dump(
                    {"environment": environment(), "repeat": args.repeat, "points": results}, f, indent=1
                )
            print(json.dumps({q: v for q, v in point.items() if q != "sweep_us"}), flush=True)


if __name__ == "__main__":
    main()
