"""What a stored KV block's bits depend on, hashed into its content address.

Two engines may share a block only if they would have computed the same bits: the same weights
(a registered synthetic model's name and seed, or a digest of the weight files), compute dtype,
block size, cache groups (their kinds, shapes, dtypes and so the KV formats), model config, and
platform stack (conformance/baselines.stack_fingerprint: platform, plugin version, HAL major,
declared determinism per op, torch, device). A model handed over as an object has no file to
digest: it must say who it is (`model.kv_fingerprint`, a string), or the store is not used.
"""
from __future__ import annotations

import hashlib
import json
import os

from shuili.core.kv_cache import ROOT_HASH

FORMAT = 1
_SMALL = 256 << 20  # files up to this size are hashed whole; larger ones by size + samples
_SAMPLE = 1 << 20
_digests: dict[tuple, str] = {}


def file_digest(path: str) -> str:
    st = os.stat(path)
    memo = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if memo not in _digests:
        h = hashlib.sha256(str(st.st_size).encode())
        with open(path, "rb") as f:
            if st.st_size <= _SMALL:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            else:  # a multi-GB shard: head, middle and tail (the header and tensor table included)
                for at in (0, st.st_size // 2, st.st_size - _SAMPLE):
                    f.seek(at)
                    h.update(f.read(_SAMPLE))
        _digests[memo] = h.hexdigest()
    return _digests[memo]


def weights_id(name: str, seed: int) -> str:
    from shuili.core.models import GGUF_NAMES, V4_NAMES, V41_NAMES

    if name in V4_NAMES or name in V41_NAMES:
        return f"synthetic:{name}:seed={seed}"
    if name in GGUF_NAMES:
        from shuili.core.models.llama import resolve_named

        name = resolve_named(name)
    if os.path.isfile(name):
        return "file:" + file_digest(name)
    if os.path.isdir(name):
        files = sorted(f for f in os.listdir(name) if f.endswith((".safetensors", ".bin", ".gguf", ".json")))
        h = hashlib.sha256()
        for f in files:
            h.update(f.encode() + b"\0" + file_digest(os.path.join(name, f)).encode())
        return "dir:" + h.hexdigest()
    raise ValueError(f"cannot identify the weights of {name!r} for the KV store")


def _config_text(model) -> str:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if cfg is None:
        return type(model).__qualname__
    dump = getattr(cfg, "model_dump_json", None)
    return dump() if dump is not None else repr(cfg)


def kv_fingerprint(config, model, groups, tokens_per_block: int, platform, model_given: bool) -> dict | None:
    """{field: value, ..., "sha256": digest}; None when the weights cannot be identified."""
    from shuili.conformance.baselines import stack_fingerprint

    if model_given:
        own = getattr(model, "kv_fingerprint", None)
        if not isinstance(own, str):
            return None
        weights = "model:" + own
    else:
        weights = weights_id(config.model, config.seed)
    fp = {"format": FORMAT, "weights": weights, "model_class": type(model).__qualname__,
          "model_config": hashlib.sha256(_config_text(model).encode()).hexdigest()[:16],
          "dtype": config.dtype, "tokens_per_block": tokens_per_block,
          "groups": hashlib.sha256(json.dumps([g.model_dump(mode="json") for g in groups],
                                              sort_keys=True).encode()).hexdigest()[:16],
          "stack": stack_fingerprint(platform)["sha256"], "root": ROOT_HASH.hex()}
    if getattr(config, "world_size", 1) > 1:  # TP size and EP on/off change bits (docs/parallel.md); DP does not
        fp["parallel"] = f"tp{config.tensor_parallel_size}-ep{int(bool(config.enable_expert_parallel))}"
    fp["sha256"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:32]
    return fp
