"""What a disk hit reads from the KV store, without running a model (so mid-v4's shapes fit a CPU).

A V4 / V4.1 model's cache groups, one prompt's --prefix-len tokens of blocks written to a DiskStore
(random bytes: the checks cost the same whatever the KV), then two reads of the hit:
  sections   the engine's lookup (KVTiers.find_cached): every block's full / compressed sections,
             sliding sections only inside the last window
  whole      every section of every block: what a hit read before block files had sections
             (version 1 read the whole file and checked one payload checksum: the same bytes and
             the same sha256 work)
Reports bytes read and seconds (best of --repeat, wall and CPU). The files were just written, so
they come from the page cache: this is the read + checksum + decode cost, not the disk's.

    python benchmarks/kv_store_read.py --model mid-v4 --prefix-len 2048
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import torch


def model_groups(model: str, dtype: str):
    from shuili.core.models import V4_NAMES, V41_NAMES

    if model in V4_NAMES:
        from shuili.core.models.deepseek_v4_cache import cache_groups
        from shuili.core.models.deepseek_v4_config import named
    elif model in V41_NAMES:
        from shuili.core.models.deepseek_v41_cache import cache_groups
        from shuili.core.models.deepseek_v41_config import named
    else:
        raise SystemExit(f"--model {model}: only the DeepSeek-V4 / V4.1 configs ({V4_NAMES + V41_NAMES}); "
                         "a model of full-attention groups only reads every section anyway")
    groups = cache_groups(named(model), dtype)
    return groups, max([16] + [g.ratio for g in groups])


def timed(fn, repeat: int) -> tuple[float, float]:
    best_wall, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        best_wall = min(best_wall, time.perf_counter() - w)
        best_cpu = min(best_cpu, time.process_time() - c)
    return best_wall, best_cpu


def main(args) -> dict:
    from shuili import SamplingParams
    from shuili.core.kv_cache import KVCacheManager
    from shuili.core.kv_tiers.disk_store import DiskStore
    from shuili.core.kv_tiers.tiers import KVTiers
    from shuili.core.request import Request

    torch.set_num_threads(1)
    groups, P = model_groups(args.model, args.dtype)
    n = args.prefix_len // P
    root = tempfile.mkdtemp(prefix="shuili-kv-read-")
    try:
        kv = KVCacheManager(groups, n + 2, P)
        store = DiskStore(root, "bench", background=False)
        tiers = KVTiers(groups, P, None, None, store, "bench")
        tiers.attach(kv)
        req = Request("r", [100 + j % 20000 for j in range(n * P + 16)], SamplingParams(max_tokens=1), 0, 0)
        hs = kv._hashes(req, n)
        g = torch.Generator().manual_seed(0)
        data = {name: torch.randint(0, 256, (int(torch.Size(shape).numel()) * dt.itemsize,), generator=g,
                                    dtype=torch.uint8).view(dt).view(shape)
                for name, (shape, dt) in ((k, tiers.expect[k]) for k in tiers.file_order)}
        for h in hs:
            store.put(tiers.key(h), h, data)
        file_bytes = store.size_bytes()

        def sections():
            got, _ = tiers.find_cached(kv, req)
            assert got == n * P, (got, n * P)
            tiers._staged = None

        def whole():
            for h in hs:
                assert store.get(tiers.key(h), tiers.expect) is not None

        out = {"model": args.model, "dtype": args.dtype, "tokens_per_block": P, "blocks": n,
               "store_file_bytes": file_bytes, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "torch": torch.__version__}
        for name, fn in (("sections", sections), ("whole", whole)):
            b0 = store.stats()["bytes_read"]
            fn()
            read = store.stats()["bytes_read"] - b0
            wall, cpu = timed(fn, args.repeat)
            out[name] = {"bytes_read": read, "wall_s": wall, "cpu_s": cpu}
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mid-v4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


if __name__ == "__main__":
    a = parse()
    r = main(a)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['model']} ({r['dtype']}), {r['blocks']} blocks of {r['tokens_per_block']} tokens, store files "
              f"{r['store_file_bytes']} bytes, {r['date_utc']} UTC, torch {r['torch']}")
        for k in ("sections", "whole"):
            print(f"{k:<9} read {r[k]['bytes_read']:>12} bytes  {r[k]['wall_s']:.3f} s wall  {r[k]['cpu_s']:.3f} s CPU")
