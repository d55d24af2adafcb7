"""A checkpoint directory of safetensors shards: which file holds which tensor, and checked reads.

`model.safetensors.index.json` (HF's shard index, `{"weight_map": {tensor: shard file}}`) is authoritative
when present: only the shards it names are opened, every shard it names must exist and hold the tensors it
maps there, and tensors it does not list are not part of the checkpoint. Without an index every
`*.safetensors` file in the directory is a shard and a tensor may live in only one of them.

Shards are opened through safetensors' memory map; a tensor's dtype and shape come from the header, so
`get(name, shape, dtypes)` rejects a wrong tensor before reading its bytes. Every error is a
`CheckpointError` naming the tensor (or file), what was expected and what was found.

    ckpt = Checkpoint(path)
    t = ckpt.get("layers.0.attn.wq_a.weight", shape=(1024, 4096), dtypes=(torch.bfloat16, torch.float8_e4m3fn))
    ckpt.names(); "x" in ckpt; ckpt.info("x") -> (dtype, shape); ckpt.shard_of("x"); ckpt.unread()
"""
from __future__ import annotations

import difflib
import json
import os

import torch

INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype strings -> torch dtypes (what `get_slice(...).get_dtype()` reports)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


class CheckpointError(ValueError):
    pass


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def open_safetensors(path: str):
    """safe_open with errors that name the file and say what a readable file needs."""
    from safetensors import SafetensorError, safe_open

    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty (0 bytes); expected a safetensors file (re-download it)")
    try:
        return safe_open(path, "pt")
    except SafetensorError as exc:
        reason = str(exc).removeprefix("Error while deserializing header: ")
        raise CheckpointError(f"{path} is not a readable safetensors file ({reason}): expected an 8-byte "
                              "header length, a JSON header and every tensor's bytes; the file is "
                              "corrupt or truncated (re-download it)") from None


def check_tensor(name: str, dtype, shape, want_shape=None, want_dtypes=None, where: str = "") -> None:
    """Raise when `dtype`/`shape` are not the expected ones; the message names tensor, expected and found."""
    at = f" (in {where})" if where else ""
    if want_dtypes is not None and dtype not in want_dtypes:
        raise CheckpointError(f"tensor {name!r} has dtype {dtype}, expected one of "
                              f"{[dtype_name(x) for x in want_dtypes]}{at}")
    if want_shape is not None and tuple(shape) != tuple(want_shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(shape)}, expected {list(want_shape)}{at}")


class Checkpoint:
    """Tensor name -> shard, from the index when there is one, else from every shard's header."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
        self.path = path
        self.index_path = os.path.join(path, INDEX_FILE)
        self._handles: dict[str, object] = {}
        self._read: set[str] = set()
        if os.path.isfile(self.index_path):
            self.where = self._from_index()
        else:
            self.index_path = None
            self.where = self._from_files()

    # ------------------------------------------------------------------------------ building the map
    def _from_index(self) -> dict[str, str]:
        from shuili.core.errors import read_json

        raw = read_json(self.index_path)
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{self.index_path}: expected {{\"weight_map\": {{tensor name: shard file}}}}, "
                                  f"got {type(wm).__name__ if isinstance(raw, dict) else type(raw).__name__}")
        if not wm:
            raise CheckpointError(f"{self.index_path}: the weight_map lists no tensors")
        by_shard: dict[str, list[str]] = {}
        for name, shard in wm.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            fpath = os.path.join(self.path, shard)
            if os.path.basename(shard) != shard or not os.path.isfile(fpath):
                others = f" and {len(names) - 1} other tensors" if len(names) > 1 else ""
                raise CheckpointError(f"{self.index_path} maps tensor {names[0]!r}{others} to shard {shard!r}, "
                                      f"but {self.path} has no such file (found shards: "
                                      f"{sorted(f for f in os.listdir(self.path) if f.endswith('.safetensors'))})")
            held = set(self._handle(shard).keys())
            for name in names:
                if name not in held:
                    raise CheckpointError(f"{self.index_path} maps tensor {name!r} to {shard}, but that shard "
                                          f"does not hold it ({len(held)} tensors there); the index and the "
                                          "shards are from different downloads (re-download them)")
        return dict(wm)

    def _from_files(self) -> dict[str, str]:
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path!r} has no *.safetensors files")
        where: dict[str, str] = {}
        for f in files:
            for name in self._handle(f).keys():
                if name in where:
                    raise CheckpointError(f"tensor {name!r} is in both {where[name]} and {f} in {self.path}; "
                                          f"a checkpoint holds each tensor once (remove the stale shard or add "
                                          f"{INDEX_FILE})")
                where[name] = f
        return where

    def _handle(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            h = self._handles[shard] = open_safetensors(os.path.join(self.path, shard))
        return h

    # ---------------------------------------------------------------------------------------- reads
    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def has(self, name: str) -> bool:
        return name in self.where

    def shard_of(self, name: str) -> str:
        self._need(name)
        return self.where[name]

    def info(self, name: str, shape=None, dtypes=None) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) from the shard header, without reading the tensor (`shape`/`dtypes`: the expected
        ones, only for the message when the tensor is missing)."""
        self._need(name, shape, dtypes)
        sl = self._handle(self.where[name]).get_slice(name)
        code = sl.get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has safetensors dtype {code}, which torch cannot read "
                                  f"(in {self.where[name]})")
        return _DTYPES[code], tuple(sl.get_shape())

    def get(self, name: str, shape=None, dtypes=None) -> torch.Tensor:
        """Read one tensor; `shape` / `dtypes` (when given) are checked from the header before reading."""
        if shape is not None or dtypes is not None:
            dt, sh = self.info(name, shape, dtypes)
            check_tensor(name, dt, sh, shape, dtypes, self.where[name])
        self._need(name)
        self._read.add(name)
        return self._handle(self.where[name]).get_tensor(name)

    def unread(self) -> list[str]:
        """Tensors of the checkpoint no `get` has asked for (a loader can reject or report them)."""
        return [n for n in self.where if n not in self._read]

    def _need(self, name: str, shape=None, dtypes=None) -> None:
        if name in self.where:
            return
        want = []
        if shape is not None:
            want.append(f"shape {list(shape)}")
        if dtypes is not None:
            want.append("dtype " + " or ".join(dtype_name(d) for d in dtypes))
        want = f"expected {', '.join(want)}; " if want else ""
        src = f"{os.path.basename(self.index_path)} does not list it" if self.index_path else "no shard holds it"
        near = difflib.get_close_matches(name, self.where.keys(), n=3, cutoff=0.75)
        hint = f"; similar names in the checkpoint: {near}" if near else ""
        raise CheckpointError(f"checkpoint {self.path} is missing tensor {name!r} ({want}{src}){hint}")


def write_checkpoint(path: str, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Write `config` as config.json, `tensors` (in their order) over `shards` safetensors files, and,
    when there is more than one, the HF shard index that `Checkpoint` reads back."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    names = list(tensors)
    per = -(-len(names) // shards)
    index = {}
    for k in range(shards):
        fname = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: tensors[n].cpu() for n in names[k * per:(k + 1) * per]}
        index.update({n: fname for n in chunk})
        save_file(chunk, os.path.join(path, fname))
    if shards > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f, indent=1)
