"""One decode step's path (docs/architecture.md): the engine hands off to the scheduler, the runner
and back to the scheduler, and nothing calls back into the engine; the files the step's control
flow crosses stay few. The model's forward and each HAL op count as one stop each ("model",
"ops"): what runs inside them is the model and the kernels."""
from __future__ import annotations

import os
import sys

import pytest

import shuili
from shuili import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shuili.__file__)))


def _where(filename: str) -> str | None:
    if not filename.startswith(ROOT + os.sep):
        return None
    rel = os.path.relpath(filename, ROOT)
    if rel.startswith("core" + os.sep + "models"):
        return "model"
    if rel.startswith("platforms"):
        return "ops"
    return rel


def trace_step(engine):
    """(calls into engine.py from outside it, the engine's hand-offs, the stops of the step)."""
    reentries, handoffs, stops, leaf = [], [], set(), [0]

    def prof(frame, event, arg):
        if event not in ("call", "return"):
            return
        here = _where(frame.f_code.co_filename)
        if here in ("model", "ops"):
            leaf[0] += 1 if event == "call" else -1
            if event == "call" and leaf[0] == 1:
                stops.add(here)
            return
        if event != "call" or here is None or leaf[0]:
            return  # contract helpers called from inside the model or a kernel belong to it
        stops.add(here)
        caller = _where(frame.f_back.f_code.co_filename) if frame.f_back else None
        if here == "core/engine.py" and caller != "core/engine.py":
            reentries.append(f"{caller} -> {frame.f_code.co_name}")
        if caller == "core/engine.py" and here != caller:
            handoffs.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        engine.step_requests()
    finally:
        sys.setprofile(None)
    reentries = [r for r in reentries if not r.endswith("-> step_requests")]
    return reentries, handoffs, stops


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_step_never_reenters_the_engine(overlap):
    llm = LLM(model="tiny-v4", platform="reference", tokens_per_block=16, num_blocks=32, overlap=overlap)
    eng = llm.engine
    for prompt in ("one decode step", "two"):
        eng.add_request(prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=8, repetition_penalty=1.1,
                                               stop=["zz"], ignore_eos=True))
    for _ in range(3):
        eng.step_requests()  # prefill, then decodes (overlap: one step in flight)
    reentries, handoffs, stops = trace_step(eng)
    assert reentries == []
    assert [h for h in handoffs if h != "__bool__"] == ["schedule", "execute", "to_host", "update"]
    expected = {"core/engine.py", "core/scheduler.py", "core/kv_cache.py", "core/request.py",
                "core/sampling_params.py", "core/runner.py", "hal/transfer.py", "core/model_api.py",
                "core/sampler.py", "model", "ops"}
    assert stops == expected
    assert len(stops) + 1 <= 12  # + core/api.py, whose LLM.generate loop calls step_requests
