"""The HAL transfer service on CUDA: one pinned asynchronous upload, event-ordered downloads.

A plain `torch.tensor(list, device="cuda")` is a blocking copy that waits for every kernel already
queued, and `.tolist()` on a device tensor is ordered after everything queued since (in overlap
mode, the next step); either would make building step N+1 wait for step N.
"""
from __future__ import annotations

import threading

import torch

from shuili.hal.transfer import EventTransfer

PAGE = 4096
_HOST_REGISTER_MAPPED, _HOST_REGISTER_READ_ONLY = 2, 8


class CudaTransfer(EventTransfer):
    def __init__(self):
        super().__init__("cuda", torch.cuda)

    def map_host(self, array, device) -> torch.Tensor:
        """A device tensor aliasing host memory (a numpy array, e.g. a memory-mapped Engram table)
        that kernels read over the bus, with no copy and no host involvement per step. A file-backed
        array (a memmap, as a checkpoint's tables are) has its pages registered with the driver
        (cudaHostRegister, mapped + read-only) once per process; unified addressing makes the host
        pointer valid on the device. Registering pins the pages, so the host needs the RAM to hold
        them; they stay registered (and the array alive) for the process's life. Arrays that share a
        page are fine: overlapping registrations are merged into one (see `_Registry.register`).
        Any other array (heap memory: a random-weight model's tables) is copied once into page-locked
        memory of its own (cudaHostAlloc, device-readable under unified addressing) instead: heap
        pages are shared with unrelated objects, and the allocator may return them to the system
        (trim, madvise) while the driver still holds them registered."""
        import numpy as np

        arr = np.asarray(array)
        if not arr.flags.c_contiguous or arr.dtype != np.uint8:
            raise ValueError("map_host takes a C-contiguous uint8 array")
        if file_backed(array):
            ptr = arr.ctypes.data
            _REGISTRY.register(ptr, arr.nbytes, array)
        else:
            pinned = torch.empty(max(arr.nbytes, 1), dtype=torch.uint8, pin_memory=True)
            pinned[:arr.nbytes].numpy()[:] = arr.reshape(-1)
            _REGISTRY.keep(pinned)
            ptr = pinned.data_ptr()
        with torch.cuda.device(torch.device(device)):
            return torch.as_tensor(_CudaArray(ptr, tuple(arr.shape)), device=torch.device(device))


def file_backed(array) -> bool:
    """Whether a numpy array's memory is a file mapping (np.memmap or mmap.mmap in its base chain)."""
    import mmap

    import numpy as np

    a, seen = array, 0
    while a is not None and seen < 64:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a, seen = getattr(a, "base", None), seen + 1
    return False


def page_span(ptr: int, size: int, page: int = PAGE) -> tuple[int, int]:
    """[start, end) of the whole pages holding bytes [ptr, ptr + size) (a mapping may start mid-page)."""
    start = ptr - ptr % page
    return start, -(-(ptr + max(size, 1)) // page) * page


class _Registry:
    """The page ranges this process registered with the driver, and the arrays that own them (kept
    alive: unmapping a registered page would leave the device reading whatever is mapped there next)."""

    def __init__(self):
        self.held: list[tuple[int, int]] = []
        self.owners: list[object] = []
        self.lock = threading.Lock()

    def register(self, ptr: int, size: int, owner) -> None:
        """Make [ptr, ptr + size) device-readable inside one registration: the driver refuses a range
        overlapping one it holds, and a copy (cudaMemcpy) of a span crossing two registrations
        fails with cudaErrorInvalidValue (the H100 run of 2026-12-05), so registrations the new
        span overlaps are dropped and their union with it registered as one."""
        with self.lock:
            span = page_span(ptr, size)
            if any(s <= span[0] and span[1] <= e for s, e in self.held):
                self.owners.append(owner)
                return
            hit = [(s, e) for s, e in self.held if s < span[1] and e > span[0]]
            lo, hi = min([span[0], *(s for s, _ in hit)]), max([span[1], *(e for _, e in hit)])
            cudart = torch.cuda.cudart()
            if hit:  # no kernel may read the pages while they are briefly unregistered (load time only)
                torch.cuda.synchronize()
            for s, e in hit:
                self._check(cudart.cudaHostUnregister(s), "cudaHostUnregister", e - s)
                self.held.remove((s, e))
            self._check(cudart.cudaHostRegister(lo, hi - lo, _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY),
                        "cudaHostRegister", hi - lo)
            self.held.append((lo, hi))
            self.held.sort()
            self.owners.append(owner)

    @staticmethod
    def _check(err, call: str, size: int) -> None:
        if int(err) != 0:
            _clear_last_error()
            raise RuntimeError(f"{call} of {size} bytes failed with CUDA error {int(err)}")

    def keep(self, owner) -> None:
        with self.lock:
            self.owners.append(owner)


_REGISTRY = _Registry()


def _clear_last_error() -> None:
    """A failed runtime call leaves its error as the thread's last error, which torch's next kernel
    launch check would raise far from here; read it back so it does not."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except OSError:
            continue
    try:  # no runtime library by name: a launch's own check consumes the error
        torch.zeros(1, device="cuda").add_(1)
    except Exception:  # noqa: BLE001 - the error being consumed
        pass


class _CudaArray:
    """The __cuda_array_interface__ torch.as_tensor reads to alias a device-valid pointer. The pages
    are registered read-only; the interface's read-only flag stays False because torch refuses it
    ("the read only flag is not supported"), and nothing writes through these views."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, False), "version": 3}
