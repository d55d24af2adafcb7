"""KV-tier configuration, CLI flags, bench output and server metrics."""
from __future__ import annotations

import json

import pytest

from shuili.cli import main
from shuili.core.config import EngineConfig

BASE = ["--platform", "reference", "--model", "tiny-v4", "--max-num-batched-tokens", "64", "--threads", "1"]


def test_config_reads_sizes_and_durations():
    c = EngineConfig(kv_host_bytes="8G", kv_store="/tmp/x", kv_store_ttl="72h", kv_store_bytes="500G")
    assert (c.kv_host_bytes, c.kv_store_ttl, c.kv_store_bytes) == (8 << 30, 259200.0, 500 << 30)
    assert EngineConfig().kv_store_ttl == 72 * 3600 and EngineConfig().kv_host_bytes == 0
    with pytest.raises(ValueError, match="kv_store_ttl"):
        EngineConfig(kv_store_ttl="3 fortnights")
    with pytest.raises(ValueError, match="kv_host_bytes"):
        EngineConfig(kv_host_bytes="-1")
    with pytest.raises(ValueError, match="kv_store_ttl"):
        EngineConfig(kv_store_ttl=0)


def test_tiers_need_the_prefix_cache():
    from shuili import LLM

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model="tiny-v4", platform="reference", enable_prefix_caching=False, kv_host_bytes=1 << 20)


def test_bench_reports_hits_per_tier_across_restarts(tmp_path, capsys):
    args = ["bench", *BASE, "--num-prompts", "2", "--input-len", "40", "--output-len", "2",
            "--kv-store", str(tmp_path / "s"), "--kv-store-ttl", "1h", "--kv-store-bytes", "1G",
            "--kv-host-bytes", "16M", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["kv_hit_tokens_disk"] == 0 and first["kv_store_writes"] > 0
    assert main(args) == 0  # a new engine, the same prompts: the store answers their prefixes
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["kv_hit_tokens_disk"] == 2 * 32 and second["errors"] == 0


def test_metrics_export_hits_per_tier():
    from shuili.core.server.metrics import ServerMetrics

    m = ServerMetrics("tiny-v4")
    state = {"running": 0, "waiting": 0, "kv": {}, "prefix_queried_tokens": 100, "prefix_hit_tokens": 80,
             "kv_tier_hit_tokens": {"device": 16, "host": 32, "disk": 32},
             "kv_tier_bytes": {"host_to_device": 1000}}
    m.render(state)
    state["kv_tier_hit_tokens"] = {"device": 16, "host": 48, "disk": 32}
    text = m.render(state).decode()
    assert 'shuili_kv_tier_hit_tokens_total{model_name="tiny-v4",tier="host"} 48.0' in text
    assert 'shuili_kv_tier_hit_tokens_total{model_name="tiny-v4",tier="disk"} 32.0' in text
    assert 'shuili_kv_tier_bytes_total{direction="host_to_device",model_name="tiny-v4"} 1000.0' in text


def test_server_state_carries_the_tier_counters(tmp_path):
    from types import SimpleNamespace

    from shuili import LLM, SamplingParams
    from shuili.core.server.app import Server
    from shuili.core.server.metrics import ServerMetrics

    llm = LLM(model="tiny-v4", platform="reference", kv_host_bytes="8M", max_num_seqs=2)
    ids = list(range(1, 40))
    llm.generate([ids], SamplingParams(max_tokens=1))
    llm.engine.kv_tiers.evict_device_cache(llm.engine.kv)
    llm.generate([ids], SamplingParams(max_tokens=1))
    stub = SimpleNamespace(engine=llm.engine, loop=SimpleNamespace(num_waiting=lambda: 0, num_in_flight=lambda: 0))
    state = Server.state(stub)
    assert state["kv_tier_hit_tokens"] == {"device": 0, "host": 32, "disk": 0}
    assert state["kv_tier_bytes"]["host_to_device"] > 0
    text = ServerMetrics("tiny-v4").render(state).decode()
    assert 'shuili_kv_tier_hit_tokens_total{model_name="tiny-v4",tier="host"} 32.0' in text
