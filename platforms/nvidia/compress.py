"""compress_pool: the compressor's per-channel softmax pooling, one program per (entry, channel
block). A fixed-shape decode step lists every token as a possible entry; the program of an entry
not completed this step (out slot -1) masks all its loads, so the step reads only the source rows
of the entries it completes (about B/128 of them on an HCA layer) instead of all B x ratio rows."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shuili.platforms.nvidia.common import cdiv, pow2
from shuili.platforms.reference.public import check_pool_args


@triton.jit
def _pool_kernel(state_ptr, src_ptr, out_ptr, y_ptr, s_row, L, R, offset, DIM,
                 OVERLAP: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cok = cols < DIM
    n_tok = tl.where(tl.load(out_ptr + i) >= 0, L, 0)  # not completed: no token, nothing read
    j = tl.arange(0, BL)
    s = tl.load(src_ptr + i * L + j, mask=j < n_tok, other=-1)
    ok = s >= 0
    if OVERLAP:  # tokens [0, R): the previous block's first half of the channels; [R, 2R): the second
        kc = offset + tl.where(j >= R, DIM, 0)
        gc = kc + 2 * DIM
    else:
        kc = offset + j * 0
        gc = kc + DIM
    base = s.to(tl.int64) * s_row
    m2 = ok[:, None] & cok[None, :]
    g = tl.load(state_ptr + base[:, None] + (gc[:, None] + cols[None, :]), mask=m2, other=float("-inf"))
    kv = tl.load(state_ptr + base[:, None] + (kc[:, None] + cols[None, :]), mask=m2, other=0.0)
    mx = tl.max(g, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a channel with no token: exp(-inf) = 0, not nan
    e = tl.exp(g - mx[None, :])  # [BL, BD]
    den = tl.sum(e, axis=0)
    num = tl.sum(e * kv, axis=0)
    y = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(y_ptr + i * DIM + cols, y, mask=cok)


def compress_pool(state: torch.Tensor, src_slots: torch.Tensor, out_slots: torch.Tensor, offset: int,
                  dim: int, overlap: bool) -> torch.Tensor:
    if state.dtype != torch.float32:
        raise TypeError(f"compress_pool: the state must be float32, got {state.dtype}")
    check_pool_args(state, src_slots, out_slots, offset, dim, overlap)
    n, span = src_slots.shape
    st = state.reshape(-1, state.shape[-1])
    if st.stride(-1) != 1:
        st = st.contiguous()
    y = torch.empty(n, dim, dtype=torch.float32, device=state.device)
    if n == 0 or dim == 0:
        return y
    bl = pow2(span)
    bd = max(16, min(pow2(dim), 4096 // bl))  # a [BL, BD] tile of about 4k values per operand
    _pool_kernel[(n, cdiv(dim, bd))](
        st, src_slots.to(torch.int64).contiguous(), out_slots.to(torch.int64).contiguous(), y, st.stride(0),
        span, span // 2, int(offset), int(dim), OVERLAP=bool(overlap), BL=bl, BD=bd)
    return y
