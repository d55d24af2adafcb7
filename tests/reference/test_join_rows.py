"""Weight.join_rows: the shared experts' gate and up weights as one linear. Its output is the
parts' outputs side by side, bit for bit, in every weight format; an fp8 part whose rows end
inside a scale block is not joined (None); mismatched parts are an error."""
import pytest
import torch

from shuili.hal.types import Weight
from shuili.platforms.reference.ops import OPS
from shuili.platforms.reference.public import (quantize_weight_fp8_block32, quantize_weight_fp8_block128,
                                               quantize_weight_mxfp4)

QUANT = {"dense": Weight.dense, "fp8_block128": quantize_weight_fp8_block128,
         "fp8_block32": quantize_weight_fp8_block32, "mxfp4": quantize_weight_mxfp4}


@pytest.mark.parametrize("fmt", list(QUANT))
def test_joined_rows_give_the_parts_outputs(fmt):
    gen = torch.Generator().manual_seed(5)
    a, b = (QUANT[fmt](torch.randn(n, 96, generator=gen) * 0.1) for n in (128, 40))
    j = Weight.join_rows([a, b])
    assert j.format == fmt and j.shape == (168, 96)
    x = torch.randn(6, 96, generator=gen).to(torch.bfloat16)
    assert torch.equal(OPS["linear"](x, j), torch.cat([OPS["linear"](x, a), OPS["linear"](x, b)], dim=-1))


def test_straddled_scale_blocks_are_not_joined():
    gen = torch.Generator().manual_seed(6)
    a, b = (quantize_weight_fp8_block128(torch.randn(n, 128, generator=gen)) for n in (96, 128))
    assert Weight.join_rows([a, b]) is None  # rows 96..127 would share block row 0 with b's
    assert Weight.join_rows([b, a]) is not None  # a whole block first, the partial one last
    m = [quantize_weight_mxfp4(torch.randn(n, 64, generator=gen)) for n in (3, 5)]
    assert Weight.join_rows(m).shape == (8, 64)  # per-row scales: always


def test_join_rows_errors_name_the_parts():
    with pytest.raises(ValueError, match="one format and one K"):
        Weight.join_rows([Weight.dense(torch.zeros(4, 8)), Weight.dense(torch.zeros(4, 16))])
