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
