"""The HAL transfer service on CUDA: one pinned asynchronous upload, event-ordered downloads.

A plain `torch.tensor(list, device="cuda")` is a blocking copy that waits for every kernel already
queued, and `.tolist()` on a device tensor is ordered after everything queued since (in overlap
mode, the next step); either would make building step N+1 wait for step N.
"""
from __future__ import annotations

import torch

from shuili.hal.transfer import EventTransfer


class CudaTransfer(EventTransfer):
    def __init__(self):
        super().__init__("cuda", torch.cuda)

    def map_host(self, array, device) -> torch.Tensor:
        """A device tensor aliasing host memory (a numpy array, e.g. a memory-mapped Engram table)
        that kernels read over the bus, with no copy and no host involvement per step: the pages are
        registered with the driver (cudaHostRegister, mapped + read-only) once, and unified
        addressing makes the host pointer valid on the device. Registering pins the pages, so the
        host needs the RAM to hold them. Not yet run on a GPU (written without device access)."""
        import numpy as np

        arr = np.asarray(array)
        if not arr.flags.c_contiguous or arr.dtype != np.uint8:
            raise ValueError("map_host takes a C-contiguous uint8 array")
        ptr, size, page = arr.ctypes.data, arr.nbytes, 4096
        base = ptr - ptr % page  # a mapping may start mid-page: register the pages around it
        length = -(-(ptr + size - base) // page) * page
        err = torch.cuda.cudart().cudaHostRegister(base, length, 2 | 8)  # Mapped | ReadOnly
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {length} bytes failed with CUDA error {int(err)}")
        with torch.cuda.device(torch.device(device)):
            return torch.as_tensor(_CudaArray(ptr, tuple(arr.shape)), device=torch.device(device))


class _CudaArray:
    """The __cuda_array_interface__ torch.as_tensor reads to alias a device-valid pointer."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, True), "version": 3}
