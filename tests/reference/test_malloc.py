"""platforms/reference/malloc.py: glibc's thresholds are raised once, and never against the user's say."""
import os
import subprocess
import sys

import pytest

_PROBE = "from shuili.platforms.reference import malloc; print(malloc.keep_freed_blocks(), malloc.keep_freed_blocks())"


def _run(**env) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "SHUILI_REFERENCE_MALLOC")}
    p = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
def test_thresholds_are_set_once_on_glibc():
    assert _run() == "True True"


def test_opt_out_and_user_thresholds_are_respected():
    assert _run(SHUILI_REFERENCE_MALLOC="0") == "False False"
    assert _run(MALLOC_TRIM_THRESHOLD_="131072") == "False False"
