"""The backend, routed through the schema-checked simulator, against the reference platform.

Each test also asserts which path ran (`PATHS`), so a silent fall back to the host path cannot
make a test pass. bf16 cases compare against the reference on the same (bf16-valued) inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

from shuili.hal.types import Weight
from tests_ascend_cases import indexer_case, paged_case


def close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.to(torch.float32) - b.to(torch.float32)).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"max abs error {err} > {tol}"


def test_rms_norm_and_unweighted(npu, ref, paths, gen):
    x = torch.randn(7, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    close(npu["rms_norm"](x, w, 1e-6), ref["rms_norm"](x, w, 1e-6), 1e-5)
    q = torch.randn(5, 4, 32, generator=gen)
    close(npu["rms_norm"](q, None, 1e-6), ref["rms_norm"](q, None, 1e-6), 1e-5)
    assert paths["rms_norm:npu_rms_norm"] == 2


@pytest.mark.parametrize("bi", [False, True])
def test_add_rms_norm(npu, npu_bi, ref, paths, gen, bi):
    ops = npu_bi if bi else npu
    x, r = torch.randn(6, 48, generator=gen), torch.randn(6, 48, generator=gen)
    w = torch.randn(48, generator=gen)
    y, s = ops["add_rms_norm"](x, r, w, 1e-5)
    ry, rs = ref["add_rms_norm"](x, r, w, 1e-5)
    assert torch.equal(s, rs)
    close(y, ry, 1e-5)
    assert paths["add_rms_norm:add+npu_rms_norm" if bi else "add_rms_norm:npu_add_rms_norm"] == 1


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_partial(npu, ref, paths, gen, interleaved, inverse):
    t, h, d, r = 5, 3, 24, 16
    x = torch.randn(t, h, d, generator=gen)
    pos = torch.tensor([0, 3, 9, 1, 30])
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    ang = torch.arange(32, dtype=torch.float32)[:, None] * inv
    cos, sin = ang.cos(), ang.sin()
    got = npu["rope"](x, pos, cos, sin, r, interleaved, inverse)
    close(got, ref["rope"](x, pos, cos, sin, r, interleaved, inverse), 1e-5)
    assert torch.equal(got[..., : d - r], x[..., : d - r])
    assert paths["rope:npu_rotary_mul"] == 1


def test_swiglu_with_and_without_limit(npu, ref, paths, gen):
    gu = torch.randn(9, 32, generator=gen) * 4
    close(npu["swiglu"](gu), ref["swiglu"](gu), 1e-5)
    close(npu["swiglu"](gu, 2.5), ref["swiglu"](gu, 2.5), 1e-5)
    assert paths["swiglu:npu_swiglu"] == 1 and paths["swiglu:torch"] == 1


def test_embedding_and_sinkhorn(npu, ref, gen):
    table = torch.randn(50, 8, generator=gen)
    ids = torch.tensor([3, 0, 49, 7])
    assert torch.equal(npu["embedding"](ids, table), ref["embedding"](ids, table))
    with pytest.raises(ValueError):
        npu["embedding"](torch.tensor([50]), table)
    m = 4
    mix = torch.randn(6, m * (m + 2), generator=gen)
    scale, base = torch.rand(3, generator=gen), torch.randn(m * (m + 2), generator=gen)
    for a, b in zip(npu["hc_split_sinkhorn"](mix, scale, base, m, 5, 1e-6),
                    ref["hc_split_sinkhorn"](mix, scale, base, m, 5, 1e-6)):
        close(a, b, 1e-5)


def test_hc_mix_composes_this_tables_ops(npu, ref, paths, gen):
    m, d = 4, 16
    x = torch.randn(5, m, d, generator=gen).to(torch.bfloat16)
    fn = Weight.dense(torch.randn(m * (m + 2), m * d, generator=gen) / 8)
    scale, base = torch.rand(3, generator=gen), torch.randn(m * (m + 2), generator=gen)
    args = (x, fn, scale, base, 5, 1e-6, 1e-6)
    for a, b in zip(npu["hc_mix"](*args), ref["hc_mix"](*args)):
        close(a, b, 1e-5)
    assert paths["rms_norm:npu_rms_norm"] == 1 and paths["hc_split_sinkhorn:host"] == 1


def test_paged_slots_runs_the_reference_on_the_device(npu, ref, paths, gen):
    bt = torch.randint(-1, 40, (4, 5), generator=gen, dtype=torch.int32)
    seq, pos = torch.randint(0, 4, (6, 1), generator=gen), torch.randint(-5, 25, (6, 9), generator=gen)
    assert torch.equal(npu["paged_slots"](bt, seq, pos, 4), ref["paged_slots"](bt, seq, pos, 4))
    assert paths["paged_slots:torch"] == 1


def test_mhc_streams_run_the_reference_on_the_device(npu, ref, paths, gen):
    x, f = torch.randn(5, 4, 16, generator=gen).to(torch.bfloat16), torch.randn(5, 16, generator=gen)
    pre, post, comb = torch.rand(5, 4, generator=gen), torch.rand(5, 4, generator=gen), torch.rand(5, 4, 4, generator=gen)
    assert torch.equal(npu["hc_collapse"](x, pre), ref["hc_collapse"](x, pre))
    assert torch.equal(npu["hc_expand"](f, x, post, comb), ref["hc_expand"](f, x, post, comb))
    assert paths["hc_collapse:torch"] == 1 and paths["hc_expand:torch"] == 1


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("renorm", [True, False])
def test_moe_route_topk(npu, ref, paths, gen, scoring, renorm):
    logits = torch.randn(11, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    w, ids = npu["moe_route_topk"](logits, bias, 4, scoring, renorm, 2.5)
    rw, rids = ref["moe_route_topk"](logits, bias, 4, scoring, renorm, 2.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, rids)
    close(w, rw, 1e-5)
    want = "moe_route_topk:host" if scoring == "sqrtsoftplus" else "moe_route_topk:npu_moe_gating_top_k"
    assert paths[want] == 1


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
def test_moe_route_hash(npu, ref, paths, gen, scoring):
    logits = torch.randn(6, 16, generator=gen)
    tid2eid = torch.randint(0, 16, (100, 3), generator=gen)
    tok = torch.tensor([5, 99, 0, 5, 42, 7])
    w, ids = npu["moe_route_hash"](logits, tok, tid2eid, scoring, True, 1.5)
    rw, rids = ref["moe_route_hash"](logits, tok, tid2eid, scoring, True, 1.5)
    assert torch.equal(ids, rids)
    close(w, rw, 1e-5)


@pytest.mark.parametrize("bi", [False, True])
def test_linear_formats(npu, npu_bi, ref, gen, bi):
    from shuili.platforms.reference.quant import (quantize_weight_fp8_block32, quantize_weight_fp8_block128,
                                                  quantize_weight_mxfp4)

    ops = npu_bi if bi else npu
    x = torch.randn(19, 64, generator=gen)
    dense = torch.randn(40, 64, generator=gen) * 0.1
    bias = torch.randn(40, generator=gen)
    for w in (Weight.dense(dense), quantize_weight_fp8_block128(dense), quantize_weight_fp8_block32(dense),
              quantize_weight_mxfp4(dense)):
        close(ops["linear"](x, w, bias), ref["linear"](x, w, bias), 1e-4)


@pytest.mark.parametrize("bi", [False, True])
def test_grouped_linear(npu, npu_bi, ref, paths, gen, bi):
    ops = npu_bi if bi else npu
    x = torch.randn(13, 32, generator=gen)
    w = Weight.dense(torch.randn(4, 24, 32, generator=gen) * 0.1)
    sizes = torch.tensor([5, 0, 6, 2])
    close(ops["grouped_linear"](x, w, sizes), ref["grouped_linear"](x, w, sizes), 1e-4)
    assert paths["grouped:tiled" if bi else "grouped:npu_grouped_matmul"] == 1


@pytest.mark.parametrize("bi", [False, True])
def test_block_diagonal_linear_regroups_around_grouped_matmul(npu, npu_bi, ref, paths, gen, bi):
    ops = npu_bi if bi else npu
    x = torch.randn(6, 3 * 32, generator=gen)
    w = Weight.dense(torch.randn(3, 24, 32, generator=gen) * 0.1)
    got = ops["block_diagonal_linear"](x, w)
    assert got.shape == (6, 72)
    close(got, ref["block_diagonal_linear"](x, w), 1e-4)
    assert paths["grouped:tiled" if bi else "grouped:npu_grouped_matmul"] == 1


@pytest.mark.parametrize("limit", [None, 3.0])
@pytest.mark.parametrize("bi", [False, True])
def test_moe_experts(npu, npu_bi, ref, paths, gen, limit, bi):
    ops = npu_bi if bi else npu
    t, d, i, e, k = 9, 32, 16, 6, 3
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=gen)
    w13 = Weight.dense(torch.randn(e, 2 * i, d, generator=gen) * 0.2)
    w2 = Weight.dense(torch.randn(e, d, i, generator=gen) * 0.2)
    close(ops["moe_experts"](x, ids, tw, w13, w2, limit), ref["moe_experts"](x, ids, tw, w13, w2, limit), 1e-4)
    assert paths["moe_experts:npu_moe_init_routing_v2"] == 1
    with pytest.raises(ValueError):
        ops["moe_experts"](x, ids.clone().fill_(e), tw, w13, w2, limit)


@pytest.mark.parametrize("window", [0, 37])
def test_paged_attention_prefill_fia(npu, ref, paths, gen, window):
    q, kc, vc, table, lens, qsl = paged_case(gen, [150, 200], [24, 40], 128)
    scale = 1 / math.sqrt(64)
    got = npu["paged_attention"](q, kc, vc, table, lens, qsl, scale, window)
    close(got, ref["paged_attention"](q, kc, vc, table, lens, qsl, scale, window), 2e-2)
    assert paths["paged_attention:npu_fused_infer_attention_score"] == 1


def test_paged_attention_decode_with_sinks_v2(npu, ref, paths, gen):
    q, kc, vc, table, lens, qsl = paged_case(gen, [17, 200, 5], [1, 1, 1], 16)
    sinks = torch.randn(4, generator=gen).to(torch.bfloat16).to(torch.float32)  # bf16-exact
    got = npu["paged_attention"](q, kc, vc, table, lens, qsl, 0.125, 0, sinks)
    close(got, ref["paged_attention"](q, kc, vc, table, lens, qsl, 0.125, 0, sinks), 2e-2)
    assert paths["paged_attention:npu_fused_infer_attention_score_v2"] == 1


def test_paged_attention_outside_envelope_runs_host_path(npu, ref, paths, gen):
    # window with decode queries: FIA ignores the band when Q_S = 1, so the host path must run
    q, kc, vc, table, lens, qsl = paged_case(gen, [40, 90], [1, 1], 16)
    got = npu["paged_attention"](q, kc, vc, table, lens, qsl, 0.125, 8)
    assert torch.equal(got, ref["paged_attention"](q, kc, vc, table, lens, qsl, 0.125, 8))
    assert paths["paged_attention:host"] == 1 and not paths["paged_attention:npu_fused_infer_attention_score"]
    q32 = q.to(torch.float32)
    npu["paged_attention"](q32, kc.float(), vc.float(), table, lens, qsl, 0.125)
    assert paths["paged_attention:host"] == 2


@pytest.mark.parametrize("ratio", [1, 4])
def test_indexer_topk_lightning(npu, ref, paths, gen, ratio):
    q, w, kc, table, qsl, pos = indexer_case(gen, [70, 33], [5, 33], ratio)
    got = npu["indexer_topk"](q, w, kc, table, qsl, pos, ratio, 12)
    want = ref["indexer_topk"](q, w, kc, table, qsl, pos, ratio, 12)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert paths["indexer_topk:npu_lightning_indexer"] == 1


def test_cache_write_packed_and_negative_slots(npu, ref, paths, gen):
    cache = torch.zeros(4, 16, 528, dtype=torch.uint8)
    want = cache.clone()
    vals = torch.randint(0, 255, (5, 528), generator=gen, dtype=torch.uint8)
    slots = torch.tensor([3, -1, 40, 17, -1])
    npu["cache_write"](cache, slots, vals)
    ref["cache_write"](want, slots, vals)
    assert torch.equal(cache, want)
    kv = torch.zeros(3, 16, 2, 8, dtype=torch.bfloat16)
    kv_want = kv.clone()
    v = torch.randn(4, 2, 8, generator=gen).to(torch.bfloat16)
    s = torch.tensor([0, 47, 5, 16])
    npu["cache_write"](kv, s, v)
    ref["cache_write"](kv_want, s, v)
    assert torch.equal(kv, kv_want)
    assert paths["cache_write:npu_scatter_pa_kv_cache"] == 2


def test_rms_norm_rope_composes_this_tables_ops(npu, ref, paths, gen):
    x, w = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16), torch.rand(64, generator=gen) + 0.5
    ang = torch.arange(16, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(8) * 2 / 16)
    args = (x, w, 1e-6, torch.tensor([0, 3, 15, 3]), ang.cos().float(), ang.sin().float(), 16)
    close(npu["rms_norm_rope"](*args), ref["rms_norm_rope"](*args), 0.07)  # an ulp of bf16 values below 8
    ropes = sum(v for k, v in paths.items() if k.startswith("rope:"))
    assert paths["rms_norm:npu_rms_norm"] == 1 and ropes == 1


def test_kv_write_packs_with_this_tables_ops(npu, ref, paths, gen):
    rows = torch.randn(5, 512, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 40, 17, 9])
    cache, want = torch.zeros(4, 16, 528, dtype=torch.uint8), torch.zeros(4, 16, 528, dtype=torch.uint8)
    npu["kv_write"](cache, slots, rows, "mxfp8")
    ref["kv_write"](want, slots, rows, "mxfp8")
    assert torch.equal(cache, want) and cache[0, 3].any() and not cache[0, 4].any()
    assert paths["kv_quantize:npu_dynamic_mx_quant"] == 1
    assert paths["cache_write:npu_scatter_pa_kv_cache"] == 1


def test_kv_formats(npu, ref, paths, gen):
    x = torch.randn(6, 512, generator=gen) * torch.logspace(-6, 3, 6)[:, None]
    x[2, :32] = 0.0  # an all-zero block hits the amax floor
    for fmt, d in (("mxfp8", 512), ("fp4_e4m3", 512), ("mxfp4", 128)):
        rows = x[:, :d].contiguous()
        packed = npu["kv_quantize"](rows, fmt)
        assert torch.equal(packed, ref["kv_quantize"](rows, fmt)), fmt
        assert torch.equal(npu["kv_dequantize"](packed, fmt, d), ref["kv_dequantize"](packed, fmt, d))
    assert paths["kv_quantize:npu_dynamic_mx_quant"] == 1 and paths["kv_dequantize:torch"] == 3


def test_single_rank_collectives(npu, gen):
    x = torch.randn(3, 4, generator=gen)
    assert npu["all_reduce"](x) is x and npu["all_gather"](x) is x


@pytest.mark.parametrize("fmt", ["fp8_block128", "fp8_block32"])
def test_opt_in_mxfp8_gemm_is_close_but_quantizes_activations(api, ref, paths, gen, monkeypatch, fmt):
    from shuili.platforms.ascend.ops import MX_GEMM_ENV, Mode, build_ops
    from shuili.platforms.reference import quant

    monkeypatch.setenv(MX_GEMM_ENV, "1")
    ops = build_ops(api, Mode(mx_gemm=True))
    x = torch.randn(5, 224, generator=gen).to(torch.bfloat16)
    dense = torch.randn(130, 224, generator=gen) * 0.05
    dense[:, 128:] *= 16  # distinct block scales, so a scale-layout mistake cannot hide
    dense[128:] *= 0.125
    dense[:, 32:64] *= 64  # differs inside one 128-column block: only fp8_block32 keeps it apart
    dense[32:64, :32] *= 1 / 32
    w = getattr(quant, f"quantize_weight_{fmt}")(dense)
    bias = torch.randn(130, generator=gen)
    got = ops["linear"](x, w, bias)
    want = ref["linear"](x.float(), w, bias)
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert paths["linear:npu_quant_matmul"] == 1 and got.dtype == torch.bfloat16
    assert 1e-4 < rel < 5e-2, rel  # e4m3 activations: close, but not the contract's numerics


@pytest.mark.parametrize("with_sinks", [False, True])
def test_sparse_attention_on_device_path(npu, ref, paths, gen, with_sinks):
    t, h, d = 6, 4, 128
    q = torch.randn(t, h, d, generator=gen)
    window = torch.randn(3, 16, d, generator=gen)                      # unpacked rows
    comp = ref["kv_quantize"](torch.randn(40, d, generator=gen), "mxfp8").view(5, 8, -1)
    idx_w = torch.randint(0, 48, (t, 5), generator=gen, dtype=torch.int32)
    idx_c = torch.randint(0, 40, (t, 7), generator=gen, dtype=torch.int32)
    idx_w[1, 2:] = -1
    idx_c[1] = -1
    idx_w[4], idx_c[4] = -1, -1                                         # no entry at all
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    args = ([window, comp], [idx_w, idx_c], 0.09, sinks, ["none", "mxfp8"])
    got = npu["sparse_attention"](q, *args)
    close(got, ref["sparse_attention"](q, *args), 1e-5)
    if not with_sinks:
        assert torch.equal(got[4], torch.zeros(h, d))
    assert paths["sparse_attention:torch"] == 1
