"""DeepSeek-V4 cache-group layout (slots: the paged_slots op; engine-free driver: core/models/driver.py).

Groups (every logical block i covers tokens [i*P, (i+1)*P)):
  swa_kv     sliding, window = sliding_window   the raw K=V latent of every token, every layer (+ MTP)
  csa_kv     compressed, ratio csa_ratio        pooled K=V entries of CSA layers
  csa_idx    compressed, ratio csa_ratio        the Lightning Indexer's compressed keys
  hca_kv     compressed, ratio hca_ratio        pooled K=V entries of HCA layers
  csa_state  sliding, window = 2*csa_ratio      per-token compressor inputs: kv | gate+ape, main then indexer
  hca_state  sliding, window = hca_ratio        per-token compressor inputs: kv | gate+ape
The compressor partial state is just the last coff*ratio tokens' projections, so preemption and prefix
caching need nothing beyond the block manager.
"""
from __future__ import annotations

from shuili.core.model_api import CacheGroupSpec
from shuili.core.models.deepseek_v4_config import V4Config
from shuili.hal.formats import bytes_per_row


def _entry(fmt: str, dim: int, dtype: str) -> tuple[tuple[int, ...], str]:
    return ((dim,), dtype) if fmt == "none" else ((bytes_per_row(fmt, dim),), "uint8")


def state_width(cfg: V4Config, kind: str) -> int:
    if kind == "csa":
        return 4 * cfg.head_dim + 4 * cfg.index_head_dim
    return 2 * cfg.head_dim


def cache_groups(cfg: V4Config, dtype: str, with_mtp: bool = False) -> list[CacheGroupSpec]:
    n = cfg.num_hidden_layers
    swa_layers = tuple(range(n)) + ((n,) if with_mtp and cfg.num_nextn_predict_layers else ())
    shape, dt = _entry(cfg.window_kv_format, cfg.head_dim, dtype)
    groups = [CacheGroupSpec(name="swa_kv", kind="sliding", layers=swa_layers, entry_shape=shape, dtype=dt,
                             window=cfg.sliding_window)]
    csa, hca = cfg.layers_of("csa"), cfg.layers_of("hca")
    if csa:
        shape, dt = _entry(cfg.compressed_kv_format, cfg.head_dim, dtype)
        groups.append(CacheGroupSpec(name="csa_kv", kind="compressed", layers=csa, entry_shape=shape, dtype=dt,
                                     ratio=cfg.csa_ratio))
        shape, dt = _entry(cfg.indexer_k_format, cfg.index_head_dim, dtype)
        groups.append(CacheGroupSpec(name="csa_idx", kind="compressed", layers=csa, entry_shape=shape, dtype=dt,
                                     ratio=cfg.csa_ratio))
        groups.append(CacheGroupSpec(name="csa_state", kind="sliding", layers=csa,
                                     entry_shape=(state_width(cfg, "csa"),), dtype="float32",
                                     window=2 * cfg.csa_ratio))
    if hca:
        shape, dt = _entry(cfg.compressed_kv_format, cfg.head_dim, dtype)
        groups.append(CacheGroupSpec(name="hca_kv", kind="compressed", layers=hca, entry_shape=shape, dtype=dt,
                                     ratio=cfg.hca_ratio))
        groups.append(CacheGroupSpec(name="hca_state", kind="sliding", layers=hca,
                                     entry_shape=(state_width(cfg, "hca"),), dtype="float32",
                                     window=cfg.hca_ratio))
    return groups
