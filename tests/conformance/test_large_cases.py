"""Op checks reach the sizes where platforms switch to their prefill paths (fuzz.LARGE_UNITS)."""
import dataclasses

import pytest

from shuili.conformance import fuzz, ops_check
from shuili.hal import PlatformConfig, resolve_platform
from shuili.hal.ops import DispatchTable

REF = resolve_platform(PlatformConfig(platform="reference"))


@pytest.mark.parametrize("op", sorted(fuzz.LARGE_UNITS))
def test_large_case_has_the_listed_units(op):
    case = fuzz.generate(op, 3, reference=REF.ops, large=True)
    assert case.units == fuzz.LARGE_UNITS[op] and case.params["large"] is True
    assert fuzz.generate(op, 3, reference=REF.ops).units <= 129


def test_an_op_without_a_large_case_says_which_have_one():
    with pytest.raises(ValueError, match="no large case.*sparse_attention"):
        fuzz.generate("rms_norm", 3, large=True)


def _platform(op, fn):
    ops = REF.ops.as_dict()
    ops[op] = fn
    return dataclasses.replace(REF, ops=DispatchTable("large-test", ops, {}))


def _results(platform, op, cases):
    return {r.name.split(".")[-1]: r for r in ops_check.check_op(platform, REF, op, seed=11, cases=cases)}


@pytest.mark.parametrize("op", ["sparse_attention", "hc_mix"])
def test_a_path_wrong_only_at_prefill_sizes_is_caught(op):
    """A platform that is right below 256 units and off by 1e-3 from there fails vs_reference, and
    only through the large case: the boundary sizes alone stop at 129."""
    inner = REF.ops.get(op)

    def prefill_path_off(*args, **kwargs):
        out = inner(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        if first.shape[0] < 256:
            return out
        first = first * (1 + 1e-3)
        return (first,) + tuple(out[1:]) if isinstance(out, tuple) else first

    res = _results(_platform(op, prefill_path_off), op, cases=2)["vs_reference"]
    assert res.status == "fail" and "T=" in res.details["case"] and "large=True" in res.details["case"]
    seen = []
    generate = fuzz.generate

    def spy(*a, **kw):
        case = generate(*a, **kw)
        seen.append(case.units)
        return case

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuzz, "generate", spy)
        assert _results(REF, op, cases=2)["vs_reference"].status == "pass"
    assert max(seen) == fuzz.LARGE_UNITS[op] and sorted(seen)[-2] <= 129


def test_large_cases_leave_the_other_seeds_as_they_were():
    """The boundary-size cases keep case_seed(seed, op, i) for i = 0, 1, ...; the large ones are
    seeded apart, one per (dtype, format)."""
    seeds, generate = [], fuzz.generate

    def spy(op, seed, *a, **kw):
        seeds.append((seed, a[-1] if len(a) > 4 else kw.get("large", False)))
        return generate(op, seed, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuzz, "generate", spy)
        _results(REF, "linear", cases=2)
    plain = [s for s, large in seeds if not large]
    assert plain == [ops_check.case_seed(11, "linear", i) for i in range(len(plain))]
    big = [s for s, large in seeds if large]
    assert len(big) == len(plain) // 2
    assert big == [ops_check.case_seed(11, "linear/large", i) for i in range(len(big))]
