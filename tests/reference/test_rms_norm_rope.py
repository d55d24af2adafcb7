"""rms_norm_rope (HAL 1.9): the two ops it stands for, composed from any table; errors name the fix."""
import pytest
import torch

from shuili.platforms.reference.ops import OPS
from shuili.platforms.reference.public import composed_rms_norm_rope


def _tables(rope_dim, n=32):
    inv = 10000 ** (torch.arange(rope_dim // 2) * 2 / rope_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] / inv
    return ang.cos().float(), ang.sin().float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_rope_is_norm_then_rope(dtype, weighted):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 64, generator=g).to(dtype)
    w = torch.rand(64, generator=g) + 0.5 if weighted else None
    pos, (cos, sin) = torch.tensor([0, 5, 31, 5]), _tables(16)
    got = OPS["rms_norm_rope"](x, w, 1e-6, pos, cos, sin, 16)
    want = OPS["rope"](OPS["rms_norm"](x, w, 1e-6), pos, cos, sin, 16)
    assert got.dtype == dtype and torch.equal(got, want)
    calls = []
    fused = composed_rms_norm_rope(lambda *a: calls.append("norm") or OPS["rms_norm"](*a),
                                   lambda *a: calls.append("rope") or OPS["rope"](*a))
    assert torch.equal(fused(x, w, 1e-6, pos, cos, sin, 16, True), want) and calls == ["norm", "rope"]


def test_rms_norm_rope_checks_its_arguments():
    cos, sin = _tables(16)
    with pytest.raises(ValueError, match=r"rope takes x \[T, H, D\]"):
        OPS["rms_norm_rope"](torch.randn(4, 64), None, 1e-6, torch.zeros(4, dtype=torch.long), cos, sin, 16)
    with pytest.raises(ValueError, match=r"cos/sin tables have 8 columns, expected rope_dim/2 = 16"):
        OPS["rms_norm_rope"](torch.randn(4, 1, 64), None, 1e-6, torch.zeros(4, dtype=torch.long), cos, sin,
                             32)
