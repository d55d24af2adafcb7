"""The CUDA transfer service: a packed pinned upload, and downloads that wait for their step only."""
import pytest
import torch

from shuili.platforms.nvidia.transfer import CudaTransfer

ARRAYS = {"a": ([1, -2, 2**62], torch.int64), "b": ([], torch.int64), "c": ([7, -1, 3], torch.int32),
          "d": ([0.5, float("inf"), -1e-30], torch.float32), "e": ([True, False], torch.bool)}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_cpu_tensors_take_plain_copies():
    t = CudaTransfer()
    got = t.upload(ARRAYS, "cpu")
    assert all(torch.equal(got[k], torch.tensor(v, dtype=dt)) for k, (v, dt) in ARRAYS.items())
    assert t.download([torch.tensor([3]), None]).wait() == [[3], []]


@cuda
def test_upload_cuda():
    got = CudaTransfer().upload(ARRAYS, "cuda")
    assert all(t.is_cuda for t in got.values())
    assert all(torch.equal(got[k].cpu(), torch.tensor(v, dtype=dt)) for k, (v, dt) in ARRAYS.items())


@cuda
def test_download_waits_for_its_step_only():
    """The host gets step N's results while work queued after them (step N+1) still runs."""
    x = torch.arange(5, device="cuda")
    pending = CudaTransfer().download([x * 2, None])
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning, queued after the copy
    assert pending.wait() == [[0, 2, 4, 6, 8], []]
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running


def test_page_span_covers_whole_pages():
    from shuili.platforms.nvidia.transfer import page_span

    assert page_span(4096 + 10, 5) == (4096, 8192)
    assert page_span(4096 + 4090, 10) == (4096, 3 * 4096)  # straddles a page boundary
    assert page_span(8192, 0) == (8192, 3 * 4096)  # an empty array still names its page


class FakeCudart:
    """The driver's rules: no page registered twice, unregister takes a registered start."""

    def __init__(self):
        self.held, self.calls = {}, []

    def cudaHostRegister(self, ptr, size, flags):
        assert all(ptr + size <= s or ptr >= s + n for s, n in self.held.items()), "page registered twice"
        self.held[ptr] = size
        self.calls.append(("reg", ptr, size))
        return 0

    def cudaHostUnregister(self, ptr):
        assert ptr in self.held, "unregistering a pointer that was never registered"
        del self.held[ptr]
        self.calls.append(("unreg", ptr))
        return 0

    def inside_one(self, ptr, size):
        return any(s <= ptr and ptr + size <= s + n for s, n in self.held.items())


def test_registry_keeps_every_array_inside_one_registration(monkeypatch):
    """An Engram table's data and scale can share a page. The driver refuses a second registration of
    a page (the H200 run of 2026-12-04), and a copy across two registrations fails (the H100 run of
    2026-12-05), so overlapping registrations merge into one and every array stays inside one."""
    from shuili.platforms.nvidia import transfer as tr

    fake = FakeCudart()
    monkeypatch.setattr(tr.torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(tr.torch.cuda, "synchronize", lambda: None)
    reg = tr._Registry()
    arrays = [(4096 + 100, 8000, "data"),  # pages 1..2
              (4096 + 8100, 50, "scale"),  # inside the data's pages: no call
              (4096 + 8100, 9000, "more"),  # pages 2..5: merges with pages 1..2
              (40 * 4096, 10, "far"),  # apart from the others
              (4096, 4096, "first page")]  # inside pages 1..5
    for ptr, size, name in arrays:
        reg.register(ptr, size, name)
    assert fake.calls == [("reg", 4096, 8192), ("unreg", 4096), ("reg", 4096, 5 * 4096), ("reg", 40 * 4096, 4096)]
    assert all(fake.inside_one(ptr, size) for ptr, size, _ in arrays)
    assert reg.held == [(4096, 6 * 4096), (40 * 4096, 41 * 4096)]
    assert reg.owners == [name for *_, name in arrays]


def test_registry_merges_every_registration_a_span_bridges(monkeypatch):
    from shuili.platforms.nvidia import transfer as tr

    fake = FakeCudart()
    monkeypatch.setattr(tr.torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(tr.torch.cuda, "synchronize", lambda: None)
    reg = tr._Registry()
    for ptr, size in [(0, 4096), (2 * 4096, 4096), (4 * 4096, 4096), (100, 4 * 4096)]:
        reg.register(ptr, size, None)
    assert reg.held == [(0, 5 * 4096)] and fake.held == {0: 5 * 4096}


def _read_back(t, arrays):
    views = [t.map_host(x, "cuda") for x in arrays]
    for x, d in zip(arrays, views):
        assert torch.equal(d.cpu(), torch.from_numpy(x.copy()))
    torch.zeros(1, device="cuda").add_(1)  # no error left behind for a later launch check
    torch.cuda.synchronize()


# On the H200 (2026-12-04, at 4036f9f) the one test these two replace failed, error text not kept:
# two arrays sharing a page of a 6,000-byte file. Each now isolates one of its two conditions. On the
# H100 (2026-12-05) the first failed with cudaErrorInvalidValue on .cpu(): the second array's bytes lay
# in two registrations, which a copy may not cross; registrations now merge.
@cuda
def test_map_host_reads_two_arrays_sharing_a_page(tmp_path):
    import numpy as np

    (tmp_path / "t.bin").write_bytes((np.arange(3 * 4096) % 253).astype(np.uint8).tobytes())
    buf = np.memmap(tmp_path / "t.bin", dtype=np.uint8, mode="r")  # whole pages: no end of file mid-page
    _read_back(CudaTransfer(), [buf[:6000], buf[6000:9000]])  # they share the page of byte 6000


@cuda
def test_map_host_reads_an_array_ending_mid_page_at_the_end_of_its_file(tmp_path):
    import numpy as np

    (tmp_path / "t.bin").write_bytes((np.arange(4096 + 1904) % 251).astype(np.uint8).tobytes())
    buf = np.memmap(tmp_path / "t.bin", dtype=np.uint8, mode="r")  # a checkpoint's last tensor ends so
    _read_back(CudaTransfer(), [buf[4500:6000]])


def test_only_file_mappings_are_registered_in_place(tmp_path):
    """Heap arrays (a random model's Engram tables) share pages with other objects that the
    allocator may give back to the system, so map_host copies them to pinned memory instead."""
    import numpy as np

    from shuili.platforms.nvidia.transfer import file_backed

    p = tmp_path / "t.bin"
    p.write_bytes(bytes(range(256)) * 64)
    mm = np.memmap(p, dtype=np.uint8, mode="r", offset=4096, shape=(8, 512))
    assert file_backed(mm) and file_backed(mm[2:5]) and file_backed(np.asarray(mm[1]))
    heap = np.arange(4096, dtype=np.uint8)
    assert not file_backed(heap) and not file_backed(heap[10:].view(np.uint8))
    assert not file_backed(np.ascontiguousarray(mm).copy())


@cuda
def test_map_host_reads_heap_and_file_arrays(tmp_path):
    import numpy as np

    p = tmp_path / "t.bin"
    p.write_bytes(bytes(range(256)) * 64)
    mm = np.memmap(p, dtype=np.uint8, mode="r", offset=100, shape=(3000,))
    heap = (np.arange(5000) % 251).astype(np.uint8)
    t = CudaTransfer()
    for a in (mm, heap, heap[7:4000]):
        assert torch.equal(t.map_host(a, "cuda").cpu(), torch.from_numpy(np.array(a)))
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
