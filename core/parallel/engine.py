"""ParallelEngine: `Engine` on rank 0 of a TP x DP world, one Scheduler (and KV manager) per DP group.

Start-up: spawn the worker ranks (or, under torchrun, join the world; ranks != 0 serve and exit),
load this rank's model shard, size the KV cache as one rank does, tell the workers, wait for
every rank to be ready. A step: schedule each DP group, broadcast every group's host arrays, run
group 0 here, gather the other groups' results, update each group's scheduler. Overlap mode and
decode graphs are off. A rank that dies fails the engine with `WorkerDied` (the liveness check
before each step, or the collective that saw the closed connection); nothing waits forever.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import sys
import time

import torch

from shuili.core.config import EngineConfig
from shuili.core.engine import Engine
from shuili.core.kv_cache import KVCacheManager
from shuili.core.parallel.world import World, WorkerDied, free_port, init_world, torchrun_env
from shuili.core.parallel.worker import RankRuntime, run_step, worker_main
from shuili.core.request import Request
from shuili.core.scheduler import Scheduler, StepOutput
from shuili.hal import resolve_platform
from shuili.hal.distributed import device_count

log = logging.getLogger("shuili.parallel")


def check_fits(config: EngineConfig, cfg, device_count: int | None) -> None:
    """Clear errors for sizes the model or the machine cannot take, naming what fits."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    world = tp * dp

    def fits(n: int) -> list[int]:
        return [d for d in range(1, n + 1) if n % d == 0]

    checks = [("num_attention_heads", cfg.num_attention_heads), ("o_groups", cfg.o_groups),
              ("vocab_size", cfg.vocab_size)]
    if not config.enable_expert_parallel:
        checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    if getattr(cfg, "engram_layer_ids", ()):  # V4.1: Engram's wkv outputs are split by TP
        checks.append(("Engram wkv width (hc_mult + 1) * hidden_size", (cfg.hc_mult + 1) * cfg.hidden_size))
    for name, n in checks:
        if n % tp:
            ok = [d for d in fits(cfg.o_groups) if cfg.num_attention_heads % d == 0 and cfg.vocab_size % d == 0]
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {name} ({n}); "
                             f"tensor_parallel_size values that fit: {ok}")
    if config.enable_expert_parallel:
        slots = cfg.n_routed_experts + config.num_redundant_experts
        if slots % world:
            raise ValueError(f"expert parallel over {world} ranks (TP {tp} x DP {dp}) needs n_routed_experts "
                             f"({cfg.n_routed_experts}) + num_redundant_experts ({config.num_redundant_experts})"
                             f" divisible by {world}; EP sizes that fit: {fits(slots)}")
    if device_count is not None and world > device_count:
        raise ValueError(f"TP {tp} x DP {dp} = {world} ranks but this machine has {device_count} devices; use "
                         f"at most {device_count} ranks here, or launch on several nodes with torchrun "
                         "(docs/parallel.md)")


class ParallelEngine(Engine):
    def __init__(self, config: EngineConfig, model=None):
        if model is not None:
            raise ValueError("the parallel engine loads its model shard by shard; pass a model name or a "
                             "checkpoint directory, not a model object")
        from shuili.core.models import V4_NAMES

        from shuili.core.parallel.model_v41 import is_v41, v41_config

        platform = resolve_platform(config.platform)
        if is_v41(config.model):
            check_fits(config, v41_config(config.model), device_count(platform.device))
        elif config.model in V4_NAMES:
            from shuili.core.models.deepseek_v4_config import named

            check_fits(config, named(config.model), device_count(platform.device))
        elif os.path.isdir(config.model):
            from shuili.core.models.deepseek_v4_loader import read_config

            check_fits(config, read_config(config.model), device_count(platform.device))
        self.world = self._start(config, platform.device)
        self.failed: str | None = None
        super().__init__(config, model=self._rank_model)
        kv = [KVCacheManager(self.kv.groups, self.pool_blocks, self.P, config.enable_prefix_caching)
              for _ in range(1, config.data_parallel_size)]
        self.schedulers = [self.scheduler] + [
            Scheduler(k, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.policy,
                      self.eos, self.tokenizer.decode) for k in kv]
        self._control(("init", (self.pool_blocks, self.P)))
        self._collect("ready")
        from shuili.core.parallel.kv_tiers_dp import attach_dp_tiers

        self.dp_tiers = attach_dp_tiers(self)  # every DP group: its host pool, the shared store
        atexit.register(self.close)

    # ------------------------------------------------------------------------ start-up
    def _start(self, config: EngineConfig, device: str) -> World:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("this process already belongs to a parallel engine (torch.distributed is "
                               "initialised); close() that engine before starting another")
        env = torchrun_env()
        size = config.world_size
        if env is not None:
            rank, n = env
            if n != size:
                raise ValueError(f"torchrun started {n} ranks but TP {config.tensor_parallel_size} x DP "
                                 f"{config.data_parallel_size} = {size}; pass --nproc-per-node x --nnodes = {size}")
            world = init_world(rank, size, config.tensor_parallel_size, config.data_parallel_size,
                               config.enable_expert_parallel, device, config.distributed_timeout_s, "env://")
            if rank != 0:  # a torchrun worker serves rank 0 and leaves with it
                try:
                    RankRuntime(config, world).serve()
                finally:
                    world.shutdown()
                sys.exit(0)
            return world
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = []
        if size > 1:
            ctx = mp.get_context("spawn")
            for r in range(1, size):
                p = ctx.Process(target=worker_main, daemon=True, name=f"shuili-rank{r}",
                                args=(r, size, init, config.model_dump_json(), torch.get_num_threads()))
                p.start()
                procs.append(p)
        try:
            world = init_world(0, size, config.tensor_parallel_size, config.data_parallel_size,
                               config.enable_expert_parallel, device, config.distributed_timeout_s, init)
        except Exception as exc:  # a worker that died before joining: name it, not the store timeout
            dead = [(r + 1, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None]
            for p in procs:
                p.terminate()
            if dead:
                raise WorkerDied(f"parallel workers {dead} (rank, exit code) died while starting; see their "
                                 "errors above") from exc
            raise
        world.procs = procs
        return world

    def _rank_model(self, ops, device, dtype, seed):
        from shuili.core.parallel.model import load_rank_model

        c = self.config
        model = load_rank_model(c.model, ops, self.world.groups, c.enable_expert_parallel, c.num_redundant_experts,
                                device, dtype, seed)
        if c.kv_store:  # the engine builds it from a name, so the KV store may identify its weights
            from shuili.core.kv_tiers.fingerprint import weights_id

            model.kv_fingerprint = weights_id(c.model, c.seed)
        return model

    # ------------------------------------------------------------------------ control plane
    def _guard(self, fn, *args):
        if self.failed:
            raise WorkerDied(self.failed)
        try:
            self.world.check_alive()
            return fn(*args)
        except WorkerDied as exc:
            self.failed = str(exc)
            raise
        except Exception as exc:  # a collective saw a closed connection or timed out
            deadline = time.monotonic() + 5.0  # the dead process's exit code lands within moments
            while time.monotonic() < deadline:
                try:
                    self.world.check_alive()
                except WorkerDied as died:
                    self.failed = str(died)
                    raise died from exc
                if not self.world.procs:
                    break
                time.sleep(0.05)
            self.failed = (f"a parallel collective failed ({type(exc).__name__}: {str(exc)[:300]}); a rank "
                           "died or stopped answering within distributed_timeout_s; the engine stopped")
            raise WorkerDied(self.failed) from exc

    def _control(self, msg):
        return self._guard(self.world.broadcast, msg)

    def _collect(self, obj):
        return self._guard(self.world.gather, obj)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        world = getattr(self, "world", None)
        if world is None:
            return
        self.world = None
        if not self.failed and world.size > 1:
            try:
                world.broadcast(("stop",))
            except Exception:
                pass
        world.shutdown()

    # ------------------------------------------------------------------------ requests
    def add_request(self, *args, **kwargs) -> Request:
        # the DP group with the fewest unfinished requests (ties: the lowest group)
        d = min(range(len(self.schedulers)), key=lambda i: (len(self.schedulers[i].requests), i))
        self.scheduler = self.schedulers[d]
        try:
            return super().add_request(*args, **kwargs)
        finally:
            self.scheduler = self.schedulers[0]

    def abort(self, request_id: str):
        for s in self.schedulers:
            if request_id in s.requests:
                req = s.abort(request_id)
                return None if req is None else self.output(req)
        return None

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    # ------------------------------------------------------------------------ step
    def step_requests(self) -> list[Request]:
        if self.failed:
            raise WorkerDied(self.failed)
        self.num_steps += 1
        t0 = time.thread_time()
        outs = [s.schedule() for s in self.schedulers]
        self.schedule_seconds += time.thread_time() - t0
        if not any(outs):
            return []
        hosts = [self.runner.host_inputs(o) for o in outs]
        payload = [(arrays, flags, len(o.chunks), max((r.req.params.top_logprobs for r in h.sample_rows), default=0))
                   for o, (h, arrays, flags) in zip(outs, hosts)]
        try:
            for m in self.remote_movers:  # hits copied into other DP groups' caches, before the step
                m.flush()
            self._control(("step", payload))
            mine = self._guard(run_step, self.runner, True, payload[0])
            results = self._collect(mine)
        except WorkerDied as exc:  # the step's requests end with the error; the engine stays failed
            for s, o in zip(self.schedulers, outs):
                if o:
                    s.fail(o, str(exc))
            raise
        touched: list[Request] = []
        for d, (o, (h, _, _)) in enumerate(zip(outs, hosts)):
            if not o:
                continue
            tokens, logprobs, bad, prompt_lp, top = results[d * self.world.tp]
            touched += self.schedulers[d].update(o, StepOutput(
                rows=h.sample_rows, tokens=tokens, logprobs=logprobs, bad=bad, prompt_rows=h.prompt_rows,
                prompt_logprobs=prompt_lp, top=top))
        if self.config.enable_eplb and self.num_steps % self.config.eplb_step_interval == 0:
            self.rebalance()
        return touched

    # ------------------------------------------------------------------------ EPLB
    def expert_load(self) -> torch.Tensor:
        """int64 [L, E]: pairs routed to each expert on all ranks since the last call (counters reset)."""
        self._control(("load",))
        mine = self.model.expert_load.cpu()
        self.model.expert_load.zero_()
        return sum(self._collect(mine))

    def rebalance(self, placement=None):
        """Plan a placement from the routing load (or apply the one given) and move the experts;
        between steps, so no request sees a half-moved layer. Returns the placement."""
        from shuili.core.parallel import eplb
        from shuili.core.parallel.rebalance import apply_placement

        if not self.config.enable_expert_parallel:
            raise ValueError("rebalancing needs enable_expert_parallel")
        if placement is None:
            cur = self.model.placement
            placement = eplb.plan(self.expert_load(), cur.ranks, cur.slots_per_rank)
        self._control(("experts", placement))
        self._guard(apply_placement, self.model, placement, self.world.groups)
        return placement
