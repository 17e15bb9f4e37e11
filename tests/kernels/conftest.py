"""Shared setup for the kernel tests.

Triton kernels run on CPU only under its interpreter, and the interpreter is chosen when
``triton`` is first imported, so the variable must be set before any test module imports
``kernels``. ``setdefault`` keeps a real GPU run (``TRITON_INTERPRET=0``) possible.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """Device the Triton path is tested on: CUDA when present, else CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
