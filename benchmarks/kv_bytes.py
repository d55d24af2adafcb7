"""KV-cache bytes per token of context for the released DeepSeek-V4-Flash and V4.1-Flash configs,
computed from shuili's own cache specs (the models' `cache_groups`), not by hand.

    PYTHONPATH=. python benchmarks/kv_bytes.py

Per cache group: a compressed group (one entry per `ratio` tokens, all kept) grows with the
context by entry_bytes * layers / ratio per token; a sliding group (window, compressor state) is
a fixed amount per sequence, entry_bytes * layers * window. Formats: "bf16" stores every row in
bfloat16; "packed" uses the storage formats of the contract (window MXFP8 528 B, compressed KV FP4
e2m1 + e4m3/16 288 B, indexer keys MXFP4 68 B at the released dims).
"""
from __future__ import annotations

import math

import torch

from shuili.core.model_api import CacheGroupSpec
from shuili.core.models import deepseek_v41_cache, deepseek_v4_cache
from shuili.core.models.deepseek_v41_config import V41Config
from shuili.core.models.deepseek_v4_config import V4Config

V4_FLASH = {"model_type": "deepseek_v4", "num_hidden_layers": 43,
            "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "num_nextn_predict_layers": 1}
PACKED = dict(window_kv_format="mxfp8", compressed_kv_format="fp4_e4m3", indexer_k_format="mxfp4")


def entry_bytes(g: CacheGroupSpec) -> int:
    return math.prod(g.entry_shape) * torch.empty((), dtype=getattr(torch, g.dtype)).element_size()


def summarize(groups: list[CacheGroupSpec]) -> tuple[float, int, list[str]]:
    per_token, fixed, rows = 0.0, 0, []
    for g in groups:
        b = entry_bytes(g) * len(g.layers)
        if g.kind == "compressed":
            per_token += b / g.ratio
            rows.append(f"{g.name}: {len(g.layers)} x {entry_bytes(g)} B / {g.ratio} tok")
        else:
            fixed += b * g.window
            rows.append(f"{g.name}: {len(g.layers)} x {entry_bytes(g)} B x {g.window} tok (fixed)")
    return per_token, fixed, rows


def main() -> None:
    models = {
        "DeepSeek-V4-Flash": lambda fmt: deepseek_v4_cache.cache_groups(
            V4Config.from_hf(V4_FLASH, **fmt), "bfloat16"),
        "DeepSeek-V4.1-Flash": lambda fmt: deepseek_v41_cache.cache_groups(V41Config(**fmt), "bfloat16"),
    }
    print("| model | formats | grows with context (B/token) | fixed per sequence (KiB) | groups |")
    print("|---|---|---:|---:|---|")
    for name, groups_of in models.items():
        for label, fmt in (("bf16", {}), ("packed", PACKED)):
            try:
                groups = groups_of(fmt)
            except ValueError as exc:  # a format the family's config does not offer
                print(f"| {name} | {label} | - | - | {exc} |")
                continue
            per_token, fixed, rows = summarize(groups)
            print(f"| {name} | {label} | {per_token:,.1f} | {fixed / 1024:,.1f} | {'; '.join(rows)} |")


if __name__ == "__main__":
    main()
