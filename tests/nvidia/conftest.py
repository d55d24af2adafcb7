"""Kernel tests run on the GPU when CUDA is present, else under TRITON_INTERPRET=1 on the CPU.

The interpreter switch is read when a kernel is decorated, so it is set here, before any test
module imports the kernels."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed: pip install 'triton>=3.6'")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
