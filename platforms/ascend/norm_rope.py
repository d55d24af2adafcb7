"""RMSNorm, fused add + RMSNorm, rotary embedding, SwiGLU, embedding, the mHC coefficients and the
mHC stream collapse and expand."""
from __future__ import annotations

import torch

from shuili.platforms.ascend.host import on_device, on_host, took
from shuili.platforms.reference.public import check_rope_args

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """float32 SiLU. On the CPU (the simulator) torch's vectorised kernels round by position in
    the tensor, so the reference's position-independent recipe is used there; NPU vector units
    apply one instruction sequence to every element, so torch's kernel is used on the device."""
    if x.device.type == "cpu":
        from shuili.hal.numerics import silu as exact_silu

        return exact_silu(x)
    return torch.nn.functional.silu(x)


def build(api, mode) -> dict:
    npu = api.ops
    ones: dict = {}

    def _gamma(weight, x):
        if weight is not None:
            return weight.to(x.dtype)
        key = (x.shape[-1], x.dtype, x.device)
        if key not in ones:
            ones[key] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        return ones[key]

    def rms_norm(x, weight, eps):
        if x.dtype not in FLOATS:
            raise TypeError(f"rms_norm needs a float input, got {x.dtype}")
        took("rms_norm:npu_rms_norm")
        return npu.npu_rms_norm(input=x, gamma=_gamma(weight, x), epsilon=float(eps))[0]

    def add_rms_norm(x, residual, weight, eps):
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError(f"add_rms_norm: residual {residual.dtype}{tuple(residual.shape)} must "
                             f"match x {x.dtype}{tuple(x.shape)}")
        if mode.batch_invariant:
            # the fused kernel's tiling is not documented as row-independent: split it
            took("add_rms_norm:add+npu_rms_norm")
            s = x + residual
            return rms_norm(s, weight, eps), s
        took("add_rms_norm:npu_add_rms_norm")
        y, _, s = npu.npu_add_rms_norm(x1=x, x2=residual, gamma=_gamma(weight, x), epsilon=float(eps))
        return y, s

    def rope(x, positions, cos, sin, rope_dim, interleaved=True, inverse=False):
        t, d, _ = check_rope_args(x, cos, sin, rope_dim)
        h = x.shape[1]
        if sin.shape != cos.shape:  # the fused op takes one table shape for both
            raise ValueError(f"cos/sin tables {tuple(cos.shape)} and {tuple(sin.shape)} must match")
        pos = positions.to(torch.int64)
        c, s = cos[pos], sin[pos]
        if inverse:
            s = -s
        if interleaved:
            r1, r2, mode_ = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1), "interleave"
        else:
            r1, r2, mode_ = torch.cat((c, c), -1), torch.cat((s, s), -1), "half"
        r1 = r1.to(x.dtype).view(1, t, 1, rope_dim)
        r2 = r2.to(x.dtype).view(1, t, 1, rope_dim)
        xr = x[..., d - rope_dim:].unsqueeze(0).contiguous()  # [1, T, H, rope_dim] (BSND)
        took("rope:npu_rotary_mul")
        y = npu.npu_rotary_mul(input=xr, r1=r1, r2=r2, rotary_mode=mode_).squeeze(0)
        if rope_dim == d:
            return y
        return torch.cat((x[..., : d - rope_dim], y), dim=-1)

    def swiglu(gate_up, limit=None):
        if limit is None and gate_up.dtype in FLOATS:
            took("swiglu:npu_swiglu")
            return npu.npu_swiglu(input=gate_up, dim=-1)
        # npu_clipped_swiglu is the gpt-oss variant (alpha, +1 bias): not this formula
        took("swiglu:torch")
        g, u = gate_up.to(torch.float32).chunk(2, dim=-1)
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
        return (silu(g) * u).to(gate_up.dtype)

    def embedding(ids, table):
        v = table.shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
            raise ValueError(f"token ids outside [0, {v}): min {int(ids.min())}, max {int(ids.max())}")
        took("embedding:torch")
        return torch.nn.functional.embedding(ids.to(torch.int64), table)

    # torch's softmax / sum kernels pick code paths by tensor size, so an on-device torch version
    # is not batch-invariant (the conformance suite caught it); the reference's fixed-tree
    # numerics run on the host instead. Small: [T, m(m+2)] per layer.
    hc_split_sinkhorn = on_host("hc_split_sinkhorn")
    engram_gate = on_host("engram_gate")

    # no torch_npu op collapses or expands the mHC streams: the reference's torch code, on the device
    # (what the model ran inline before HAL 1.6). Products and adds of slices only, no reduction
    # kernel, so unlike the coefficients above it is row-local on any device; the streams stay on the NPU
    hc_collapse = on_device("hc_collapse")
    hc_expand = on_device("hc_expand")

    return {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope": rope, "swiglu": swiglu,
            "embedding": embedding, "hc_split_sinkhorn": hc_split_sinkhorn,
            "engram_gate": engram_gate, "hc_collapse": hc_collapse, "hc_expand": hc_expand}
