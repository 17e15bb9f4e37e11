"""GPU benchmark and large-shape check of the kernels (a script, not collected by pytest).

    TRITON_INTERPRET=0 python -m bench.kernels_bench [--sweep]
    TRITON_INTERPRET=0 python -m bench.kernels_bench --split-kv [--json out.json]
    TRITON_INTERPRET=0 python -m bench.kernels_bench --argmax [--json out.json]
    TRITON_INTERPRET=0 python -m bench.kernels_bench --top1 [--json out.json]

Each attention line: Triton time, effective bandwidth (K/V bytes read once) and TFLOP/s, and the max
abs difference to the torch reference. ``--sweep`` also times other tile configurations. ``--split-kv``
only times decode attention of the default model's shape (9 query / 3 KV heads, D 64, bf16, block 16) at
batch 1-64 and contexts 128-2048 with 1-16 splits and the launcher's own choice, as a decode step runs it:
30 launches (one per layer) replayed in a CUDA graph, us per launch (median of 20 replays). ``--argmax`` times
greedy sampling's argmax over [N, 49152] fp32 logits (N = 1, 8, 64) in a CUDA graph: ``torch.argmax`` and
``flexspec_kernels.argmax`` at several tile widths and warp counts (each checked equal to torch's, ties included).
``--top1`` times a drafter's greedy drafts with their confidence over [N, 49152] bf16 LM-head output (N = 15,
240, 960: a block of 15 drafts at batch 1, 16, 64) in a CUDA graph: the torch path (fp32 copy, softmax, max)
and ``flexspec_kernels.top1_softmax`` at several tile widths and warp counts (indices checked equal to torch's,
probabilities to 1e-5 relative).
"""

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flexspec_kernels import (
    argmax_triton,
    attention,
    attention_split,
    pack_masks,
    paged_attention_ref,
    paged_attention_triton,
    rejection_sample,
    store_kv_cache,
    top1_softmax_ref,
    top1_softmax_triton,
)

DEV = "cuda"


def make_batch(ctx_lens, new_lens, hq, hkv, d, block_size=16, dtype=torch.bfloat16, tree_mask=False):
    num_seqs = len(ctx_lens)
    blocks = [-(-c // block_size) for c in ctx_lens]
    num_blocks = max(sum(blocks), 1)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=DEV, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=DEV).int()
    block_tables = torch.zeros(num_seqs, max(blocks + [1]), dtype=torch.int32, device=DEV)
    used = 0
    for s, nb in enumerate(blocks):
        block_tables[s, :nb] = perm[used : used + nb]
        used += nb
    t = sum(new_lens)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(new_lens).cumsum(0)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx_lens, new_lens)])
    mask = mask_start_loc = None
    if tree_mask:
        masks = [(torch.rand(n, n) < 0.5).tril() | torch.eye(n, dtype=torch.bool) for n in new_lens]
        mask, mask_start_loc = (x.to(DEV) for x in pack_masks(masks))
    return {
        "q": torch.randn(t, hq, d, device=DEV, dtype=dtype),
        "k": torch.randn(t, hkv, d, device=DEV, dtype=dtype),
        "v": torch.randn(t, hkv, d, device=DEV, dtype=dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": torch.tensor(ctx_lens, dtype=torch.int32, device=DEV),
        "query_start_loc": qsl.to(DEV),
        "positions": positions.to(DEV),
        "scale": d**-0.5,
        "mask": mask,
        "mask_start_loc": mask_start_loc,
    }


def bench_attention(name, b, max_query_len, flops=None, sdpa=None, check=True, **kw):
    fn = lambda: paged_attention_triton(**b, max_query_len=max_query_len, **kw)
    ms = do_bench(fn, warmup=50, rep=200)
    hkv, d = b["k"].shape[1:]
    kv_bytes = (int(b["context_lens"].sum()) + b["k"].shape[0]) * hkv * d * 2 * b["k"].element_size()
    line = f"{name:42s} {ms * 1e3:9.1f} us  {kv_bytes / ms / 1e9:5.2f} TB/s"
    if flops:
        line += f"  {flops / ms / 1e9:6.0f} TFLOP/s"
    if sdpa is not None:
        sdpa_ms = do_bench(sdpa, warmup=50, rep=200)
        line += f"  | torch sdpa {sdpa_ms * 1e3:8.1f} us ({flops / sdpa_ms / 1e9:5.0f} TFLOP/s)"
    if check:
        err = (fn().float() - paged_attention_ref(**b, **kw).float()).abs().max().item()
        line += f"  maxerr {err:.2e}"
    print(line, flush=True)
    return ms


def split_kv_sweep(json_path=None):
    """Decode attention of the default model's shape: us per launch inside a 30-launch CUDA graph, per batch
    size, context length and split count ("auto": the launcher's choice); max error of auto vs the reference."""
    rows = []
    for bs in (1, 4, 16, 64):
        for ctx in (128, 512, 1024, 2048):
            b = make_batch([ctx] * bs, [1] * bs, 9, 3, 64)
            ref = paged_attention_ref(**b).float()
            for splits in (1, 2, 4, 8, 16, None):
                fn = lambda: paged_attention_triton(**b, max_query_len=1, num_splits=splits)  # noqa: B023
                fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(30):
                        fn()
                times = []
                for _ in range(20):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    g.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / 30)
                times.sort()
                row = {
                    "batch": bs,
                    "ctx": ctx,
                    "splits": splits or "auto",
                    "us_per_launch": round(times[10], 2),
                }
                row["maxerr"] = round((fn().float() - ref).abs().max().item(), 5)
                if splits is None:
                    row["auto_splits"] = attention_split.num_splits_for(
                        (bs // 5 + bs) * 3, 1, torch.device(DEV)
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                f,
                indent=1,
            )


def _row_kernel_sweep(inputs, torch_fn, triton_fn, check, json_path=None):
    """Time ``torch_fn(x)`` and ``triton_fn(x, block, num_warps)`` at every tile width / warp count in a CUDA
    graph (us per call) for each ``x`` of ``inputs`` ({N: [N, V] tensor}); ``check(got, want, label)`` raises
    on a wrong result. Prints one row per N and writes them to ``json_path``."""
    from flexspec.layers.fused import graph_time_us

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for n, x in inputs.items():
        want = torch_fn(x)
        row = {"torch_us": round(graph_time_us(lambda x=x: torch_fn(x)), 2)}
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                fn = lambda x=x, b=block, w=warps: triton_fn(x, b, w)
                check(fn(), want, f"block={block}, num_warps={warps}, N={n}")
                row[f"b{block}_w{warps}_us"] = round(graph_time_us(fn), 2)
        res[n] = row
        print(n, row, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)


def _logits_with_a_tie(n, dtype, tie):
    x = (torch.randn(n, 49152, device=DEV) * 3).to(dtype)
    x[:, 777] = x[:, 40000] = tie  # a tie: the lowest index wins
    return x


def argmax_sweep(json_path=None):
    """Greedy argmax over [N, 49152] fp32 logits in a CUDA graph (us per call): torch vs ``flexspec_kernels.argmax``."""

    def check(got, want, label):
        if not torch.equal(got, want):
            raise AssertionError(f"argmax_triton({label}) != torch")

    inputs = {n: _logits_with_a_tie(n, torch.float32, 100.0) for n in (1, 8, 64)}
    _row_kernel_sweep(inputs, lambda x: x.argmax(-1), argmax_triton, check, json_path)


def top1_sweep(json_path=None):
    """Top-1 token + softmax probability over [N, 49152] bf16 logits in a CUDA graph (us per call): the torch
    path vs ``flexspec_kernels.top1_softmax``."""

    def check(got, want, label):
        if not torch.equal(got[1], want[1]):
            raise AssertionError(f"top1_softmax_triton({label}): index != torch")
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)

    inputs = {n: _logits_with_a_tie(n, torch.bfloat16, 30.0) for n in (15, 240, 960)}
    _row_kernel_sweep(inputs, top1_softmax_ref, top1_softmax_triton, check, json_path)


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    i = sys.argv.index("--json") if "--json" in sys.argv else -1
    if "--split-kv" in sys.argv:
        split_kv_sweep(sys.argv[i + 1] if i >= 0 else None)
        return
    if "--argmax" in sys.argv:
        argmax_sweep(sys.argv[i + 1] if i >= 0 else None)
        return
    if "--top1" in sys.argv:
        top1_sweep(sys.argv[i + 1] if i >= 0 else None)
        return
    hq, hkv, d = 32, 8, 128

    def batch(ctx, new, **kw):
        return make_batch(ctx, new, kw.pop("hq", hq), kw.pop("hkv", hkv), kw.pop("d", d), **kw)

    bench_attention("decode  S=128 ctx=4096 (bf16, D128, G4)", batch([4096] * 128, [1] * 128), 1)
    bench_attention("decode  S=32  ctx=16384", batch([16384] * 32, [1] * 32), 1, check=False)
    bench_attention("decode  S=256 ctx=1024", batch([1024] * 256, [1] * 256), 1)
    bench_attention("verify  S=64 n=8 ctx=2048 tree mask", batch([2048] * 64, [8] * 64, tree_mask=True), 8)
    bench_attention("verify  S=64 n=8 ctx=2048 causal", batch([2048] * 64, [8] * 64), 8)
    n = 2048
    b = make_batch([0], [n], hq, hkv, d)
    q4, k4, v4 = (b[x].transpose(0, 1)[None] for x in ("q", "k", "v"))
    sdpa = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    causal_flops = 4 * n * n * d * hq / 2
    bench_attention("prefill n=2048 ctx=0 causal", b, n, causal_flops, sdpa)
    b = make_batch([4096], [n], hq, hkv, d)
    bench_attention("chunked prefill n=2048 ctx=4096", b, n, 4 * n * (4096 + n / 2) * d * hq)
    b = make_batch([3000] + [2048] * 63, [2048] + [1] * 63, hq, hkv, d)
    bench_attention("mixed: 1 prefill 2048 + 63 decodes", b, 2048)
    bench_attention("mixed, hint None", b, None)
    for dd in (64, 256):
        bench_attention(f"decode  S=128 ctx=4096 D={dd}", batch([4096] * 128, [1] * 128, d=dd), 1)
        bb = make_batch([0], [n], hq, hkv, dd)
        bench_attention(f"prefill n=2048 D={dd}", bb, n, 4 * n * n * dd * hq / 2)
    bench_attention("prefill sliding_window=256 softcap=50", make_batch([1024], [n], hq, hkv, d), n,
                    sliding_window=256, logits_soft_cap=50.0)  # fmt: skip
    bench_attention("decode fp32 S=8 ctx=1000", batch([1000] * 8, [1] * 8, dtype=torch.float32), 1)

    if "--sweep" in sys.argv:
        orig = attention._launch_config
        for label, b, mql in (
            ("verify S=64 n=8", batch([2048] * 64, [8] * 64, tree_mask=True), 8),
            ("prefill 2048", make_batch([0], [n], hq, hkv, d), n),
        ):
            configs = [(16, 32, 4), (16, 64, 4), (16, 128, 4), (32, 64, 4), (64, 64, 4), (64, 32, 4)]
            configs += [(128, 64, 8), (128, 64, 4), (128, 32, 4), (64, 128, 8), (128, 128, 8)]
            for bm, bn, nw in configs:
                if bm < hq // hkv:
                    continue
                attention._launch_config = lambda *a, bm=bm, bn=bn, nw=nw: (bm, bm // (hq // hkv), bn, nw)
                try:
                    bench_attention(f"  sweep {label} M{bm} N{bn} w{nw}", b, mql, check=False)
                except Exception as e:  # noqa: BLE001
                    print(f"  sweep {label} M{bm} N{bn} w{nw} failed: {type(e).__name__}")
        attention._launch_config = orig

    # rejection sampler: S=256, 4 drafts, Qwen-size vocab
    s, k, vocab = 256, 4, 151936
    p = torch.softmax(torch.randn(s * k, vocab, device=DEV), -1)
    qd = torch.softmax(torch.randn(s * k, vocab, device=DEV), -1)
    args = (
        torch.multinomial(qd, 1)[:, 0], torch.arange(0, s * k + 1, k, device=DEV, dtype=torch.int32), p,
        torch.zeros(s, dtype=torch.int64, device=DEV), torch.zeros(s, dtype=torch.bool, device=DEV),
        torch.rand(s * k, device=DEV), torch.empty_like(p).exponential_(), qd,
    )  # fmt: skip
    for be in ("triton", "torch"):
        ms = do_bench(lambda be=be: rejection_sample(*args, max_spec_len=k, backend=be), warmup=10, rep=100)
        tbps = 3 * p.numel() * 4 / ms / 1e9  # p, q and noise read once
        print(f"rejection_sample {be:6s} S=256 k=4 V=151936  {ms * 1e3:9.1f} us  {tbps:5.2f} TB/s")
    out_t = rejection_sample(*args, max_spec_len=k, backend="triton")
    out_r = rejection_sample(*args, max_spec_len=k, backend="torch")
    print("rejection triton == torch:", torch.equal(out_t, out_r))

    t, hkv_, d_ = 8192, 8, 128
    key = torch.randn(t, hkv_, d_, device=DEV, dtype=torch.bfloat16)
    kc = torch.zeros(t // 16 + 1, 16, hkv_, d_, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(kc.shape[0] * 16, device=DEV)[:t]
    ms = do_bench(lambda: store_kv_cache(key, key, kc, vc, slots), warmup=10, rep=100)
    tbps = 4 * key.numel() * 2 / ms / 1e9  # K, V read and written
    print(f"store_kv_cache T=8192 Hkv=8 D=128 bf16     {ms * 1e3:9.1f} us  {tbps:5.2f} TB/s")


if __name__ == "__main__":
    main()
