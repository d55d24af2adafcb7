"""Engram gather + upload time per step: decode batch 64 and a 4k prefill chunk, mid-v41 Engram sizes.

Synthetic tables (fp8 rows [N, 256] + e8m0 scales [N, 8], i.e. the released 264 B rows) are written
once to a safetensors file and memory-mapped like a checkpoint's; N follows from `--vocab` (24 primes
above it per layer, ~24 x vocab rows). Per case it reports, in ms per step (median of --iters):
  hash       host hash of the step's tokens (int64 math)
  gather_raw the memmap reads alone: T x 24 rows per layer into a host buffer (no hash, no dequant)
  gather     host gather of T x 24 rows per layer into one (pinned on CUDA) buffer; on the CPU device
             this includes the dequantization (done on the gathering thread there)
  upload     one copy to the device + dequantize (kv_dequantize "mxfp8") to [T, 24 * 256]; ~0 on CPU
  step       Engram.step + get(): hash, gather, upload, dequantize, end to end (no prefetch)
  exposed    what a step still waits for when the rows were prefetched while a compute stand-in
             of --compute-ms ran (0 = fully hidden)
  device     (placeholder ids, overlap decode) hash on the device + gather from host memory the
             device reads: the memmap on CPU, registered host pages (zero-copy) on CUDA
Tables are page-cached after the first pass (a warm host); a cold 100 GB table adds page faults.

  python benchmarks/engram_gather.py --device cpu
  python benchmarks/engram_gather.py --device cuda --platform nvidia
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch


def write_tables(path: str, spec, seed: int = 0) -> None:
    """Random fp8 rows and e8m0 scales, streamed to disk in slabs (never whole in memory)."""
    header, off = {}, 0
    for lid, n in zip(spec.layer_ids, spec.num_embeddings):
        for name, width, dt in ((f"engram.{lid}.weight", spec.head_dim, "F8_E4M3"),
                                (f"engram.{lid}.scale", spec.head_dim // 32, "F8_E8M0")):
            header[name] = {"dtype": dt, "shape": [n, width], "data_offsets": [off, off + n * width]}
            off += n * width
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for name, e in header.items():
            n, width = e["shape"]
            for a in range(0, n, 1 << 18):
                m = min(1 << 18, n - a)
                if e["dtype"] == "F8_E4M3":  # finite e4m3 bytes (exponent field below 15)
                    block = rng.integers(0, 256, (m, width), dtype=np.uint8) & np.uint8(0xF7)
                else:
                    block = rng.integers(118, 130, (m, width), dtype=np.uint8)
                f.write(block.tobytes())


def batch_of(engram, ids: list[int], history: list[int], starts: list[int], device, holes: bool):
    lb = engram.spec.lookback
    t = len(ids)
    return SimpleNamespace(
        input_ids=torch.tensor(ids, device=device), num_tokens=t, static_decode=False,
        engram_history=torch.tensor(history, device=device).view(t, lb), engram_history_cpu=history,
        input_ids_cpu=[-1] * t if holes else ids, query_start_loc_cpu=starts)


def timed(fn, sync, iters: int) -> float:
    fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def run_case(engram, name: str, t: int, seqs: int, device, sync, iters: int, compute_ms: float, vocab: int):
    from shuili.core.models.engram import EngramRows  # noqa: F401  (the API exercised)
    from shuili.core.models.engram_hash import engram_history, windows_from

    rng = np.random.default_rng(1)
    per = t // seqs
    reqs = [rng.integers(0, vocab, 4096 + per).tolist() for _ in range(seqs)]
    ids, hist, starts = [], [], [0]
    for r in reqs:  # each sequence at position 4096 (a decode token, or a chunk after 4096 tokens)
        ids += r[4096:4096 + per]
        hist += engram_history(lambda a, b, r=r: r[a:b], 4096, 4096 + per, engram.spec.lookback)
        starts.append(len(ids))
    layers = engram.spec.layer_ids
    win = windows_from(torch.tensor(ids), torch.tensor(hist).view(t, -1))
    res = {"case": name, "tokens": t, "rows_per_layer": t * engram.spec.n_cols,
           "bytes": t * engram.spec.n_cols * 264 * len(layers)}
    res["hash_ms"] = timed(lambda: engram.host_hasher(win), lambda: None, iters)
    rid = engram.host_hasher(win).numpy()
    bufs = [np.empty(t * engram.spec.n_cols * engram.tables[lid].packed_bytes, np.uint8) for lid in layers]

    def raw():
        for k, lid in enumerate(layers):
            engram.tables[lid].gather(np.ascontiguousarray(rid[:, k]).reshape(-1), bufs[k])

    res["gather_raw_ms"] = timed(raw, lambda: None, iters)
    g = engram._gather_host(ids, hist)
    res["gather_ms"] = timed(lambda: engram._gather_host(ids, hist), lambda: None, iters)
    res["upload_ms"] = timed(lambda: engram._upload(g), sync, iters)

    def step(holes=False):
        rows = engram.step(batch_of(engram, ids, hist, starts, device, holes))
        for lid in layers:
            rows.get(lid)

    res["step_ms"] = timed(step, sync, iters)

    def prefetched():
        engram.prefetch(ids, hist)
        time.sleep(compute_ms / 1e3)  # the current step's compute, during which the gather runs
        t0 = time.perf_counter()
        step()
        sync()
        return (time.perf_counter() - t0) * 1e3

    prefetched()
    exposed = [prefetched() for _ in range(iters)]
    res["exposed_after_prefetch_ms"] = statistics.median(exposed)
    res["device_path_ms"] = timed(lambda: step(holes=True), sync, iters)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--platform", default=None, help="HAL platform for kv_dequantize (default: reference)")
    ap.add_argument("--vocab", type=int, default=80_000, help="engram_vocab_size: ~24 x this rows per table")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--dir", default=None, help="where the synthetic table file goes (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from shuili.core.models.engram import Engram, EngramTable
    from shuili.core.models.engram_hash import EngramSpec
    from shuili.hal import PlatformConfig, resolve_platform

    # num_embeddings follow from the hash (24 primes above vocab per layer): size a probe spec first
    fields = dict(layer_ids=(1, 6), max_ngram_size=4, n_heads=8, head_dim=256, vocab_size=args.vocab,
                  pad_id=2, compressed_vocab_size=99092)
    spec = EngramSpec(**fields, num_embeddings=tuple(EngramSpec.model_construct(**fields).table_rows))
    resolved = resolve_platform(PlatformConfig(platform=args.platform or "reference"))
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    transfer = resolved.transfer
    tmp = args.dir or tempfile.mkdtemp(prefix="engram_bench_")
    os.makedirs(tmp, exist_ok=True)
    path = os.path.join(tmp, f"engram_{args.vocab}.safetensors")
    if not os.path.exists(path):
        write_tables(path, spec)
    tables = {lid: EngramTable.from_safetensors(path, f"engram.{lid}.weight", f"engram.{lid}.scale")
              for lid in spec.layer_ids}
    tmap = torch.randint(0, spec.compressed_vocab_size, (129280,), generator=torch.Generator().manual_seed(0))
    engram = Engram(spec, tmap, tables, resolved.ops, device=device, dtype=torch.bfloat16, transfer=transfer)
    info = {"device": str(device), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "table_rows": spec.num_embeddings, "table_file_gb":
            round(os.path.getsize(path) / 1e9, 2), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(info))
    results = [run_case(engram, "decode b64", 64, 64, device, sync, args.iters, args.compute_ms, 129280),
               run_case(engram, "prefill chunk 4096", 4096, 1, device, sync, max(3, args.iters // 3),
                        args.compute_ms, 129280)]
    for r in results:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    engram.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
