"""The NVIDIA plugin without a GPU: cheap import, honest probe, capability table, op signatures."""
import sys

import pytest
import torch

from shuili.hal.capabilities import DeterminismLevel as L
from shuili.hal.ops import OP_NAMES, check_signature
from shuili.platforms.nvidia import plugin


def test_plugin_import_is_cheap():
    # the plugin module may be imported by `shuili platforms` on any host
    src = open(plugin.__file__).read().split("def probe")[0]
    assert "import triton" not in src and "torch.cuda" not in src


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_probe_says_why_not():
    av = plugin.probe()
    assert not av.available and "CUDA" in av.reason


@pytest.mark.parametrize("bi", [False, True])
def test_capabilities_cover_every_op(bi):
    caps = plugin.capabilities(bi)
    assert set(caps.ops) == set(OP_NAMES)
    assert caps.graph_capture and caps.device_type == "cuda"
    for mode_op in ("linear", "grouped_linear", "block_diagonal_linear", "moe_experts", "paged_attention"):
        level = caps.determinism(mode_op)
        assert level == (L.batch_invariant if bi else L.run_to_run)
    assert caps.op("linear").supports_format("mxfp4")


@pytest.mark.parametrize("bi", [False, True])
def test_op_table_matches_contract(bi):
    from shuili.platforms.nvidia.ops import make_ops

    table = make_ops(bi)
    assert set(table) == set(OP_NAMES)
    for name, fn in table.items():
        assert check_signature(name, fn) is None, name
