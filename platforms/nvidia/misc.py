"""Small ops: embedding, swiglu, cache_write (Triton byte copy that skips negative slots without a
host sync), paged_slots (block-table lookups in one launch), single-process collectives."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import as_u8, cdiv, check, in_range, interpreting, pow2
from shuili.platforms.nvidia import quant
from shuili.platforms.reference.public import OPS as REFERENCE_OPS, check_kv_write_args, check_slots_args


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


def kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor, fmt: str) -> None:
    """One launch: each row whose slot is not negative is packed straight into its cache row."""
    check_kv_write_args(cache, rows, fmt)
    if fmt == "none":
        return cache_write(cache, slot_mapping, rows.to(cache.dtype))
    rb = quant.bytes_per_row(fmt, rows.shape[1])
    if cache.dim() != 3 or cache.shape[2] != rb or not cache.is_contiguous():
        raise ValueError(f"kv_write: a {fmt} cache of {rows.shape[1]}-wide rows is contiguous uint8 "
                         f"[blocks, block_size, {rb}], got {tuple(cache.shape)}")
    if slot_mapping.shape != (rows.shape[0],):
        raise ValueError(f"kv_write: slot_mapping {tuple(slot_mapping.shape)} must be [{rows.shape[0]}]")
    slots = cache.shape[0] * cache.shape[1]
    check(slot_mapping, lambda s: s < slots, f"kv_write: slots must be < {slots} (num_blocks * block_size)")
    quant.pack(rows, fmt, cache, slot_mapping.to(torch.int64).contiguous())


@triton.jit
def _slots_kernel(bt_ptr, seq_ptr, pos_ptr, out_ptr, N, C, nb, s_bt, ss_r, ss_c, sp_r, sp_c, per_block,
                  BLOCK: tl.constexpr):
    """paged_slots over the broadcast [R, C] (flat index i = r * C + c; strides 0 where broadcast).
    The block is read only where it exists, which is where the reference's clamped gather counts."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    r = i // C
    c = i % C
    seq = tl.load(seq_ptr + r * ss_r + c * ss_c, mask=ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + r * sp_r + c * sp_c, mask=ok, other=-1).to(tl.int64)
    p = tl.maximum(pos, 0)
    blk = p // per_block
    inb = (pos >= 0) & (blk < nb)
    phys = tl.load(bt_ptr + seq * s_bt + blk, mask=ok & inb, other=-1).to(tl.int64)
    tl.store(out_ptr + i, tl.where(inb & (phys >= 0), phys * per_block + p % per_block, -1), mask=ok)


def paged_slots(block_tables: torch.Tensor, seq_idx: torch.Tensor, pos: torch.Tensor,
                per_block: int) -> torch.Tensor:
    """One launch where torch took 14 small kernels (a decode step looks slots up six or seven times)."""
    check_slots_args(block_tables, per_block)
    seq, p = torch.broadcast_tensors(seq_idx, pos)  # views: stride 0 where broadcast
    if seq.dim() > 2 or seq.dim() == 0:
        return REFERENCE_OPS["paged_slots"](block_tables, seq_idx, pos, per_block)
    check(seq_idx, in_range(0, block_tables.shape[0]),
          f"paged_slots: seq_idx must lie in [0, {block_tables.shape[0]}) (the block table's rows)")
    if seq.dim() == 1:
        seq, p = seq[:, None], p[:, None]
    out = torch.empty(seq.shape, dtype=torch.int64, device=pos.device)
    n = out.numel()
    if n:
        bt = block_tables.contiguous()
        block = 256
        _slots_kernel[(cdiv(n, block),)](bt, seq, p, out, n, seq.shape[1], bt.shape[1], bt.stride(0),
                                         seq.stride(0), seq.stride(1), p.stride(0), p.stride(1), per_block,
                                         BLOCK=block)
    return out.view(torch.broadcast_shapes(seq_idx.shape, pos.shape))


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
