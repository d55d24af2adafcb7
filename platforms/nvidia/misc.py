"""Small ops: embedding, swiglu, cache_write (Triton byte copy that skips negative slots without a
host sync), mHC Sinkhorn (Triton, one program per token), single-process collectives."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import as_u8, cdiv, check, in_range, interpreting, pow2


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    ids = ids.to(torch.int64)
    check(ids, in_range(0, table.shape[0]), f"embedding ids must lie in [0, {table.shape[0]})")
    return torch.nn.functional.embedding(ids, table)


@triton.jit
def _swiglu_kernel(x_ptr, y_ptr, inter, s_x, s_y, limit, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    g = tl.load(x_ptr + r * s_x + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r * s_x + inter + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:  # where, not minimum: a NaN stays NaN, as in torch's clamp
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    # silu as the MoE GEMM's epilogue computes it (qgemm.py), so shared and routed experts agree
    tl.store(y_ptr + r * s_y + c, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=ok)


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """One launch where Triton runs (torch's took 7 a call: two casts, two clamps, silu, mul, cast;
    the shared expert of every layer of a decode step paid them)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: gate_up's last dimension must be even (gate | up), got {gate_up.shape[-1]}")
    inter = gate_up.shape[-1] // 2
    if gate_up.device.type == "cpu" and not interpreting():
        g, u = gate_up[..., :inter].float(), gate_up[..., inter:].float()
        if limit is not None:
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
        return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if y.numel():
        block = min(1024, pow2(inter))
        _swiglu_kernel[(x.shape[0], cdiv(inter, block))](x, y, inter, x.stride(0), y.stride(0),
                                                         float(limit) if limit is not None else 0.0,
                                                         HAS_LIMIT=limit is not None, BLOCK=block)
    return y.reshape(*gate_up.shape[:-1], inter)


@triton.jit
def _copy_rows(cache_ptr, slot_ptr, val_ptr, ROW, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i)
    if slot < 0:
        return
    ok = c < ROW
    tl.store(cache_ptr + slot * ROW + c, tl.load(val_ptr + i * ROW + c, mask=ok), mask=ok)


def cache_write(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    n = values.shape[0]
    if values.dtype != cache.dtype or tuple(values.shape[1:]) != tuple(cache.shape[2:]):
        raise ValueError(f"cache_write: values {values.dtype} {tuple(values.shape)} do not fit cache "
                         f"{cache.dtype} {tuple(cache.shape)} (rows must match [num_blocks, block_size, ...])")
    if not cache.is_contiguous():
        raise ValueError("cache_write needs a contiguous cache tensor")
    if n == 0:
        return None
    slots = cache.shape[0] * cache.shape[1]
    check(slot_mapping, lambda s: s < slots, f"cache_write: slots must be < {slots} (num_blocks * block_size)")
    row = values[0].numel() * values.element_size()
    dst = as_u8(cache.view(-1)) if cache.dtype != torch.uint8 else cache.view(-1)
    src = values.contiguous().view(-1)
    src = as_u8(src) if src.dtype != torch.uint8 else src
    block = min(4096, pow2(row))
    _copy_rows[(n, cdiv(row, block))](dst, slot_mapping.to(torch.int64).contiguous(), src, row,
                                      BLOCK=block)
    return None


@triton.jit
def _sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, iters, eps,
                     M: tl.constexpr, MP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = M * (M + 2)
    i = tl.arange(0, MP)
    iok = i < M
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    a = tl.load(mix_ptr + t * W + i, mask=iok, other=0.0) * s0 + tl.load(base_ptr + i, mask=iok, other=0.0)
    tl.store(pre_ptr + t * M + i, 1.0 / (1.0 + tl.exp(-a)) + eps, mask=iok)
    b = tl.load(mix_ptr + t * W + M + i, mask=iok, other=0.0) * s1 + tl.load(base_ptr + M + i, mask=iok,
                                                                              other=0.0)
    tl.store(post_ptr + t * M + i, 2.0 / (1.0 + tl.exp(-b)), mask=iok)
    r = tl.arange(0, MP)[:, None]
    c = tl.arange(0, MP)[None, :]
    ok = (r < M) & (c < M)
    z = tl.load(mix_ptr + t * W + 2 * M + r * M + c, mask=ok, other=0.0) * s2 \
        + tl.load(base_ptr + 2 * M + r * M + c, mask=ok, other=0.0)
    z = tl.where(ok, z, float("-inf"))
    ez = tl.where(ok, tl.exp(z - tl.max(z, axis=1)[:, None]), 0.0)
    den = tl.sum(ez, axis=1)[:, None]
    cm = tl.where(ok, ez / tl.where(den > 0, den, 1.0) + eps, 0.0)
    cm = cm / (tl.sum(cm, axis=0)[None, :] + eps)
    for _ in range(1, iters):
        cm = cm / (tl.sum(cm, axis=1)[:, None] + eps)
        cm = cm / (tl.sum(cm, axis=0)[None, :] + eps)
    tl.store(comb_ptr + t * M * M + r * M + c, cm, mask=ok)


def hc_split_sinkhorn(mix, scale, base, hc_mult, iters, eps):
    m = int(hc_mult)
    t = mix.shape[0]
    if mix.shape[-1] != m * (m + 2):
        raise ValueError(f"hc_split_sinkhorn: mix must be [T, {m * (m + 2)}] for hc_mult={m}")
    dev = mix.device
    pre = torch.empty(t, m, device=dev)
    post = torch.empty(t, m, device=dev)
    comb = torch.empty(t, m, m, device=dev)
    if t:
        _sinkhorn_kernel[(t,)](mix.float().contiguous(), scale.float().contiguous(),
                               base.float().contiguous(), pre, post, comb, int(iters), float(eps),
                               M=m, MP=pow2(m, 2))
    return pre, post, comb




def all_reduce(x: torch.Tensor, group: object | None = None) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = parts[0].clone()
    for p in parts[1:]:  # fixed rank order, so every rank gets the same bits
        out += p
    return out


def all_gather(x: torch.Tensor, group: object | None = None, dim: int = 0) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_to_all(x: torch.Tensor, send_counts, recv_counts, group: object | None = None) -> torch.Tensor:
    """NCCL all_to_all_single: rows are copied, so any algorithm gives the same bits."""
    import torch.distributed as dist

    from shuili.hal import distributed

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return distributed.all_to_all(x, send_counts, recv_counts, group, world)
