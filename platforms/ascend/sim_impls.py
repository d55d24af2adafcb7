"""CPU implementations of the documented semantics of the torch_npu operators in `schemas.py`.

Written from the op-plugin documentation (docs/zh/custom_APIs/torch_npu/*.md, torch_npu 2.13 era)
and vllm-ascend's call patterns, independently of the reference platform, so that routing the
backend through them and comparing against the reference checks the backend's argument values,
layouts and dtypes, not just its argument names. Each implementation rejects what the real
operator documents as unsupported (dtypes, layouts, block sizes, modes): a backend that calls an
NPU op outside its envelope fails here in CI instead of on the first Ascend box.

Where the documentation is silent these implementations pick one reading and say so ("ASSUMED");
docs/platforms/ascend.md lists those assumptions as unverified.
"""
from __future__ import annotations

import torch

F16_BF16 = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MASK_SIZE = 2048
CODE_E5M2, CODE_E4M3, CODE_E8M0 = 291, 292, 293


def need(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {msg}")


def _dummy() -> torch.Tensor:
    return torch.zeros(1)


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row x[i] (a fresh contiguous tensor) separately. torch's CPU kernels
    round an element differently in the vector body and the scalar tail, so a whole-tensor call
    would make a row's bits depend on the rows before it, which a per-token NPU kernel does not."""
    if x.shape[0] == 0:
        return fn(x)
    return torch.stack([fn(r.clone()) for r in x])


# ------------------------------------------------------------------------------------ norm etc.
def npu_rms_norm(input, gamma, epsilon=1e-6):
    op = "npu_rms_norm"
    need(input.dtype in FLOATS, op, f"input dtype {input.dtype} not in fp16/bf16/fp32")
    need(gamma.dtype == input.dtype, op, f"gamma dtype {gamma.dtype} != input dtype {input.dtype}")
    need(2 <= input.dim() <= 8 or input.dim() == 1, op, f"input has {input.dim()} dims")
    nd = gamma.dim()
    need(tuple(input.shape[-nd:]) == tuple(gamma.shape), op,
         f"gamma shape {tuple(gamma.shape)} != trailing dims of input {tuple(input.shape)}")
    lead = input.shape[: input.dim() - nd]
    xf = input.to(torch.float32).reshape(-1, gamma.numel())
    rstd = rowwise(lambda r: torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + epsilon), xf)
    y = (xf * rstd * gamma.to(torch.float32).reshape(-1)).to(input.dtype).reshape(input.shape)
    return y, rstd.reshape(*lead, *([1] * nd))


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    op = "npu_add_rms_norm"
    need(x1.shape == x2.shape and x1.dtype == x2.dtype, op,
         f"x1 {x1.dtype}{tuple(x1.shape)} and x2 {x2.dtype}{tuple(x2.shape)} must match")
    x_sum = (x1.to(torch.float32) + x2.to(torch.float32)).to(x1.dtype)
    y, rstd = npu_rms_norm(x_sum, gamma, epsilon)
    return y, rstd, x_sum


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    op = "npu_rotary_mul"
    need(rotary_mode in ("half", "interleave"), op, f"rotary_mode {rotary_mode!r} not half/interleave")
    need(rotate is None, op, "rotate is only for the legacy 'half' matrix form; not emulated")
    need(input.dim() == 4, op, f"input must be 4-D ([B, S, N, D] style), got {input.dim()}-D")
    need(input.dtype in FLOATS and r1.dtype == input.dtype and r2.dtype == input.dtype, op,
         f"input/r1/r2 dtypes {input.dtype}/{r1.dtype}/{r2.dtype} must be one float dtype")
    d = input.shape[-1]
    need(d % 2 == 0, op, f"last dim {d} must be even")
    need(r1.shape == r2.shape and r1.dim() == 4 and r1.shape[-1] == d, op,
         f"r1/r2 must be 4-D with last dim {d}, got {tuple(r1.shape)} / {tuple(r2.shape)}")
    torch.broadcast_shapes(r1.shape, input.shape)
    x = input.to(torch.float32)
    if rotary_mode == "half":
        rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    else:
        pairs = x.unflatten(-1, (d // 2, 2))
        rot = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x * r1.to(torch.float32) + rot * r2.to(torch.float32)).to(input.dtype)


def npu_swiglu(input, dim=-1):
    op = "npu_swiglu"
    need(input.dtype in FLOATS, op, f"dtype {input.dtype}")
    need(input.shape[dim] % 2 == 0, op, f"dim {dim} of size {input.shape[dim]} is not even")
    a, b = input.to(torch.float32).chunk(2, dim=dim)
    silu = rowwise(torch.nn.functional.silu, a.reshape(-1, a.shape[-1]).contiguous()).reshape(a.shape)
    return (silu * b).to(input.dtype)


# ------------------------------------------------------------------------------------------ MoE
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
                         group_count=1, group_select_mode=0, renorm=0, norm_type=0, out_flag=False,
                         routed_scaling_factor=1.0, eps=1e-20):
    op = "npu_moe_gating_top_k"
    need(x.dim() == 2 and x.dtype in FLOATS, op, f"x must be 2-D fp16/bf16/fp32, got {x.dtype}")
    t, e = x.shape
    need(e <= 2048, op, f"{e} experts > 2048")
    need(renorm == 0, op, "only renorm=0 (norm, then top-k) is supported")
    need(norm_type in (0, 1), op, f"norm_type {norm_type} (0 softmax, 1 sigmoid)")
    need(group_count >= 1 and e % group_count == 0 and e // group_count > 2, op,
         f"{e} experts do not split into {group_count} groups of more than 2")
    need(1 <= k_group <= group_count and 1 <= k <= e // group_count * k_group, op,
         f"k={k}, k_group={k_group} out of range")
    if bias is not None:
        need(bias.shape == (e,) and bias.dtype == x.dtype, op,
             f"bias must be [{e}] of x's dtype {x.dtype}, got {bias.dtype}{tuple(bias.shape)}")
    need((input_ids is None) == (tid2eid is None), op, "input_ids and tid2eid go together")
    # one row at a time: torch's CPU kernels round by position in the tensor (vector body vs
    # scalar tail), and a per-token kernel's result must not depend on the other tokens
    act = (lambda r: torch.softmax(r, dim=-1)) if norm_type == 0 else torch.sigmoid
    norm = rowwise(act, x.to(torch.float32))
    if tid2eid is not None:
        need(input_ids.shape == (t,) and tid2eid.dim() == 2 and tid2eid.shape[1] == k, op,
             f"hash mode needs input_ids [{t}] and tid2eid [V, {k}]")
        ids = tid2eid.to(torch.int64)[input_ids.to(torch.int64)]
    else:
        sel = norm if bias is None else norm + bias.to(torch.float32)
        if group_count > 1:
            g = sel.view(t, group_count, -1)
            score = g.amax(-1) if group_select_mode == 0 else g.topk(2, dim=-1).values.sum(-1)
            keep = torch.argsort(-score, dim=-1, stable=True)[:, :k_group]
            mask = torch.ones(t, group_count, dtype=torch.bool).scatter_(1, keep, False)
            sel = sel.masked_fill(mask[..., None].expand_as(g).reshape(t, e), float("-inf"))
        ids = torch.argsort(-sel, dim=-1, stable=True)[:, :k]
    y = norm.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = (y * routed_scaling_factor).to(x.dtype)
    return y, ids.to(torch.int32), (norm if out_flag else _dummy())


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                            expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                            active_expert_range=(), row_idx_type=0, x_dtype=None):
    op = "npu_moe_init_routing_v2"
    need(x.dim() == 2 and x.dtype in FLOATS, op, f"x must be 2-D float, got {x.dtype}")
    need(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32 and expert_idx.shape[0] == x.shape[0],
         op, f"expert_idx must be int32 [{x.shape[0]}, k], got {expert_idx.dtype}{tuple(expert_idx.shape)}")
    need(quant_mode == -1 and scale is None and offset is None and x_dtype is None, op,
         "only the unquantized mode (quant_mode=-1) is emulated")
    need(drop_pad_mode == 0 and expert_capacity == -1, op, "only dropless mode is emulated")
    need(row_idx_type == 0, op, "only row_idx_type=0 (scatter index) is emulated")
    need(expert_tokens_num_type in (0, 1), op, "expert_tokens_num_type 0 (cumsum) or 1 (count)")
    need(expert_num > 0, op, "expert_num must be given")
    lo, hi = (tuple(active_expert_range) or (0, expert_num))
    need(lo == 0 and hi == expert_num, op, "only the full active_expert_range [0, expert_num) is emulated")
    t, k = expert_idx.shape
    need(active_num in (-1, t * k), op, f"active_num {active_num}: only all {t * k} rows are emulated")
    flat = expert_idx.reshape(-1).to(torch.int64)
    need(bool(((flat >= 0) & (flat < expert_num)).all()), op, "expert ids outside [0, expert_num)")
    sorted_row = torch.argsort(flat, stable=True)
    expanded_x = x[sorted_row // k].clone()
    expanded_row_idx = torch.empty(t * k, dtype=torch.int32)
    expanded_row_idx[sorted_row] = torch.arange(t * k, dtype=torch.int32)
    counts = torch.bincount(flat, minlength=expert_num).to(torch.int64)
    tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    if not expert_tokens_num_flag:
        tokens = _dummy().to(torch.int64)
    return expanded_x, expanded_row_idx, tokens, _dummy()


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None):
    op = "npu_moe_token_unpermute"
    need(not padded_mode and restore_shape is None, op, "padded_mode is not supported")
    need(sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, op,
         f"sorted_indices must be int32 1-D, got {sorted_indices.dtype}")
    need(permuted_tokens.dtype in FLOATS, op, f"dtype {permuted_tokens.dtype}")
    k = 1 if probs is None else probs.shape[-1]
    n = sorted_indices.shape[0]
    need(n == permuted_tokens.shape[0] and n % k == 0, op, "sorted_indices / permuted_tokens mismatch")
    if probs is not None:
        need(probs.dtype == permuted_tokens.dtype and probs.shape == (n // k, k), op,
             f"probs must be {permuted_tokens.dtype} [{n // k}, {k}], got {probs.dtype}{tuple(probs.shape)}")
    rows = permuted_tokens.to(torch.float32)[sorted_indices.to(torch.int64)].view(n // k, k, -1)
    out = torch.zeros(n // k, rows.shape[-1], dtype=torch.float32)
    for j in range(k):
        p = 1.0 if probs is None else probs[:, j:j + 1].to(torch.float32)
        out = out + rows[:, j] * p
    return out.to(permuted_tokens.dtype)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                       x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    op = "npu_grouped_matmul"
    need(all(a is None for a in (bias, scale, offset, antiquant_scale, antiquant_offset,
                                 per_token_scale, activation_input)), op,
         "only the unquantized form without bias is emulated")
    need(len(x) == 1 and len(weight) == 1, op, "emulated form: one x [M, K] and one weight [E, K, N]")
    need(split_item in (2, 3) and group_type == 0, op,
         f"split_item {split_item} / group_type {group_type}: emulated form is 2|3 / 0 (split M)")
    need(group_list_type in (0, 1), op, "group_list_type 0 (cumsum) or 1 (counts)")
    need(act_type == 0 and output_dtype is None, op, "act_type / output_dtype not emulated")
    a, w = x[0], weight[0]
    need(a.dim() == 2 and w.dim() == 3 and w.shape[1] == a.shape[1], op,
         f"x {tuple(a.shape)} / weight {tuple(w.shape)} are not [M, K] / [E, K, N]")
    need(a.dtype in FLOATS and w.dtype == a.dtype, op, f"x/weight dtypes {a.dtype}/{w.dtype}")
    e = w.shape[0]
    need(e <= 1024 and group_list is not None and group_list.shape == (e,)
         and group_list.dtype == torch.int64, op, f"group_list must be int64 [{e}] (E <= 1024)")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list[:1] * 0)
    counts = [int(c) for c in counts.tolist()]
    need(all(c >= 0 for c in counts) and sum(counts) <= a.shape[0], op, "group_list does not fit M")
    out = torch.zeros(a.shape[0], w.shape[2], dtype=a.dtype)
    start = 0
    for g, c in enumerate(counts):
        out[start:start + c] = (a[start:start + c].to(torch.float32) @ w[g].to(torch.float32)).to(a.dtype)
        start += c
    return [out]


# ----------------------------------------------------------------------------------- attention
def _check_mask(op: str, sparse_mode: int, atten_mask) -> None:
    if sparse_mode in (2, 3, 4):
        need(atten_mask is not None and atten_mask.shape[-2:] == (MASK_SIZE, MASK_SIZE)
             and atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), op,
             f"sparse_mode {sparse_mode} needs the optimized {MASK_SIZE}x{MASK_SIZE} bool/int8 mask")
        want = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), 1)
        need(bool((atten_mask.reshape(MASK_SIZE, MASK_SIZE).to(torch.bool) == want).all()), op,
             "the optimized mask must be triu(ones(2048, 2048), diagonal=1)")
    else:
        need(sparse_mode == 0 and atten_mask is None, op,
             f"sparse_mode {sparse_mode} with a mask is not emulated (0, 3, 4 are)")


def _fia(op, query, key, value, atten_mask, qlen_cum, kv_lens, block_table, num_heads, kv_heads,
         scale, pre_tokens, next_tokens, input_layout, sparse_mode, block_size, sink, lse_flag,
         quant_args):
    """Paged TND attention: the shared body of the FIA v1 / v2 emulations."""
    need(all(a is None for a in quant_args), op, "quantization / rope / prefix / pse inputs not emulated")
    need(not lse_flag, op, "softmax_lse output not emulated")
    need(input_layout == "TND", op, f"input_layout {input_layout!r}: only TND is emulated")
    need(query.dim() == 3 and query.dtype in F16_BF16, op,
         f"query must be [T, N, D] fp16/bf16, got {query.dtype}{tuple(query.shape)}")
    t, n, d = query.shape
    need(num_heads == n, op, f"num heads {num_heads} != query heads {n}")
    kvn = kv_heads or n
    need(n % kvn == 0 and n // kvn <= 64, op, f"{n} query heads over {kvn} kv heads (ratio <= 64)")
    need(key.dtype == query.dtype and value.dtype == query.dtype, op, "key/value dtype != query dtype")
    need(key.dim() == 3 and key.shape == value.shape and key.shape[2] == kvn * d, op,
         f"paged key/value must be [blocks, block_size, KV_N*D={kvn * d}], got {tuple(key.shape)}")
    need(kvn * d <= 65535, op, "KV_N * D > 65535 in the (blocknum, blocksize, H) layout")
    need(block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2, op,
         "block_table must be int32 [B, max_blocks]")
    need(block_size == key.shape[1], op, f"block_size {block_size} != key.shape[1] {key.shape[1]}")
    need(qlen_cum is not None and kv_lens is not None, op, "TND needs both actual sequence lengths")
    qc = [int(v) for v in qlen_cum]
    b = len(qc)
    need(b == block_table.shape[0] and len(kv_lens) >= b, op,
         f"{b} batches but block_table has {block_table.shape[0]} rows / {len(kv_lens)} kv lengths")
    need(all(qc[i] <= qc[i + 1] for i in range(b - 1)) and qc[-1] == t, op,
         f"query lengths {qc} must be a non-decreasing prefix sum ending at T={t}")
    qlens = [qc[0]] + [qc[i + 1] - qc[i] for i in range(b - 1)]
    multi = max(qlens) > 1
    if multi:
        need(block_size % 128 == 0 and 128 <= block_size <= 512, op,
             f"block_size {block_size}: Q_S > 1 needs a multiple of 128 in [128, 512]")
    else:
        need(block_size % 16 == 0, op, f"block_size {block_size}: Q_S = 1 needs a multiple of 16")
    need(sparse_mode in (0, 3, 4), op, f"sparse_mode {sparse_mode} not emulated")
    _check_mask(op, sparse_mode, atten_mask)
    if sink is not None:
        need(sink.dtype == torch.bfloat16 and sink.shape == (n,), op,
             f"learnable_sink must be bfloat16 [{n}], got {sink.dtype}{tuple(sink.shape)}")
    kf = key.view(-1, kvn, d)
    vf = value.view(-1, kvn, d)
    out = torch.zeros(t, n, d, dtype=torch.float32)
    g = n // kvn
    start = 0
    for bi in range(b):
        ql, kl = qlens[bi], int(kv_lens[bi])
        need(0 <= ql <= kl, op, f"batch {bi}: {ql} queries but {kl} kv tokens")
        nblk = -(-kl // block_size)
        need(nblk <= block_table.shape[1], op, f"batch {bi} needs {nblk} blocks")
        blocks = block_table[bi, :nblk].to(torch.int64)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:kl]
        k = kf[slots].to(torch.float32)  # [kl, KVN, D]
        v = vf[slots].to(torch.float32)
        q = query[start:start + ql].to(torch.float32)
        logits = torch.einsum("qhgd,khd->hgqk", q.view(ql, kvn, g, d), k) * scale
        i = torch.arange(ql)[:, None] + (kl - ql)  # bottom-right aligned diagonal
        j = torch.arange(kl)[None, :]
        # Q_S = 1 takes the incremental path, which ignores sparse_mode / pre / next tokens
        if ql > 1 or multi:
            if sparse_mode == 3:
                logits = logits.masked_fill(j > i, float("-inf"))
            elif sparse_mode == 4:
                band = (j > i + next_tokens) | (j < i - pre_tokens)
                logits = logits.masked_fill(band, float("-inf"))
        logits = logits.reshape(n, ql, kl)
        if sink is not None:
            s = sink.to(torch.float32)[:, None, None].expand(n, ql, 1)
            p = torch.softmax(torch.cat((logits, s), dim=-1), dim=-1)[..., :kl]
        else:
            p = torch.softmax(logits, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", p.view(kvn, g, ql, kl), v)
        out[start:start + ql] = o.reshape(ql, n, d)
        start += ql
    return out.to(query.dtype), _dummy()


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                    actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
                                    quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None,
                                    key_antiquant_offset=None, value_antiquant_scale=None,
                                    value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None,
                                    key_shared_prefix=None, value_shared_prefix=None,
                                    actual_shared_prefix_len=None, query_rope=None, key_rope=None,
                                    key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647,
                                    input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                                    inner_precise=0, block_size=0, antiquant_mode=0,
                                    key_antiquant_mode=0, value_antiquant_mode=0,
                                    softmax_lse_flag=False):
    quant = (pse_shift, dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2,
             antiquant_scale, antiquant_offset, key_antiquant_scale, key_antiquant_offset,
             value_antiquant_scale, value_antiquant_offset, query_padding_size, kv_padding_size,
             key_shared_prefix, value_shared_prefix, actual_shared_prefix_len, query_rope, key_rope,
             key_rope_antiquant_scale)
    return _fia("npu_fused_infer_attention_score", query, key, value, atten_mask,
                actual_seq_lengths, actual_seq_lengths_kv, block_table, num_heads,
                num_key_value_heads, scale, pre_tokens, next_tokens, input_layout, sparse_mode,
                block_size, None, softmax_lse_flag, quant)


def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None,
                                       pse_shift=None, atten_mask=None, actual_seq_qlen=None,
                                       actual_seq_kvlen=None, block_table=None,
                                       dequant_scale_query=None, dequant_scale_key=None,
                                       dequant_offset_key=None, dequant_scale_value=None,
                                       dequant_offset_value=None, dequant_scale_key_rope=None,
                                       quant_scale_out=None, quant_offset_out=None,
                                       quant_scale_p=None, learnable_sink=None, num_query_heads=1,
                                       num_key_value_heads=0, softmax_scale=1.0,
                                       pre_tokens=2147483647, next_tokens=2147483647,
                                       input_layout="BSH", sparse_mode=0, block_size=0,
                                       query_quant_mode=0, key_quant_mode=0, value_quant_mode=0,
                                       inner_precise=0, return_softmax_lse=False, query_dtype=None,
                                       key_dtype=None, value_dtype=None, query_rope_dtype=None,
                                       key_rope_dtype=None, key_shared_prefix_dtype=None,
                                       value_shared_prefix_dtype=None,
                                       dequant_scale_query_dtype=None,
                                       dequant_scale_key_dtype=None,
                                       dequant_scale_value_dtype=None,
                                       dequant_scale_key_rope_dtype=None, out_dtype=None):
    quant = (query_rope, key_rope, pse_shift, dequant_scale_query, dequant_scale_key,
             dequant_offset_key, dequant_scale_value, dequant_offset_value, dequant_scale_key_rope,
             quant_scale_out, quant_offset_out, quant_scale_p, query_dtype, key_dtype, value_dtype,
             query_rope_dtype, key_rope_dtype, key_shared_prefix_dtype, value_shared_prefix_dtype,
             dequant_scale_query_dtype, dequant_scale_key_dtype, dequant_scale_value_dtype,
             dequant_scale_key_rope_dtype, out_dtype)
    return _fia("npu_fused_infer_attention_score_v2", query, key, value, atten_mask,
                actual_seq_qlen, actual_seq_kvlen, block_table, num_query_heads,
                num_key_value_heads, softmax_scale, pre_tokens, next_tokens, input_layout,
                sparse_mode, block_size, learnable_sink, return_softmax_lse, quant)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    op = "npu_scatter_pa_kv_cache"
    need(cache_mode == "Norm", op, f"cache_mode {cache_mode!r}: only 'Norm' (ND caches) is emulated; "
         "'PA_NZ' needs caches made with npu_format_cast(.., 29)")
    need(compress_lens is None and compress_seq_offsets is None and seq_lens is None, op,
         "compression inputs not emulated")
    ok = (torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
    for name, src, cache in (("key", key, key_cache), ("value", value, value_cache)):
        need(src.dtype in ok and cache.dtype == src.dtype, op,
             f"{name} dtype {src.dtype} / cache dtype {cache.dtype} (fp16, bf16, int8, fp8)")
        need(src.dim() == 3 and cache.dim() == 4 and tuple(cache.shape[2:]) == tuple(src.shape[1:]), op,
             f"{name} [T, KV_N, D] {tuple(src.shape)} does not match cache "
             f"[blocks, block_size, KV_N, D] {tuple(cache.shape)}")
    need(slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == (key.shape[0],),
         op, "slot_mapping must be int32/int64 [T]")
    slots = slot_mapping.to(torch.int64)
    # ASSUMED: negative slots are undefined behaviour on the device, so they are rejected here
    need(bool((slots >= 0).all()), op, "negative slot ids are not skipped by this kernel")
    need(bool((slots < key_cache.shape[0] * key_cache.shape[1]).all()), op, "slot id out of range")
    key_cache.view(-1, *key.shape[1:])[slots] = key
    value_cache.view(-1, *value.shape[1:])[slots] = value


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None,
                          actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                          layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=9223372036854775807, next_tokens=9223372036854775807,
                          return_value=False):
    op = "npu_lightning_indexer"
    need(layout_query == "TND" and layout_key == "PA_BSND", op, "only TND queries over PA_BSND keys")
    need(query.dim() == 3 and query.dtype in F16_BF16 and key.dtype == query.dtype, op,
         f"query/key must be one of fp16/bf16, got {query.dtype}/{key.dtype}")
    t, n1, d = query.shape
    need(d == 128 and key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == 128, op,
         f"D must be 128 and key [blocks, block_size, 1, 128], got {tuple(key.shape)}")
    need(n1 in (8, 16, 24, 32, 64), op, f"Ascend 950 supports N1 in 8/16/24/32/64, got {n1}")
    need(weights.dtype == query.dtype and weights.shape == (t, n1), op,
         f"weights must be {query.dtype} [{t}, {n1}] (950: no float32), got {weights.dtype}")
    bs = key.shape[1]
    need(bs % 16 == 0 and bs <= 1024, op, f"block_size {bs} must be a multiple of 16, <= 1024")
    need(1 <= sparse_count <= 2048 or sparse_count in (3072, 4096, 5120, 6144, 7168, 8192), op,
         f"sparse_count {sparse_count}")
    need(sparse_mode in (0, 3), op, f"sparse_mode {sparse_mode}")
    need(pre_tokens == 2**63 - 1 and next_tokens == 2**63 - 1, op, "pre/next tokens must be defaults")
    need(not return_value, op, "return_value is unsupported with PA_BSND keys")
    for name, v in (("actual_seq_lengths_query", actual_seq_lengths_query),
                    ("actual_seq_lengths_key", actual_seq_lengths_key), ("block_table", block_table)):
        need(v is not None and v.dtype == torch.int32, op, f"{name} must be an int32 tensor")
    qc = actual_seq_lengths_query.tolist()
    b = len(qc)
    need(qc[-1] == t and block_table.shape[0] == b and actual_seq_lengths_key.shape == (b,), op,
         "query prefix sums / key lengths / block_table rows disagree")
    kf = key.view(-1, d).to(torch.float32)
    out = torch.full((t, 1, sparse_count), -1, dtype=torch.int32)
    start = 0
    for bi in range(b):
        ql, kl = qc[bi] - start, int(actual_seq_lengths_key[bi])
        nblk = -(-kl // bs)
        need(nblk <= block_table.shape[1], op, f"batch {bi} needs {nblk} blocks")
        slots = (block_table[bi, :nblk].to(torch.int64)[:, None] * bs + torch.arange(bs)).reshape(-1)[:kl]
        k = kf[slots]
        for i in range(ql):
            row = start + i
            vis = kl if sparse_mode == 0 else max(0, min(kl, kl - ql + i + 1))
            if vis == 0:
                continue
            s = torch.relu(query[row].to(torch.float32) @ k[:vis].T)  # [N1, vis]
            score = (weights[row].to(torch.float32)[:, None] * s).sum(0)
            # ASSUMED: indices ordered by descending score, ties to the lower position, -1 padded
            order = torch.argsort(-score, stable=True)[:sparse_count]
            out[row, 0, : order.numel()] = order.to(torch.int32)
        start = qc[bi]
    return out, _dummy().to(query.dtype)


# -------------------------------------------------------------------------------- quantization
def _e8m0_ceil_scale(s: torch.Tensor) -> torch.Tensor:
    """Biased e8m0 exponent of a float32 scale, rounded up (op doc, scale_alg=1)."""
    bits = s.contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    up = ((e > 0) & (e < 254) & (m > 0)) | ((e == 0) & (m > 0x400000))
    return (e + up.to(torch.int32)).to(torch.uint8)


def _e8m0_value(byte: torch.Tensor) -> torch.Tensor:
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), byte.to(torch.float64) - 127)


def npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32,
                         scale_alg=0, dst_type_max=0.0, max_low_bound=0.0):
    op = "npu_dynamic_mx_quant"
    need(input.dtype in FLOATS, op, f"input dtype {input.dtype}")
    need(axis in (-1, input.dim() - 1), op, "only the last axis is emulated")
    need(dst_type in (CODE_E4M3, CODE_E5M2), op,
         f"dst_type {dst_type}: only the fp8 outputs (291 e5m2, 292 e4m3fn) are emulated")
    need(round_mode == "rint", op, "fp8 outputs support round_mode='rint' only")
    need(scale_alg in (0, 1), op, f"scale_alg {scale_alg} is not valid for fp8")
    need(block_size % 32 == 0 and 0 < block_size <= 1024, op, f"block_size {block_size}")
    need(input.dtype != torch.float32 or block_size == 32, op, "float32 input needs block_size 32")
    need(dst_type_max == 0.0, op, "dst_type_max is only for fp4 outputs")
    need(max_low_bound >= 0.0 and (scale_alg == 1 or max_low_bound == 0.0), op,
         "max_low_bound only applies with scale_alg=1")
    n = input.shape[-1]
    nb = -(-n // block_size)
    x = torch.nn.functional.pad(input.to(torch.float32), (0, nb * block_size - n))
    xb = x.reshape(*input.shape[:-1], nb, block_size)
    amax = xb.abs().amax(-1)
    fp8 = torch.float8_e4m3fn if dst_type == CODE_E4M3 else torch.float8_e5m2
    dmax, emax = (448.0, 8) if dst_type == CODE_E4M3 else (57344.0, 15)
    if scale_alg == 1:
        if max_low_bound > 0:
            amax = amax.clamp_min(max_low_bound)
        byte = _e8m0_ceil_scale((amax / dmax).to(torch.float32))
    else:
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        exp = torch.floor(torch.log2(safe)) - emax
        byte = torch.where(amax > 0, (exp + 127).clamp(0, 254), torch.zeros_like(exp)).to(torch.uint8)
    recip = (1.0 / _e8m0_value(byte)).to(torch.float32)
    y = (xb * recip[..., None]).clamp(-dmax, dmax).reshape(*input.shape[:-1], -1)[..., :n].to(fp8)
    pairs = -(-nb // 2)
    scale = torch.zeros(*input.shape[:-1], pairs * 2, dtype=torch.uint8)
    scale[..., :nb] = byte
    return y, scale.view(*input.shape[:-1], pairs, 2)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None, y_scale=None):
    """Only the MXFP8 x MXFP8 form (vllm-ascend w8a8_mxfp8): x1 e4m3 [M, K], x2 e4m3 [K, N],
    e8m0 scales pertoken_scale [M, ceil(K/64), 2] and scale [ceil(K/64), N, 2]."""
    op = "npu_quant_matmul"
    need(offset is None and y_scale is None and x1_dtype is None and x2_dtype is None, op,
         "only the MXFP8 x MXFP8 form is emulated")
    need(x1.dtype == torch.float8_e4m3fn and x2.dtype == torch.float8_e4m3fn, op,
         f"x1/x2 must be float8_e4m3fn, got {x1.dtype}/{x2.dtype}")
    need(scale_dtype == CODE_E8M0 and pertoken_scale_dtype == CODE_E8M0, op,
         "MX scales need scale_dtype = pertoken_scale_dtype = float8_e8m0fnu (293)")
    need(list(group_sizes or []) == [1, 1, 32], op, "MX block sizes must be group_sizes=[1, 1, 32]")
    need(x1.dim() == 2 and x2.dim() == 2 and x2.shape[0] == x1.shape[1], op,
         f"x1 [M, K] / x2 [K, N] expected, got {tuple(x1.shape)} / {tuple(x2.shape)}")
    m, k = x1.shape
    n = x2.shape[1]
    kb = -(-k // 32)
    pairs = -(-kb // 2)
    need(pertoken_scale is not None and pertoken_scale.dtype == torch.uint8
         and tuple(pertoken_scale.shape) == (m, pairs, 2), op, f"pertoken_scale must be uint8 [{m}, {pairs}, 2]")
    need(scale.dtype == torch.uint8 and tuple(scale.shape) == (pairs, n, 2), op,
         f"scale must be uint8 [{pairs}, {n}, 2]")
    need(bias is None or (bias.dtype == torch.float32 and tuple(bias.shape) == (n,)), op,
         "bias must be float32 [N]")
    out = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}.get(output_dtype)  # ASSUMED codes
    need(out is not None, op, f"output_dtype {output_dtype} (c10 ScalarType code of fp16/fp32/bf16)")
    sa = _e8m0_value(pertoken_scale.reshape(m, -1)[:, :kb]).repeat_interleave(32, -1)[:, :k]
    sb = _e8m0_value(scale.permute(1, 0, 2).reshape(n, -1)[:, :kb]).repeat_interleave(32, -1)[:, :k]
    y = (x1.to(torch.float64) * sa) @ (x2.to(torch.float64).T * sb).T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out)


IMPLS = {name: fn for name, fn in globals().items() if name.startswith("npu_") and callable(fn)}
