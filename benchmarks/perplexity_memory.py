"""Peak resident memory (max RSS) and CPU time of `shuili perplexity` on the reference platform.

Runs `python -m shuili perplexity --json` in a child process (so the number is that command's own
high-water mark, not this script's) and reads the child's rusage: ru_maxrss (KiB on Linux) and
user + system CPU seconds. Prints them with a digest of the report's per-sample nll values, so
runs of two versions can be checked to report the same numbers. Point PYTHONPATH at a worktree
to measure another commit.

    python benchmarks/perplexity_memory.py [--model smollm2-135m] [--threads 1] [--json]
        [-- extra perplexity flags]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("extra", nargs="*", help="more flags for `shuili perplexity` (after --)")
    a = ap.parse_args()
    # the tree measured is PYTHONPATH's (else this script's); the child runs elsewhere, since
    # `python -m` puts its working directory first on sys.path, ahead of PYTHONPATH
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               PYTHONPATH=os.path.abspath(os.environ.get("PYTHONPATH") or root))
    cmd = [sys.executable, "-m", "shuili", "perplexity", "--model", a.model, "--json", *a.extra]
    w0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - w0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads(proc.stdout)
    nll = [s["nll"] for s in report["samples"]]
    res = {"model": a.model, "tree": env["PYTHONPATH"], "threads": a.threads, "max_rss_gb": ru.ru_maxrss * 1024 / 1e9,
           "user_cpu_s": ru.ru_utime, "sys_cpu_s": ru.ru_stime, "wall_s": wall,
           "corpus_ppl": report["corpus_ppl"],
           "nll_sha256": hashlib.sha256(json.dumps(nll).encode()).hexdigest()[:16],
           "load_average": os.getloadavg()}
    if a.json:
        print(json.dumps(res))
        return
    print(f"shuili perplexity --model {a.model}: max RSS {res['max_rss_gb']:.2f} GB, CPU {ru.ru_utime:.1f} s user "
          f"+ {ru.ru_stime:.1f} s sys ({wall:.1f} s wall), corpus ppl {res['corpus_ppl']:.4f}, "
          f"nll digest {res['nll_sha256']}, load average {res['load_average'][0]:.1f}")


if __name__ == "__main__":
    main()
