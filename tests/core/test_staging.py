"""The packed upload gives back every array bit for bit, whatever the mix of dtypes and lengths."""
import pytest
import torch

from shuili.core.staging import ALIGN, Download, pack, unpack, upload

ARRAYS = [([1, -2, 2**62], torch.int64), ([], torch.int64), ([7, -1, 3], torch.int32),
          ([0.5, float("inf"), -1e-30], torch.float32), ([True, False], torch.bool),
          ([5], torch.int32), ([-(2**63)], torch.int64)]


def check(got):
    got = list(got.values()) if isinstance(got, dict) else got
    assert len(got) == len(ARRAYS)
    for t, (v, dt) in zip(got, ARRAYS):
        assert t.dtype == dt and torch.equal(t.cpu(), torch.tensor(v, dtype=dt))


def test_pack_roundtrip_and_alignment():
    buf, views = pack(ARRAYS)
    assert all(o % ALIGN == 0 for o, _, _ in views)
    assert buf.numel() == 8 * 3 + 0 + 16 + 16 + 8 + 8 + 8
    # a copy to a fresh buffer, as the device copy does, keeps every view valid
    check(unpack(buf.clone(), views))


def test_upload_cpu():
    check(upload(dict(enumerate(ARRAYS)), "cpu"))


def test_upload_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    got = upload(dict(enumerate(ARRAYS)), "cuda")
    assert all(t.is_cuda for t in got.values())
    check(got)


def test_download_cpu():
    got = Download([torch.tensor([3, -1]), None, torch.tensor([True]), torch.zeros(0)]).wait()
    assert got == [[3, -1], [], [True], []]


def test_download_waits_for_its_step_only():
    """The host gets step N's results while work queued after them (step N+1) still runs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.arange(5, device="cuda")
    pending = Download([x * 2, None])
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning, queued after the copy
    assert pending.wait() == [[0, 2, 4, 6, 8], []]
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running
