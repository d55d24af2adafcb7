"""kv_write (HAL 1.9): the new KV rows packed into their format and stored at their slots, the same
bytes as kv_quantize then cache_write; negative slots skip; the errors name the fix."""
import pytest
import torch

from shuili.hal.formats import bytes_per_row
from shuili.platforms.reference.ops import OPS


@pytest.mark.parametrize("fmt,d", [("mxfp8", 512), ("fp4_e4m3", 64), ("mxfp4", 128), ("none", 16)])
def test_kv_write_is_quantize_then_write(fmt, d):
    g = torch.Generator().manual_seed(d)
    rows = torch.randn(6, d, generator=g).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 31, -1, 12])
    rb = bytes_per_row(fmt, d) if fmt != "none" else d
    dtype = torch.uint8 if fmt != "none" else torch.float32
    stale = torch.randint(0, 256, (2, 16, rb), generator=g) if fmt != "none" else torch.randn(2, 16, rb)
    stale = stale.to(dtype)
    got, want = stale.clone(), stale.clone()
    OPS["kv_write"](got, slots, rows, fmt)
    vals = rows.to(dtype) if fmt == "none" else OPS["kv_quantize"](rows, fmt)
    OPS["cache_write"](want, slots, vals)
    assert torch.equal(got, want)
    flat = got.view(-1, rb)
    assert torch.equal(flat[1], stale.view(-1, rb)[1])  # no row was written there
    assert torch.equal(flat[5], vals[0])


def test_kv_write_errors_name_the_fix():
    rows = torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"kv_write: rows must be \[N, D\]"):
        OPS["kv_write"](torch.zeros(1, 4, 33, dtype=torch.uint8), torch.tensor([0]), rows[0], "mxfp8")
    with pytest.raises(ValueError,
                       match=r"kv_write: a mxfp8 cache holds packed uint8 rows.*allocate it as uint8"):
        OPS["kv_write"](torch.zeros(1, 4, 33), torch.tensor([0, 1]), rows, "mxfp8")
