"""KV-cache groups: per-layer specs, grouping and pool sizing, block pool, per-kind managers."""

from hybridkv.kv_groups.block_pool import NULL_BLOCK, NULL_SLOT, BlockPool, StateSlotPool
from hybridkv.kv_groups.block_table import BlockTable, MultiGroupBlockTable
from hybridkv.kv_groups.cache_tensors import allocate_kv_cache, layer_pool_positions
from hybridkv.kv_groups.coordinator import KVCacheCoordinator, PrefixCacheStats
from hybridkv.kv_groups.hashing import BlockHasher
from hybridkv.kv_groups.plan import KVCacheGroup, KVCachePlan, group_layers, plan_kv_cache
from hybridkv.kv_groups.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVSharingSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "AttentionSpec", "ChunkedLocalAttentionSpec", "FullAttentionSpec", "KVCacheGroup", "KVCachePlan",
    "KVCacheSpec", "KVSharingSpec", "MambaSpec", "MLAAttentionSpec", "SlidingWindowSpec", "group_layers",
    "plan_kv_cache",
    "NULL_BLOCK", "NULL_SLOT", "BlockHasher", "BlockPool", "BlockTable", "KVCacheCoordinator",
    "MultiGroupBlockTable", "PrefixCacheStats", "StateSlotPool", "allocate_kv_cache", "layer_pool_positions",
]
