"""Shared setup for the kernel tests.

Triton kernels run on CPU only under Triton's interpreter, which is chosen when ``triton`` is first
imported, so the variable is set here, before any test module imports ``flexspec_kernels``. Where a GPU is
visible the kernels are compiled for it instead (run with ``TRITON_INTERPRET=0`` to be explicit).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture
def device() -> torch.device:
    """Device the Triton path is tested on: CUDA when present, else CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
