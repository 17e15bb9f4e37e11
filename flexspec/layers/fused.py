"""When layers use the fused Triton kernels of ``kernels`` instead of their plain-torch code.

Fused kernels run for CUDA tensors when no gradient is needed (they have no backward; training the
drafters goes through the torch code). ``FLEXSPEC_FUSED_KERNELS=0`` turns them off, for A/B benchmarks
and for bisecting numerics; on CPU the torch code always runs (it is the kernels' reference).
"""

from __future__ import annotations

import os

import torch

from flexspec_kernels._dispatch import EnvSettingError, env_flag
from flexspec_kernels.skinny_linear import MAX_ROWS

ENABLED = env_flag("FLEXSPEC_FUSED_KERNELS", True)


def use_fused(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """True when ``x`` is on CUDA (or ROCm) and neither it nor ``params`` needs a gradient."""
    if not (ENABLED and x.is_cuda):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))


# Skinny fused GEMMs (``flexspec_kernels.skinny_linear``) for decoder steps of few tokens:
#   "auto": on CUDA, for the row counts where a start-up measurement found them faster (``skinny_max_rows``);
#   "on": on CUDA for every step of <= 16 rows; "off": never;
#   "torch": also on CPU, through their torch reference (tests use it to check the fused decoder's data flow).
SKINNY = os.environ.get("FLEXSPEC_SKINNY_LINEAR", "auto").strip().lower() or "auto"
SKINNY_MIN_GAIN = 0.05  # "auto" takes the fused form where it measured >= 5% faster (timing noise)
if SKINNY in ("0", "false", "no"):
    SKINNY = "off"
elif SKINNY in ("1", "true", "yes"):
    SKINNY = "on"
elif SKINNY not in ("auto", "on", "off", "torch"):
    raise EnvSettingError(
        f"FLEXSPEC_SKINNY_LINEAR={os.environ['FLEXSPEC_SKINNY_LINEAR']!r}: expected auto, on, off, torch, 1 or 0"
    )


# Batch-1/2 decode: RoPE + KV-cache write folded into the QKV GEMV and split-KV attention's merge into the O GEMV
# (``flexspec_kernels.skinny_attention``, inside the skinny path). ``FLEXSPEC_FUSED_DECODE=0`` keeps their own launches (A/B).
DECODE_FUSIONS = env_flag("FLEXSPEC_FUSED_DECODE", True)


def use_skinny(x: torch.Tensor, *params: torch.Tensor, max_rows: int | None = None) -> bool:
    """True when a decoder step over ``x`` [T, H] should use the skinny fused GEMMs: 0 < T <= ``max_rows`` (the
    measured limit in "auto" mode; at most ``flexspec_kernels.skinny_linear.MAX_ROWS``), gradients off (inference /
    no_grad: the layer weights of a model being trained must not go through it), and on CUDA with the fused
    kernels enabled unless the mode is "torch"."""
    rows = MAX_ROWS if max_rows is None or SKINNY != "auto" else min(max_rows, MAX_ROWS)
    if SKINNY == "off" or x.dim() != 2 or not 0 < x.shape[0] <= rows:
        return False
    if torch.is_grad_enabled():  # in-place residual updates and Triton kernels have no backward
        return False
    return SKINNY == "torch" or use_fused(x, *params)


def graph_time_us(fn, repeat: int = 20, trials: int = 10) -> float:
    """Median time per call of ``fn`` (CUDA work, no host sync inside) replayed ``repeat`` times in one CUDA
    graph, over ``trials`` replays, in microseconds: what a captured decode step pays for it (launching it
    from Python would cost more than a ~2 us kernel)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles, and settles the caching allocator outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeat)
    del graph
    return sorted(times)[len(times) // 2]
