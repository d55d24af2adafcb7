"""Availability probe, SoC detection and the determinism settings of the Ascend platform.

The probe never lets `import torch_npu` run blind: it first checks that the package exists
(without importing it) and that the CANN libraries it links against can be loaded, because an
`import torch_npu` without CANN raises (2.13) or even calls sys.exit() (older releases).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass

from shuili.hal.types import Availability

# libraries libtorch_npu.so / torch_npu._C need from the CANN toolkit (ldd of the 2.13.0 wheel)
CANN_LIBRARIES = ("libascendcl.so", "libhccl.so", "libacl_op_compiler.so", "libge_runner.so",
                  "libgraph.so")
ASCEND_950_SOC = 260


@dataclass(frozen=True)
class Soc:
    family: str  # "950", "A3", "A2", "310P", "unknown"
    soc_version: int
    name: str

    @property
    def is_950(self) -> bool:
        return self.family == "950"

    @property
    def supported(self) -> bool:
        return self.family in ("950", "A3", "A2")


def soc_family(soc_version: int) -> str:
    """Numeric `torch_npu.npu.get_soc_version()` -> family (ascend.md 2: 260 is Ascend 950)."""
    if soc_version == ASCEND_950_SOC:
        return "950"
    if 250 <= soc_version <= 255:
        return "A3"
    if 220 <= soc_version <= 225:
        return "A2"
    if 200 <= soc_version <= 205:
        return "310P"
    return "unknown"


def detect_soc(api) -> Soc:
    version = int(api.device.get_soc_version())
    try:
        name = str(api.device.get_device_name(0))
    except Exception:  # some runtimes refuse before set_device; the id is what matters
        name = "?"
    return Soc(soc_family(version), version, name)


def missing_cann_libraries(names=CANN_LIBRARIES) -> list[str]:
    missing = []
    for name in names:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing


def probe(api_loader=None) -> Availability:
    """Whether this host can run the Ascend platform, with an operator-actionable reason.

    api_loader: returns an NpuApi (default `npu_api.load`); tests pass the simulator's.
    """
    if api_loader is None:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability.no("torch_npu not installed (pip install 'shuili[ascend]' on a host "
                                   "with the CANN toolkit)")
        missing = missing_cann_libraries()
        if missing:
            home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME") or "unset"
            return Availability.no(
                f"CANN libraries missing: {', '.join(missing)} (ASCEND_HOME_PATH={home}; source "
                "<cann>/set_env.sh so LD_LIBRARY_PATH finds them)", missing=missing)
        from shuili.platforms.ascend.npu_api import load as api_loader
    try:
        api = api_loader()
    except (Exception, SystemExit) as exc:  # old torch_npu calls sys.exit() when CANN is broken
        return Availability.no(f"import torch_npu failed: {type(exc).__name__}: {exc}")
    try:
        count = int(api.device.device_count()) if api.device.is_available() else 0
    except Exception as exc:
        return Availability.no(f"NPU runtime error: {type(exc).__name__}: {exc}")
    if count == 0:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "unset")
        return Availability.no(f"no NPU visible (torch.npu.device_count() == 0; "
                               f"ASCEND_RT_VISIBLE_DEVICES={visible}; check npu-smi info)")
    soc = detect_soc(api)
    if not soc.supported:
        return Availability.no(f"{soc.name} (SoC id {soc.soc_version}, family {soc.family}) is not "
                               "supported: shuili targets Ascend 950, with A2/A3 as lesser targets",
                               soc_version=soc.soc_version)
    note = "" if soc.is_950 else " (lesser target: no MX quantization ops)"
    return Availability.yes(f"{count} x {soc.name} (SoC {soc.soc_version}, Ascend {soc.family}){note}",
                            soc_version=soc.soc_version, family=soc.family, devices=count)


# environment a deterministic run needs; HCCL reads it when a communicator is created, so it must
# be set before init_process_group (vllm-ascend faqs 15 / batch_invariant.py)
DETERMINISTIC_ENV = {
    "HCCL_DETERMINISTIC": "true",
    "LCCL_DETERMINISTIC": "1",
    "ATB_MATMUL_SHUFFLE_K_ENABLE": "0",
    "ATB_LLM_LCOC_ENABLE": "0",
}


def apply_determinism(config, api, environ=None, set_torch_deterministic=None) -> dict:
    """When config.deterministic or config.batch_invariant: set DETERMINISTIC_ENV, call
    torch.use_deterministic_algorithms(True) (torch_npu maps it to ACL deterministic mode) and
    torch_npu.npu.set_deterministic_level(1) where it exists. Returns what was applied."""
    if not (config.deterministic or config.batch_invariant):
        return {}
    environ = os.environ if environ is None else environ
    applied = {}
    for key, value in DETERMINISTIC_ENV.items():
        environ[key] = value
        applied[key] = value
    if set_torch_deterministic is None:
        import torch

        set_torch_deterministic = torch.use_deterministic_algorithms
    set_torch_deterministic(True)
    applied["torch.use_deterministic_algorithms"] = True
    setter = getattr(api.device, "set_deterministic_level", None)
    if setter is not None:
        setter(1)
        applied["torch_npu.npu.set_deterministic_level"] = 1
    return applied
