"""Probe reasons, SoC detection, lazy import, and `import shuili` / `shuili platforms` with and
without TORCH_DEVICE_BACKEND_AUTOLOAD=0 (in subprocesses, so nothing leaks into this process)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from shuili.hal.ops import OP_NAMES
from shuili.platforms.ascend import device
from shuili.platforms.ascend.sim import FakeNpu, simulated_api

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def run(code: str, env_extra: dict, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env.update(env_extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


PLATFORMS = ("import json, sys; from shuili.hal.cli import describe; d = describe();"
             "a = [p for p in d['platforms'] if p['name'] == 'ascend'][0];"
             "print(json.dumps(a)); print('torch_npu' in sys.modules, file=sys.stderr)")


EVERYTHING = ("import shuili, sys; from shuili.cli import main; sys.argv = ['shuili', 'platforms'];"
              "rc = main(); print('rc', rc); " + PLATFORMS)


@pytest.mark.skipif(HAS_TORCH_NPU, reason="this host has torch_npu")
@pytest.mark.parametrize("autoload", [None, "0"])
def test_import_and_platforms_report_not_installed(autoload):
    env = {} if autoload is None else {"TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    r = run(EVERYTHING, env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert any(line.strip().startswith("torch_npu not installed") for line in out), r.stdout
    assert "rc 0" in out or "rc None" in out
    row = json.loads(out[-1])
    assert row["available"] is False
    assert row["reason"].startswith("torch_npu not installed")
    assert row["capabilities"]["ops"] == len(OP_NAMES)  # every op of the contract is declared
    assert r.stderr.strip().endswith("False")  # listing platforms never imported torch_npu


BROKEN = '''
raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
'''


@pytest.mark.skipif(HAS_TORCH_NPU, reason="this host has torch_npu")
def test_installed_without_cann_reports_missing_libraries_and_never_imports(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(BROKEN)
    (tmp_path / "imported_marker").write_text("")
    r = run(PLATFORMS, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["available"] is False
    assert row["reason"].startswith("CANN libraries missing: libascendcl.so, libhccl.so")
    assert r.stderr.strip().endswith("False")


def test_import_failure_and_sys_exit_become_reasons():
    def raising():
        raise ImportError("libhccl.so: cannot open shared object file")

    def exiting():
        raise SystemExit(1)  # what torch_npu < 2.5 did on a broken CANN

    assert "import torch_npu failed: ImportError" in device.probe(raising).reason
    assert "SystemExit" in device.probe(exiting).reason


def test_no_npu_visible(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    a = device.probe(lambda: simulated_api(FakeNpu(count=0)))
    assert not a.available and a.reason.startswith("no NPU visible")


@pytest.mark.parametrize("soc,family,ok", [(260, "950", True), (223, "A2", True), (253, "A3", True),
                                           (202, "310P", False), (100, "unknown", False)])
def test_soc_detection(soc, family, ok):
    assert device.soc_family(soc) == family
    a = device.probe(lambda: simulated_api(FakeNpu(soc_version=soc, device_name=f"Ascend_{soc}")))
    assert a.available is ok, a.reason
    if ok:
        assert a.details["family"] == family and f"SoC {soc}" in a.reason
        assert ("lesser target" in a.reason) is (family != "950")
    else:
        assert "not supported" in a.reason


def test_plugin_module_import_is_lazy():
    code = textwrap.dedent("""
        import sys
        import shuili.platforms.ascend.plugin as p
        p.shuili_platform_info(); p.shuili_platform_probe('ascend')
        from shuili.hal import PlatformConfig
        p.shuili_platform_capabilities('ascend', PlatformConfig())
        print('torch_npu' in sys.modules, 'shuili.platforms.ascend.sim' in sys.modules)
    """)
    r = run(code, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
