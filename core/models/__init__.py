"""Model registry: a name, a checkpoint directory or a GGUF file -> a `Model` on a platform."""
from __future__ import annotations

import os

from shuili.hal import DispatchTable

DEFAULT_MODEL = "smollm2-135m"
V4_NAMES = ("tiny-v4", "mid-v4")
V41_NAMES = ("tiny-v41", "mid-v41")
GGUF_NAMES = ("smollm2-135m",)


def known_models() -> list[str]:
    return [*GGUF_NAMES, *V4_NAMES, *V41_NAMES]


def load_model(name_or_path: str, ops: DispatchTable, device: str = "cpu", dtype: str = "float32",
               seed: int = 0, with_mtp: bool = False, with_dspark: bool = False, weight_formats=None):
    """Build or load a model (with_mtp: DeepSeek-V4's MTP block and its cache; with_dspark:
    DeepSeek-V4.1's DSpark draft layers and their cache; for speculative decoding; other models
    ignore them; weight_formats: the GEMM weight formats the platform declares, None = all, used by
    V4.1 checkpoints). Errors name the problem and the fix."""
    if name_or_path in V4_NAMES:
        from shuili.core.models import deepseek_v4

        return deepseek_v4.build(name_or_path, ops, device=device, dtype=dtype, seed=seed, with_mtp=with_mtp)
    if name_or_path in V41_NAMES:
        from shuili.core.models import deepseek_v41

        return deepseek_v41.build(name_or_path, ops, device=device, dtype=dtype, seed=seed, with_dspark=with_dspark)
    if name_or_path in GGUF_NAMES:
        from shuili.core.models import llama

        return llama.load_gguf(llama.resolve_named(name_or_path), ops, device=device, dtype=dtype)
    if name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"GGUF file {name_or_path!r} does not exist")
        from shuili.core.models import llama

        return llama.load_gguf(name_or_path, ops, device=device, dtype=dtype)
    if os.path.isdir(name_or_path):
        cfg_path = os.path.join(name_or_path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{name_or_path!r} has no config.json; point --model at a "
                                    "checkpoint directory, a .gguf file or one of " + ", ".join(known_models()))
        from shuili.core.errors import read_json

        raw = read_json(cfg_path)
        model_type = raw.get("model_type") if isinstance(raw, dict) else None
        if model_type == "deepseek_v4":
            from shuili.core.models import deepseek_v4

            return deepseek_v4.load_checkpoint(name_or_path, ops, device=device, dtype=dtype, with_mtp=with_mtp)
        if model_type in ("deepseek_v41", "deepseek_v41_text"):
            from shuili.core.models import deepseek_v41

            return deepseek_v41.load_checkpoint(name_or_path, ops, device=device, dtype=dtype,
                                                with_dspark=with_dspark, weight_formats=weight_formats)
        raise ValueError(f"{cfg_path}: model_type {model_type!r} is not supported; shuili serves "
                         "deepseek_v4 / deepseek_v41 checkpoints and Llama-family GGUF files")
    raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(known_models())}, "
                     "a checkpoint directory with config.json, or a .gguf file")
