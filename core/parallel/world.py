"""The ranks of a parallel engine: torch.distributed process groups, started by shuili (spawn) or
adopted from torchrun's environment, and the checks that fail the engine fast when a rank dies.

Layout: rank = dp_rank * tp + tp_rank (TP innermost, as vLLM), so a TP group is contiguous and,
with TP <= the GPUs of a node, never crosses a node. Data groups use the platform's backend
(gloo on the CPU, NCCL on CUDA, HCCL on Ascend) with `distributed_timeout_s`; the control group
(step broadcasts) is gloo with a long timeout, because a worker waits there while the engine is
idle. A dead peer closes its sockets, so gloo fails the next collective at once; a stuck one
fails after the timeout.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

from shuili.core.parallel.model import Groups
from shuili.hal.distributed import backend_for, bind_device

log = logging.getLogger("shuili.parallel")

IDLE_TIMEOUT = timedelta(days=7)  # the control group: workers wait there between requests

class WorkerDied(RuntimeError):
    """A rank of the parallel engine exited or stopped answering; the engine cannot go on."""

@dataclass
class World:
    rank: int
    size: int
    tp: int
    dp: int
    groups: Groups
    control: object  # gloo group over every rank (broadcast of step inputs, gather of results)
    procs: list = field(default_factory=list)  # spawned workers (rank 0 of a spawned engine only)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    # ------------------------------------------------------------------ control plane
    def broadcast(self, obj=None):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj):
        """Rank 0: every rank's obj in rank order; other ranks: None."""
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def check_alive(self) -> None:
        """Raise WorkerDied naming every spawned worker that has exited."""
        dead = [(r + 1, p.pid, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
        if dead:
            names = ", ".join(f"rank {r} (pid {pid}, exit code {code})" for r, pid, code in dead)
            raise WorkerDied(f"parallel worker {names} died; the engine stopped. Check the worker's log "
                             "above (out of memory, a crash) and start the engine again")

    def shutdown(self) -> None:
        import torch.distributed as dist

        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
        self.procs = []
        if dist.is_initialized():
            dist.destroy_process_group()

def init_world(rank: int, size: int, tp: int, dp: int, expert_parallel: bool, device: str,
               timeout_s: float, init_method: str | None) -> World:
    """init_process_group plus the TP groups (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    backend = backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    bind_device(device, int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
    tp_group = None
    for d in range(dp):
        ranks = list(range(d * tp, (d + 1) * tp))
        g = dist.new_group(ranks, backend=backend, timeout=timeout) if tp > 1 else None
        if rank in ranks:
            tp_group = g
    groups = Groups(tp=tp, tp_rank=rank % tp, tp_group=tp_group,
                    ep=size if expert_parallel else 1, ep_rank=rank if expert_parallel else 0,
                    ep_group=None)  # None = the world: EP spans every rank
    return World(rank, size, tp, dp, groups, control)

def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun (or any launcher setting the env:// variables)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
