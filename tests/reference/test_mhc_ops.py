"""hc_collapse and hc_expand on the reference platform: the contract's formula, the model's former
glue bit for bit, and shape errors that name the argument."""
import pytest
import torch

from shuili.hal import numerics
from shuili.platforms.reference.ops import OPS

collapse, expand = OPS["hc_collapse"], OPS["hc_expand"]


def inputs(t, m, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, m, d, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    f = torch.randn(t, d, generator=g).to(dtype)
    return x, f, torch.rand(t, m, generator=g), 2 * torch.rand(t, m, generator=g), torch.rand(t, m, m, generator=g)


def glue_collapse(x, pre):
    """DeepseekV4Model._hc_pre's line before HAL 1.6."""
    return numerics.tree_sum(pre[..., None] * x.float(), dim=1).to(x.dtype)


def glue_expand(f, x, post, comb):
    """DeepseekV4Model._hc_post before HAL 1.6."""
    out = post[..., None] * f.float()[:, None, :]
    xf = x.float()
    for j in range(x.shape[1]):
        out = out + comb[:, j, :, None] * xf[:, j, None, :]
    return out.to(x.dtype)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_matches_the_contract(m):
    x, f, pre, post, comb = inputs(9, m, 40, seed=m)
    want = torch.einsum("tk,tkd->td", pre.double(), x.double())
    assert torch.allclose(collapse(x, pre).double(), want, rtol=1e-5, atol=1e-5)
    want = post.double()[..., None] * f.double()[:, None] + torch.einsum("tjk,tjd->tkd", comb.double(), x.double())
    got = expand(f, x, post, comb)
    assert got.shape == (9, m, 40) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_bits_are_the_model_glue(dtype, m):
    x, f, pre, post, comb = inputs(17, m, 64, seed=10 + m, dtype=dtype)
    got = collapse(x, pre)
    assert got.dtype == dtype and torch.equal(got, glue_collapse(x, pre))
    got = expand(f, x, post, comb)
    assert got.dtype == dtype and torch.equal(got, glue_expand(f, x, post, comb))


def test_collapse_sums_by_the_tree():
    # streams 1, 2^-24, -1, 2^-24: the tree's (s0 + s2) + (s1 + s3) is exact, 2^-23; left to right
    # float32 rounds 1 + 2^-24 to 1 and ends at 2^-24
    x = torch.tensor([1.0, 2.0 ** -24, -1.0, 2.0 ** -24]).view(1, 4, 1)
    assert collapse(x, torch.ones(1, 4)).item() == 2.0 ** -23


def test_rows_are_independent():
    x, f, pre, post, comb = inputs(6, 4, 16, seed=3)
    a, b = collapse(x, pre), expand(f, x, post, comb)
    x[2] += 1.0
    pre[4] *= 2.0
    a2, b2 = collapse(x, pre), expand(f, x, post, comb)
    keep = [0, 1, 3, 5]
    assert torch.equal(a[keep], a2[keep]) and not torch.equal(a[2], a2[2]) and not torch.equal(a[4], a2[4])
    assert torch.equal(b[[0, 1, 3, 4, 5]], b2[[0, 1, 3, 4, 5]]) and not torch.equal(b[2], b2[2])


def test_empty_batch():
    x, f, pre, post, comb = inputs(0, 4, 8)
    assert collapse(x, pre).shape == (0, 8) and expand(f, x, post, comb).shape == (0, 4, 8)


def test_bad_shapes_are_named():
    x, f, pre, post, comb = inputs(3, 4, 8)
    with pytest.raises(ValueError, match=r"hc_collapse: x must be \[T, m, D\]"):
        collapse(x[:, 0], pre)
    with pytest.raises(ValueError, match=r"hc_collapse: pre must be \[T, m\]"):
        collapse(x, pre[:, :2])
    with pytest.raises(ValueError, match=r"hc_expand: f must be \[T, D\]"):
        expand(f[:, :4], x, post, comb)
    with pytest.raises(ValueError, match=r"hc_expand: post must be \[T, m\]"):
        expand(f, x, post[:2], comb)
    with pytest.raises(ValueError, match=r"hc_expand: comb must be \[T, m, m\]"):
        expand(f, x, post, comb[:, :, :2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4])
def test_hc_mix_bits_are_the_model_glue(dtype, m):
    """hc_mix is the three calls the models made before HAL 1.7, bit for bit."""
    from shuili.hal.types import Weight

    d, g = 48, torch.Generator().manual_seed(m)
    x = (torch.randn(7, m, d, generator=g) * 3).to(dtype)
    fn = Weight.dense(torch.randn(m * (m + 2), m * d, generator=g) / 16)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(m * (m + 2), generator=g)
    flat = OPS["rms_norm"](x.reshape(7, m * d).float(), None, 1e-6)
    want = OPS["hc_split_sinkhorn"](OPS["linear"](flat, fn).float(), scale, base, m, 20, 1e-6)
    got = OPS["hc_mix"](x, fn, scale, base, 20, 1e-6, 1e-6)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=r"hc_mix: fn must be a dense weight \[m\(m\+2\), m\*D\]"):
        OPS["hc_mix"](x, Weight.dense(fn.data[:, 1:]), scale, base, 20, 1e-6, 1e-6)
