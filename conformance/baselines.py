"""Locked baselines: `conformance/baselines/<platform>/<workload>.json`.

A baseline holds, per sampling mode of a workload, each sample's prompt hash, token ids, the
sha256 of its raw float32 logprob bits and its perplexity, plus provenance (versions, determinism
settings, the stack fingerprint). `run` compares against it: under the same fingerprint token ids
and logprob bits must match exactly; under another fingerprint bits are not comparable (the
check says so and how to refresh) and only perplexity is held, to `PPL_RTOL`.
`update` rewrites a baseline under a `HostSafeLock`, via temp file + fsync + atomic rename.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform as _pyplatform
import struct
import subprocess
import sys
from typing import Any

from shuili.conformance.lock import HostSafeLock, atomic_write
from shuili.hal.capabilities import DeterminismLevel
from shuili.conformance.report import CheckResult

SCHEMA = 1
DEFAULT_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines")
PPL_RTOL = 1e-3
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "NCCL_ALGO", "NCCL_PROTO",
                   "HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC", "ACL_OPT_DETERMINISTIC",
                   "OMP_NUM_THREADS", "MKL_NUM_THREADS", "SHUILI_PERTURB_OPS")


def logprob_bits_sha256(logprobs: list[float]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(logprobs)}f", *logprobs)).hexdigest()


def token_sha256(ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else float("nan")


def sample_record(prompt_ids: list[int], token_ids: list[int], logprobs: list[float]) -> dict:
    return {"prompt_sha256": token_sha256(prompt_ids), "token_ids": list(token_ids),
            "logprob_bits_sha256": logprob_bits_sha256(logprobs), "perplexity": perplexity(logprobs)}


# ------------------------------------------------------------------------------------ provenance
def _cpu_isa() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return _pyplatform.machine()
    wanted = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma", "neon", "sve")
    return _pyplatform.machine() + "+" + ",".join(w for w in wanted if w in flags)


def _device_name(device_type: str) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} sm{major}{minor} x{torch.cuda.get_device_properties(0).multi_processor_count}SM"
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401

            return str(torch.npu.get_device_name())
        except Exception:
            return "npu (unknown)"
    return _cpu_isa()


def op_levels(resolved) -> dict[str, str]:
    """Each op's declared determinism level, by name."""
    return {n: c.determinism.name for n, c in resolved.capabilities.ops.items()}


def stack_fingerprint(resolved) -> dict[str, str]:
    """What the bits may depend on. Baseline bits are comparable only under an equal fingerprint."""
    import torch

    from shuili.hal.version import HAL_API_MAJOR

    caps = resolved.capabilities
    fp = {
        "platform": resolved.name,
        "plugin_version": resolved.info.plugin_version,
        # a minor release adds optional hooks and hints, never changes an op's result
        "hal_api": str(HAL_API_MAJOR),
        # the declared determinism per op: a platform in batch-invariant mode (by config or by its
        # own switch) declares other levels and runs other kernels, so other bits
        "op_levels": hashlib.sha256(json.dumps(op_levels(resolved), sort_keys=True).encode()).hexdigest()[:12],
        "torch": torch.__version__,
        # a CPU platform whose every op is portable_bitwise computes the same bits on any CPU, ISA,
        # BLAS and thread count (tests/reference/test_host_independence.py checks the reference)
        "device": "cpu (host-independent)" if caps.device_type == "cpu" and all(
            c.determinism >= DeterminismLevel.portable_bitwise for c in caps.ops.values())
        else _device_name(caps.device_type),
        "cuda": str(torch.version.cuda),
    }
    fp["sha256"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return fp


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(resolved, engine_settings: dict | None = None) -> dict[str, Any]:
    import numpy
    import torch

    import shuili

    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "versions": {"shuili": shuili.__version__, "python": sys.version.split()[0],
                     "torch": torch.__version__, "numpy": numpy.__version__,
                     "plugin": resolved.info.plugin_version},
        "git_commit": _git_commit(),
        "host": {"machine": _pyplatform.machine(), "system": _pyplatform.system()},
        "determinism": {
            "platform_config": resolved.config.model_dump(),
            "op_levels": op_levels(resolved),
            "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in DETERMINISM_ENV if k in os.environ},
        },
        "engine": engine_settings or {},
        "fingerprint": stack_fingerprint(resolved),
    }


# -------------------------------------------------------------------------------- files and lock
def path_for(root: str, platform: str, workload: str) -> str:
    for part, what in ((platform, "platform"), (workload, "workload")):
        if not part or os.sep in part or part.startswith("."):
            raise ValueError(f"{what} name {part!r} cannot name a baseline file")
    return os.path.join(root, platform, f"{workload}.json")


def load(root: str, platform: str, workload: str) -> dict | None:
    path = path_for(root, platform, workload)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: baseline schema {data.get('schema')!r}, this shuili reads {SCHEMA}; "
                         "refresh it with `shuili conformance baseline update`")
    return data


def build(platform: str, workload: str, modes: dict[str, list[dict]], prov: dict,
          extra: dict | None = None) -> dict:
    body = {"schema": SCHEMA, "platform": platform, "workload": workload,
            "modes": {m: {"samples": s} for m, s in sorted(modes.items())}, **(extra or {})}
    body["content_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    body["provenance"] = prov
    return body


def update(root: str, data: dict, timeout: float = 300.0) -> str:
    """Write one baseline under the cross-host lock of `root`; returns its path."""
    path = path_for(root, data["platform"], data["workload"])
    with HostSafeLock(os.path.join(root, ".baseline.lock"), timeout=timeout):
        atomic_write(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
    return path


# ----------------------------------------------------------------------------------- comparison
def same_stack(baseline: dict, fingerprint: dict, levels: dict[str, str] | None = None) -> bool:
    """Whether a baseline's bits are comparable with this stack's: an equal fingerprint, or one that
    differs only by ops added to the contract since the lock (the locked workload cannot have used
    them) while every op it knew keeps its level. `levels`: this stack's `op_levels`."""
    prov = baseline.get("provenance", {})
    locked_fp = prov.get("fingerprint", {})
    if locked_fp.get("sha256") == fingerprint.get("sha256"):
        return True
    locked_levels = prov.get("determinism", {}).get("op_levels")
    if levels is None or not isinstance(locked_levels, dict):
        return False
    others = [k for k in fingerprint if k not in ("sha256", "op_levels")]
    return (all(locked_fp.get(k) == fingerprint.get(k) for k in others)
            and all(levels.get(op) == lvl for op, lvl in locked_levels.items()))


def compare(baseline: dict | None, current: dict, fingerprint: dict, name: str,
            root: str, levels: dict[str, str] | None = None) -> CheckResult:
    """Hold a run's samples (same shape as a baseline body) to the locked baseline. `levels`: this
    stack's `op_levels` (ops added since the lock then do not make the stack another)."""
    from shuili.conformance.compare import Divergence

    fix = f"`shuili conformance baseline update --platform {current['platform']} --workload {current['workload']}`"
    if baseline is None:
        return CheckResult(name=name, kind="baseline", status="skip",
                           message=f"no baseline at {path_for(root, current['platform'], current['workload'])}; "
                                   f"lock one with {fix}")
    locked_fp = baseline.get("provenance", {}).get("fingerprint", {})
    comparable = same_stack(baseline, fingerprint, levels)
    for mode, body in current["modes"].items():
        want = baseline["modes"].get(mode)
        if want is None:
            return CheckResult(name=name, kind="baseline", status="fail",
                               message=f"the baseline has no mode {mode!r}; refresh it with {fix}")
        for i, (w, g) in enumerate(zip(want["samples"], body["samples"])):
            if w["prompt_sha256"] != g["prompt_sha256"]:
                return CheckResult(name=name, kind="baseline", status="fail",
                                   message=f"{mode} sample {i}: the workload's prompt changed since the "
                                           f"baseline was locked; refresh it with {fix}")
            if comparable:
                div = _first_token_divergence(w["token_ids"], g["token_ids"])
                if div is not None:
                    step, e, t = div
                    return CheckResult(
                        name=name, kind="baseline", status="fail", level="portable_bitwise (locked)",
                        message=f"{mode}: token ids differ from the locked baseline",
                        divergence=Divergence(where={"mode": mode, "request": i, "step": step},
                                              expected=e, got=t))
                if w["logprob_bits_sha256"] != g["logprob_bits_sha256"]:
                    return CheckResult(
                        name=name, kind="baseline", status="fail", level="portable_bitwise (locked)",
                        message=f"{mode} sample {i}: same tokens, but the logprob bits hash differs "
                                f"from the locked baseline (perplexity {w['perplexity']!r} locked, "
                                f"{g['perplexity']!r} now)",
                        divergence=Divergence(where={"mode": mode, "request": i},
                                              expected=w["logprob_bits_sha256"][:16],
                                              got=g["logprob_bits_sha256"][:16], note="sha256 prefix"))
            elif not math.isclose(w["perplexity"], g["perplexity"], rel_tol=PPL_RTOL):
                return CheckResult(
                    name=name, kind="baseline", status="fail", level=f"perplexity rtol {PPL_RTOL}",
                    message=f"{mode} sample {i}: perplexity {g['perplexity']:.6g} vs locked "
                            f"{w['perplexity']:.6g} (another stack: bits not compared)")
        if len(want["samples"]) != len(body["samples"]):
            return CheckResult(name=name, kind="baseline", status="fail",
                               message=f"{mode}: {len(body['samples'])} samples now, "
                                       f"{len(want['samples'])} locked; refresh it with {fix}")
    if comparable:
        return CheckResult(name=name, kind="baseline", status="pass", level="portable_bitwise (locked)",
                           message=f"token ids and logprob bits equal the baseline locked "
                                   f"{baseline['provenance'].get('created', '?')}")
    diff = {k: (locked_fp.get(k), fingerprint.get(k)) for k in fingerprint
            if k != "sha256" and locked_fp.get(k) != fingerprint.get(k)}
    return CheckResult(name=name, kind="baseline", status="info", level=f"perplexity rtol {PPL_RTOL}",
                       message=f"baseline locked under another stack {diff}: bits not comparable, "
                               f"perplexity within rtol {PPL_RTOL}; lock this stack with {fix}",
                       details={"fingerprint_diff": diff})


def _first_token_divergence(want: list[int], got: list[int]):
    for step, (w, g) in enumerate(zip(want, got)):
        if w != g:
            return step, w, g
    if len(want) != len(got):
        n = min(len(want), len(got))
        return n, (want[n] if n < len(want) else "<end>"), (got[n] if n < len(got) else "<end>")
    return None
