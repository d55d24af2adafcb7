"""The simulator must make backend mistakes fail: wrong names, dtypes, layouts and semantics.

Each case re-binds the backend to a copy of the simulated API in which ONE call is altered the way
a plausible bug would alter it, and asserts the call raises or the result leaves the reference.
"""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from shuili.platforms.ascend.ops import Mode, build_ops
from tests_ascend_cases import indexer_case, paged_case  # noqa: F401  (see conftest sys.path)


def mutated(api, op: str, change):
    """api whose `op` gets its kwargs passed through `change(kwargs) -> kwargs` first."""
    real = getattr(api.ops, op)
    ops = types.SimpleNamespace(**vars(api.ops))
    setattr(ops, op, lambda *a, **kw: real(*a, **change(dict(kw))))
    return dataclasses.replace(api, ops=ops)


def test_wrong_keyword_is_rejected_by_the_schema(api):
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'eps'"):
        api.ops.npu_rms_norm(input=torch.ones(2, 4), gamma=torch.ones(4), eps=1e-6)
    with pytest.raises(RuntimeError):  # a Python list where the schema wants a Tensor
        api.ops.npu_lightning_indexer(query=torch.ones(1), key=torch.ones(1), weights=[1.0])


def test_fia_band_off_by_one_is_caught(api, ref, gen):
    bad = build_ops(mutated(api, "npu_fused_infer_attention_score",
                            lambda kw: {**kw, "pre_tokens": kw["pre_tokens"] + 1}), Mode())
    q, kc, vc, table, lens, qsl = paged_case(gen, [150, 200], [24, 40], 128)
    got = bad["paged_attention"](q, kc, vc, table, lens, qsl, 0.125, 37)
    want = ref["paged_attention"](q, kc, vc, table, lens, qsl, 0.125, 37)
    assert (got.float() - want.float()).abs().max() > 5e-2


def test_fia_cumulative_kv_lengths_are_caught(api, ref, gen):
    def cumulative(kw):
        kv = kw["actual_seq_lengths_kv"]
        return {**kw, "actual_seq_lengths_kv": [sum(kv[: i + 1]) for i in range(len(kv))]}

    bad = build_ops(mutated(api, "npu_fused_infer_attention_score", cumulative), Mode())
    q, kc, vc, table, lens, qsl = paged_case(gen, [150, 200], [24, 40], 128)
    with pytest.raises(RuntimeError):
        bad["paged_attention"](q, kc, vc, table, lens, qsl, 0.125)


def test_fia_block_size_outside_envelope_is_rejected(api, gen):
    q, kc, vc, table, lens, qsl = paged_case(gen, [40, 30], [40, 30], 16)
    nb, bs, kvh, d = kc.shape
    with pytest.raises(RuntimeError, match="multiple of 128"):
        api.ops.npu_fused_infer_attention_score(
            query=q, key=kc.view(nb, bs, kvh * d), value=vc.view(nb, bs, kvh * d),
            actual_seq_lengths=[40, 70], actual_seq_lengths_kv=[40, 30], block_table=table,
            num_heads=4, num_key_value_heads=2, input_layout="TND", block_size=bs)


def test_scatter_default_cache_mode_is_rejected(api):
    key = torch.ones(2, 1, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Norm"):
        api.ops.npu_scatter_pa_kv_cache(key=key, value=key, key_cache=cache, value_cache=cache,
                                        slot_mapping=torch.tensor([0, 1]))


def test_routing_int64_ids_and_renorm_are_rejected(api):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="int32"):
        api.ops.npu_moe_init_routing_v2(x=x, expert_idx=torch.zeros(4, 2, dtype=torch.int64),
                                        expert_num=4, active_num=8)
    with pytest.raises(RuntimeError, match="renorm"):
        api.ops.npu_moe_gating_top_k(x=x, k=2, renorm=1)


def test_unpermute_with_gather_index_is_caught(api, ref, gen):
    """Passing the inverse permutation (the gather index) instead of expanded_row_idx."""
    from shuili.hal.types import Weight

    def inverse(kw):
        idx = kw["sorted_indices"].to(torch.int64)
        inv = torch.empty_like(idx)
        inv[idx] = torch.arange(idx.numel())
        return {**kw, "sorted_indices": inv.to(torch.int32)}

    bad = build_ops(mutated(api, "npu_moe_token_unpermute", inverse), Mode())
    t, d, i, e, k = 8, 16, 8, 4, 2
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=gen)
    w13 = Weight.dense(torch.randn(e, 2 * i, d, generator=gen))
    w2 = Weight.dense(torch.randn(e, d, i, generator=gen))
    got = bad["moe_experts"](x, ids, tw, w13, w2)
    assert (got - ref["moe_experts"](x, ids, tw, w13, w2)).abs().max() > 1e-2


def test_indexer_key_lengths_per_sequence_are_caught(api, ref, gen):
    """Using each sequence's full key count instead of the per-query visible count."""
    def full(kw):
        return {**kw, "actual_seq_lengths_key": torch.full_like(kw["actual_seq_lengths_key"],
                                                              int(kw["actual_seq_lengths_key"].max()))}

    bad = build_ops(mutated(api, "npu_lightning_indexer", full), Mode())
    q, w, kc, table, qsl, pos = indexer_case(gen, [70, 33], [5, 33], 4)
    got = bad["indexer_topk"](q, w, kc, table, qsl, pos, 4, 12)
    assert not torch.equal(got, ref["indexer_topk"](q, w, kc, table, qsl, pos, 4, 12))


def test_mx_quant_floor_scale_algorithm_is_caught(api, ref, gen):
    bad = build_ops(mutated(api, "npu_dynamic_mx_quant",
                            lambda kw: {**kw, "scale_alg": 0, "max_low_bound": 0.0}), Mode())
    x = torch.randn(4, 64, generator=gen) * 3
    assert not torch.equal(bad["kv_quantize"](x, "mxfp8"), ref["kv_quantize"](x, "mxfp8"))
