"""The vendored schemas are torch_npu's, they parse, and the simulator registers all of them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shuili.platforms.ascend.schemas import SCHEMAS
from shuili.platforms.ascend.sim import NAMESPACE, simulated_api
from shuili.platforms.ascend.sim_impls import IMPLS

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = [ROOT.parent / "shared" / "reference" / "torch_npu_schemas.txt",
             ROOT / ".." / "shared" / "reference" / "torch_npu_schemas.txt"]


def test_vendored_schemas_match_the_torch_npu_dump():
    path = next((p for p in REFERENCE if p.is_file()), None)
    if path is None:
        pytest.skip("no copy of ../shared/reference/torch_npu_schemas.txt next to this checkout")
    lines = set(path.read_text().splitlines())
    for name, schema in SCHEMAS.items():
        assert schema in lines, f"{name}: vendored schema differs from torch_npu 2.13.0's"


def test_every_schema_parses_and_names_itself():
    for name, schema in SCHEMAS.items():
        parsed = torch._C.parse_schema(schema)
        assert parsed.name == name


def test_simulator_covers_every_called_op_with_the_real_argument_names():
    import inspect

    api = simulated_api()
    unimplemented = sorted(set(SCHEMAS) - set(IMPLS))
    assert unimplemented == []
    for name, fn in IMPLS.items():
        schema = torch._C.parse_schema(SCHEMAS[name])
        want = [a.name for a in schema.arguments]
        got = list(inspect.signature(fn).parameters)
        assert got == want, f"{name}: simulator parameters {got} != schema {want}"
        assert getattr(api.ops, name)._qualified_op_name == f"{NAMESPACE}::{name}"
