"""The transfer service: the packed upload gives back every array bit for bit, whatever the mix of
dtypes and lengths; each platform resolves with its own transfer; the core holds no device code."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from shuili.hal import PlatformConfig, resolve_platform
from shuili.hal.transfer import ALIGN, HostTransfer, pack, unpack

ARRAYS = [([1, -2, 2**62], torch.int64), ([], torch.int64), ([7, -1, 3], torch.int32),
          ([0.5, float("inf"), -1e-30], torch.float32), ([True, False], torch.bool),
          ([5], torch.int32), ([-(2**63)], torch.int64)]
CORE = Path(__file__).resolve().parents[2] / "core"


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


def test_host_transfer_roundtrip():
    t = HostTransfer()
    check(t.upload({str(i): a for i, a in enumerate(ARRAYS)}, "cpu"))
    got = t.download([torch.tensor([3, -1]), None, torch.tensor([True]), torch.zeros(0)]).wait()
    assert got == [[3, -1], [], [True], []]


def test_every_platform_provides_its_transfer():
    from shuili.platforms.ascend import sim_plugin
    from shuili.platforms.ascend.transfer import NpuTransfer

    assert isinstance(resolve_platform(PlatformConfig(platform="reference")).transfer, HostTransfer)
    sim = resolve_platform(PlatformConfig(platform="ascend-sim"), extra_plugins={"ascend-sim": sim_plugin})
    assert isinstance(sim.transfer, NpuTransfer)
    check(sim.transfer.upload({str(i): a for i, a in enumerate(ARRAYS)}, "cpu"))  # simulator: host copies


def test_core_has_no_vendor_device_code():
    vendor = re.compile(r"torch\.(cuda|npu)\b|[\"'](cuda|npu)[\"']")
    bad = [f"{p.name}: {m.group(0)}" for p in sorted(CORE.rglob("*.py")) for m in vendor.finditer(p.read_text())]
    assert not bad, bad
