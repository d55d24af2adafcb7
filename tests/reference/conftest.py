import pytest
import torch

from shuili.platforms.reference.ops import OPS


@pytest.fixture
def ops():
    return OPS


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
