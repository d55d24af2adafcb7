"""The engram_gate op (V4.1 Engram write) on the reference platform vs the formula in float64."""
from __future__ import annotations

import pytest
import torch

from shuili.hal import PlatformConfig, resolve_platform
from shuili.hal.numerics import normal

OPS = resolve_platform(PlatformConfig(platform="reference")).ops


def direct(x, kv, q, k, eps):
    """transformers' DeepseekV41Engram arithmetic, in float64."""
    t, m, d = x.shape
    x, kv, w = x.double(), kv.double(), q.double() * k.double()
    key, value = kv[:, :m * d].view(t, m, d), kv[:, m * d:]
    rstd = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (x * w * key).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return x + gate[..., None] * value[:, None, :]


@pytest.mark.parametrize("m,d,scale", [(4, 64, 1.0), (4, 256, 30.0), (1, 32, 0.01)])
def test_engram_gate_matches_the_formula(m, d, scale):
    g = torch.Generator().manual_seed(m * d)
    x = normal((9, m, d), g) * scale
    kv = normal((9, (m + 1) * d), g)
    q, k = 1 + 0.3 * normal((m, d), g), 1 + 0.3 * normal((m, d), g)
    got = OPS.engram_gate(x, kv, q, k, 1e-20)
    want = direct(x, kv, q, k, 1e-20)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    # negative control: the gate matters (a zero gate, x unchanged, is far from the result)
    assert ((x.double() - want).abs().max() / want.abs().max()).item() > 1e-3


def test_engram_gate_rows_are_independent():
    g = torch.Generator().manual_seed(3)
    x, kv = normal((7, 4, 32), g), normal((7, 5 * 32), g)
    q, k = normal((4, 32), g), normal((4, 32), g)
    full = OPS.engram_gate(x, kv, q, k, 1e-6)
    for i in range(7):
        assert torch.equal(OPS.engram_gate(x[i:i + 1], kv[i:i + 1], q, k, 1e-6), full[i:i + 1])


def test_engram_gate_shape_errors_name_the_argument():
    x = torch.zeros(2, 4, 32)
    with pytest.raises(ValueError, match="kv must be"):
        OPS.engram_gate(x, torch.zeros(2, 4 * 32), torch.ones(4, 32), torch.ones(4, 32), 1e-6)
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        OPS.engram_gate(x, torch.zeros(2, 5 * 32), torch.ones(3, 32), torch.ones(4, 32), 1e-6)
