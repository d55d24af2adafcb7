"""The reference platform's compiled loops (platforms/reference/native.py) give the torch forms' bits.

The GEMM is exact by construction (every partial sum is an integer below 2**53), the row ops and
paged attention repeat numerics' IEEE operations one by one; these tests hold all three to the
torch forms, bit for bit, on ragged shapes, edge values and several thread counts, and check the
fallbacks: a host without a working compiler or with SHUILI_REFERENCE_NATIVE=0 runs the torch
forms, with the same bits."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import subprocess
import sys

import pytest
import torch

from shuili.hal import numerics
from shuili.platforms.reference import attention, elementwise, native, norm, rope, sampling

pytestmark = pytest.mark.skipif(not all(native.enabled(name) for name in native._LIBS),
                                reason=f"no C compiler on this host: {native.status()}")


def grids(g, m, n, k):
    pa, pb = numerics.dot_bits(k)
    qa = torch.randint(-(1 << pa), (1 << pa) + 1, (m, k), generator=g).to(torch.float64)
    qb = torch.randint(-(1 << pb), (1 << pb) + 1, (n, k), generator=g).to(torch.float64)
    sa = numerics.pow2(torch.randint(-1000, 100, (m, 1), generator=g))
    sb = numerics.pow2(torch.randint(-100, 900, (1, n), generator=g))
    return qa, sa, qb, sb


@pytest.mark.parametrize("m,n,k", [(1, 1, 9), (5, 7, 64), (6, 8, 576), (7, 9, 576), (16, 960, 576),
                                   (13, 37, 1536), (70, 17, 300), (64, 3, 16384)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gemm_bits_equal_scaled_matmul(m, n, k, threads):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    qa, sa, qb, sb = grids(g, m, n, k)
    qa[0, : k // 2] = -0.0  # exact zero sums and signed zeros
    if m > 2:
        qa[1] = (1 << numerics.dot_bits(k)[0])  # the largest grid values: the bound is tight
        qb[0] = -(1 << numerics.dot_bits(k)[1])
    want = numerics.scaled_matmul(qa, sa, qb, sb)
    got = native.gemm(qa, sa, native.pack(qb), sb, n, threads=threads)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_gemm_nonfinite_rows_match():
    g = torch.Generator().manual_seed(3)
    qa, sa, qb, sb = grids(g, 9, 11, 33)
    qa[2, 3], qa[4, 0], qb[5, 7] = float("nan"), float("inf"), float("-inf")
    want = numerics.scaled_matmul(qa, sa, qb, sb)
    got = native.gemm(qa, sa, native.pack(qb), sb, 11)
    assert native._same(got, want)


@pytest.mark.parametrize("m,n,k", [(1, 1, 9), (8, 9, 37), (16, 960, 576), (13, 37, 1536), (70, 17, 300)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_linear_bits_equal_to_fixed_then_scaled_matmul(m, n, k, threads):
    """The compiled linear builds the activation grids itself: numerics.to_fixed's bits, every edge
    row of the load check included (zero, NaN, inf, subnormal, near-overflow rows, .5 ties)."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    pa, pb = numerics.dot_bits(k)
    x = native._linear_check_rows(g, max(m, 8), k, pa)[:m].contiguous() if k > 7 else torch.randn(m, k, generator=g)
    qb = torch.randint(-(1 << pb), (1 << pb) + 1, (n, k), generator=g).to(torch.float64)
    sb = numerics.pow2(torch.randint(-100, 900, (1, n), generator=g))
    qx, ex = numerics.to_fixed(x, pa)
    want = numerics.scaled_matmul(qx, numerics.pow2((ex - pa).clamp(-1022, 1023)), qb, sb)
    got = native.linear(x, pa, native.pack(qb), sb, n, threads=threads)
    assert native._same(got, want)


def test_reference_linear_uses_the_compiled_grids_with_the_same_bits(monkeypatch):
    """gemm.linear with the compiled entry against its torch path (grids in torch, then the GEMM)."""
    from shuili.hal.types import Weight
    from shuili.platforms.reference import gemm

    g = torch.Generator().manual_seed(5)
    w = Weight.dense(torch.randn(40, 96, generator=g) * 0.1)
    for m in (1, 16, 65):  # both of fixed_linear's torch grid paths: host row scales and to_fixed
        x = native._linear_check_rows(g, m, 96, numerics.dot_bits(96)[0]) if m >= 8 else torch.randn(m, 96, generator=g)
        calls = []
        monkeypatch.setattr(native, "linear", lambda *a, **kw: calls.append(1) or native_linear(*a, **kw))
        got = gemm.linear(x, w)
        monkeypatch.undo()
        assert calls, "gemm.linear did not take the compiled entry"
        fw = gemm.weight_fixed(w)
        torch_fw = gemm.FixedWeight(numerics.to_fixed(gemm.weight_f32(w), fw.pb)[0], fw.e, fw.pb, fw.scale, None, fw.n)
        assert native._same(got, gemm.fixed_linear(x, torch_fw))


native_linear = native.linear


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 tile choice")
@pytest.mark.parametrize("isa", [["-mno-avx512f"], ["-mno-avx2", "-mno-avx512f"]], ids=["avx2", "no-avx2"])
def test_the_256_bit_tile_gives_the_same_bits(tmp_path, isa):
    """The tile an AVX2-only host builds (CI's kind) is held to the torch path on any x86 host: built
    here with AVX-512 turned off, checked at load and on decode and prefill shapes, 1-3 threads.
    Without AVX2 too, the affine panels' codes are read by the portable loop an ARM host builds."""
    out = tmp_path / "fixed_gemm_avx2.so"
    native._build(native._compiler(), native._DIR / "fixed_gemm.c", isa, native._torch_openmp(), out)
    lib = ctypes.CDLL(str(out))
    native._gemm_signature(lib)
    native._check_gemm(lib)
    g = torch.Generator().manual_seed(11)
    for m, n, k, bits in ((16, 960, 576, 32), (13, 37, 1536, 32), (70, 17, 300, 32), (9, 8, 200, 32),
                          (16, 960, 576, 4), (13, 37, 1536, 8), (70, 17, 416, 4), (1, 9, 64, 8)):
        pa, pb = numerics.dot_bits(k)
        x = native._linear_check_rows(g, max(m, 8), k, pa)[:m].contiguous()
        if bits == 32:
            qb = torch.randint(-(1 << pb), (1 << pb) + 1, (n, k), generator=g).to(torch.float64)
        else:
            qb = native.affine_grid(g, n, k, bits, pb)
        sb = numerics.pow2(torch.randint(-100, 900, (1, n), generator=g))
        qx, ex = numerics.to_fixed(x, pa)
        want = numerics.scaled_matmul(qx, numerics.pow2((ex - pa).clamp(-1022, 1023)), qb, sb)
        panels = native.pack(qb)
        assert panels.bits == bits
        for threads in (1, 2, 3):
            got = torch.empty(m, n, dtype=torch.float32)
            lib.shuili_fixed_linear(x.data_ptr(), m, k, pa, panels.data.data_ptr(), panels.bits,
                                    sb.contiguous().data_ptr(), n, got.data_ptr(), threads)
            assert native._same(got, want), (m, n, k, bits, threads)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (5, 9, 64), (16, 960, 576), (13, 37, 1536), (70, 17, 416),
                                   (40, 24, 192)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_affine_panels_give_the_float32_panels_bits(bits, m, n, k, threads):
    """The affine form (4- or 8-bit codes, a step and an offset per chunk and row) against the torch
    path, through gemm and linear: ragged N, several K blocks (KC = 192), the grid's bound reached."""
    g = torch.Generator().manual_seed(bits * 100 + m + n + k)
    pa, pb = numerics.dot_bits(k)
    qb = native.affine_grid(g, n, k, bits, pb)
    panels = native.pack(qb)
    assert panels.bits == bits or n == 1
    assert panels.data.numel() <= -(-n // native.NR) * native.NR * k * (bits / 8 + 0.25)
    qa = torch.randint(-(1 << pa), (1 << pa) + 1, (m, k), generator=g).to(torch.float64)
    qa[0, : k // 2] = -0.0
    sa = numerics.pow2(torch.randint(-1000, 100, (m, 1), generator=g))
    sb = numerics.pow2(torch.randint(-100, 900, (1, n), generator=g))
    assert native._same(native.gemm(qa, sa, panels, sb, n, threads=threads), numerics.scaled_matmul(qa, sa, qb, sb))
    x = native._linear_check_rows(g, max(m, 8), k, pa)[:m].contiguous()
    qx, ex = numerics.to_fixed(x, pa)
    want = numerics.scaled_matmul(qx, numerics.pow2((ex - pa).clamp(-1022, 1023)), qb, sb)
    assert native._same(native.linear(x, pa, panels, sb, n, threads=threads), want)


def test_pack_keeps_float32_panels_where_no_affine_form_is_exact():
    g = torch.Generator().manual_seed(2)
    pb = numerics.dot_bits(64)[1]
    affine = native.affine_grid(g, 9, 64, 8, pb)
    assert native.pack(affine).bits == 8
    assert native.pack(affine, affine=False).bits == 32
    cases = {"random grid": torch.randint(-(1 << pb), (1 << pb) + 1, (9, 64), generator=g).double(),
             "K not whole chunks": affine[:, :40],
             "codes above 255": torch.arange(64, dtype=torch.float64).expand(9, 64) * torch.tensor([1.0, 9.0]).repeat(32),
             "a NaN": torch.where(torch.arange(64) == 5, float("nan"), affine),
             "D * c above 2**24": torch.tensor([-1.0, 1.0]).repeat(32).expand(2, 64) * float(1 << 24)}
    for what, q in cases.items():
        assert native.pack(q).bits == 32, what


def test_gguf_quantized_weights_pack_as_affine_codes():
    """A Q4_1 weight (SmolLM2's layers) and a Q8_0 one (its embedding / lm_head), dequantized as the
    GGUF loader does, reach the kernel as 4- and 8-bit codes, with the float32 panels' bits."""
    import numpy as np
    from gguf import GGMLQuantizationType as T, quants

    from shuili.hal.types import Weight
    from shuili.platforms.reference import gemm

    rng = np.random.default_rng(0)
    for kind, bits in ((T.Q4_1, 4), (T.Q8_0, 8)):
        w32 = quants.dequantize(quants.quantize(rng.standard_normal((40, 576), dtype=np.float32) * 0.05, kind), kind)
        w = Weight.dense(torch.from_numpy(np.ascontiguousarray(w32)))
        fw = gemm.weight_fixed(w)
        assert fw.panels is not None and fw.panels.bits == bits
        x = native._linear_check_rows(torch.Generator().manual_seed(bits), 16, 576, numerics.dot_bits(576)[0])
        torch_fw = gemm.FixedWeight(numerics.to_fixed(gemm.weight_f32(w), fw.pb)[0], fw.e, fw.pb, fw.scale, None, fw.n)
        assert native._same(gemm.fixed_linear(x, fw), gemm.fixed_linear(x, torch_fw))


def test_gemm_check_catches_a_misread_affine_panel():
    """Negative control: a kernel that reads 4-bit panels as 8-bit ones is refused at load."""
    real = native._library("gemm")

    class Wrong:
        def shuili_fixed_gemm(self, a, sa, m, k, w, bits, sb, n, out, threads):
            return real.shuili_fixed_gemm(a, sa, m, k, w, 8 if bits == 4 else bits, sb, n, out, threads)

        shuili_fixed_linear = staticmethod(real.shuili_fixed_linear)

    with pytest.raises(RuntimeError, match="4-bit panels"):
        native._check_gemm(Wrong())


def test_panels_that_do_not_match_the_weight_are_refused():
    g = torch.Generator().manual_seed(4)
    panels = native.pack(native.affine_grid(g, 16, 64, 4, 20))
    qa, sa = torch.zeros(2, 64, dtype=torch.float64), torch.ones(2, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="do not pack"):
        native.gemm(qa, sa, native.Panels(panels.data, 8), torch.ones(1, 16, dtype=torch.float64), 16)
    with pytest.raises(TypeError, match="native.Panels"):
        native.gemm(qa, sa, panels.data, torch.ones(1, 16, dtype=torch.float64), 16)


def test_linear_check_catches_a_wrong_grid():
    """Negative control: a linear entry that rounds the activations to one bit less is refused."""
    real = native._library("gemm")

    class Wrong:
        shuili_fixed_gemm = staticmethod(real.shuili_fixed_gemm)

        def shuili_fixed_linear(self, x, m, k, pa, w, bits, sb, n, out, threads):
            return real.shuili_fixed_linear(x, m, k, pa - 1, w, bits, sb, n, out, threads)

    with pytest.raises(RuntimeError, match="linear disagrees"):
        native._check_gemm(Wrong())


def test_pack_refuses_grids_float32_cannot_hold():
    with pytest.raises(ValueError, match="2\\*\\*24"):
        native.pack(torch.tensor([[float((1 << 24) + 1)]], dtype=torch.float64))


def test_gemm_check_catches_a_wrong_kernel():
    """Negative control of the load-time check: a kernel that drops the last product is refused."""
    real = native._library("gemm")

    class Wrong:
        def shuili_fixed_gemm(self, a, sa, m, k, w, bits, sb, n, out, threads):
            real.shuili_fixed_gemm(a, sa, m, k - 1, w, bits, sb, n, out, threads)  # wrong: panels not re-laid out for k - 1

    with pytest.raises(RuntimeError, match="disagrees"):
        native._check_gemm(Wrong())


def test_rowops_refuses_another_exp_length(monkeypatch):
    """The exp loops unroll a Horner chain of the build's length (EXP_N): a numerics with another
    coefficient count must refuse the library rather than compute a different polynomial."""
    import ctypes

    lib = ctypes.CDLL(native._state["rowops", "path"])
    monkeypatch.setattr(numerics, "_EXP_COEFFS", [*numerics._EXP_COEFFS, 0.0])
    with pytest.raises(RuntimeError, match="exp coefficient count"):
        native._rowops_signature(lib)


def edge(g, shape):
    x = native._edge_values(g, int(torch.Size(shape).numel())).view(shape)
    return x[..., torch.randperm(shape[-1], generator=g)]


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (16, 576), (2, 5, 960)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_bits(shape, with_weight):
    g = torch.Generator().manual_seed(sum(shape))
    x, r = edge(g, shape), torch.randn(shape, generator=g) * 100
    w = torch.randn(shape[-1], generator=g) if with_weight else None
    got_y, got_s = norm.add_rms_norm(x, r, w, 1e-5)
    want_y, want_s = norm.add_rms_norm_torch(x, r, w, 1e-5)
    assert native._same(got_y, want_y) and native._same(got_s, want_s)
    assert native._same(norm.rms_norm(r, w, 1e-6), norm.rms_norm_torch(r, w, 1e-6))


@pytest.mark.parametrize("limit", [None, 7.0, 0.1])
def test_swiglu_bits(limit):
    g = torch.Generator().manual_seed(5)
    for shape in [(1, 2), (3, 74), (16, 3072), (2, 3, 64)]:
        x = edge(g, shape) if shape[-1] > 16 else torch.randn(shape, generator=g)
        assert native._same(elementwise.swiglu(x, limit), elementwise.swiglu_torch(x, limit))
    wide = torch.linspace(-800.0, 800.0, 20000).view(1, -1)  # every exp64 branch, both factor forms
    assert native._same(native.swiglu(wide, None), elementwise.swiglu_torch(wide, None))


def test_log_softmax_bits():
    g = torch.Generator().manual_seed(11)
    cases = [torch.randn(16, 49152, generator=g) * 8, edge(g, (4, 333)), torch.full((2, 5), float("-inf")),
             torch.tensor([[float("inf"), 1.0, 2.0], [float("nan"), 0.0, 1.0]]), torch.randn(1, 1, generator=g),
             torch.linspace(-300.0, 300.0, 4001).view(1, -1)]
    for x in cases:
        assert native._same(sampling.log_softmax(x), sampling.log_softmax_torch(x)), x.shape
    assert native._same(native.log_softmax(cases[0]), sampling.log_softmax_torch(cases[0]))


@pytest.mark.parametrize("t,h,d,rd", [(1, 1, 2, 2), (16, 9, 64, 64), (5, 3, 40, 32), (7, 2, 64, 16), (0, 4, 8, 8)])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_bits(t, h, d, rd, interleaved, inverse):
    """The compiled rope against its torch form on edge values, on a strided view (q or k sliced
    out of a fused qkv row) and on a contiguous copy; through rope.rope's dispatch too."""
    g = torch.Generator().manual_seed(t * 100 + d + rd)
    fused = edge(g, (t, h * d + 24)) if t else torch.empty(0, h * d + 24)
    x = fused[:, 8:8 + h * d].reshape(t, h, d)
    table = 50
    cos, sin = edge(g, (table, rd // 2)), torch.randn(table, rd // 2, generator=g)
    pos = torch.randint(0, table, (t,), generator=g)
    c, s = rope._angles(pos, cos, sin, t)
    for view in (x, x.contiguous()):
        want = rope.rope_rows(view, c, s, rd, interleaved, inverse)
        assert native._same(native.rope(view, c.view(t, rd // 2), s.view(t, rd // 2), rd, interleaved, inverse), want)
        assert native._same(rope.rope(view, pos, cos, sin, rd, interleaved, inverse), want)


@pytest.mark.parametrize("old,new", [
    # inverse ignored
    ("si = inverse ? -s0[i] : s0[i];", "si = s0[i];"),
    # the unrotated channels left out
    ("memcpy(o, xr, sizeof(float) * keep);", ""),
    # the second output from a fused multiply-add, one rounding fewer
    ("ob[i * step] = as + bc;", "ob[i * step] = fmaf(a, si, bc);"),
])
def test_rowops_check_catches_a_wrong_rope(tmp_path, old, new):
    """Negative control of the load-time check: a rope one detail away is refused."""
    lib = _perturbed_library(tmp_path, old, new, "rowops")
    with pytest.raises(RuntimeError, match="native rope"):
        native._check_rowops(lib)


_PROBE = """
import json, torch
from shuili.platforms.reference import attention, native, gemm, norm
from shuili.hal.types import Weight
g = torch.Generator().manual_seed(1)
x, w = torch.randn(5, 96, generator=g), Weight.dense(torch.randn(40, 96, generator=g))
y = gemm.linear(x, w)
z = norm.add_rms_norm(x, x.flip(0), None, 1e-6)[0]
q, kc, vc, table, lens, qsl = native._attention_case(g, [9, 1, 23, 6], [1, 1, 5, 0], 4, 2, 12, 7, 4)
native._attention_edges(q, kc, vc, table)
a = attention.paged_attention(q, kc, vc, table, lens, qsl, 0.3, 3, torch.randn(4, generator=g))
a = a.masked_fill(a.isnan(), float("nan"))  # one nan: payloads are not part of the contract
print(json.dumps({"status": native.status(), "bits": [t.view(torch.int32).tolist() for t in (y, z, a)]}))
"""


def _probe(tmp_path, **env) -> dict:
    e = {**os.environ, "SHUILI_CACHE_DIR": str(tmp_path / "cache"), **env}
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"stderr": r.stderr}


def test_fallbacks_give_the_same_bits(tmp_path):
    built = _probe(tmp_path)
    assert built["status"].count("native (") == 3, built["status"]
    off = _probe(tmp_path, SHUILI_REFERENCE_NATIVE="0")
    assert off["status"].count("torch (SHUILI_REFERENCE_NATIVE=0)") == 3
    broken = _probe(tmp_path, CC="false")  # a compiler that always fails: warned, then torch
    assert broken["status"].count("torch (building") == 3, broken["status"]
    assert "SHUILI_REFERENCE_NATIVE=0 to silence" in broken["stderr"]
    assert built["bits"] == off["bits"] == broken["bits"]


def test_extra_compiler_flags_reach_every_build(tmp_path):
    """SHUILI_REFERENCE_NATIVE_CFLAGS: its flags are part of each library's build and cache key (an
    AVX-512 host builds the AVX2 kernels with -mno-avx512f, same bits), and a flag the compiler
    refuses fails every build, so all three fall back to the torch forms."""
    built = _probe(tmp_path)
    avx2 = _probe(tmp_path, SHUILI_REFERENCE_NATIVE_CFLAGS="-mno-avx512f")
    assert avx2["status"].count("native (") == 3, avx2["status"]
    so = lambda status: set(re.findall(r"\(([^()]*\.so)\)", status))  # noqa: E731
    assert len(so(avx2["status"])) == 3 and not so(avx2["status"]) & so(built["status"])  # other cache files
    assert avx2["bits"] == built["bits"]
    bad = _probe(tmp_path, SHUILI_REFERENCE_NATIVE_CFLAGS="-fno-such-flag-for-shuili")
    assert bad["status"].count("torch (building") == 3, bad["status"]
    assert "-fno-such-flag-for-shuili" in bad["stderr"] and bad["bits"] == built["bits"]


# ------------------------------------------------------------------------------- paged attention
def _specials(g, *tensors, count=3):
    """Each tensor gets `count` values from the edge set at random places, in place."""
    pool = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, 1e-40, 3e38, -3e38]
    for t in tensors:
        flat = t.view(-1)
        for i in torch.randint(0, flat.numel(), (count,), generator=g).tolist():
            flat[i] = pool[int(torch.randint(0, len(pool), (1,), generator=g))]


def _attend_both(args, scale, window, sinks, threads):
    q, kc, vc, table, lens, qsl = args
    want = attention.paged_attention_torch(q, kc, vc, table, lens, qsl, scale, window, sinks)
    forms = attention._native_args(table, lens, qsl, q.shape[0], kc.shape[1])
    return native.paged_attention(q, kc, vc, *forms, scale, window, sinks, threads), want


# (lens, q_lens, H, KVH, D, Dv, block size): decode, prefill, chunked prefill and idle sequences mixed
_SHAPES = [([9, 1, 23, 6], [1, 1, 5, 0], 4, 2, 12, 7, 4),
           ([48] * 5, [1] * 5, 9, 3, 64, 64, 16),
           ([37, 70, 2], [37, 19, 2], 6, 1, 64, 64, 16),
           ([1], [1], 2, 2, 1, 1, 1),
           ([130, 5], [40, 1], 8, 2, 8, 33, 3)]


@pytest.mark.parametrize("shape", range(len(_SHAPES)))
@pytest.mark.parametrize("window,with_sinks", [(0, False), (0, True), (1, False), (3, True), (50, False)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_paged_attention_bits(shape, window, with_sinks, threads):
    lens, q_lens, h, kvh, d, dv, bs = _SHAPES[shape]
    g = torch.Generator().manual_seed(100 * shape + window + with_sinks)
    args = native._attention_case(g, lens, q_lens, h, kvh, d, dv, bs)
    if shape == 0:
        native._attention_edges(*args[:4])
    else:
        _specials(g, *args[:3])
    sinks = torch.randn(h, generator=g) * 4 if with_sinks else None
    got, want = _attend_both(args, 0.125, window, sinks, threads)
    assert native._same(got, want)


@pytest.mark.parametrize("magnitude", [-100, -30, 10, 40])
def test_paged_attention_bits_at_extreme_magnitudes(magnitude):
    """Logits from tiny (uniform softmax, subnormal grids) to huge (one-hot, overflowing exps)."""
    g = torch.Generator().manual_seed(magnitude + 1000)
    q, kc, vc, table, lens, qsl = native._attention_case(g, [21, 8, 3], [4, 1, 3], 6, 3, 16, 16, 4)
    kc *= 2.0 ** magnitude
    vc[:, ::2] *= 2.0 ** -magnitude
    for window, sinks in ((0, None), (5, torch.full((6,), 2.0 ** magnitude))):
        got, want = _attend_both((q, kc, vc, table, lens, qsl), 0.7, window, sinks, 2)
        assert native._same(got, want)


def test_paged_attention_dispatch():
    """attention.paged_attention runs the compiled loop on float32 caches (any q dtype) and the torch
    form otherwise; either way the torch form's bits."""
    g = torch.Generator().manual_seed(4)
    q, kc, vc, table, lens, qsl = native._attention_case(g, [9, 1, 23, 6], [1, 1, 5, 0], 4, 2, 12, 7, 4)
    for qq, k, v in ((q, kc, vc), (q.double(), kc, vc), (q.bfloat16(), kc, vc),
                     (q, kc.bfloat16(), vc.bfloat16())):
        got = attention.paged_attention(qq, k, v, table, lens, qsl, 0.25, 2, None)
        want = attention.paged_attention_torch(qq, k, v, table, lens, qsl, 0.25, 2, None)
        assert got.dtype == want.dtype == qq.dtype
        assert native._same(got.float(), want.float())


def test_paged_attention_refuses_blocks_outside_the_cache():
    g = torch.Generator().manual_seed(5)
    q, kc, vc, table, lens, qsl = native._attention_case(g, [9, 4], [1, 1], 4, 2, 12, 12, 4)
    table[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        attention.paged_attention(q, kc, vc, table, lens, qsl, 0.25)


def _perturbed_library(tmp_path, old: str, new: str, name: str = "attention"):
    """Library `name` built from its source with `old` (once in it) replaced by `new`."""
    src_name, flags = native._LIBS[name]
    src = (native._DIR / src_name).read_text()
    assert src.count(old) == 1
    path = tmp_path / src_name
    path.write_text(src.replace(old, new))
    native._build(native._compiler(), path, flags, native._torch_openmp(), tmp_path / f"{name}.so")
    lib = ctypes.CDLL(str(tmp_path / f"{name}.so"))
    native._SIGNATURES[name](lib)
    return lib


@pytest.mark.parametrize("old,new", [
    # a straight sum instead of numerics.tree_sum's pairwise tree
    ("float denom = tree_sum(s->e, cnt, s->buf);",
     "float denom = 0.0f; for (int64_t j = 0; j < cnt; ++j) denom += s->e[j];"),
    # no nan where the torch form multiplies p = 0 with a non-finite value of the shared range
    ("o[x] = s->poison[x] ? NAN : (float)(t1 + t2);", "o[x] = (float)(t1 + t2);"),
    # the logits' scale applied in float64, rounded once
    ("s->lg[j] = (float)(((acc[j] + 0.0) * sa) * s->sbk[off + j]) * a->scale;",
     "s->lg[j] = (float)(((acc[j] + 0.0) * sa) * s->sbk[off + j] * a->scale);"),
])
def test_attention_check_catches_a_wrong_kernel(tmp_path, old, new):
    """Negative control of the load-time check: kernels one IEEE detail away are refused."""
    with pytest.raises(RuntimeError, match="disagrees"):
        native._check_attention(_perturbed_library(tmp_path, old, new))
