"""KV tiers below the device: a host-memory pool and a shared block store (docs/kv-tiers.md).

device blocks --evicted--> host pool (byte budget, LRU)            host_pool.py
device blocks --published--> block store (content-addressed files)  disk_store.py (BlockStore: store.py)
admission: device, then host, then store, per cache group and block  tiers.py
"""
from shuili.core.kv_tiers.store import BlockStore
from shuili.core.kv_tiers.tiers import KVTiers, build_tiers
from shuili.core.kv_tiers.units import parse_bytes, parse_duration

__all__ = ["BlockStore", "KVTiers", "build_tiers", "parse_bytes", "parse_duration"]
