"""Fixtures for the core engine tests (helpers live in core_helpers.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from core_helpers import bits, make_llm  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny GEMMs: threads only add contention (results do not depend on the count). Scoped to
    this folder's tests, so the rest of the suite keeps torch's default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def solo_results():
    """Each workload request run alone, one at a time, cold cache: the reference answers."""
    cache = {}

    def get(prompts, params, model_kw=None):
        key = (tuple(prompts), tuple(p.model_dump_json() for p in params), repr(model_kw))
        if key not in cache:
            llm = make_llm(model_kw, enable_prefix_caching=False)
            cache[key] = [bits(llm.generate([pr], [pa])[0]) for pr, pa in zip(prompts, params)]
        return cache[key]

    return get
