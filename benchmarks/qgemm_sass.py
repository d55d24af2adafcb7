"""Compile the quantized GEMM kernels for sm_90 without a GPU and report what the compiler made of them.

For each configuration: registers, stack (spill) bytes, dynamic shared memory, and counts of chosen
SASS instructions per kernel: HGMMA (Hopper warpgroup MMA) / HMMA (mma.sync), LDGSTS (asynchronous
global->shared copies, i.e. software-pipelined loads), LDG.E.U8 (single-byte global loads),
LDL/STL (local-memory spill traffic), I2F, FMUL. "old" is gemm.py's _gemm_kernel at the tile it
picks for that case, "new" is qgemm.py's _qgemm_kernel at its tile. Integer arguments are marked
divisible by 16, as Triton's launcher specialises them at run time for these shapes.

Then, for the new kernel, the main K loop (the largest backward branch whose body holds the MMAs):
its SASS instructions per thread ("loop"), and "per elem" = loop x threads / weight elements one
iteration dequantizes (BN x BK, twice for the SwiGLU GEMM), i.e. issue slots per weight element,
the cost the dequantisation adds to a decode GEMM that should be bound by weight bytes. Beside it
the loop's shared-memory traffic (STS/LDS/LDSM), shuffles (SHFL) and byte/bit shuffling
(PRMT/LOP3), which show layout conversions, and its float work (FMUL, F2FP conversions) and
compares/selects (ISETP/SEL); FTZ counts flush-to-zero float multiplies, adds and conversions in
the whole kernel (the mxfp4 decode relies on subnormals being kept, so it must read 0).

It needs Triton's bundled ptxas and cuobjdump (any host) and also compiles every constexpr
combination the ops launch, so a GPU-only compile error shows here first:

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/qgemm_sass.py [--all]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shuili.platforms.nvidia import gemm, qgemm

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OPS = ("HGMMA", "HMMA", "LDGSTS", "LDG.E.U8", "LDL", "STL", "I2F", "FMUL")
# loop-body columns: label -> opcode prefixes (the opcode up to its first dot, or whole)
LOOP_OPS = {"STS": ("STS",), "LDS": ("LDS",), "LDSM": ("LDSM",), "SHFL": ("SHFL",), "PRMT": ("PRMT",),
            "LOP3": ("LOP3",), "FMUL": ("FMUL", "FFMA", "HMUL2", "HFMA2"), "F2FP": ("F2FP", "F2F", "I2F"),
            "ISETP/SEL": ("ISETP", "SEL", "FSEL")}
FLOAT_OPS = ("FMUL", "FFMA", "FADD", "F2FP", "HMUL2", "HFMA2", "HADD2")  # ops that could flush a weight


def compile_kernel(old, fmt, bm, bn, bk, nw, ns, grouped=False, swiglu=False, xidx=False, yidx=False,
                   f32=False, hilo=False, split=1, bias=False, limit=False, planes=False, diag=False):
    fn = gemm._gemm_kernel if old else qgemm._qgemm_kernel
    vals = dict(FMT=fmt, GROUPED=grouped, X_IDX=xidx, Y_IDX=yidx, HAS_BIAS=bias, SWIGLU=swiglu, HAS_LIMIT=limit,
                F32=f32, HILO=hilo, NATIVE_FP8=True, SPLIT=split, BM=bm, BN=bn, BK=bk)
    if not old:
        vals["PLANES"] = planes
        vals["ASM_E2M1"] = qgemm.ASM_E2M1
        vals["DIAG"] = diag
        vals["BF16_EVEN_ODD"] = qgemm.MXFP4_BF16_EVEN_ODD
        vals["s_sg"] = 1  # row-major scales: the launcher specialises the stride 1 to a constant
    act = "*fp32" if (f32 or (hilo and not planes)) else "*bf16"
    out = "*fp32" if (split > 1 or (swiglu and not planes) or yidx or hilo or f32) else "*bf16"
    ptr = {"x_ptr": act, "y_ptr": out, "w_ptr": "*u8", "s_ptr": "*fp32" if fmt == 1 else "*u8", "b_ptr": act,
           "yw_ptr": "*fp32", "limit": "fp32"}
    sig, cst, attrs = {}, {}, {}
    for i, p in enumerate(fn.arg_names):
        if p in vals:
            sig[p], cst[p] = "constexpr", vals[p]
            continue
        sig[p] = ptr.get(p, "*i64" if p.endswith("_ptr") else "i32")
        if sig[p] != "fp32" and p not in ("M", "TOPK"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, cst, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=nw, num_stages=ns))


def dump(k) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return res, sass


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every SASS instruction, NOPs left out (alignment padding)."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _INSN.finditer(sass) if m.group(3) != "NOP"]


def main_loop(sass: str) -> list[tuple[int, str, str]]:
    """The instructions of the largest loop (backward branch) that holds an MMA; the whole kernel if
    none does. A software-pipelined loop's body is one steady-state iteration."""
    ins = instructions(sass)
    best = ins
    for addr, op, arg in ins:
        t = re.search(r"0x([0-9a-f]+)", arg)
        if not op.startswith("BRA") or not t or int(t.group(1), 16) >= addr:
            continue
        body = [i for i in ins if int(t.group(1), 16) <= i[0] <= addr]
        if any(o.startswith(("HMMA", "HGMMA")) for _, o, _ in body) and (best is ins or len(body) > len(best)):
            best = body
    return best


def loop_report(k, elems: int, nw: int) -> str:
    """Main-loop SASS per thread, per weight element dequantized in one iteration, by column."""
    body = main_loop(dump(k)[1])
    cols = " ".join(f"{lab}={sum(op.split('.')[0] in pre for _, op, _ in body)}" for lab, pre in LOOP_OPS.items())
    # the mxfp4 decode's exactness needs subnormals kept: any flush-to-zero float op shows here
    ftz = sum(op.startswith(FLOAT_OPS) and (".FTZ" in op or ".FMZ" in op) for _, op, _ in instructions(dump(k)[1]))
    cols += f" FTZ={ftz}"
    return f"loop {len(body):>4} insn, {len(body) * 32 * nw / elems:5.2f} per elem  {cols}"


def report(k) -> str:
    res, sass = dump(k)
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    found = {op: len(re.findall(re.escape(op) + r"\b", sass)) for op in OPS}
    counts = " ".join(f"{op}={n}" for op, n in found.items())
    return f"regs {m.group(1):>3} stack {m.group(2):>4} smem {k.metadata.shared // 1024:>3} KB  {counts}"


def new_opts(bm):
    return (4, 4) if bm <= 16 else (8, 3)


CASES = [  # (label, old kernel kwargs, new kernel kwargs)
    ("mxfp4 linear M64", dict(fmt=2, bm=64, bn=64, bk=64, nw=4, ns=3), dict(fmt=2, bm=64, bn=64, bk=128)),
    ("mxfp4 linear M16", dict(fmt=2, bm=16, bn=64, bk=128, nw=4, ns=3), dict(fmt=2, bm=16, bn=64, bk=128)),
    ("fp8 linear M64", dict(fmt=1, bm=64, bn=64, bk=64, nw=4, ns=3), dict(fmt=1, bm=64, bn=64, bk=128)),
    ("fp8 linear M16", dict(fmt=1, bm=16, bn=64, bk=128, nw=4, ns=3), dict(fmt=1, bm=16, bn=64, bk=128)),
    ("mxfp4 moe GEMM1 (12 rows/expert)", dict(fmt=2, bm=16, bn=64, bk=128, nw=4, ns=3, grouped=True),
     dict(fmt=2, bm=16, bn=64, bk=128, grouped=True, swiglu=True, xidx=True, limit=True, planes=True)),
    ("mxfp4 moe GEMM2 (12 rows/expert)", dict(fmt=2, bm=16, bn=64, bk=128, nw=4, ns=3, grouped=True, hilo=True),
     dict(fmt=2, bm=16, bn=64, bk=128, grouped=True, hilo=True, yidx=True, planes=True)),
    # the MoE GEMMs at the default-mode decode tiles qgemm.MOE_TILES picks (BN, BK, warps, stages)
    ("mxfp4 moe GEMM1 at MOE_TILES", dict(fmt=2, bm=16, bn=64, bk=128, nw=4, ns=3, grouped=True),
     dict(fmt=2, bm=16, bn=qgemm.MOE_TILES["gemm1"][0], bk=qgemm.MOE_TILES["gemm1"][1], grouped=True,
          swiglu=True, xidx=True, limit=True, planes=True, opts=qgemm.MOE_TILES["gemm1"][2:4])),
    ("mxfp4 moe GEMM2 at MOE_TILES", dict(fmt=2, bm=16, bn=64, bk=128, nw=4, ns=3, grouped=True, hilo=True),
     dict(fmt=2, bm=16, bn=qgemm.MOE_TILES["gemm2"][0], bk=qgemm.MOE_TILES["gemm2"][1], grouped=True,
          hilo=True, yidx=True, planes=True, opts=qgemm.MOE_TILES["gemm2"][2:4])),
    # the hi/lo split of a float32 input per K step, as grouped_linear still launches it
    ("mxfp4 GEMM2, float32 input split", dict(fmt=2, bm=16, bn=64, bk=128, nw=4, ns=3, grouped=True, hilo=True),
     dict(fmt=2, bm=16, bn=64, bk=128, grouped=True, hilo=True, yidx=True)),
]
# every other constexpr combination the ops launch (compile check only)
EXTRA = [dict(fmt=f, bm=bm, bn=64, bk=32 if kw.get("f32") else 128, **kw) for f in (1, 2) for bm in (16, 32, 64)
         for kw in (dict(bias=True), dict(split=3, bias=True), dict(f32=True, split=2), dict(grouped=True, f32=True),
                    dict(grouped=True, hilo=True), dict(grouped=True, split=2),
                    dict(grouped=True, swiglu=True, xidx=True, limit=True),
                    dict(grouped=True, swiglu=True, xidx=True, limit=True, planes=True),
                    dict(grouped=True, swiglu=True, xidx=True, limit=True, f32=True),
                    dict(grouped=True, hilo=True, yidx=True), dict(grouped=True, hilo=True, yidx=True, planes=True),
                    dict(grouped=True, f32=True, yidx=True), dict(grouped=True, diag=True),
                    dict(grouped=True, diag=True, split=2))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="also compile every launched constexpr combination")
    a = ap.parse_args()
    for label, old, new in CASES:
        print(f"{label:<34} old: {report(compile_kernel(True, **old))}", flush=True)
        new = dict(new)
        nw, ns = new.pop("opts", new_opts(new["bm"]))
        k = compile_kernel(False, nw=nw, ns=ns, **new)
        print(f"{'':<34} new: {report(k)}", flush=True)
        elems = new["bn"] * new["bk"] * (2 if new.get("swiglu") else 1)
        print(f"{'':<34}      {loop_report(k, elems, nw)}", flush=True)
    if a.all:
        for kw in EXTRA:
            nw, ns = new_opts(kw["bm"])
            print(f"compiles {kw}: {report(compile_kernel(False, nw=nw, ns=ns, **kw))}", flush=True)


if __name__ == "__main__":
    main()
