"""Whether the caller has range-checked the index tensors it hands the ops.

A platform may check an op's index arguments (token ids, KV slots, expert ids) on the device:
on NVIDIA that is 3-5 launches a check (platforms/nvidia/common.check). The engine builds those
tensors from host lists it has checked already (core/runner.check_host_inputs,
core/parallel/worker.check_step_inputs), or derives them in range by construction (router ids,
group sizes; tid2eid is checked when the weights load). Inside its steps the device checks repeat
that work: 67 checks in the profile of a 4k mid-v4 prefill forward, about a fifth of its 1,262
launches; leaving them out took 0.5 ms off that 59 ms forward on an H100 (docs/performance.md).

The engine marks its steps with `inputs_checked()` (the runner sets `INPUTS_CHECKED` itself); a
platform's checks may step aside while `inputs_are_checked()` holds. Every other caller of the ops
keeps the device checks. The flag is a context variable, so it holds for the thread (or task) that
set it and no other.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

# set and reset directly (token = INPUTS_CHECKED.set(True) ... INPUTS_CHECKED.reset(token)) where a
# hot path should not call into this module: the engine's step (tests/core/test_step_path.py)
INPUTS_CHECKED = contextvars.ContextVar("shuili_inputs_checked", default=False)


@contextlib.contextmanager
def inputs_checked() -> Iterator[None]:
    """Ops called in this block get index tensors their caller has range-checked."""
    token = INPUTS_CHECKED.set(True)
    try:
        yield
    finally:
        INPUTS_CHECKED.reset(token)


def inputs_are_checked() -> bool:
    return INPUTS_CHECKED.get()
