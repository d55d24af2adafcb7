"""Kernel tests run on the GPU when CUDA is present, else under TRITON_INTERPRET=1 on the CPU.

The interpreter switch is read when a kernel is decorated, so it is set here, before any test
module imports the kernels. Under the interpreter the session also gets a tl.dot that does not
call the host's BLAS (tests_nvidia_dot.py says why), so the bitwise batch-invariance tests check
the kernels' tiling, split-K and combine order on any host; a GPU run keeps its own dot.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed: pip install 'triton>=3.6'")

sys.path.insert(0, str(Path(__file__).parent))  # tests_nvidia_dot (importlib import mode)
import tests_nvidia_dot  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session", autouse=True)
def blas_free_interpreter_dot():
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        tests_nvidia_dot.install(mp)
        yield


@pytest.fixture
def device():
    return DEVICE
