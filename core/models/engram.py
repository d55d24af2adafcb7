"""DeepSeek-V4.1 Engram memory: tables in host memory, each step's rows gathered and uploaded.

The two released tables hold ~384M rows each (fp8 [256] + 8 ue8m0 scales: 264 B, ~100 GB per table).
They stay memory-mapped from the checkpoint's safetensors (`EngramTable`: a numpy memmap of the
file, so only the pages of rows actually gathered are ever read) and never become a torch tensor,
let alone one on the accelerator. A step needs 24 rows per token per Engram layer (`engram_hash`),
gathered into one host buffer (page-locked where the transfer service pins), uploaded with one
copy (`hal.transfer.upload_tensor`) and dequantized on the device by the `kv_dequantize` op (the
rows are exactly the "mxfp8" KV format: 256 e4m3 bytes, then 8 e8m0 scales).

When the rows are gathered (design, and why):
* The hash depends only on token ids: a token's window is itself plus its 3 predecessors, which the
  runner sends with every step (`ForwardBatch.engram_history`, built from the request's tokens by
  `engram_history`). So there is no per-request Engram state to save, restore or invalidate:
  chunked prefill, prefix-cache hits and preemption see the same windows by construction.
* Prefill chunks (every id on the host): the rows are hashed and gathered on a background thread.
  `prefetch` starts that for the next chunk while the current step runs; `step` otherwise starts it
  when the forward begins, so it overlaps the layers before the first Engram layer, and waits for
  it only when that layer asks (`EngramRows.get`).
* Decode in overlap mode (the input id is a placeholder filled on the device from the previous
  step's sampled tokens): the host cannot know the ids without waiting for the previous step, which
  would serialise overlap mode. Those steps hash on the device (same int64 math, same bits) from the
  filled `input_ids`, and gather from host memory the device can read: on the CPU (reference
  platform) that is the memmap itself; on CUDA the table pages are registered
  once by the transfer service (`map_host`: cudaHostRegister, read-only, mapped) and read by an
  `index_select` through unified addressing. No host sync either way.
  Why device-side hashing for decode and not a host gather started the moment the sampled ids land:
  the host learns the ids only after the previous step finishes, and the rows must be on the device
  before layer 1 runs. A host gather would therefore hold the GPU at layer 1 for a download, a
  gather and an upload every decode step, or need a device-side wait on a host flag. The device-side
  hash costs a few int64 kernels and reads 24 x 264 B per token per layer over the bus, with no host
  involvement.
  Measured here (benchmarks/engram_gather.py, docs/performance.md "Engram gather": 2 shared CPU
  cores, mid-v41 sizes, 2 layers, page-cached 1 GB of tables):
  * reading the rows from the memmap: 0.26 ms for decode batch 64, 49 ms for a 4096-token chunk;
  * the host hash: 0.2 / 6 ms;
  * on the CPU, the reference `kv_dequantize` dominates (~35 ms / 2.3 s), and a prefetch hides it
    for decode (0.95 ms exposed).
  On an H200 (docs/performance.md, 2026-12-04) the CUDA zero-copy path costs 0.80 ms at decode
  batch 64 against 1.53 ms for hash + host gather + upload. Without `map_host` the step falls back
  to one host round trip (a sync) and warns.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from shuili.core.models.engram_hash import EngramHasher, EngramSpec, windows_from
from shuili.hal.formats import bytes_per_row
from shuili.hal.transfer import upload_tensor

log = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F32": (4, "float32"), "BF16": (2, "bfloat16"), "F16": (2, "float16")}
_FP8 = ("F8_E4M3", "U8", "I8")  # e4m3 bytes (U8/I8: the same bytes under a plain integer dtype)
_SCALE = ("F8_E8M0", "U8", "F32")


def _safetensors_entries(path: str) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file, reading only its header."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    return 8 + n, header


def _map(path: str, name: str, start: int, header: dict, dtypes: Sequence[str]) -> tuple[np.memmap, str]:
    if name not in header:
        raise KeyError(f"{path}: tensor {name!r} not found (the file holds {len(header) - ('__metadata__' in header)} "
                       f"tensors, e.g. {[k for k in header if k != '__metadata__'][:4]})")
    e = header[name]
    if e["dtype"] not in dtypes:
        raise ValueError(f"{path}: tensor {name!r} has dtype {e['dtype']}, expected one of {list(dtypes)}")
    if len(e["shape"]) != 2:
        raise ValueError(f"{path}: tensor {name!r} has shape {e['shape']}, expected 2-D [rows, width]")
    lo, hi = e["data_offsets"]
    rows, width = e["shape"]
    item = 4 if e["dtype"] == "F32" else 2 if e["dtype"] in ("BF16", "F16") else 1
    if hi - lo != rows * width * item:
        raise ValueError(f"{path}: tensor {name!r} spans {hi - lo} bytes, its shape {e['shape']} x {item} B "
                         f"needs {rows * width * item}")
    size = start + hi
    if os.path.getsize(path) < size:
        raise ValueError(f"{path}: truncated: tensor {name!r} ends at byte {size}, the file has "
                         f"{os.path.getsize(path)}")
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start + lo, shape=(rows, width * item))
    return mm, e["dtype"]


class EngramTable:
    """One Engram layer's rows, memory-mapped (host memory, never read whole, never a torch tensor).

    kind "mxfp8": `data` e4m3 bytes [N, D] and `scale` [N, D/32] (e8m0 bytes, or float32 powers of
    two); kind "float32" / "bfloat16" / "float16": dequantized rows [N, D] (what save_pretrained of a
    dequantized model writes)."""

    def __init__(self, data: np.ndarray, scale: np.ndarray | None, kind: str, head_dim: int, source: str = ""):
        self.data, self.scale, self.kind, self.head_dim, self.source = data, scale, kind, head_dim, source
        if kind == "mxfp8" and (scale is None or scale.shape[0] != data.shape[0]):
            raise ValueError(f"{source}: an fp8 Engram table needs one scale row per data row")

    @classmethod
    def from_safetensors(cls, path: str, weight: str, scale: str | None = None,
                         scale_path: str | None = None) -> "EngramTable":
        """Map `weight` (and its `scale`, from `scale_path` when another shard holds it) of a file."""
        start, header = _safetensors_entries(path)
        data, dt = _map(path, weight, start, header, _FP8 + tuple(_FLOAT_DTYPES))
        if dt in _FLOAT_DTYPES:
            item, kind = _FLOAT_DTYPES[dt]
            return cls(data, None, kind, data.shape[1] // item, f"{path}:{weight}")
        if scale is None:
            raise ValueError(f"{path}: Engram table {weight!r} is fp8 ({dt}) and needs its scale tensor name")
        if scale_path is not None and scale_path != path:
            sc, sdt = _map(scale_path, scale, *_safetensors_entries(scale_path), _SCALE)
        else:
            sc, sdt = _map(path, scale, start, header, _SCALE)
        d = data.shape[1]
        groups = sc.shape[1] // (4 if sdt == "F32" else 1)
        if sc.shape[0] != data.shape[0] or groups * 32 != d:
            raise ValueError(f"{path}: scale {scale!r} must be [{data.shape[0]}, {d // 32}] (one per 32 of "
                             f"{weight!r}), got [{sc.shape[0]}, {groups}]")
        return cls(data, sc if sdt != "F32" else sc.view(np.uint32), "mxfp8", d, f"{path}:{weight}")

    @property
    def num_rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def packed_bytes(self) -> int:
        """Bytes per gathered row: the "mxfp8" KV row (264 for D = 256), or D floats."""
        return bytes_per_row("mxfp8", self.head_dim) if self.kind == "mxfp8" else int(self.data.shape[1])

    def gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows `ids` (int64 [R], checked in range) into out uint8 [R * packed_bytes]: all data rows
        first, then all scale rows (mxfp8), so each part is one contiguous `np.take`."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise IndexError(f"{self.source}: Engram row id outside [0, {self.num_rows}): the table does "
                             "not match the config's engram_num_embeddings / hash")
        r, w = ids.size, self.data.shape[1]
        np.take(self.data, ids, axis=0, out=out[:r * w].reshape(r, w), mode="clip")
        if self.kind == "mxfp8":
            g = self.head_dim // 32
            dst = out[r * w:r * (w + g)].reshape(r, g)
            if self.scale.dtype == np.uint32:  # float32 powers of two -> their e8m0 exponent byte
                bits = np.take(self.scale, ids, axis=0, mode="clip")
                if np.any(bits & 0x7FFFFF):
                    raise ValueError(f"{self.source}: a float32 Engram scale is not a power of two")
                dst[:] = (bits >> 23) & 0xFF
            else:
                np.take(self.scale, ids, axis=0, out=dst, mode="clip")

    def decode(self, raw: torch.Tensor, rows: int, ops) -> torch.Tensor:
        """Uploaded uint8 [rows * packed_bytes] -> float32 [rows, D] (exact) on raw's device."""
        w = self.data.shape[1]
        if self.kind != "mxfp8":
            return raw[:rows * w].view(getattr(torch, self.kind)).view(rows, self.head_dim).float()
        packed = torch.cat([raw[:rows * w].view(rows, w), raw[rows * w:rows * self.packed_bytes].view(rows, -1)], 1)
        return ops.kv_dequantize(packed, "mxfp8", self.head_dim)


class _HostGather:
    """One host-side gather: the step's row ids hashed and gathered into one (pinned) uint8 buffer."""

    def __init__(self, buf: torch.Tensor, rows: int, layout: list[tuple[int, int]],
                 decoded: dict[int, torch.Tensor] | None = None):
        self.buf, self.rows, self.layout = buf, rows, layout  # layout: (offset, bytes) per layer
        self.decoded = decoded  # CPU device: rows already dequantized by the gathering thread


class EngramRows:
    """A step's Engram rows: `get(layer_id)` -> [T, C * D] in the model dtype on the model device.
    The first `get` waits for the host gather (if any) and uploads the whole step in one copy."""

    def __init__(self, engram: "Engram", parts: list, num_tokens: int):
        self._engram, self._parts, self._t = engram, parts, num_tokens
        self._rows: dict[int, torch.Tensor] | None = None

    def get(self, layer_id: int) -> torch.Tensor:
        if self._rows is None:
            self._rows = self._engram._materialise(self._parts, self._t)
        return self._rows[layer_id]


class Engram:
    """The Engram service of one model: hash, gather from the mapped tables, upload, prefetch."""

    def __init__(self, spec: EngramSpec, token_map: Sequence[int] | torch.Tensor, tables: Mapping[int, EngramTable],
                 ops, device="cpu", dtype: torch.dtype = torch.float32, transfer=None, pin: bool | None = None,
                 prefetch_slots: int = 4):
        missing = [i for i in spec.layer_ids if i not in tables]
        if missing:
            raise ValueError(f"no Engram table for layers {missing} (engram_layer_ids {list(spec.layer_ids)})")
        for k, lid in enumerate(spec.layer_ids):
            t = tables[lid]
            if t.head_dim != spec.head_dim or t.num_rows != spec.num_embeddings[k]:
                raise ValueError(f"Engram table of layer {lid} ({t.source}) is [{t.num_rows}, {t.head_dim}]; the "
                                 f"config says [{spec.num_embeddings[k]}, {spec.head_dim}]")
        self.spec, self.tables, self.ops, self.dtype, self.transfer = spec, dict(tables), ops, dtype, transfer
        self.device = torch.device(device)
        self.host_hasher = EngramHasher(spec, token_map, "cpu")
        self._dev_hasher = None  # built on first device-side hash
        self.pin = self.device.type not in ("cpu", "meta") if pin is None else pin
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engram-gather")
        self._prefetched: OrderedDict[tuple, Future] = OrderedDict()
        self._slots = prefetch_slots
        self._lock = threading.Lock()
        self._uva: dict[int, tuple] = {}
        self._static_dev = None  # the device the static-decode views and hasher were built for
        self._warned: set[int] = set()
        self.stats = {"host_gathers": 0, "prefetch_hits": 0, "device_gathers": 0}

    @property
    def lookback(self) -> int:
        return self.spec.lookback

    def prepare_device(self) -> None:
        """Build the device hasher and map the tables for device reads now (call before capturing
        decode graphs: neither may happen during a capture). A no-op on the CPU."""
        if self.device.type == "cpu":
            return
        self._dev_hasher = self._dev_hasher or self.host_hasher.to(self.device)
        for lid in self.spec.layer_ids:
            if lid not in self._uva:
                try:
                    self._uva[lid] = _mapped_views(self.transfer, self.tables[lid], self.device)
                except Exception as exc:  # noqa: BLE001 - the step path warns and falls back
                    log.warning("Engram table of layer %d cannot be mapped for %s: %s", lid, self.device, exc)

    # ------------------------------------------------------------------------------- host path
    def _gather_host(self, ids: Sequence[int], history: Sequence[int]) -> _HostGather:
        t, lb, c = len(ids), self.spec.lookback, self.spec.n_cols
        win = windows_from(torch.tensor(list(ids), dtype=torch.int64),
                           torch.tensor(list(history), dtype=torch.int64).view(t, lb))
        rid = self.host_hasher(win).numpy()  # [T, L, C]
        sizes = [t * c * self.tables[lid].packed_bytes for lid in self.spec.layer_ids]
        buf = torch.empty(max(sum(sizes), 8), dtype=torch.uint8, pin_memory=self.pin)
        host, layout, off = buf.numpy(), [], 0
        for k, lid in enumerate(self.spec.layer_ids):
            self.tables[lid].gather(np.ascontiguousarray(rid[:, k]).reshape(-1), host[off:off + sizes[k]])
            layout.append((off, sizes[k]))
            off += sizes[k]
        g = _HostGather(buf, t * c, layout)
        if self.device.type == "cpu":  # host == device: dequantize here too, off the forward's thread
            g.decoded = self._upload(g)
        return g

    @staticmethod
    def _key(ids: Sequence[int], history: Sequence[int]) -> tuple:
        return tuple(ids), tuple(history)

    def prefetch(self, ids: Sequence[int], history: Sequence[int]) -> None:
        """Start gathering the rows of a future chunk (all ids known) on the background thread;
        a later `step` whose chunk has exactly these ids and look-back uses the result."""
        if any(i < 0 for i in ids):
            return
        key = self._key(ids, history)
        with self._lock:
            if key in self._prefetched:
                return
            self._prefetched[key] = self._pool.submit(self._gather_host, list(ids), list(history))
            while len(self._prefetched) > self._slots:
                self._prefetched.popitem(last=False)

    def _take(self, ids: Sequence[int], history: Sequence[int]) -> Future:
        key = self._key(ids, history)
        with self._lock:
            fut = self._prefetched.pop(key, None)
        if fut is not None:
            self.stats["prefetch_hits"] += 1
            return fut
        self.stats["host_gathers"] += 1
        return self._pool.submit(self._gather_host, list(ids), list(history))

    # ----------------------------------------------------------------------------- the step
    def step(self, batch) -> EngramRows:
        """Start the rows of this step's tokens. `batch`: a ForwardBatch with `engram_history`
        int64 [T, lookback] and `input_ids_cpu` (host ids, -1 placeholders). Chunks whose ids are
        all on the host use the host gather (prefetched, or started now for each run of such
        chunks); chunks with placeholders, and static (graph) decode steps, hash on the device
        (`_device_rows`). Row order is the batch's."""
        hist = batch.engram_history
        t = batch.num_tokens
        if hist is None or tuple(hist.shape) != (t, self.spec.lookback):
            raise ValueError(f"Engram needs ForwardBatch.engram_history int64 [{t}, {self.spec.lookback}] "
                             f"(got {None if hist is None else tuple(hist.shape)}); the runner builds it with "
                             "engram_history() when the model has Engram layers")
        ids_cpu = getattr(batch, "input_ids_cpu", None) or []
        hist_cpu = getattr(batch, "engram_history_cpu", None) or []
        lb = self.spec.lookback
        if batch.static_decode:  # a graph-capturable step: no host gather, no host sync, fixed shapes
            return EngramRows(self, [("static", batch.input_ids, hist)], t)
        if len(ids_cpu) != t or len(hist_cpu) != t * lb:
            return EngramRows(self, [("device", batch.input_ids, hist)], t)
        qsl = batch.query_start_loc_cpu or [0, t]
        parts, run = [], None  # run: (kind, first row, end row) of consecutive chunks of one kind

        def flush():
            if run is None:
                return
            kind, a, b = run
            if kind == "device":
                parts.append(("device", batch.input_ids[a:b], hist[a:b]))
            else:
                parts.append(("host", self._take(ids_cpu[a:b], hist_cpu[a * lb:b * lb])))

        for a, b in zip(qsl[:-1], qsl[1:]):
            kind = "device" if any(i < 0 for i in ids_cpu[a:b]) else "host"  # placeholders: device hash
            if kind == "host":
                with self._lock:
                    fut = self._prefetched.pop(self._key(ids_cpu[a:b], hist_cpu[a * lb:b * lb]), None)
                if fut is not None:
                    self.stats["prefetch_hits"] += 1
                    flush()
                    run = None
                    parts.append(("host", fut))
                    continue
            if run is not None and run[0] == kind:
                run = (kind, run[1], b)
            else:
                flush()
                run = (kind, a, b)
        flush()
        return EngramRows(self, parts, t)

    def rows_for(self, ids: Sequence[int], history: Sequence[int]) -> dict[int, torch.Tensor]:
        """Rows of one chunk given on the host (tests, benchmarks): {layer: [T, C * D]}."""
        return self._materialise([("host", self._take(ids, history))], len(ids))

    def _materialise(self, parts: list, t: int) -> dict[int, torch.Tensor]:
        per_layer: dict[int, list[torch.Tensor]] = {lid: [] for lid in self.spec.layer_ids}
        for part in parts:
            if part[0] == "static":
                got = self.static_rows(part[1], part[2])
            elif part[0] == "device":
                got = self._device_rows(part[1], part[2])
            else:
                got = self._upload(part[1].result())
            for lid, r in got.items():
                per_layer[lid].append(r)
        cd = self.spec.n_cols * self.spec.head_dim
        return {lid: (rs[0] if len(rs) == 1 else torch.cat(rs)).view(t, cd).to(self.dtype)
                for lid, rs in per_layer.items()}

    def _upload(self, g: _HostGather) -> dict[int, torch.Tensor]:
        if g.decoded is not None:
            return g.decoded
        dev = upload_tensor(self.transfer, g.buf, self.device)
        return {lid: self.tables[lid].decode(dev[o:o + n], g.rows, self.ops)
                for lid, (o, n) in zip(self.spec.layer_ids, g.layout)}

    # --------------------------------------------------------------------------- device path
    def _device_rows(self, input_ids: torch.Tensor, history: torch.Tensor) -> dict[int, torch.Tensor]:
        """Hash on the device from the (filled) input ids; gather from memory the device reads."""
        self.stats["device_gathers"] += 1
        if self._dev_hasher is None:
            self._dev_hasher = self.host_hasher.to(input_ids.device)
        rid = self._dev_hasher(windows_from(input_ids, history))  # [T, L, C] on the device
        out = {}
        for k, lid in enumerate(self.spec.layer_ids):
            ids = rid[:, k].reshape(-1)
            table = self.tables[lid]
            if ids.device.type == "cpu":  # the device is the host: read the memmap directly
                buf = torch.empty(ids.numel() * table.packed_bytes, dtype=torch.uint8)
                table.gather(ids.numpy(), buf.numpy())
                out[lid] = table.decode(buf, ids.numel(), self.ops)
            else:
                out[lid] = self._uva_rows(lid, ids)
        return out

    def _uva_rows(self, lid: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows read by the device straight from the table's host pages, mapped once by the platform
        transfer service (`map_host`: CUDA registers the pages); a platform without it, or a mapping
        that fails, gets one host round trip per step (a sync), with a warning."""
        table = self.tables[lid]
        try:
            views = self._uva.get(lid)
            if views is None:
                views = self._uva[lid] = _mapped_views(self.transfer, table, ids.device)
            parts = [v.index_select(0, ids).reshape(-1) for v in views]
            return table.decode(torch.cat(parts) if len(parts) > 1 else parts[0], ids.numel(), self.ops)
        except Exception as exc:  # noqa: BLE001 - fall back, loudly, once per table
            if lid not in self._warned:
                self._warned.add(lid)
                log.warning("Engram zero-copy gather unavailable on %s (%s): host round trip per step "
                            "(a sync in overlap mode)", ids.device, exc)
            host = ids.cpu().numpy()
            buf = torch.empty(host.size * table.packed_bytes, dtype=torch.uint8, pin_memory=self.pin)
            table.gather(host, buf.numpy())
            return table.decode(upload_tensor(self.transfer, buf, ids.device), host.size, self.ops)

    # --------------------------------------------------------------------- static (graph) decode
    @property
    def static_capable(self) -> bool:
        """Whether a static decode step can be served: the device reads host memory directly (the
        CPU), or the platform's transfer service can map host pages for the device (`map_host`); and
        no table stores float32 scales (those become e8m0 bytes in the host gather only)."""
        if any(t.scale is not None and t.scale.dtype == np.uint32 for t in self.tables.values()):
            return False
        return self.device.type == "cpu" or callable(getattr(self.transfer, "map_host", None))

    def static_rows(self, input_ids: torch.Tensor, history: torch.Tensor) -> dict[int, torch.Tensor]:
        """The rows of a static decode step (inside a device graph): hashed on the device and read by
        `index_select` from device views of the tables' host pages; shapes depend on T only, nothing
        is read back to the host. The first call (a warm-up run, before any capture) builds the device
        hasher and maps the tables; a table that cannot be mapped raises (the graph capture then fails
        and decode runs eagerly, through `step`'s host round trip), never a host gather in the graph."""
        self.stats["static_gathers"] = self.stats.get("static_gathers", 0) + 1
        dev = input_ids.device
        views = self._static_views(dev)
        rid = self._dev_hasher(windows_from(input_ids, history), check=False)  # [T, L, C] on the device
        out = {}
        for k, lid in enumerate(self.spec.layer_ids):
            ids = rid[:, k].reshape(-1)
            parts = [v.index_select(0, ids).reshape(-1) for v in views[lid]]
            out[lid] = self.tables[lid].decode(torch.cat(parts) if len(parts) > 1 else parts[0], ids.numel(),
                                               self.ops)
        return out

    def _static_views(self, dev: torch.device) -> dict[int, tuple[torch.Tensor, ...]]:
        if self._static_dev == dev:
            return self._uva
        # mapping must not happen while a graph records: the platform's capture runs warm-up
        # forwards first (platforms/nvidia/graphs.py), and the first of them maps the tables here
        self._dev_hasher = self.host_hasher.to(dev)
        for lid in self.spec.layer_ids:
            if lid in self._uva:
                continue
            if dev.type == "cpu":  # the device is the host: views alias the mapped file
                self._uva[lid] = _host_views(self.tables[lid])
            else:
                self._uva[lid] = _mapped_views(self.transfer, self.tables[lid], dev)
        self._static_dev = dev
        return self._uva

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _host_views(table: EngramTable) -> tuple[torch.Tensor, ...]:
    """CPU tensors aliasing the table's memmap (no copy; only the pages of rows read are touched)."""
    import warnings

    if table.scale is not None and table.scale.dtype == np.uint32:
        raise RuntimeError("float32 Engram scales need the host gather (converted to e8m0 there)")
    with warnings.catch_warnings():  # read-only pages: the views are only ever read
        warnings.simplefilter("ignore", UserWarning)
        return tuple(torch.from_numpy(np.asarray(a)) for a in (table.data, table.scale) if a is not None)


def _mapped_views(transfer, table: EngramTable, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Device views of the table's data and scale pages through `transfer.map_host`."""
    fn = getattr(transfer, "map_host", None)
    if fn is None:
        raise RuntimeError("the platform's transfer service cannot map host memory for the device")
    if table.scale is not None and table.scale.dtype == np.uint32:
        raise RuntimeError("float32 Engram scales need the host gather (converted to e8m0 there)")
    return tuple(fn(a, device) for a in (table.data, table.scale) if a is not None)
