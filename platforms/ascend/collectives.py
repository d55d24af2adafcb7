"""all_reduce / all_gather over torch.distributed with the hccl backend.

Deterministic or batch-invariant mode sums in a fixed rank order (all_gather, then rank 0 + 1 +
...), independent of HCCL's reduction algorithm; otherwise a plain HCCL all_reduce (run-to-run
deterministic only with HCCL_DETERMINISTIC=true, set by `device.apply_determinism`).
"""
from __future__ import annotations

import torch

from shuili.platforms.ascend.host import took


def _world(group) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def build(api, mode) -> dict:
    fixed_order = mode.deterministic or mode.batch_invariant

    def all_gather(x, group=None, dim=0):
        n = _world(group)
        if n == 1:
            return x
        import torch.distributed as dist

        took("all_gather:hccl")
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    def all_reduce(x, group=None):
        n = _world(group)
        if n == 1:
            return x
        import torch.distributed as dist

        if fixed_order:
            took("all_reduce:gather+ordered_sum")
            parts = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(parts, x.contiguous(), group=group)
            out = parts[0].clone()
            for p in parts[1:]:
                out += p
            return out
        took("all_reduce:hccl")
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    def all_to_all(x, send_counts, recv_counts, group=None):
        # torch.distributed.all_to_all_single over HCCL (no torch_npu op: the fused
        # npu_alltoallv_gmm / npu_gmm_alltoallv of torch_npu_schemas.txt are a later optimisation)
        from shuili.hal import distributed

        return distributed.all_to_all(x, send_counts, recv_counts, group, _world(group),
                                      on_exchange=lambda: took("all_to_all:hccl"))

    return {"all_reduce": all_reduce, "all_gather": all_gather, "all_to_all": all_to_all}
