"""Parallel pieces without an engine: config checks, shard loading, the collectives on 2 gloo ranks,
and the CLI."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

from shuili.core.config import EngineConfig
from shuili.core.models.deepseek_v4_config import named
from shuili.core.parallel.engine import check_fits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------- config checks
def test_sizes_that_do_not_fit_are_named_with_what_fits():
    cfg = named("tiny-v4")  # 4 heads, 2 output groups, 8 experts
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the model's o_groups \(2\).*\[1, 2\]"):
        check_fits(EngineConfig(tensor_parallel_size=4), cfg, None)
    with pytest.raises(ValueError, match=r"divisible by 3; EP sizes that fit: \[1, 2, 4, 8\]"):
        check_fits(EngineConfig(data_parallel_size=3, enable_expert_parallel=True), cfg, None)
    with pytest.raises(ValueError, match="4 ranks but this machine has 2 devices"):
        check_fits(EngineConfig(tensor_parallel_size=2, data_parallel_size=2), cfg, 2)
    check_fits(EngineConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True), cfg, 4)


def test_config_rejects_combinations_it_cannot_run():
    with pytest.raises(ValueError, match="drop --overlap"):
        EngineConfig(tensor_parallel_size=2, overlap=True)
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        EngineConfig(enable_eplb=True)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig(tensor_parallel_size=2, data_parallel_size=3).world_size == 6


# ------------------------------------------------------------------------------- shard loading
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from shuili.core.models.deepseek_v4_loader import random_params, released_tensors, save_checkpoint

    cfg = named("tiny-v4", num_nextn_predict_layers=0)
    path = str(tmp_path_factory.mktemp("ckpt"))
    save_checkpoint(path, cfg, released_tensors(cfg, random_params(cfg, seed=3, with_mtp=False)), shards=2)
    return cfg, path


def _data(v):
    return v.data if hasattr(v, "format") else v


@pytest.mark.parametrize("tp,rank,ep", [(2, 1, False), (2, 0, True), (1, 0, True)])
def test_checkpoint_shards_equal_slices_of_the_whole_model(checkpoint, tp, rank, ep, monkeypatch):
    from shuili.core.models import deepseek_v4_loader as L
    from shuili.core.parallel.eplb import Placement
    from shuili.core.parallel.sharding import ShardPlan, load_sharded, random_sharded

    cfg, path = checkpoint
    slots = Placement.contiguous(cfg.num_hidden_layers, 8, 4, redundant=4).local(rank + 1) if ep else ()
    plan = ShardPlan(cfg, tp, rank, ep, slots)
    whole_reads = []
    real_get = L.Checkpoint.get
    monkeypatch.setattr(L.Checkpoint, "get",
                        lambda self, n, *a, **k: whole_reads.append(n) or real_get(self, n, *a, **k))
    got = load_sharded(path, plan)
    want = random_sharded(plan, seed=3)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(_data(got[name]), _data(want[name])), name
    split = [n for n in whole_reads if plan.rule(n) is not None or (".experts." in n and not ep and tp > 1)]
    assert not split, f"read whole although this rank keeps a slice: {split[:3]}"
    if tp > 1:  # negative control: the shards really are slices
        assert got["layers.0.attn.wq_b.weight"].shape[0] == cfg.num_attention_heads * cfg.head_dim // tp


def test_sharded_load_refuses_tid2eid_outside_the_experts(tmp_path):
    from shuili.core.models.deepseek_v4_loader import random_params, released_tensors, save_checkpoint
    from shuili.core.parallel.sharding import ShardPlan, load_sharded

    cfg = named("tiny-v4", num_nextn_predict_layers=0)
    tensors = released_tensors(cfg, random_params(cfg, seed=3, with_mtp=False))
    tensors["layers.0.ffn.gate.tid2eid"][5, 0] = cfg.n_routed_experts  # a captured step would not see it
    save_checkpoint(str(tmp_path), cfg, tensors)
    with pytest.raises(ValueError, match=r"'layers.0.ffn.gate.tid2eid' has expert ids outside \[0, 8\)"):
        load_sharded(str(tmp_path), ShardPlan(cfg, 2, 0))


# ------------------------------------------------------------------------------- collectives
def _collective_rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from shuili.platforms.reference import collectives as C

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(5, 3, generator=g) * 1e4
    send = [2, 3] if rank == 0 else [4, 1]
    rows = torch.arange(sum(send) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    recv = C.all_to_all(torch.tensor(send), [1, 1], [1, 1]).tolist()
    out = {"recv": recv, "a2a": C.all_to_all(rows, send, recv), "sum": C.all_reduce(x), "cat": C.all_gather(x, dim=1)}
    try:
        C.all_to_all(rows, [1, 1], recv)
    except ValueError as exc:
        out["err"] = str(exc)
    # numpy arrays pickle by value; a tensor goes through shared memory that dies with this process,
    # which may exit before the parent unpickles it
    q.put((rank, {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}))
    dist.barrier()
    dist.destroy_process_group()


def test_reference_collectives_on_two_gloo_ranks():
    from shuili.core.parallel.world import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_collective_rank, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=300) for _ in ps)
    res = {r: {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in o.items()} for r, o in res.items()}
    for p in ps:
        p.join(timeout=60)
    xs = [torch.rand(5, 3, generator=torch.Generator().manual_seed(r)) * 1e4 for r in range(2)]
    rows = [torch.arange(10, dtype=torch.float32).view(-1, 2), torch.arange(10, dtype=torch.float32).view(-1, 2) + 100]
    assert res[0]["recv"] == [2, 4] and res[1]["recv"] == [3, 1]
    assert torch.equal(res[0]["a2a"], torch.cat([rows[0][:2], rows[1][:4]]))
    assert torch.equal(res[1]["a2a"], torch.cat([rows[0][2:], rows[1][4:]]))
    for r in range(2):  # rank order, bit for bit, the same on both ranks
        assert torch.equal(res[r]["sum"], xs[0] + xs[1])
        assert torch.equal(res[r]["cat"], torch.cat(xs, dim=1))
        assert "sum to x's 5 rows" in res[r]["err"]


# ------------------------------------------------------------------------------- CLI
def test_generate_with_tensor_parallel_from_the_command_line():
    from shuili.core.api import LLM
    from shuili.core.sampling_params import SamplingParams

    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "shuili", "generate", "--tensor-parallel-size", "2", "--platform", "reference",
           "--model", "tiny-v4", "--prompt", "Hello", "--max-tokens", "4", "--json", "--num-blocks", "16",
           "--threads", "1"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])["outputs"][0]["token_ids"]
    one = LLM("tiny-v4", platform="reference", num_blocks=16).generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))
    assert got == one[0].outputs[0].token_ids


def test_a_rank_runs_its_forward_with_checked_inputs():
    """A worker rank's forward runs inside hal.checks.inputs_checked (rank 0 checked the ids, the
    rank its slots and tables), so the ops may leave their device checks out; a non-lead rank
    returns nothing."""
    from types import SimpleNamespace

    from shuili.core.parallel.worker import run_step
    from shuili.hal.checks import inputs_are_checked

    seen = []

    def forward(batch):
        seen.append(inputs_are_checked())
        return torch.zeros(1, 4)

    step = SimpleNamespace(batch=None, sampling=None, prompt_idx=torch.zeros(0, dtype=torch.int64))
    runner = SimpleNamespace(device_step=lambda arrays, flags, n: step, model=SimpleNamespace(forward=forward))
    assert run_step(runner, False, ({}, {}, 0, 0)) is None
    assert seen == [True] and not inputs_are_checked()
