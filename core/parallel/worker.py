"""One rank's side of a parallel step, and the loop a worker rank runs.

Rank 0 (the engine) schedules every DP group, builds each group's step inputs as host arrays
(`ModelRunner.host_inputs`) and broadcasts them; every rank runs its group's inputs through its
shard of the model (the collectives inside tie the ranks together); the first rank of each TP
group samples (its logits are the gathered, whole-vocabulary ones) and its results are gathered
back to rank 0, which hands them to that group's scheduler. Messages on the control group:
("init", (pool blocks, tokens per block)), ("step", [payload per DP group]), ("experts", placement),
("kv_read" / "kv_write", DP group, blocks) (core/parallel/kv_tiers_dp.py), ("stop",).
"""
from __future__ import annotations

import logging
import os
import sys

import torch

from shuili.hal.checks import inputs_checked

log = logging.getLogger("shuili.parallel")


def run_step(runner, lead: bool, payload):
    """payload: (arrays, flags, num_chunks, top_k) of this rank's DP group -> host results
    (tokens, logprobs, bad, prompt_logprobs, top) on a TP group's first rank, else None."""
    arrays, flags, n, top_k = payload
    step = runner.device_step(arrays, flags, n)
    with inputs_checked():  # rank 0 checked the ids on the host, this rank its slots and tables
        logits = runner.model.forward(step.batch)  # every rank runs it: the collectives need all
    if not lead:
        return None
    tokens, logprobs, bad, prompt_lp, top = [], [], [], [], None
    if step.sampling is not None:
        rows = logits[step.sample_idx]
        s = runner.sampler(rows, step.sampling)
        tokens, logprobs, bad = s.tokens.tolist(), s.logprobs.tolist(), s.bad.tolist()
        t = runner.sampler.top_logprobs(rows, top_k)
        if t is not None:
            top = [list(zip(i, v)) for i, v in zip(t[0].tolist(), t[1].tolist())]
    if step.prompt_idx.numel():
        lp = runner.ops.log_softmax(logits[step.prompt_idx])
        prompt_lp = lp.gather(1, step.prompt_targets[:, None])[:, 0].tolist()
    return tokens, logprobs, bad, prompt_lp, top


def check_step_inputs(arrays: dict, num_blocks: int | dict[str, int], P: int) -> None:
    """A rank's integrity check of what it was sent: every slot and block id fits its caches.
    num_blocks: one count for every group, or per group name (core/kv_sizing.py)."""
    for name, (vals, _) in arrays.items():
        if not name.startswith(("slots.", "table.")):
            continue
        group = name.split(".", 1)[1]
        n = num_blocks[group] if isinstance(num_blocks, dict) else num_blocks
        if name.startswith("slots.") and vals and not -1 <= max(vals) < n * P:
            raise RuntimeError(f"step input {name} holds slot {max(vals)} outside the {n * P} slots")
        if name.startswith("table.") and vals and not -1 <= max(vals) < n:
            raise RuntimeError(f"step input {name} holds block {max(vals)} outside the {n} blocks")


class RankRuntime:
    """A worker rank: its platform, model shard and runner; `serve` answers rank 0 until stop."""

    def __init__(self, config, world):
        from shuili.core.parallel.model import load_rank_model
        from shuili.hal import resolve_platform

        self.config, self.world = config, world
        self.platform = resolve_platform(config.platform)
        self.model = load_rank_model(config.model, self.platform.ops, world.groups, config.enable_expert_parallel,
                                     config.num_redundant_experts, self.platform.device, config.dtype, config.seed)
        self.runner = None

    def serve(self) -> None:
        from shuili.core.runner import ModelRunner

        w = self.world
        while True:
            msg = w.broadcast()
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "init":
                num_blocks, self.P = msg[1]
                groups = self.model.cache_groups()
                if hasattr(self.model, "attach_transfer"):
                    self.model.attach_transfer(self.platform.transfer)
                self.runner = ModelRunner(self.model, self.platform.ops, groups, num_blocks,
                                          self.P, self.platform.device, None, self.platform.transfer)
                self.num_blocks = num_blocks
                w.gather("ready")
            elif kind == "step":
                payload = msg[1][w.dp_rank]
                check_step_inputs(payload[0], self.num_blocks, self.P)
                w.gather(run_step(self.runner, w.tp_rank == 0, payload))
            elif kind == "experts":
                from shuili.core.parallel.rebalance import apply_placement

                apply_placement(self.model, msg[1], self.world.groups)
            elif kind in ("kv_read", "kv_write"):  # KV tiers of a DP group (core/parallel/kv_tiers_dp.py)
                from shuili.core.parallel.kv_tiers_dp import serve_kv

                serve_kv(self, msg)
            elif kind == "load":
                w.gather(self.model.expert_load.cpu())
                self.model.expert_load.zero_()
            else:
                raise RuntimeError(f"unknown control message {kind!r}")


def worker_main(rank: int, size: int, init_method: str, config_json: str, threads: int) -> None:
    """Entry point of a worker process started by the engine (multiprocessing spawn)."""
    from shuili.core.config import EngineConfig
    from shuili.core.parallel.world import init_world

    torch.set_num_threads(threads)
    config = EngineConfig.model_validate_json(config_json)
    from shuili.hal import resolve_platform

    device = resolve_platform(config.platform).device
    world = init_world(rank, size, config.tensor_parallel_size, config.data_parallel_size,
                       config.enable_expert_parallel, device, config.distributed_timeout_s, init_method)
    try:
        RankRuntime(config, world).serve()
    except Exception:
        log.exception("parallel worker rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)  # a worker that cannot go on leaves at once: rank 0's next collective fails fast
