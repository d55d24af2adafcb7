"""Weight bytes of DeepSeek-V4.1 configs (the released V4.1-Flash and mid-v41) in bf16 and in the
released formats, computed from the V4.1 tensor schema and the contract's `hal.formats.weight_bytes`,
not by hand. The bytes a decode step streams are what the memory roofline of issue 20 is measured
against.

    PYTHONPATH=. python benchmarks/weight_bytes.py

"released": dense linears (schema kind linear / grouped) fp8_block32 (e4m3 + one ue8m0 per 32x32),
routed experts mxfp4 (e2m1 + one e8m0 per 32 along K), embeddings / compressor / indexer key and
weights projections bf16, norms / mHC / router float32. Engram tables are host memory and not counted.
"in memory" adds what shuili holds beyond the checkpoint: fp8 scales widened to float32 (3 extra bytes
per 32x32 block).
"""
from __future__ import annotations

import math

from shuili.core.models.deepseek_v41_config import V41Config, named
from shuili.core.models.deepseek_v41_loader import schema
from shuili.hal.formats import weight_bytes, weight_scale_shape

RELEASED_FORMAT = {"linear": "fp8_block32", "grouped": "fp8_block32", "experts": "mxfp4", "dense": "dense"}


def count(cfg: V41Config) -> dict[str, float]:
    bf16 = released = extra = 0
    for sp in schema(cfg).values():
        if sp.kind == "f32":
            bf16 += 4 * math.prod(sp.shape)
            released += 4 * math.prod(sp.shape)
            continue
        bf16 += weight_bytes("dense", sp.shape)
        fmt = RELEASED_FORMAT[sp.kind]
        released += weight_bytes(fmt, sp.shape)
        if fmt == "fp8_block32":
            extra += 3 * math.prod(weight_scale_shape(fmt, sp.shape))
    return {"bf16_GB": bf16 / 1e9, "released_GB": released / 1e9, "released_in_memory_GB": (released + extra) / 1e9,
            "ratio": released / bf16}


def main() -> None:
    print("| config | bf16 (GB) | released formats (GB) | in memory (GB) | released / bf16 |")
    print("|---|---:|---:|---:|---:|")
    for name, cfg in (("DeepSeek-V4.1-Flash", V41Config()), ("mid-v41", named("mid-v41"))):
        c = count(cfg)
        print(f"| {name} | {c['bf16_GB']:.2f} | {c['released_GB']:.2f} | {c['released_in_memory_GB']:.2f} | "
              f"{c['ratio']:.3f} |")


if __name__ == "__main__":
    main()
