"""Quantized KV storage through the HAL ops: MXFP8 window KV, FP4/e4m3-16 compressed KV, MXFP4
indexer keys. Stored rows are bit-exact `kv_quantize` of the float rows; cache layouts have the
documented sizes; quantized caches keep the chunking invariance."""
from __future__ import annotations

import pytest
import torch

from shuili.core.models import deepseek_v4 as V
from shuili.core.models.deepseek_v4_cache import cache_groups
from shuili.core.models.deepseek_v4_config import named
from shuili.core.models.deepseek_v4_loader import random_params
from shuili.hal.config import PlatformConfig
from shuili.hal.formats import bytes_per_row
from shuili.hal.registry import resolve_platform
from shuili.platforms.reference import quant

QUANT = dict(window_kv_format="mxfp8", compressed_kv_format="fp4_e4m3", indexer_k_format="mxfp4")


@pytest.fixture(scope="module")
def ops():
    return resolve_platform(PlatformConfig(platform="reference")).ops


def _model(ops, seed=4, **fmts):
    cfg = named("tiny-v4", **fmts)
    return V.DeepseekV4Model(cfg, ops, random_params(cfg, seed=seed))


def _ids(n, seed=0):
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cache_layout_sizes():
    mid = {g.name: g for g in cache_groups(named("mid-v4", **QUANT), "bfloat16")}
    assert mid["swa_kv"].entry_shape == (528,) and mid["swa_kv"].dtype == "uint8"  # 512 e4m3 + 16 e8m0
    assert mid["csa_kv"].entry_shape == (288,) and mid["hca_kv"].entry_shape == (288,)
    assert mid["csa_idx"].entry_shape == (68,)  # 64 B e2m1 + 4 e8m0 per 128-dim key
    assert mid["csa_kv"].ratio == 4 and mid["hca_kv"].ratio == 128 and mid["swa_kv"].window == 128
    assert mid["csa_state"].window == 8 and mid["hca_state"].window == 128
    assert mid["csa_state"].entry_shape == (4 * 512 + 4 * 128,) and mid["csa_state"].dtype == "float32"
    assert mid["swa_kv"].layers == tuple(range(12))
    assert cache_groups(named("mid-v4"), "bfloat16", with_mtp=True)[0].layers == tuple(range(13))
    for fmt, d, n in (("mxfp8", 512, 528), ("fp4_e4m3", 512, 288), ("mxfp4", 128, 68), ("mxfp8", 128, 132)):
        assert bytes_per_row(fmt, d) == n  # the one formula, in hal/formats.py
        assert quant.kv_quantize(torch.zeros(1, d), fmt).shape == (1, n)
    # 64-token blocks: 64 window rows per block of 528 B, for each of the 12 layers
    assert mid["swa_kv"].bytes_per_block(64) == 64 * 528 * 12
    with pytest.raises(ValueError, match="multiple"):
        mid["hca_kv"].entries_per_block(64)


def test_stored_rows_are_bit_exact_kv_quantize(ops):
    ids = _ids(45)
    f = _model(ops)
    fd = f.driver(max_len=64)
    f.forward(fd.batch([(0, ids)]))
    # window KV of layer 0 sees identical inputs in both models
    w = _model(ops, window_kv_format="mxfp8")
    w.forward(w.driver(max_len=64).batch([(0, ids)]))
    rows = f.caches["swa_kv"][0].view(-1, 128)[:45]
    assert torch.equal(w.caches["swa_kv"][0].view(-1, 132)[:45], ops.kv_quantize(rows, "mxfp8"))
    # compressed KV / indexer keys of the first CSA layer (2) see identical inputs when the window is float
    c = _model(ops, compressed_kv_format="fp4_e4m3", indexer_k_format="mxfp4")
    c.forward(c.driver(max_len=64).batch([(0, ids)]))
    n = 45 // 4
    kv = f.caches["csa_kv"][2].view(-1, 128)[:n]
    ik = f.caches["csa_idx"][2].view(-1, 64)[:n]
    assert torch.equal(c.caches["csa_kv"][2].view(-1, 72)[:n], ops.kv_quantize(kv, "fp4_e4m3"))
    assert torch.equal(c.caches["csa_idx"][2].view(-1, 34)[:n], ops.kv_quantize(ik, "mxfp4"))
    assert torch.equal(ops.kv_dequantize(c.caches["csa_kv"][2].view(-1, 72)[:n], "fp4_e4m3", 128),
                       quant.kv_dequantize(quant.kv_quantize(kv, "fp4_e4m3"), "fp4_e4m3", 128))


def test_quantized_caches_stay_close_and_invariant(ops):
    ids = _ids(61, seed=1)
    f = _model(ops)
    ref = f.forward(f.driver(max_len=64).batch([(0, ids)], logits="all"))
    q = _model(ops, **QUANT)
    one = q.forward(q.driver(max_len=64).batch([(0, ids)], logits="all"))
    # FP4 compressed KV and MXFP8 windows are coarse and a random tiny model's routing / top-k flips
    # amplify them, but it is recognisably the same function
    assert not torch.equal(one, ref)
    assert float(torch.nn.functional.cosine_similarity(one, ref, dim=-1).min()) > 0.8
    d = q.driver(max_len=64)
    parts = [q.forward(d.batch([(0, ids[a:b])], logits="all")) for a, b in ((0, 23), (23, 58), (58, 59),
                                                                             (59, 60), (60, 61))]
    assert torch.equal(torch.cat(parts), one)

