"""Programmatic dependent launch (PDL) for the decode step's chain of small kernels.

A batch-1 decode step is ~160 launches of a few microseconds each, replayed from a CUDA graph; between two of
them the GPU drains the first grid, flushes its writes, then launches and schedules the next grid, whose first
loads wait a DRAM round trip: ~2-3 us per boundary that no kernel fusion inside a launch removes. Hopper
(sm_90) and later can launch a kernel while its predecessor still runs (CUDA programming guide, "Programmatic
Dependent Launch and Synchronization"; PTX ``griddepcontrol``). A kernel launched that way:

1. loads what no earlier kernel of the step writes (the weights: constant while serving),
2. waits for the previous grid to complete and its memory to be visible (``gdc_wait``, :func:`pdl_wait`),
3. lets the next kernel launch (``gdc_launch_dependents``), and does the rest.

Every kernel launched with PDL calls :func:`pdl_wait` unconditionally, before reading or writing anything an
earlier kernel may touch and before any early exit: a grid that finished without waiting would no longer order
its successors after its predecessor. The release comes after the wait, so at most one grid runs ahead
(prefetching its weights) of the one doing the work. Kernels launched without PDL (torch ops, cuBLAS) keep
full stream ordering on both sides. TensorRT-LLM and FlashInfer (``enable_pdl``) use PDL for the same reason.

Only the decode path's chain uses it: the skinny kernels (``flexspec_kernels.skinny_linear``, ``skinny_attention``,
``skinny_merge``) always, attention and argmax at up to ``CHAIN_ROWS`` query rows (decode at batch 1-4, where
attention sits between skinny kernels). Larger steps run cuBLAS GEMMs between them, and there PDL bought nothing:
H200, session 23 (``bench/results/h200-2026-12-04-s23/pdl/``), plain decode steps at batch 4-64, then all through
cuBLAS, took 1-1.5% longer with PDL on attention and argmax than without (0.977 vs 0.966 ms at b=4, 1.445 vs
1.424 at b=64), against 0.447 vs 0.616 ms at batch 1 and 0.564 vs 0.703 at batch 2. (The row limit came after
those runs; it makes larger steps launch exactly as with PDL off.)

``FLEXSPEC_PDL`` (default on) turns it off for A/B benchmarks; it is also off on CPUs (the Triton interpreter),
ROCm and GPUs before sm_90, and with a Triton that lacks ``tl.extra.cuda.gdc_wait``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._dispatch import env_flag, interpreting

try:
    from triton.language.extra import cuda as _tl_cuda

    HAS_GDC = hasattr(_tl_cuda, "gdc_wait") and hasattr(_tl_cuda, "gdc_launch_dependents")
except ImportError:  # a Triton build without the CUDA extras (ROCm)
    HAS_GDC = False

CHAIN_ROWS = 4  # attention / argmax launches of at most this many rows use PDL (the skinny decode chain)

# ``FLEXSPEC_PDL``, parsed at first use (``pdl_setting``) so that importing the kernels never raises;
# benchmarks and tests assign it directly (then ``pdl_launch`` re-reads it).
PDL: bool | None = None


def pdl_setting() -> bool:
    """Whether PDL is wanted: ``PDL`` once set, else ``FLEXSPEC_PDL`` (default on), read and checked on the
    first call. Raises ``EnvSettingError`` naming the variable for a value that is not a boolean switch."""
    global PDL
    if PDL is None:
        PDL = env_flag("FLEXSPEC_PDL", True)
    return PDL


def pdl_supported(capability: tuple[int, int], is_hip: bool, has_gdc: bool = HAS_GDC) -> bool:
    """Whether a device of compute ``capability`` can use PDL: CUDA (not ROCm) sm_90 or later, with a Triton
    that has the grid-dependency ops."""
    return has_gdc and not is_hip and tuple(capability) >= (9, 0)


@functools.cache
def _device_supports(index: int) -> bool:
    return pdl_supported(torch.cuda.get_device_capability(index), torch.version.hip is not None)


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether Triton kernels working on ``t`` launch with PDL (pass the result as the kernel's ``USE_PDL`` and
    :func:`launch_options` to the launch)."""
    if not t.is_cuda or not pdl_setting() or interpreting():
        return False
    return _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_options(use_pdl: bool) -> dict[str, bool]:
    """Extra launch keyword arguments: ``launch_pdl=True`` with PDL, nothing otherwise (the interpreter and
    older Triton builds do not know the option)."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous grid (complete, writes visible), then let the next one launch. Nothing without
    PDL. Every program of a PDL kernel must reach this before touching data earlier kernels write."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
