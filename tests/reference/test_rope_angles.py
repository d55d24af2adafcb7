"""rope reuses its gathered cos/sin rows while the tables are unchanged and the positions equal
in value; in-place changes to either must be seen."""
import pytest
import torch

from shuili.platforms.reference import rope as R


def _fresh(*args, **kw):
    R._ANGLES[0] = None
    return R.rope(*args, **kw)


def test_in_place_changes_are_seen(gen):
    cos, sin = torch.rand(32, 4, generator=gen), torch.rand(32, 4, generator=gen)
    x = torch.rand(5, 3, 8, generator=gen)
    pos = torch.tensor([0, 3, 7, 9, 31])
    first = R.rope(x, pos, cos, sin, 8, interleaved=False)
    assert torch.equal(first, _fresh(x, pos, cos, sin, 8, interleaved=False))
    pos[1] = 4  # in place
    moved = R.rope(x, pos, cos, sin, 8, interleaved=False)
    assert not torch.equal(moved, first)  # negative control: the change matters
    assert torch.equal(moved, _fresh(x, pos, cos, sin, 8, interleaved=False))
    R.rope(x, pos, cos, sin, 8, interleaved=False)
    cos[4] += 1.0  # in place: the table's version changes
    assert torch.equal(R.rope(x, pos, cos, sin, 8, interleaved=False),
                       _fresh(x, pos, cos, sin, 8, interleaved=False))


def test_a_cached_call_still_checks_shapes_and_range(gen):
    cos, sin = torch.rand(32, 4, generator=gen), torch.rand(32, 4, generator=gen)
    pos = torch.tensor([1, 2, 3])
    R.rope(torch.rand(3, 2, 8), pos, cos, sin, 8)
    with pytest.raises(ValueError, match="positions has shape"):
        R.rope(torch.rand(4, 2, 8), pos, cos, sin, 8)
    with pytest.raises(ValueError, match="must lie in"):
        R.rope(torch.rand(3, 2, 8), torch.tensor([1, 2, 32]), cos, sin, 8)
