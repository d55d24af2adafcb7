"""Discovery, selection, version handshake, duplicates, missing ops, the example plugin."""
from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys

import pytest

from shuili.hal import (
    HAL_API_VERSION, Availability, DeterminismLevel, DuplicatePlatformError, HALError,
    IncompatiblePluginError, MissingOpError, OpCapability, PlatformCapabilities, PlatformConfig,
    PlatformInfo, PlatformUnavailableError, list_platforms, resolve_platform,
)
from shuili.hal.hookspecs import hookimpl
from shuili.hal.ops import OP_NAMES, DispatchTable


class FakePlatform:
    """An in-process plugin; each test tweaks one attribute."""

    def __init__(self, name="fake", priority=5, version=HAL_API_VERSION, available=True,
                 ops=None, fallback_ops=(), reason="ok"):
        self.name, self.priority, self.version = name, priority, version
        self.available, self.reason = available, reason
        from shuili.platforms.reference.ops import OPS

        self.ops = dict(OPS) if ops is None else ops
        self.fallback_ops = tuple(fallback_ops)

    @hookimpl
    def shuili_platform_info(self):
        return PlatformInfo(name=self.name, vendor="test", priority=self.priority,
                            hal_api_version=self.version)

    @hookimpl
    def shuili_platform_probe(self, platform):
        if platform != self.name:
            return None
        return Availability(available=self.available, reason=self.reason)

    @hookimpl
    def shuili_platform_capabilities(self, platform, config):
        if platform != self.name:
            return None
        return PlatformCapabilities(
            ops={n: OpCapability(determinism=DeterminismLevel.run_to_run) for n in self.ops},
            fallback_ops=self.fallback_ops)

    @hookimpl
    def shuili_platform_ops(self, platform, config):
        return self.ops if platform == self.name else None


def names(disc):
    return {e.name: e for e in disc.entries}


def test_builtins_and_entry_point_plugins_are_discovered():
    found = names(list_platforms())
    assert {"reference", "nvidia", "ascend", "example"} <= set(found)
    assert found["reference"].usable
    assert not found["nvidia"].usable and "CUDA" in found["nvidia"].availability.reason
    assert not found["ascend"].usable and "torch_npu" in found["ascend"].availability.reason
    assert found["example"].plugin == "example"


def test_auto_picks_highest_priority_available_and_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="shuili.hal"):
        plat = resolve_platform(PlatformConfig(platform="auto"))
    assert plat.name == "reference"  # nvidia/ascend unavailable; example has priority -10
    assert "highest priority" in plat.reason and "nvidia" in plat.reason
    assert any("reference selected" in r.getMessage() for r in caplog.records)
    plat = resolve_platform(PlatformConfig(), extra_plugins={"fake": FakePlatform(priority=50)})
    assert plat.name == "fake"


def test_auto_skips_unavailable_even_with_higher_priority():
    fake = FakePlatform(priority=500, available=False, reason="no widget attached")
    plat = resolve_platform(PlatformConfig(), extra_plugins={"fake": fake})
    assert plat.name == "reference" and "no widget attached" in plat.reason


def test_auto_refuses_a_tie_in_priority():
    a, b = FakePlatform("a", priority=7), FakePlatform("b", priority=7)
    with pytest.raises(DuplicatePlatformError, match="ambiguous"):
        resolve_platform(PlatformConfig(), extra_plugins={"a": a, "b": b})


def test_explicit_unavailable_lists_every_platform_with_its_reason():
    with pytest.raises(PlatformUnavailableError) as exc:
        resolve_platform(PlatformConfig(platform="nvidia"))
    msg = str(exc.value)
    assert "nvidia" in msg and "CUDA" in msg and "reference" in msg and "torch_npu" in msg


def test_unknown_platform_names_the_installed_ones():
    with pytest.raises(PlatformUnavailableError, match="unknown platform 'tpu'") as exc:
        resolve_platform(PlatformConfig(platform="tpu"))
    assert "reference" in str(exc.value)


@pytest.mark.parametrize("mode", ["reference", "auto"])
def test_two_plugins_claiming_one_name_is_an_error(mode):
    impostor = FakePlatform(name="reference", priority=1)
    with pytest.raises(DuplicatePlatformError, match="claimed by plugins"):
        resolve_platform(PlatformConfig(platform=mode), extra_plugins={"impostor": impostor})
    entries = [e for e in list_platforms(extra_plugins={"impostor": impostor}).entries
               if e.name == "reference"]
    assert len(entries) == 2 and all(not e.usable for e in entries)


def test_plugin_for_another_hal_major_is_refused():
    old = FakePlatform(name="old", version="2.3")
    with pytest.raises(IncompatiblePluginError, match="built for HAL API 2.3"):
        resolve_platform(PlatformConfig(platform="old"), extra_plugins={"old": old})
    entry = names(list_platforms(extra_plugins={"old": old}))["old"]
    assert not entry.usable and "HAL API 2.3" in entry.availability.reason
    # never chosen by auto either, whatever its priority
    old.priority = 10_000
    assert resolve_platform(PlatformConfig(), extra_plugins={"old": old}).name == "reference"


def test_newer_minor_is_accepted():
    major = HAL_API_VERSION.split(".")[0]
    plat = resolve_platform(PlatformConfig(platform="fake"),
                            extra_plugins={"fake": FakePlatform(version=f"{major}.99")})
    assert plat.name == "fake"


def test_missing_undeclared_op_fails_at_resolve_time():
    fake = FakePlatform()
    del fake.ops["paged_attention"]
    with pytest.raises(MissingOpError, match="paged_attention"):
        resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": fake})


def test_declared_fallback_is_logged_and_recorded(caplog):
    fake = FakePlatform(fallback_ops=["paged_attention"])
    del fake.ops["paged_attention"]
    with caplog.at_level(logging.WARNING, logger="shuili.hal"):
        plat = resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": fake})
    assert plat.fallbacks == ("paged_attention",)
    assert plat.ops.sources["paged_attention"] == "reference"
    assert plat.ops.sources["linear"] == "fake"
    assert "reference fallback" in plat.capabilities.ops["paged_attention"].notes
    assert any("paged_attention" in r.getMessage() for r in caplog.records)
    with pytest.raises(MissingOpError, match="forbids fallbacks"):
        resolve_platform(PlatformConfig(platform="fake", allow_reference_fallback=False),
                         extra_plugins={"fake": fake})


def test_wrong_op_signature_is_refused():
    def rms_norm(x, w, epsilon):  # contract says (x, weight, eps)
        return x

    fake = FakePlatform()
    fake.ops["rms_norm"] = rms_norm
    with pytest.raises(HALError, match="rms_norm"):
        resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": fake})


def test_op_outside_the_contract_is_refused():
    fake = FakePlatform()
    fake.ops["flash_magic"] = lambda x: x
    with pytest.raises(HALError, match="flash_magic"):
        resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": fake})


def test_hookimpl_typo_is_caught_by_check_pending():
    class Typo(FakePlatform):
        @hookimpl
        def shuili_platform_prob(self, platform):  # misspelt hook name
            return None

    disc = list_platforms(extra_plugins={"typo": Typo(name="typo")})
    assert "typo" in disc.broken and "unknown hook" in disc.broken["typo"]
    assert "typo" not in names(disc)


def test_broken_entry_point_is_reported_not_fatal(monkeypatch):
    real = importlib.metadata.entry_points

    def fake_entry_points(group=None, **kw):
        eps = list(real(group=group, **kw))
        bad = importlib.metadata.EntryPoint("vendorx", "vendorx_not_installed.plugin", group)
        return eps + [bad]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    disc = list_platforms()
    assert "vendorx" in disc.broken and "ModuleNotFoundError" in disc.broken["vendorx"]
    assert resolve_platform(PlatformConfig(platform="reference")).name == "reference"


def test_dispatch_table_is_frozen_and_holds_plain_callables():
    fake = FakePlatform()
    plat = resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": fake})
    assert isinstance(plat.ops, DispatchTable)
    for name in OP_NAMES:
        assert plat.ops.get(name) is fake.ops[name]  # the plugin's own function, no pluggy wrapper
    with pytest.raises(AttributeError):
        plat.ops.rms_norm = None


def test_example_plugin_overrides_three_ops_and_falls_back_for_the_rest():
    plat = resolve_platform(PlatformConfig(platform="example"))
    overridden = {n for n, s in plat.ops.sources.items() if s == "example"}
    assert overridden == {"rms_norm", "swiglu", "linear"}
    assert set(plat.fallbacks) == set(OP_NAMES) - overridden
    assert plat.capabilities.determinism("rms_norm") == DeterminismLevel.run_to_run


def test_cli_platforms_json_reports_availability_and_reasons():
    out = subprocess.run([sys.executable, "-m", "shuili", "platforms", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    rows = {r["name"]: r for r in data["platforms"]}
    assert rows["reference"]["available"] is True
    assert rows["reference"]["capabilities"]["ops"] == len(OP_NAMES)
    for name in ("nvidia", "ascend"):
        assert rows[name]["available"] is False and rows[name]["reason"]
    assert data["hal_api_version"] == HAL_API_VERSION


def test_platform_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="extra"):
        PlatformConfig(platfrom="reference")


class GraphPlatform(FakePlatform):
    """A fake platform with the optional graph-capture hook (HAL 1.1)."""

    def __init__(self, capture, declares=True, **kw):
        super().__init__(**kw)
        self.capture, self.declares = capture, declares

    @hookimpl
    def shuili_platform_capabilities(self, platform, config):
        caps = super().shuili_platform_capabilities(platform, config)
        return None if caps is None else caps.model_copy(update={"graph_capture": self.declares})

    @hookimpl
    def shuili_platform_graph_capture(self, platform, config):
        return self.capture if platform == self.name else None


def test_graph_capture_hook_is_optional_and_checked():
    def capture(fn):
        return fn

    assert resolve_platform(PlatformConfig(platform="reference")).capture_graph is None
    plat = resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": GraphPlatform(capture)})
    assert plat.capture_graph is capture
    with pytest.raises(HALError, match="declares graph_capture=False"):
        resolve_platform(PlatformConfig(platform="fake"),
                         extra_plugins={"fake": GraphPlatform(capture, declares=False)})
    with pytest.raises(HALError, match="not a callable"):
        resolve_platform(PlatformConfig(platform="fake"), extra_plugins={"fake": GraphPlatform(42)})


def test_engine_uses_graphs_only_when_platform_and_model_allow(monkeypatch):
    from shuili import LLM
    from shuili.core import engine as engine_mod

    real = engine_mod.resolve_platform

    def with_capture(config):
        return real(config).__class__(**{**real(config).__dict__, "capture_graph": lambda fn: fn})

    monkeypatch.setattr(engine_mod, "resolve_platform", with_capture)
    kw = dict(model="tiny-v4", platform="reference", tokens_per_block=16, max_num_seqs=4)
    assert LLM(**kw).engine.runner.graphs is not None
    assert LLM(**kw, enforce_eager=True).engine.runner.graphs is None
    monkeypatch.setattr(engine_mod, "resolve_platform", real)
    assert LLM(**kw).engine.runner.graphs is None  # the reference declares no capture
