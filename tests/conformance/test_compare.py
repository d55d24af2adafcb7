"""Comparators: bits, signed zeros, NaN, tolerance, first-divergence detail."""
import torch

from shuili.conformance.compare import compare, compare_outputs, f32_bits


def test_bitwise_catches_one_ulp_with_both_bit_patterns():
    x = torch.linspace(-3, 3, 50)
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(float("inf")))
    div = compare(x, y, "bitwise")
    assert div is not None and div.where["index"] == [17] and div.mismatches == 1
    assert div.expected_bits == f32_bits(float(x[17])) and div.got_bits == f32_bits(float(y[17]))
    assert div.expected_bits != div.got_bits
    assert compare(x, y, "tolerance") is None  # 1 ulp is inside the float32 tolerance


def test_signed_zero_differs_bitwise_only():
    a, b = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert compare(a, b, "bitwise").expected_bits == "0x00000000"
    assert compare(a, b, "tolerance") is None


def test_nan_always_fails_even_against_nan():
    a = torch.tensor([1.0, float("nan")])
    assert compare(a, a.clone(), "bitwise").note == "NaN in output"
    assert compare(a, a.clone(), "tolerance").note == "NaN in output"


def test_tolerance_fails_beyond_dtype_tolerance_and_shapes_ints():
    a = torch.ones(4)
    assert compare(a, a + 1e-2, "tolerance") is not None
    bf = (a + 4e-3).to(torch.bfloat16)  # within 2 bf16 ulp of the float32 reference
    assert compare(a, bf, "tolerance") is None
    assert compare(torch.arange(4), torch.tensor([0, 1, 3, 3]), "tolerance").where["index"] == [2]
    assert compare(torch.zeros(2, 3), torch.zeros(3, 2), "bitwise").note == "shape differs"


def test_outputs_name_which_output():
    a = [torch.zeros(2), torch.ones(2)]
    b = [torch.zeros(2), torch.tensor([1.0, 2.0])]
    assert compare_outputs(a, b, "bitwise").where["output"] == 1


def test_sum_scale_admits_cancellation_error_but_not_a_wrong_sum():
    # a dot product that cancels to 0.0058 from terms summing to 173 (seen on a CI host: one
    # float32 order against another differed by 1.3e-5, 1e-7 of the terms' magnitude)
    exp, got = torch.tensor([0.005775433499366045]), torch.tensor([0.00578819215297699])
    scale = torch.tensor([173.37])
    assert compare(exp, got, "tolerance") is not None
    assert compare(exp, got, "tolerance", scale=scale) is None
    wrong = compare(exp, torch.tensor([0.0068]), "tolerance", scale=scale)
    assert wrong is not None and "sum|terms|" in wrong.note


def test_linear_vs_reference_uses_the_sum_scale():
    from shuili.conformance import fuzz
    from shuili.conformance.ops_check import _sum_scales, place
    from shuili.platforms.reference.public import OPS, dequantize_weight

    case = fuzz.generate("linear", 1842794957408, "fp8_block128", (), OPS, 1)
    kw = place(case.kwargs, case.act, "cpu", torch.float32)
    (scale,) = _sum_scales("linear", kw)
    exact = kw["x"].double() @ dequantize_weight(kw["w"]).double().t()
    plain = (kw["x"] @ dequantize_weight(kw["w"]).t()).double()
    assert scale.shape == exact.shape and bool((scale >= exact.abs()).all())
    assert compare(exact, plain, "tolerance", tolerance_dtype="float32", scale=scale) is None
    assert _sum_scales("rms_norm", kw) is None


def test_moe_experts_vs_reference_uses_the_sum_scale():
    # the case the H200 failed on 2026-12-04 (float32, fp8_block32 experts, limit 7): outputs that
    # cancel to ~1e-2 from terms in the hundreds, where two float32 orders differ by ~3e-4
    from shuili.conformance import fuzz
    from shuili.conformance.ops_check import _sum_scales, place
    from shuili.platforms.reference.public import OPS

    case = fuzz.generate("moe_experts", 2158385926345780, "fp8_block32", (), OPS, 1)
    kw = place(case.kwargs, case.act, "cpu", torch.float32)
    (scale,) = _sum_scales("moe_experts", kw)
    out = OPS["moe_experts"](**kw)
    assert scale.shape == out.shape and bool((scale >= out.double().abs() * 0.999).all())
    noisy = out.double() + 2e-7 * scale  # a rounding-sized error: admitted
    assert compare(out, noisy, "tolerance", tolerance_dtype="float32", scale=scale) is None
    wrong = out.double().clone()
    wrong[0, 0] += 1e-3 * scale[0, 0] + 1.0  # a wrong sum: caught
    assert compare(out, wrong, "tolerance", tolerance_dtype="float32", scale=scale) is not None
