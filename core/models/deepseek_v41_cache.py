"""DeepSeek-V4.1 cache-group layout: one window pool per layer, and per KV-source group (not per layer)
one compressed-KV pool and one indexer-key pool ("cache once": the layers after a source read its
entries and store nothing but their own window).

Groups (every logical block i covers tokens [i*P, (i+1)*P)):
  swa_kv       sliding, window = sliding_window   every layer's raw K=V latent (QAT: MXFP8 values)
  kv_src{L}    compressed, ratio r_L              source L's compressed entries (QAT: FP4 e2m1/e4m3-16)
  idx_src{L}   compressed, ratio r_L              source L's indexer keys (QAT: FP4 e2m1/ue8m0-32)
  state_src{L} sliding, window = r_L (r_L > 1)    per-token compressor inputs kv | gate of source L
A partial group is just the last < r tokens' projections in state_src{L}, so chunked prefill,
preemption and prefix caching need nothing beyond the block manager.
"""
from __future__ import annotations

from shuili.core.model_api import CacheGroupSpec
from shuili.core.models.deepseek_v41_config import V41Config
from shuili.core.models.deepseek_v4_cache import _entry


def kv_group(src: int) -> str:
    return f"kv_src{src}"


def idx_group(src: int) -> str:
    return f"idx_src{src}"


def state_group(src: int) -> str:
    return f"state_src{src}"


def cache_groups(cfg: V41Config, dtype: str, n_draft: int = 0) -> list[CacheGroupSpec]:
    """n_draft: DSpark draft layers, whose context KV takes swa_kv layers num_hidden_layers + k."""
    shape, dt = _entry(cfg.window_kv_format, cfg.head_dim, dtype)
    groups = [CacheGroupSpec(name="swa_kv", kind="sliding", layers=tuple(range(cfg.num_hidden_layers + n_draft)),
                             entry_shape=shape, dtype=dt, window=cfg.sliding_window)]
    for src in cfg.kv_source_layer_ids:
        r = cfg.ratio(src)
        shape, dt = _entry(cfg.compressed_kv_format, cfg.head_dim, dtype)
        groups.append(CacheGroupSpec(name=kv_group(src), kind="compressed", layers=(src,), entry_shape=shape,
                                     dtype=dt, ratio=r))
        shape, dt = _entry(cfg.indexer_k_format, cfg.index_head_dim, dtype)
        groups.append(CacheGroupSpec(name=idx_group(src), kind="compressed", layers=(src,), entry_shape=shape,
                                     dtype=dt, ratio=r))
        if r > 1:
            groups.append(CacheGroupSpec(name=state_group(src), kind="sliding", layers=(src,),
                                         entry_shape=(2 * cfg.head_dim,), dtype="float32", window=r))
    return groups
