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
