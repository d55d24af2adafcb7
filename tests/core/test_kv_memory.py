"""KV cache tensors on the CPU are zeros whose pages become resident only where written
(core/kv_memory.py): a 1 GiB default budget no longer costs 1 GiB of resident memory up front.
Residency is read from the kernel's per-mapping accounting (Linux /proc/self/smaps): page counts,
not timings."""
from __future__ import annotations

import os

import pytest
import torch
from core_helpers import make_llm

from shuili import SamplingParams
from shuili.core.kv_memory import kv_zeros
from shuili.core.model_api import CacheGroupSpec
from shuili.core.runner import allocate_caches

SMAPS = "/proc/self/smaps"
needs_smaps = pytest.mark.skipif(not os.path.exists(SMAPS), reason="per-mapping residency needs Linux /proc")


def resident_bytes(t: torch.Tensor) -> int:
    """Rss of the mapping that holds t's first byte."""
    addr = t.data_ptr()
    inside = False
    with open(SMAPS) as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("tensor's address is in no mapping")


def test_zeros_of_the_requested_shape_and_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn):
        t = kv_zeros((5, 4, 3, 2), dtype, "cpu")
        assert t.shape == (5, 4, 3, 2) and t.dtype == dtype and t.is_contiguous()
        assert not t.view(torch.uint8).any()
    a, b = kv_zeros((8, 16), torch.float32, "cpu"), kv_zeros((8, 16), torch.float32, "cpu")
    a[3, 5] = 7.0  # every call owns its memory
    assert float(a.sum()) == 7.0 and not b.any()
    assert kv_zeros((0, 16, 2), torch.float32, "cpu").shape == (0, 16, 2)


@needs_smaps
def test_pages_become_resident_only_where_written():
    n = 64 << 20
    t = kv_zeros((256, n // 256 // 4), torch.float32, "cpu")  # 256 blocks of 256 KiB
    assert resident_bytes(t) < 64 << 10
    t[7] = 1.0  # one block written: its pages, not the others
    assert (256 << 10) <= resident_bytes(t) < (256 << 10) + (64 << 10)
    assert float(t[7].sum()) == n // 256 // 4 and not t[8].any()
    # negative control: writing every block makes the whole map resident (the measure can fail)
    t.fill_(2.0)
    assert resident_bytes(t) >= n - (64 << 10)


@needs_smaps
def test_allocate_caches_is_lazy_and_zero():
    g = CacheGroupSpec(name="kv", kind="full", layers=[0, 1], entry_shape=(2, 2, 64), dtype="float32")
    caches = allocate_caches([g], 4096, 16, "cpu")  # 2 layers x 32 MiB
    for t in caches["kv"]:
        assert t.shape == (4096, 16, 2, 2, 64) and t.dtype == torch.float32
        assert resident_bytes(t) < 64 << 10
    assert caches["kv"][0].data_ptr() != caches["kv"][1].data_ptr()


@needs_smaps
def test_engine_with_a_large_budget_keeps_its_kv_mostly_unresident():
    # long max_model_len x 64 sequences: the byte budget, not the cap, sizes the pools
    llm = make_llm({"max_model_len": 1 << 16}, num_blocks=None, kv_cache_bytes=256 << 20, max_num_seqs=64,
                   tokens_per_block=16)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    caches = [t for ts in llm.engine.runner.caches.values() for t in ts]
    total = sum(t.numel() * t.element_size() for t in caches)
    assert total > 200 << 20
    assert sum(resident_bytes(t) for t in caches) < total // 20
    llm.engine.kv.check_integrity()
