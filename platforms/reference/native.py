"""The reference platform's compiled loops, built on first use, loaded with ctypes: the GEMM
(`native/fixed_gemm.c`), the row ops add_rms_norm, swiglu, log_softmax (`native/rowops.c`) and
paged attention (`native/attention.c`); the last two repeat numerics' IEEE operations in order (see
their headers).

Why a compiled GEMM and why its bits are still the oracle's: `numerics.dot_bits` keeps every
partial sum of the fixed-point products an integer below 2**53, so any summation order gives the
same float64 sum. The C loop may block, vectorise, fuse multiply-adds and split the output columns
over threads as it likes and still return exactly the torch float64 matmul path's bits; its
finishing `(acc + 0.0) * sa * sb -> float32` repeats `numerics.scaled_matmul`'s operations in order.
What it gains: the weight grid is read in panels laid out for the loop, with no BLAS packing per
call: as float32 (exact: |q| <= 2**21 at K >= 2, 2**24 at most), half the bytes of the float64 grid,
or, for a GGUF-quantized weight, as 4- or 8-bit affine codes (`Panels`), an eighth to a quarter of
that.

Built with the C compiler found as $CC, `cc` or `gcc` (`-O3 -march=native`, never `-ffast-math`)
into $SHUILI_CACHE_DIR (default ~/.cache/shuili/native), keyed by the source, the compiler and the
CPU's feature flags, written atomically, so concurrent processes and hosts sharing a home directory
do not clash. At load the kernel is checked bit for bit against the torch path on a small case with
edge values, each row op against its torch form; a host without a compiler, a failed build or a
failed check falls back to the torch forms (same bits, slower) with one warning.
SHUILI_REFERENCE_NATIVE=0 turns all three libraries off. SHUILI_REFERENCE_NATIVE_CFLAGS adds
compiler flags to every build (part of the cache key): `-mno-avx512f` builds, on an AVX-512 host,
the 256-bit kernels an AVX2-only host gets (benchmarks/cpu_vs_transformers.py's AVX2 row).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from shuili.hal import numerics

log = logging.getLogger(__name__)

NR = 8  # output columns per packed weight panel: fixed_gemm.c's NR
_DIR = Path(__file__).with_name("native")
# library -> (source, extra flags). rowops repeats numerics' IEEE operations one by one: no fused
# multiply-add may merge two of its roundings. The GEMM's sums are exact, so it may fuse freely.
# -fno-trapping-math and -fno-math-errno change no value (no trap or errno is ever read) but let
# the exp loops be if-converted and vectorised; a Horner loop of fixed length (EXP_N, numerics'
# coefficient count) unrolls, which a count known only at run time would not.
_LIBS = {"gemm": ("fixed_gemm.c", []),
         "rowops": ("rowops.c", ["-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno",
                                 f"-DEXP_N={len(numerics._EXP_COEFFS)}"]),
         "attention": ("attention.c", ["-ffp-contract=off", f"-DEXP_N={len(numerics._EXP_COEFFS)}"])}
MAX_BITS = 24  # float32 holds every integer grid value |q| <= 2**24 exactly
_MAX_GRID = float(1 << MAX_BITS)
_lock = threading.Lock()
_state: dict = {}


def enabled(name: str = "gemm") -> bool:
    """True when the compiled library `name` ("gemm", "rowops" or "attention") is built, loaded and has passed
    its bit check."""
    return _library(name) is not None


def status() -> str:
    """One line per library: 'native (<path>)', or 'torch (<why>)' where the torch path is in use."""
    parts = []
    for name in _LIBS:
        lib = _library(name)
        parts.append(f"{name}: " + (f"native ({_state[name, 'path']})" if lib is not None
                                     else f"torch ({_state.get((name, 'why'), 'off')})"))
    return "; ".join(parts)


class Panels(NamedTuple):
    """A weight grid laid out for fixed_gemm.c: ceil(N / NR) panels of NR output rows, rows past N
    zero. bits 32: float32 data [..., P, K, NR], the grid values. bits 8 or 4: the affine form,
    uint8 data [..., P, K / CH, chunk_bytes(bits)]: per panel and chunk of CH columns, NR float32
    steps D, NR float32 offsets M, then CH x NR codes c (one byte each, or two to a byte: row 2t in
    the low nibble of byte row t), each grid value being D * c + M. Every chunk of the bundled
    SmolLM2's Q4_1 and Q8_0 weights has this form (`pack` verifies it chunk by chunk; a weight with
    one chunk that does not keeps float32 panels). It holds the weights in 0.75 or 1.25 bytes per
    value instead of 4, so a decode step streams a fifth of the bytes. The kernel decodes it
    exactly in float32 (`pack` keeps D * c and D * c + M integers of magnitude at most 2**24), so
    every form gives the same bits."""
    data: torch.Tensor
    bits: int

    def group(self, e: int) -> "Panels":
        """The panels of group e of a grouped [E, N, K] weight."""
        return Panels(self.data[e], self.bits)


CH = 32  # K per affine chunk: fixed_gemm.c's CH


def chunk_bytes(bits: int) -> int:
    return 2 * NR * 4 + CH * NR * bits // 8


def pack(q: torch.Tensor, affine: bool = True) -> Panels:
    """Integer-valued float64 grid q [..., N, K] -> its `Panels`: the affine form with the fewest
    bits that holds every chunk exactly (when `affine`), else float32. Exact when |q| <= 2**24
    (checked; `numerics.dot_bits` gives the weight side at most 24 bits from K = 9 on)."""
    big = q.abs() > _MAX_GRID
    if bool(big.any()) and bool((big & q.isfinite()).any()):  # inf and nan are float32 values too
        raise ValueError("a fixed-point weight grid exceeds 2**24 and would not be exact in float32")
    *lead, n, k = q.shape
    packed = _pack_affine(q) if affine else None
    if packed is not None:
        return packed
    panels = -(-n // NR)
    p = torch.zeros(*lead, panels * NR, k, dtype=torch.float32)
    p[..., :n, :] = q
    return Panels(p.view(*lead, panels, NR, k).transpose(-1, -2).contiguous(), 32)


_AFFINE_ROWS = 4096  # rows per slice of the affine search: bounds its temporaries (~19 MB each at K = 576)


def _pack_affine(q: torch.Tensor) -> Panels | None:
    """q [..., N, K] in the affine form of `Panels`, or None where some chunk has no 8-bit affine
    form (or K is not whole chunks, or a value is not finite)."""
    *lead, n, k = q.shape
    if k % CH or k == 0 or n == 0:
        return None
    panels = -(-n // NR)
    flat = q.reshape(-1, n, k)
    codes = torch.zeros(flat.shape[0], panels * NR, k, dtype=torch.uint8)
    dm = torch.zeros(flat.shape[0], panels * NR, k // CH, 2, dtype=torch.float32)
    for e in range(flat.shape[0]):
        for r0 in range(0, n, _AFFINE_ROWS):
            g = flat[e, r0:r0 + _AFFINE_ROWS].reshape(-1, k // CH, CH)
            low = g.amin(-1)  # nan where a chunk holds one; an inf fails the equality below
            if not bool(low.isfinite().all()):
                return None
            diff = (g - low[..., None]).to(torch.int32)  # exact: integers below 2**25
            step = _chunk_gcd(diff)
            c = diff // step[..., None]
            d32, m32 = step.to(torch.float32), low.to(torch.float32)
            d64, m64 = d32.double(), m32.double()
            # D and M float32 values, D * c within float32's integers (the kernel decodes in float32), and
            # D * c + M the grid (== holds -0 == +0, which no sum can tell apart)
            dc = d64[..., None] * c
            if (int(c.max()) > 255 or not torch.equal(d64, step.double()) or not torch.equal(m64, low)
                    or float(dc.max()) > _MAX_GRID or not torch.equal(dc + m64[..., None], g)):
                return None
            rows = g.shape[0]
            codes[e, r0:r0 + rows] = c.reshape(rows, k).to(torch.uint8)
            dm[e, r0:r0 + rows, :, 0] = d32
            dm[e, r0:r0 + rows, :, 1] = m32
    bits = 4 if int(codes.max()) < 16 else 8
    # [E, P * NR, ...] -> [E, P, K / CH, ..., NR]: a panel's rows innermost
    c = codes.view(-1, panels, NR, k // CH, CH).permute(0, 1, 3, 4, 2)
    if bits == 4:
        c = c[..., 0::2, :] | (c[..., 1::2, :] << 4)
    d = dm.view(-1, panels, NR, k // CH, 2).permute(0, 1, 3, 4, 2)  # [E, P, K / CH, 2, NR]: D[NR] then M[NR]
    d = d.contiguous().view(torch.uint8).reshape(-1, panels, k // CH, 2 * NR * 4)
    data = torch.cat([d, c.reshape(-1, panels, k // CH, CH * NR * bits // 8)], -1)
    return Panels(data.reshape(*lead, panels, k // CH, chunk_bytes(bits)).contiguous(), bits)


def _chunk_gcd(diff: torch.Tensor) -> torch.Tensor:
    """gcd of each chunk's non-negative differences diff [..., CH] (1 for an all-zero chunk). The
    smallest positive difference is the gcd wherever it divides all the others (a quantized chunk
    nearly always holds codes 0 and 1); the rest take torch.gcd column by column."""
    big = torch.iinfo(diff.dtype).max
    step = torch.where(diff > 0, diff, big).amin(-1)
    step = torch.where(step == big, 1, step)
    odd = ~(diff % step[..., None] == 0).all(-1)
    if bool(odd.any()):
        rest, g = diff[odd], torch.zeros_like(step[odd])
        for j in range(CH):
            g = torch.gcd(g, rest[..., j])
        step[odd] = g
    return step


def _check_panels(panels: Panels, n: int, k: int) -> None:
    if not isinstance(panels, Panels):
        raise TypeError(f"expected native.Panels (from native.pack), got {type(panels).__name__}")
    p, d = -(-n // NR), panels.data
    if panels.bits == 32:
        ok = d.shape == (p, k, NR) and d.dtype == torch.float32
    else:
        ok = (panels.bits in (4, 8) and k % CH == 0 and d.shape == (p, k // CH, chunk_bytes(panels.bits))
              and d.dtype == torch.uint8)
    if not ok or not d.is_contiguous():
        raise ValueError(f"panels {tuple(d.shape)} {d.dtype} ({panels.bits} bits) do not pack an [{n}, {k}] weight")


def _threads(m: int, n: int, k: int, threads: int | None) -> int:
    if m * n * k < (1 << 20):  # below ~1M multiply-adds a thread start costs more than it saves
        return 1
    return torch.get_num_threads() if threads is None else threads


def gemm(qa: torch.Tensor, sa: torch.Tensor, panels: Panels, sb: torch.Tensor, n: int,
         threads: int | None = None) -> torch.Tensor:
    """float32 [M, N] = ((qa @ q^T + 0.0) * sa * sb) for qa [M, K] float64 integer grids, sa [M, 1],
    sb [1, N] float64 and `pack(q)`'s panels [ceil(N / NR), K, NR]: numerics.scaled_matmul's bits."""
    lib = _need("gemm")
    m, k = qa.shape
    _check_panels(panels, n, k)
    qa = qa.to(torch.float64).contiguous()
    sa = sa.to(torch.float64).reshape(m).contiguous()
    sb = sb.to(torch.float64).reshape(n).contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        nt = _threads(m, n, k, threads)
        rc = lib.shuili_fixed_gemm(qa.data_ptr(), sa.data_ptr(), m, k, panels.data.data_ptr(), panels.bits,
                                   sb.data_ptr(), n, out.data_ptr(), nt)
        if rc == 1:
            raise MemoryError("native.gemm: no memory for the kernel's panel buffers")
        if rc:
            raise ValueError(f"native.gemm cannot read {panels.bits}-bit panels of K = {k}")
    return out


def linear(x: torch.Tensor, pa: int, panels: Panels, sb: torch.Tensor, n: int,
           threads: int | None = None) -> torch.Tensor:
    """float32 x [M, K] -> float32 [M, N]: x's rows on their `numerics.to_fixed(x, pa)` grids times
    `pack(q)`'s panels, scaled by sb [1, N] as `gemm`: the bits of to_fixed then scaled_matmul, with
    the grids built in the same call."""
    lib = _need("gemm")
    m, k = x.shape
    _check_panels(panels, n, k)
    if x.dtype != torch.float32:
        raise ValueError(f"native.linear takes float32 activations, got {x.dtype}")
    x = x.contiguous()
    sb = sb.to(torch.float64).reshape(n).contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        nt = _threads(m, n, k, threads)
        rc = lib.shuili_fixed_linear(x.data_ptr(), m, k, pa, panels.data.data_ptr(), panels.bits, sb.data_ptr(), n,
                                     out.data_ptr(), nt)
        if rc == 1:
            raise MemoryError(f"native.linear: no memory for the [{m}, {k}] float64 activation grid")
        if rc:
            raise ValueError(f"native.linear cannot read {panels.bits}-bit panels of K = {k}")
    return out


def _need(name: str):
    lib = _library(name)
    if lib is None:
        raise RuntimeError(f"the native {name} library is not available: {_state.get((name, 'why'))}")
    return lib


def _library(name: str):
    if name in _state:
        return _state[name]
    with _lock:
        if name not in _state:
            lib = None
            if os.environ.get("SHUILI_REFERENCE_NATIVE", "1") == "0":
                _state[name, "why"] = "SHUILI_REFERENCE_NATIVE=0"
            else:
                try:
                    lib, path = _load(name)
                    _CHECKS[name](lib)
                    _state[name, "path"] = path
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    lib = None
                    _state[name, "why"] = str(e)
                    log.warning("shuili reference: the compiled %s library is unavailable (%s); using "
                                "the torch ops instead (the same bits, slower). Install a C compiler "
                                "(gcc or clang) or set SHUILI_REFERENCE_NATIVE=0 to silence this.", name, e)
            _state[name] = lib
    return _state[name]


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("SHUILI_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shuili")
    return Path(root) / "native"


def _load(name: str) -> tuple[ctypes.CDLL, Path]:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    src_name, flags = _LIBS[name]
    flags = [*flags, *shlex.split(os.environ.get("SHUILI_REFERENCE_NATIVE_CFLAGS", ""))]
    src = _DIR / src_name
    omp = _torch_openmp()
    headers = [h.read_bytes() for h in sorted(_DIR.glob("*.h"))]  # numerics.h: shared by every library
    key = hashlib.sha256(b"\0".join([src.read_bytes(), *headers, version.encode(), _cpu_flags().encode(),
                                     platform.machine().encode(), " ".join(flags + omp).encode()])
                         ).hexdigest()[:16]
    out = _cache_dir() / f"{src.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _build(cc, src, flags, omp, out)
    lib = ctypes.CDLL(str(out))
    _SIGNATURES[name](lib)
    return lib, out


def _gemm_signature(lib) -> None:
    p = ctypes.c_void_p
    i64, i32 = ctypes.c_int64, ctypes.c_int
    lib.shuili_fixed_gemm.argtypes = [p, p, i64, i64, p, i32, p, i64, p, i32]
    lib.shuili_fixed_gemm.restype = ctypes.c_int
    lib.shuili_fixed_linear.argtypes = [p, i64, i64, i32, p, i32, p, i64, p, i32]
    lib.shuili_fixed_linear.restype = ctypes.c_int


def _rowops_signature(lib) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.shuili_rms_norm.argtypes = [p, p, p, i64, i64, f32, p, p]
    lib.shuili_rms_norm.restype = ctypes.c_int
    lib.shuili_swiglu.argtypes = [p, i64, i64, ctypes.c_int, f32, p, ctypes.c_int]
    lib.shuili_swiglu.restype = None
    lib.shuili_log_softmax.argtypes = [p, i64, i64, p, ctypes.c_int]
    lib.shuili_log_softmax.restype = ctypes.c_int
    lib.shuili_rope.argtypes = [p, i64, i64, i64, i64, p, p, i64, ctypes.c_int, ctypes.c_int, p]
    lib.shuili_rope.restype = None
    d = ctypes.c_double
    lib.shuili_rowops_init.argtypes = [p, ctypes.c_int, p, ctypes.c_int, d, d, d, d]
    lib.shuili_rowops_init.restype = ctypes.c_int
    exp_c = (d * len(numerics._EXP_COEFFS))(*numerics._EXP_COEFFS)
    log_c = (d * len(numerics._LOG_COEFFS))(*numerics._LOG_COEFFS)
    if lib.shuili_rowops_init(ctypes.addressof(exp_c), len(exp_c), ctypes.addressof(log_c), len(log_c),
                              numerics._LN2_HI, numerics._LN2_LO, numerics._INV_LN2, numerics._SQRT2):
        raise RuntimeError(f"rowops was built for another exp coefficient count than numerics' {len(exp_c)}")


def _torch_openmp() -> list[str]:
    """Link flags for the OpenMP runtime torch loaded (its own libgomp copy in pip wheels), so the
    kernel's threads are torch's team: a second runtime's spinning workers would share the cores
    with torch's after every op. Empty when torch has no libgomp of its own (then the compiler's)."""
    if torch.__config__.parallel_info().find("OpenMP") < 0:
        return []
    for line in Path("/proc/self/maps").read_text().splitlines() if Path("/proc/self/maps").exists() else []:
        path = line.split()[-1]
        if "/libgomp" in path and os.path.exists(path):
            return [f"-L{os.path.dirname(path)}", f"-l:{os.path.basename(path)}",
                    f"-Wl,-rpath,{os.path.dirname(path)}"]
    return []


def _build(cc: str, src: Path, extra: list[str], omp: list[str], out: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        errors = []
        # some compilers (and ARM gcc) refuse -march=native; clang may lack OpenMP: pthreads then
        for flags in (["-march=native", "-fopenmp", *omp], ["-fopenmp", *omp], ["-march=native"], []):
            cmd = [cc, "-O3", "-fPIC", "-shared", "-pthread", "-fno-fast-math", f"-I{_DIR}", *extra, *flags, str(src),
                   "-o", tmp, "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp, out)  # atomic: a concurrent builder's file is equally good
                return
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-400:]}")
        raise RuntimeError(f"building {src.name} failed: " + " | ".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_gemm(lib) -> None:
    """Bit equality with numerics.scaled_matmul on grids with ties, zeros of both signs, NaN, inf,
    subnormal and overflowing scales, ragged row and column counts, one and two threads; then, through
    gemm and linear alike, affine panels (4 and 8 bits, K over several blocks)."""

    g = torch.Generator().manual_seed(13)
    m, n, k = 13, 21, 37
    pa, pb = numerics.dot_bits(k)
    qa = torch.randint(-(1 << pa), (1 << pa) + 1, (m, k), generator=g).to(torch.float64)
    qb = torch.randint(-(1 << pb), (1 << pb) + 1, (n, k), generator=g).to(torch.float64)
    qa[0] = 0.0
    qa[1] = -0.0
    qb[2] = -0.0
    qa[3, 5] = float("nan")
    qa[4, 6] = float("inf")
    qb[5, 7] = float("-inf")
    sa = numerics.pow2(torch.randint(-1100, 200, (m, 1), generator=g))
    sb = numerics.pow2(torch.randint(-200, 1000, (1, n), generator=g))
    panels = pack(qb)
    _check_gemm_case(lib, qa, sa, panels, sb, numerics.scaled_matmul(qa, sa, qb, sb), "")
    x = _linear_check_rows(g, m, k, pa)
    qx, ex = numerics.to_fixed(x, pa)
    want = numerics.scaled_matmul(qx, numerics.pow2((ex - pa).clamp(-1022, 1023)), qb, sb)
    _check_linear_case(lib, x, pa, panels, sb, want, "")
    k = 13 * CH  # three K blocks of the kernel, the last one short
    pa, pb = numerics.dot_bits(k)
    x = _linear_check_rows(g, m, k, pa)
    qx, ex = numerics.to_fixed(x, pa)
    sx = numerics.pow2((ex - pa).clamp(-1022, 1023))
    for bits in (4, 8):
        qb = affine_grid(g, n, k, bits, pb)
        panels = pack(qb)
        if panels.bits != bits:
            raise RuntimeError(f"pack chose {panels.bits}-bit panels for a {bits}-bit affine grid")
        want = numerics.scaled_matmul(qx, sx, qb, sb)  # the same sums from the grids or the activations
        _check_gemm_case(lib, qx, sx, panels, sb, want, f" ({bits}-bit panels)")
        _check_linear_case(lib, x, pa, panels, sb, want, f" ({bits}-bit panels)")


def affine_grid(g: torch.Generator, n: int, k: int, bits: int, pb: int) -> torch.Tensor:
    """A float64 [n, k] weight grid whose chunks are D * c + M with `bits`-bit codes, |value| <= 2**pb
    (as a Q4_1 or Q8_0 weight's grid is): the largest step, a zero step, negative offsets, a zero row."""
    top = (1 << bits) - 1
    c = torch.randint(0, top + 1, (n, k // CH, CH), generator=g).to(torch.float64)
    step = torch.randint(1, (1 << (pb + 1)) // top + 1, (n, k // CH, 1), generator=g).to(torch.float64)
    step[0, 0] = 0.0
    low = -(step * top) / 2
    low = torch.where(torch.rand(low.shape, generator=g) < 0.5, low.floor(), -(step * top).clamp_max(1 << pb))
    q = (step * c + low).reshape(n, k)
    q[min(1, n - 1)] = 0.0
    return q


def _check_gemm_case(lib, qa, sa, panels: Panels, sb, want, what: str) -> None:
    m, k, n = qa.shape[0], qa.shape[1], want.shape[1]
    for threads in (1, 2):
        got = torch.empty(m, n, dtype=torch.float32)
        lib.shuili_fixed_gemm(qa.contiguous().data_ptr(), sa.contiguous().data_ptr(), m, k, panels.data.data_ptr(),
                              panels.bits, sb.contiguous().data_ptr(), n, got.data_ptr(), threads)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            raise RuntimeError(f"the native fixed-point GEMM disagrees with the torch path's bits{what} "
                               f"({threads} thread(s)); please report this with your compiler and CPU")


def _check_linear_case(lib, x, pa, panels: Panels, sb, want, what: str) -> None:
    m, k, n = x.shape[0], x.shape[1], want.shape[1]
    for threads in (1, 2):
        got = torch.empty(m, n, dtype=torch.float32)
        lib.shuili_fixed_linear(x.data_ptr(), m, k, pa, panels.data.data_ptr(), panels.bits, sb.contiguous().data_ptr(),
                                n, got.data_ptr(), threads)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            raise RuntimeError(f"the native fixed-point linear disagrees with numerics.to_fixed and the torch "
                               f"path's bits{what} ({threads} thread(s)); please report this with your compiler and CPU")


def _linear_check_rows(g: torch.Generator, m: int, k: int, pa: int) -> torch.Tensor:
    """float32 [m, k] activations with every case of the row grid: zero rows of both signs, a NaN,
    an infinity, subnormal-only and near-overflow rows, exact .5 ties of the rounding, and signed
    zeros inside a row."""
    x = torch.randn(m, k, generator=g) * numerics.pow2(torch.randint(-30, 30, (m, 1), generator=g)).float()
    x[0] = 0.0
    x[1] = -0.0
    x[2, 3] = float("nan")
    x[3, 4] = float("-inf")
    x[4] = torch.randint(-7, 8, (k,), generator=g).float() * 2.0 ** -149
    x[5] = torch.randn(k, generator=g) * 1e37
    x[5, 0] = 3.4e38
    x[6] = (2 * torch.arange(k) + 1).float() * 2.0 ** (-pa - 1)  # on the grid of e = 0: ties at .5
    x[6, 0] = -0.75  # the row max, so e = 0
    x[6, 1] = -x[6, 1]
    x[7, ::3] = -0.0
    return x.contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 x [..., D]: (norm.rms_norm(s, weight, eps), s) with s = x + residual, or s = x (then
    None is returned for it): the bits of norm.py's torch form."""
    lib = _need("rowops")
    d = x.shape[-1]
    xs = _f32(x)
    rs = _f32(residual) if residual is not None else None
    ws = _f32(weight) if weight is not None else None
    y = torch.empty_like(xs)
    s = torch.empty_like(xs) if rs is not None else None
    rows = xs.numel() // d if d else 0
    if rows and lib.shuili_rms_norm(xs.data_ptr(), rs.data_ptr() if rs is not None else None,
                                    ws.data_ptr() if ws is not None else None, rows, d, float(eps),
                                    y.data_ptr(), s.data_ptr() if s is not None else None):
        raise MemoryError("rms_norm: out of memory for one row's scratch")
    return y, s


def swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """float32 [..., 2I] -> [..., I]: elementwise.swiglu's bits."""
    lib = _need("rowops")
    gu = _f32(gate_up)
    inter = gu.shape[-1] // 2
    out = torch.empty(*gu.shape[:-1], inter, dtype=torch.float32)
    rows = gu.numel() // gu.shape[-1] if gu.shape[-1] else 0
    if rows and inter:
        lib.shuili_swiglu(gu.data_ptr(), rows, inter, limit is not None,
                          float(limit) if limit is not None else 0.0, out.data_ptr(),
                          torch.get_num_threads() if rows * inter >= (1 << 13) else 1)
    return out


def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rope_dim: int, interleaved: bool,
         inverse: bool) -> torch.Tensor:
    """float32 x [T, H, D] (any token stride, heads and channels contiguous), c and s float32
    [T, half] contiguous rows of the tables -> float32 [T, H, D]: rope.rope_rows's bits."""
    lib = _need("rowops")
    t, h, d = x.shape
    if x.dtype != torch.float32 or x.stride(2) != 1 or (h > 1 and x.stride(1) != d):
        x = _f32(x)
    c, s = _f32(c), _f32(s)
    out = torch.empty(t, h, d, dtype=torch.float32)
    if x.numel():
        lib.shuili_rope(x.data_ptr(), t, h, d, x.stride(0), c.data_ptr(), s.data_ptr(), rope_dim, interleaved,
                        inverse, out.data_ptr())
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 [B, V]: sampling.log_softmax_torch's bits, rows over torch's thread count."""
    lib = _need("rowops")
    x = _f32(logits)
    out = torch.empty_like(x)
    if x.numel() and lib.shuili_log_softmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                                            torch.get_num_threads() if x.numel() >= (1 << 16) else 1):
        raise MemoryError("log_softmax: out of memory for one row's scratch")
    return out


def _edge_values(g: torch.Generator, n: int) -> torch.Tensor:
    """float32 values of every magnitude, with zeros of both signs, subnormals, infinities, nan and
    the exp/clamp boundaries."""

    x = torch.randn(n, generator=g) * numerics.pow2(torch.randint(-30, 30, (n,), generator=g)).to(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, float("inf"), float("-inf"), float("nan"),
                            -103.97, -110.0, -745.5, 88.72, 90.0, 709.5, 3.4e38, -3.4e38])
    x[:special.numel()] = special[:n]
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any nan equals any nan (payloads are not part of the contract)."""
    na, nb = a.isnan(), b.isnan()
    return bool(torch.equal(na, nb)) and torch.equal(a.masked_fill(na, 0).view(torch.int32),
                                                     b.masked_fill(nb, 0).view(torch.int32))


def _check_rowops(lib) -> None:
    """Each op against its torch form, bit for bit, on edge values (the oracle's own test)."""
    from shuili.platforms.reference import elementwise, norm, rope as rope_ops, sampling

    _state["rowops"] = lib  # the wrappers look it up
    try:
        g = torch.Generator().manual_seed(7)
        x = _edge_values(g, 37 * 3).view(3, 37)
        r = _edge_values(g, 37 * 3).view(3, 37).flip(-1)
        w = torch.randn(37, generator=g)
        checks = {
            "rms_norm": (rms_norm(x, w, 1e-6, r), norm.add_rms_norm_torch(x, r, w, 1e-6)),
            "swiglu": (swiglu(torch.cat([x, r], -1), None), elementwise.swiglu_torch(torch.cat([x, r], -1), None)),
            "swiglu_limit": (swiglu(torch.cat([x, r], -1), 7.0), elementwise.swiglu_torch(torch.cat([x, r], -1), 7.0)),
            "log_softmax": (log_softmax(x), sampling.log_softmax_torch(x)),
        }
        # rope on a strided view (a slice of fused rows), with channels left alone, both pair layouts
        xr = _edge_values(g, 3 * 2 * 48).view(3, 96)[:, 8:88].reshape(3, 2, 40)
        c, s = _edge_values(g, 3 * 20).view(3, 20), _edge_values(g, 3 * 20).view(3, 20).flip(-1)
        for rd, inter, inv in ((32, True, False), (32, False, True), (40, False, False), (40, True, True)):
            h = rd // 2
            checks[f"rope_{rd}_{inter}_{inv}"] = (
                rope(xr, c[:, :h], s[:, :h], rd, inter, inv),
                rope_ops.rope_rows(xr, c[:, None, :h], s[:, None, :h], rd, inter, inv))
        for name, (got, want) in checks.items():
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            if not all(_same(a, b) for a, b in zip(got, want)):
                raise RuntimeError(f"the native {name} disagrees with its torch form's bits; please "
                                   "report this with your compiler and CPU")
    finally:
        _state.pop("rowops")


def _attention_signature(lib) -> None:

    p, i64, d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.shuili_paged_attention.argtypes = [p, p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_float, p, p, ctypes.c_int]
    lib.shuili_paged_attention.restype = ctypes.c_int
    lib.shuili_attention_init.argtypes = [p, ctypes.c_int, d, d, d]
    lib.shuili_attention_init.restype = ctypes.c_int
    exp_c = (d * len(numerics._EXP_COEFFS))(*numerics._EXP_COEFFS)
    if lib.shuili_attention_init(ctypes.addressof(exp_c), len(exp_c), numerics._LN2_HI, numerics._LN2_LO,
                                 numerics._INV_LN2):
        raise RuntimeError(f"attention.c's N_EXP does not match numerics' {len(exp_c)} exp coefficients")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    lens: torch.Tensor, qsl: torch.Tensor, scale: float, window: int,
                    sinks: torch.Tensor | None, threads: int | None = None) -> torch.Tensor:
    """float32 [T, H, Dv]: attention.paged_attention_torch's bits for float32 q [T, H, D] and
    contiguous float32 caches [blocks, block_size, KVH, D | Dv]; table [B, cols], lens [B], qsl [B + 1]
    int64 contiguous, already checked (attention._check_lens)."""

    lib = _need("attention")
    t, h, d = q.shape
    nb, bs, kvh, dv = v_cache.shape
    qf = _f32(q)
    sk = _f32(sinks) if sinks is not None else None
    out = torch.empty(t, h, dv, dtype=torch.float32)
    if t == 0:
        return out
    nt = torch.get_num_threads() if threads is None else threads
    if t * h * d * int(lens.max()) < (1 << 15):  # a few thousand multiply-adds: not worth a thread start
        nt = 1
    pa, pb = numerics.dot_bits(d)
    r = lib.shuili_paged_attention(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), nb * bs,
                                   table.data_ptr(), table.shape[1], lens.data_ptr(), qsl.data_ptr(),
                                   lens.shape[0], h, kvh, d, dv, bs, window, pa, pb, scale,
                                   sk.data_ptr() if sk is not None else None, out.data_ptr(), nt)
    if r == -1:
        raise MemoryError("paged_attention: out of memory for the key grids")
    if r:
        raise ValueError("paged_attention: a block table entry points outside the cache")
    return out


def _attention_case(g: torch.Generator, lens: list[int], q_lens: list[int], h: int, kvh: int, d: int,
                    dv: int, bs: int) -> tuple:
    """A ragged paged_attention call: shuffled blocks, key rows of magnitudes 2**-6 .. 2**2 (logits
    that spread the softmax), value rows of 2**-60 .. 2**60, queries of the last q_lens positions of
    each sequence."""

    cols = max(-(-n // bs) for n in lens) + 1
    nb = len(lens) * cols + 1
    kc = torch.randn(nb, bs, kvh, d, generator=g) * numerics.pow2(
        torch.randint(-6, 3, (nb, bs, kvh, 1), generator=g)).to(torch.float32)
    vc = torch.randn(nb, bs, kvh, dv, generator=g) * numerics.pow2(
        torch.randint(-60, 61, (nb, bs, kvh, 1), generator=g)).to(torch.float32)
    table = torch.randperm(nb, generator=g)[:len(lens) * cols].view(len(lens), cols).to(torch.int32)
    q = torch.randn(sum(q_lens), h, d, generator=g) * 4
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), qsl


def _at(cache: torch.Tensor, table: torch.Tensor, b: int, j: int) -> torch.Tensor:
    """Sequence b's token j in a cache [blocks, block_size, KVH, D]: a view [KVH, D]."""
    bs = cache.shape[1]
    return cache[int(table[b, j // bs]), j % bs]


def _attention_edges(q, kc, vc, table) -> None:
    """Edge values for `_attention_case(g, [9, 1, 23, 6], [1, 1, 5, 0], ...)`, in place: non-finite
    keys and values inside and outside windows of 3 and in a prefill's future, zero, subnormal and
    huge rows, a nan and an inf query."""
    _at(kc, table, 0, 3)[0, 0] = float("inf")  # outside a window of 3
    _at(vc, table, 0, 7)[1, 1] = float("nan")  # inside it
    _at(kc, table, 0, 5)[:] = -0.0
    _at(vc, table, 0, 6)[:] = 1e-40
    _at(vc, table, 2, 21)[0, 2] = float("inf")  # the future of the prefill's first queries
    _at(vc, table, 2, 2)[1, 0] = float("nan")  # before the prefill's windows of 3
    _at(kc, table, 2, 20)[1] = 3e38
    _at(kc, table, 2, 19)[0] = 1e-44
    q[0, 1, 3] = float("nan")
    q[2, 0, 0] = float("inf")


def _check_attention(lib) -> None:
    """paged_attention against its torch form, bit for bit: ragged decode and prefill sequences, GQA,
    a window and sinks, edge values in q and the caches, one and two threads."""
    from shuili.platforms.reference import attention

    _state["attention"] = lib  # the wrapper looks it up
    try:
        g = torch.Generator().manual_seed(17)
        q, kc, vc, table, lens, qsl = _attention_case(g, [9, 1, 23, 6], [1, 1, 5, 0], 4, 2, 12, 7, 4)
        _attention_edges(q, kc, vc, table)
        sinks = torch.randn(4, generator=g)
        for window, sk, threads in ((0, None, 1), (3, sinks, 2), (0, sinks, 2)):
            want = attention.paged_attention_torch(q, kc, vc, table, lens, qsl, 0.3, window, sk)
            args = attention._native_args(table, lens, qsl, q.shape[0], kc.shape[1])
            got = paged_attention(q, kc, vc, *args, 0.3, window, sk, threads)
            if not _same(got, want):
                raise RuntimeError(f"the native paged_attention disagrees with its torch form's bits (window "
                                   f"{window}, {threads} thread(s)); please report this with your compiler and CPU")
    finally:
        _state.pop("attention")


_SIGNATURES = {"gemm": _gemm_signature, "rowops": _rowops_signature, "attention": _attention_signature}
_CHECKS = {"gemm": _check_gemm, "rowops": _check_rowops, "attention": _check_attention}
