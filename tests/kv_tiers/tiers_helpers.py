"""Shared by the KV-tier engine tests (a uniquely named module: tests import it by name)."""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

from shuili import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
CHILD = str(Path(__file__).with_name("kv_engine_child.py"))


def bits(o) -> list:
    return [list(o.token_ids), [struct.pack("<f", x).hex() for x in o.logprobs]]


def params(n: int) -> list[dict]:
    """Seeded sampling with logprobs, so a wrong cache bit shows in the tokens or the logprob bytes."""
    return [dict(max_tokens=5, temperature=0.8, seed=11 + i, logprobs=1, ignore_eos=True) for i in range(n)]


def prompts(vocab: int, prefix_len: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def cold(model: str, ps: list[list[int]], pars: list[dict], **kw) -> list:
    """Each prompt alone on an engine with no prefix cache at all: the recompute answer."""
    llm = LLM(model=model, platform="reference", enable_prefix_caching=False, **kw)
    return [bits(llm.generate([p], SamplingParams(**q))[0]) for p, q in zip(ps, pars)]


def in_new_process(model: str, ps, pars, engine: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    spec = json.dumps({"model": model, "prompts": ps, "params": pars, "engine": engine})
    r = subprocess.run([sys.executable, CHILD, spec], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
