"""Count the launches one mid-v4-shaped decode step (or prefill) makes on the NVIDIA platform, by call site,
without a GPU.

The forward runs eagerly on the CPU with TRITON_INTERPRET=1 (the same Python the captured step
records). Each torch op that would launch a CUDA kernel (views and allocations launch none) and
each Triton kernel launch is counted against the innermost shuili frame that made it. Device-side
checks are left out as a captured step leaves them out (`common.check` under capture). The count
is exact for the code, not a timing: the GPU profile (`nvidia_decode_ctx.py --profile`) says what
each launch costs.

    TRITON_INTERPRET=1 python benchmarks/step_launches.py [--layers 4] [--batch 4] [--released] [--rows 40]
        [--prefill L]   (B fresh prompts of L tokens instead of a decode step at --ctx; the interpreter
                         runs every kernel, so L in the hundreds takes minutes)
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch nothing on a CUDA device: metadata, views, allocation (names as counted: the
# overload cut off and a trailing underscore stripped, so set_ is "set")
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand",
    "permute", "transpose", "t", "detach", "alias", "split", "split_with_sizes", "unbind", "narrow",
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh",
    "view_as_real", "view_as_complex", "unflatten", "flatten", "chunk", "is_nonzero", "sym_size", "sym_stride",
    "_reshape_alias", "resolve_conj", "resolve_neg", "set", "sym_numel", "dim", "size", "stride",
    "is_same_size", "_local_scalar_dense", "record_stream", "numel", "is_contiguous",
    "scalar_tensor",  # a wrapped Python number (torch.where(c, x, -1)): a CPU 0-dim tensor, no kernel
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def site() -> str:
    """The innermost frame in shuili's own code (not this script, not the HAL's dispatch)."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = fr.filename
        if f.startswith(ROOT) and "benchmarks" not in f and "/hal/" not in f:
            return f"{os.path.relpath(f, ROOT)}:{fr.name}:{fr.lineno}"
    return "?"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.sites = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0].rstrip("_")
        if not self.paused and name not in NO_LAUNCH:
            # a copy to the same dtype and layout of a contiguous tensor is still a kernel; a no-op .to() is not
            if not (name == "_to_copy" and args and isinstance(args[0], torch.Tensor)
                    and (kwargs or {}).get("dtype", args[0].dtype) == args[0].dtype
                    and args[0].device.type == "cpu" and (kwargs or {}).get("device") in (None, args[0].device)):
                self.ops[name] += 1
                self.sites[("torch " + name, site())] += 1
        return func(*args, **(kwargs or {}))


def hook_triton(counter: Counter):
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *a, **k):
        counter.ops["triton " + self.fn.__name__] += 1
        counter.sites[("triton " + self.fn.__name__, site())] += 1
        counter.paused += 1  # the interpreter's own torch calls are not device kernels
        try:
            return run(self, *a, **k)
        finally:
            counter.paused -= 1

    InterpretedFunction.run = counted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4, help="layers: swa, csa, hca, csa ... (mid-v4's order)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--released", action="store_true")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--prefill", type=int, default=0, metavar="L")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import nvidia_decode_ctx as D

    import shuili.platforms.nvidia.common as common
    from shuili.core.models.deepseek_v4 import DeepseekV4Model
    from shuili.core.models.deepseek_v4_config import named
    from shuili.hal.ops import OP_NAMES, DispatchTable
    from shuili.platforms.nvidia.ops import make_ops

    D.DEV = "cpu"
    base = named("mid-v4")
    n = args.layers
    over = dict(num_hidden_layers=n, attn_kinds=base.attn_kinds[1:n + 1], mlp_kinds=base.mlp_kinds[-n:],
                vocab_size=1024)
    if args.released:
        over.update(D.RELEASED_KV)
    cfg = named("mid-v4", **over)
    params = D.gpu_params(cfg, args.released, torch.bfloat16)
    ops = DispatchTable("nvidia", make_ops(), {n: "nvidia" for n in OP_NAMES})
    model = DeepseekV4Model(cfg, ops, params, device="cpu", dtype="bfloat16",
                            max_model_len=max(args.ctx + 256, args.prefill))
    if args.prefill:
        g = torch.Generator().manual_seed(0)
        driver = model.driver(max_seqs=args.batch, max_len=args.prefill)
        prompts = [torch.randint(0, cfg.vocab_size, (args.prefill,), generator=g).tolist()
                   for _ in range(args.batch)]
        batch = driver.batch([(s, p, 0) for s, p in enumerate(prompts)])
    else:
        batch = D.Caches(model, ops, args.batch, args.ctx, 128).batch(model.cache_groups())
    # as in a captured step: no device-side checks (on a CPU tensor `check` would run them eagerly);
    # every module imported the function itself, so its code is what is replaced
    common.check.__code__ = (lambda x, ok, msg: None).__code__
    # warm: lazy tables, compiled constants (a prefill warms on a short prompt: the interpreter is slow)
    model.forward(driver.batch([(0, prompts[0][:16], 0)]) if args.prefill else batch)
    counter = Counter()
    hook_triton(counter)
    with counter:
        model.forward(batch)
    total = sum(counter.ops.values())
    what = f"prefill of {args.prefill} tokens" if args.prefill else f"decode at {args.ctx}"
    print(f"{cfg.attn_kinds} {cfg.mlp_kinds} batch {args.batch}, {what}, released={args.released}: "
          f"{total} launches")
    print(f"{'launches':>8}  kind / call site")
    for (kind, where), k in counter.sites.most_common(args.rows):
        print(f"{k:8d}  {kind:28s} {where}")
    print("\nby op:")
    for name, k in counter.ops.most_common(args.rows):
        print(f"{k:8d}  {name}")


if __name__ == "__main__":
    main()
