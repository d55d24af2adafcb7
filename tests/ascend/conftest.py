"""Fixtures: the Ascend op table bound to the torch_npu simulator, and the reference oracle."""
from __future__ import annotations

import pytest
import torch

from shuili.platforms.ascend.host import PATHS
from shuili.platforms.ascend.ops import Mode, build_ops
from shuili.platforms.ascend.sim import simulated_api


@pytest.fixture
def paths():
    PATHS.clear()
    return PATHS


@pytest.fixture(scope="session")
def api():
    return simulated_api()


@pytest.fixture(scope="session")
def npu(api):
    return build_ops(api, Mode())


@pytest.fixture(scope="session")
def npu_bi(api):
    return build_ops(api, Mode(batch_invariant=True, deterministic=True))


@pytest.fixture(scope="session")
def ref():
    from shuili.platforms.reference.ops import OPS

    return OPS


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests_ascend_cases (importlib import mode)
