"""Batch-invariant dense linears of one mid-v4 decode step (platforms/nvidia/gemm.py's own kernel):
candidate tiles against the current ones and against cuBLAS (default mode), timed over the step's
dense linears, each candidate's bits held to batch invariance (one row alone = the same row in a
batch of M).

Two knobs, both fixed for every M (so any choice is batch-invariant):
- gemm.BI_TILE_F32 (BM, BN, BK, warps): float32 activations, IEEE FMA dots; the mHC mixing
  linears and the routers;
- gemm.BI_TILE (BM, BN, BK): bf16 activations, tensor-core dots; the compressor and indexer
  weights_proj linears (dense in the released formats too) and, in bf16 checkpoints, every linear.

Shapes and per-step counts come from the model's weight schema. --apply writes a shell script that
sets the best candidates in platforms/nvidia/gemm.py (used inside a device call to validate them).

    python benchmarks/nvidia_bi_linear.py [--m 1,64,256] [--json out.json] [--apply apply.sh]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvidia_qgemm import L2_BYTES, graph_time  # noqa: E402

from shuili.core.models.deepseek_v4_config import named  # noqa: E402
from shuili.core.models.deepseek_v4_loader import schema  # noqa: E402
from shuili.hal.types import Weight  # noqa: E402
from shuili.platforms.nvidia import gemm  # noqa: E402

DEV = "cuda"
F32_CANDIDATES = [(64, 64, 64, 4), (16, 32, 32, 4), (16, 32, 32, 2), (16, 32, 64, 4), (32, 32, 32, 4),
                  (16, 64, 32, 4), (32, 64, 32, 4), (64, 32, 32, 4), (16, 16, 64, 2), (16, 32, 128, 4),
                  (32, 32, 64, 4)]
BF16_CANDIDATES = [(64, 64, 64), (64, 128, 64), (64, 64, 128), (32, 64, 128), (16, 64, 128),
                   (64, 32, 128), (16, 128, 64), (32, 128, 64), (16, 64, 64)]


def step_linears(model: str = "mid-v4") -> dict[str, Counter]:
    """(N, K) -> calls per decode step, by activation kind: 'f32' (mHC mixing and routers), 'dense'
    (bf16 in every format: compressors, with wkv and wgate concatenated as the model runs them, the
    indexer's weights_proj and the LM head) and 'linear' (bf16 only in bf16 checkpoints). MTP layers excluded."""
    out = {"f32": Counter(), "dense": Counter(), "linear": Counter()}
    for name, spec in schema(named(model)).items():
        if name.startswith("mtp") or len(spec.shape) != 2:
            continue
        if spec.kind == "f32" and (name.endswith("_fn") or name.endswith(".gate.weight")):
            out["f32"][spec.shape] += 1
        elif spec.kind == "dense" and ".compressor.wkv." in name:
            out["dense"][(2 * spec.shape[0], spec.shape[1])] += 1
        elif spec.kind == "dense" and (name.endswith("weights_proj.weight") or name == "head.weight"):
            out["dense"][spec.shape] += 1
        elif spec.kind == "linear":
            out["linear"][spec.shape] += 1
    return out


def one_shape(n, k, m, dtype, bi):
    """(graph-replayed seconds of linear(x [m, k], W [n, k]) over rotated weight copies, row m - 1
    alone equal to it in the batch, relative error against float64)."""
    copies = max(1, min(64, L2_BYTES // (n * k * dtype.itemsize) + 1))
    g = torch.Generator(device=DEV).manual_seed(n * 7 + k)
    ws = [Weight.dense(torch.randn(n, k, device=DEV, generator=g).to(dtype) * k ** -0.5) for _ in range(copies)]
    x = torch.randn(max(m, 2), k, device=DEV, generator=g).to(dtype)[:m]
    t = graph_time([lambda w=w: gemm.linear(x, w, batch_invariant=bi) for w in ws], ms=30)
    full = gemm.linear(x, ws[0], batch_invariant=bi)
    one = gemm.linear(x[m - 1:m].clone(), ws[0], batch_invariant=bi)
    want = x.double() @ ws[0].data.double().t()
    err = float((full.double() - want).norm() / want.norm())
    return t, (torch.equal(one, full[m - 1:m]) if bi else True), err


def sweep(shapes, dtype, knob: str, candidates, ms):
    """{candidate: {(n, k, m): (seconds, invariant, rel err)} or {"error": ...}}, "cublas" first
    (default mode, for reference), then the candidates in order (the first is the tile in use)."""
    keep = getattr(gemm, knob)
    res = {}
    for cand in ["cublas"] + candidates:
        if cand != "cublas":
            setattr(gemm, knob, tuple(cand))
        row = {}
        try:
            for m in ms:
                for n, k in shapes:
                    row[(n, k, m)] = one_shape(n, k, m, dtype, cand != "cublas")
        except Exception as exc:  # noqa: BLE001 (out of resources for this tile: record and go on)
            row = {"error": f"{type(exc).__name__}: {str(exc)[:80]}"}
        finally:
            setattr(gemm, knob, keep)
        res[str(cand)] = row
        print(knob, cand, "error" in row and row["error"] or "", flush=True)
    return res


def totals(row, counts: Counter, m):
    """(us per step: sum of count x time, every shape invariant, max rel err) at M = m."""
    t = sum(cnt * row[(n, k, m)][0] for (n, k), cnt in counts.items())
    return t * 1e6, all(row[(n, k, m)][1] for n, k in counts), max(row[(n, k, m)][2] for n, k in counts)


def best(res, counts, ms, m_pick=64):
    """The candidate with the least step time at m_pick that is batch-invariant at every M and not
    more than 5% slower than the tile in use at any M."""
    cur = res[list(res)[1]]
    ok = [(totals(r, counts, m_pick)[0], c) for c, r in res.items()
          if c != "cublas" and "error" not in r and all(totals(r, counts, m)[1] for m in ms)
          and all(totals(r, counts, m)[0] <= 1.05 * totals(cur, counts, m)[0] for m in ms)]
    return min(ok)[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,64,256")
    ap.add_argument("--json", default=None)
    ap.add_argument("--apply", default=None, help="write sed lines that set the best tiles in gemm.py")
    a = ap.parse_args()
    ms = [int(v) for v in a.m.split(",")]
    shapes = step_linears()
    print({k: dict(v) for k, v in shapes.items()}, flush=True)
    f32 = sweep(list(shapes["f32"]), torch.float32, "BI_TILE_F32", F32_CANDIDATES, ms)
    both = shapes["dense"] + shapes["linear"]
    bf16 = sweep(list(both), torch.bfloat16, "BI_TILE", BF16_CANDIDATES, ms)
    pick_f32, pick_bf16 = best(f32, shapes["f32"], ms), best(bf16, both, ms)
    lines = []
    for title, res, counts in (("float32 (mHC mixing, routers)", f32, shapes["f32"]),
                               ("bf16, every dense linear of a bf16-checkpoint step", bf16, both),
                               ("bf16, the dense linears of a released-format step", bf16, shapes["dense"])):
        lines.append(f"\n{title}: us per step (sum over the step's calls), by M")
        lines.append(f"{'tile':<22}" + "".join(f"{'M' + str(m):>10}" for m in ms) + "  invariant  max rel err")
        for c, r in res.items():
            if "error" in r:
                lines.append(f"{c:<22}  {r['error']}")
                continue
            tt_ = [totals(r, counts, m) for m in ms]
            lines.append(f"{c:<22}" + "".join(f"{t[0]:10.1f}" for t in tt_)
                         + f"  {str(all(t[1] for t in tt_)):>9}  {max(t[2] for t in tt_):.1e}")
    lines.append(f"\npicked: BI_TILE_F32 = {pick_f32}, BI_TILE = {pick_bf16}")
    print("\n".join(lines), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            flat = {kn: {c: ({f"{n}x{k}@M{m}": v for (n, k, m), v in r.items()} if "error" not in r else r)
                         for c, r in res.items()} for kn, res in (("f32", f32), ("bf16", bf16))}
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **flat,
                       "pick": [pick_f32, pick_bf16]}, f, indent=1)
    if a.apply:
        with open(a.apply, "w") as f:
            f.write(f"sed -i 's/^BI_TILE_F32 = .*/BI_TILE_F32 = {pick_f32}/' platforms/nvidia/gemm.py\n")
            f.write(f"sed -i 's/^BI_TILE = ([0-9, ]*)/BI_TILE = {pick_bf16}/' platforms/nvidia/gemm.py\n")
            f.write("grep -n '^BI_TILE' platforms/nvidia/gemm.py\n")


if __name__ == "__main__":
    main()
