"""linear, grouped_linear and the routed experts (npu_moe_init_routing_v2 + npu_grouped_matmul +
npu_moe_token_unpermute), plus expert selection through npu_moe_gating_top_k.

Quantized weights (fp8_block128, fp8_block32, mxfp4) are dequantized once per Weight object to the
activation dtype (cached; costs that memory) because the HAL contract keeps activations unquantized.
The native MXFP8 GEMM (npu_dynamic_mx_quant + npu_quant_matmul) quantizes activations, so it is
opt-in (SHUILI_ASCEND_MX_GEMM=1, fp8_block128 / fp8_block32 weights on 950; see
docs/platforms/ascend.md). Both fp8 block sizes become its weight operand losslessly: a
power-of-two scale per 128x128 or 32x32 block is one e8m0 byte per 1x32 block.
"""
from __future__ import annotations

import weakref

import torch

from shuili.hal.types import Weight
from shuili.platforms.ascend.host import on_host, took
from shuili.platforms.ascend.norm_rope import silu
from shuili.hal.numerics import tree_sum

TILE = 16  # batch-invariant mode: every matmul has exactly TILE rows
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_DENSE: "weakref.WeakKeyDictionary[Weight, dict]" = weakref.WeakKeyDictionary()
_MX: "weakref.WeakKeyDictionary[Weight, tuple]" = weakref.WeakKeyDictionary()
# c10::ScalarType codes for `int? output_dtype` (ASSUMED: torch_npu keeps torch's numbering for
# standard dtypes and adds 285+ for its own, see npu_api.DTYPE_CODES)
SCALAR_TYPE_CODES = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}


def mx_weight(w: Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block128 / fp8_block32 -> the MXFP8 weight operand of npu_quant_matmul, losslessly: e4m3
    data as x2 [K, N] and the power-of-two block scales re-expressed per 32 along K as e8m0 bytes in
    the [ceil(K/64), N, 2] layout npu_dynamic_mx_quant produces (cached per Weight)."""
    if w not in _MX:
        from shuili.hal.formats import fp8_weight_block

        b = fp8_weight_block(w.format)
        n, k = w.data.shape
        exp = torch.log2(w.scale.to(torch.float32))
        if not bool((exp == exp.round()).all()):
            raise ValueError(f"{w.format} scales must be powers of two to become e8m0")
        byte = (exp + 127).to(torch.uint8)  # [ceil(N/b), ceil(K/b)]
        per32 = byte.repeat_interleave(b, 0)[:n].repeat_interleave(b // 32, 1)[:, : -(-k // 32)]
        kb = per32.shape[1]
        pairs = -(-kb // 2)
        padded = torch.zeros(n, pairs * 2, dtype=torch.uint8, device=w.data.device)
        padded[:, :kb] = per32
        scale = padded.view(n, pairs, 2).permute(1, 0, 2).contiguous()  # [K/64, N, 2]
        _MX[w] = (w.data.t().contiguous(), scale)
    return _MX[w]


def dense_weight(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Logical weight ([N, K] or [E, N, K]) in `dtype`, on the weight's device."""
    if not isinstance(w, Weight):
        raise TypeError(f"expected a shuili.hal.types.Weight, got {type(w).__name__}")
    if w.format == "dense":
        return w.data if w.data.dtype == dtype else w.data.to(dtype)
    per = _DENSE.setdefault(w, {})
    if dtype not in per:
        from shuili.platforms.reference.public import dequantize_weight

        per[dtype] = dequantize_weight(w).to(dtype).contiguous()
    return per[dtype]


def tiled_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T as matmuls of exactly TILE zero-padded rows: a row's bits depend only
    on itself, provided the device matmul is deterministic for a fixed shape."""
    m = x.shape[0]
    padded = -(-m // TILE) * TILE
    xp = torch.zeros(padded, x.shape[1], dtype=x.dtype, device=x.device)
    xp[:m] = x
    out = torch.empty(padded, w.shape[0], dtype=x.dtype, device=x.device)
    for i in range(0, padded, TILE):
        out[i:i + TILE] = torch.nn.functional.linear(xp[i:i + TILE], w)
    return out[:m]


def _finish(w: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    w = w.to(torch.float32)
    if renormalize:  # fixed-tree sum of elementwise adds: the same bits for a row alone or batched
        w = w / (tree_sum(w) + 1e-20)[:, None]
    return w * scaling


def build(api, mode) -> dict:
    npu = api.ops
    # sqrtsoftplus (DeepSeek-V4) has no norm_type: the reference's batch-invariant code on the host
    host_topk, host_hash = on_host("moe_route_topk"), on_host("moe_route_hash")

    def _gating_fits(logits, topk, scoring):
        e = logits.shape[-1]
        return (scoring in ("sigmoid", "softmax") and logits.dim() == 2 and logits.dtype in FLOATS
                and 2 < e <= 2048 and 1 <= topk <= e)

    def moe_route_topk(logits, bias, topk, scoring, renormalize, scaling):
        if _gating_fits(logits, topk, scoring):
            took("moe_route_topk:npu_moe_gating_top_k")
            _, ids, norm = npu.npu_moe_gating_top_k(
                x=logits, k=topk, bias=None if bias is None else bias.to(logits.dtype), k_group=1,
                group_count=1, group_select_mode=0, renorm=0,
                norm_type=1 if scoring == "sigmoid" else 0, out_flag=True,
                routed_scaling_factor=1.0, eps=1e-20)
            ids = ids.to(torch.int64)
            # only renorm=0 exists and norm_type 1 always renormalises: weights come from normOut
            return _finish(norm.gather(1, ids), renormalize, scaling), ids
        return host_topk(logits, bias, topk, scoring, renormalize, scaling)

    def moe_route_hash(logits, token_ids, tid2eid, scoring, renormalize, scaling):
        k = tid2eid.shape[1]
        if _gating_fits(logits, k, scoring):
            took("moe_route_hash:npu_moe_gating_top_k")
            _, ids, norm = npu.npu_moe_gating_top_k(
                x=logits, k=k, input_ids=token_ids, tid2eid=tid2eid, renorm=0,
                norm_type=1 if scoring == "sigmoid" else 0, out_flag=True,
                routed_scaling_factor=1.0, eps=1e-20)
            ids = ids.to(torch.int64)
            return _finish(norm.gather(1, ids), renormalize, scaling), ids
        return host_hash(logits, token_ids, tid2eid, scoring, renormalize, scaling)

    def _mx_linear(x, w, bias):
        """MXFP8 x MXFP8 on the 950 cube units: activations quantized per 32 (ceil scale)."""
        took("linear:npu_quant_matmul")
        xq, xs = npu.npu_dynamic_mx_quant(input=x, axis=-1, round_mode="rint",
                                          dst_type=api.code("float8_e4m3fn"), block_size=32,
                                          scale_alg=1)
        w8, ws = mx_weight(w)
        e8m0 = api.code("float8_e8m0fnu")
        return npu.npu_quant_matmul(x1=xq, x2=w8, scale=ws, pertoken_scale=xs,
                                    bias=None if bias is None else bias.to(torch.float32),
                                    output_dtype=SCALAR_TYPE_CODES[x.dtype], scale_dtype=e8m0,
                                    pertoken_scale_dtype=e8m0, group_sizes=[1, 1, 32])

    def linear(x, w, bias=None):
        if (mode.mx_gemm and mode.is_950 and not mode.batch_invariant
                and w.format in ("fp8_block128", "fp8_block32")
                and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)):
            return _mx_linear(x, w, bias)
        wd = dense_weight(w, x.dtype)
        if wd.dim() != 2 or x.dim() != 2:
            raise ValueError(f"linear takes x [T, K] and a 2D weight, got {tuple(x.shape)} / "
                             f"{tuple(wd.shape)}")
        if mode.batch_invariant:
            took("linear:tiled")
            y = tiled_linear(x, wd)
        else:
            took("linear:matmul")
            y = torch.nn.functional.linear(x, wd)
        return y if bias is None else (y.to(torch.float32) + bias.to(torch.float32)).to(x.dtype)

    def _grouped(x, wd, sizes):
        if mode.batch_invariant or wd.shape[0] > 1024 or x.dtype not in FLOATS:
            took("grouped:tiled")
            out = torch.empty(x.shape[0], wd.shape[1], dtype=x.dtype, device=x.device)
            start = 0
            for e, c in enumerate(sizes.tolist()):
                if c:
                    out[start:start + c] = tiled_linear(x[start:start + c], wd[e])
                start += c
            return out
        took("grouped:npu_grouped_matmul")
        return npu.npu_grouped_matmul(x=[x], weight=[wd.transpose(1, 2)],
                                      group_list=sizes.to(torch.int64), split_item=2,
                                      group_type=0, group_list_type=1)[0]

    def grouped_linear(x, w, group_sizes):
        wd = dense_weight(w, x.dtype)
        if wd.dim() != 3 or group_sizes.shape != (wd.shape[0],):
            raise ValueError(f"grouped_linear needs W [E, N, K] and group_sizes [E], got "
                             f"{tuple(wd.shape)} / {tuple(group_sizes.shape)}")
        if int(group_sizes.sum()) != x.shape[0] or bool((group_sizes < 0).any()):
            raise ValueError(f"group_sizes {group_sizes.tolist()} must be >= 0 and sum to {x.shape[0]}")
        return _grouped(x, wd, group_sizes)

    def moe_experts(x, topk_ids, topk_weights, w13, w2, swiglu_limit=None):
        t, k = topk_ids.shape
        e = w13.shape[0]
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
            raise ValueError(f"expert ids outside [0, {e}): {topk_ids.min().item()}..{topk_ids.max().item()}")
        if t == 0:
            return torch.zeros(0, x.shape[1], dtype=x.dtype, device=x.device)
        took("moe_experts:npu_moe_init_routing_v2")
        # float32 from routing to combine: the contract forms a = silu(g) * u in float32 and sums
        # the k expert outputs at >= float32; bf16 intermediates (three extra roundings) leave
        # the tolerance. A bf16 GMM with float32 output (output_dtype) is the faster variant to
        # validate on hardware.
        xf = x.to(torch.float32)
        ex, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
            x=xf, expert_idx=topk_ids.to(torch.int32), active_num=t * k, expert_num=e,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
            active_expert_range=[0, e])
        h = _grouped(ex, dense_weight(w13, torch.float32), counts)
        g, u = h.chunk(2, dim=-1)
        if swiglu_limit is not None:
            g = g.clamp(max=swiglu_limit)
            u = u.clamp(-swiglu_limit, swiglu_limit)
        a = silu(g) * u
        o = _grouped(a, dense_weight(w2, torch.float32), counts)
        # unpermute sums each token's k rows in j order (documented as deterministic)
        y = npu.npu_moe_token_unpermute(permuted_tokens=o, sorted_indices=row_idx,
                                        probs=topk_weights.to(torch.float32))
        return y.to(x.dtype)

    return {"linear": linear, "grouped_linear": grouped_linear, "moe_experts": moe_experts,
            "moe_route_topk": moe_route_topk, "moe_route_hash": moe_route_hash}
