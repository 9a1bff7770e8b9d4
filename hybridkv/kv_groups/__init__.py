"""KV-cache groups: per-layer specs, grouping and pool sizing, block pool, per-kind managers."""

from hybridkv.kv_groups.plan import KVCacheGroup, KVCachePlan, group_layers, plan_kv_cache
from hybridkv.kv_groups.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "AttentionSpec", "ChunkedLocalAttentionSpec", "FullAttentionSpec", "KVCacheGroup", "KVCachePlan",
    "KVCacheSpec", "MambaSpec", "SlidingWindowSpec", "group_layers", "plan_kv_cache",
]
