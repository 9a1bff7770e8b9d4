"""The torch cache tensors of a plan: one byte pool per page position, viewed per layer.

A pool page is ``layers_per_block`` layers x ``block_size`` tokens. Position ``i`` of the page is one
tensor of (num_blocks, bytes per layer-block) bytes; the ``i``-th layer of *every* attention group views
it as (num_blocks, kv_planes, block_size, num_kv_heads, head_size) in its spec's dtype (2 planes, K and V; MLA's
latent cache 1). A block id belongs to one
group at a time, so the groups never touch the same bytes, and one block id addresses the same page in
all of its group's layers. Mamba layers get their own (num_state_slots, *shape) tensors per state.

Everything starts at zero: the null block and the null slot read as zeros, so padded batch rows stay
finite.
"""

from __future__ import annotations

import torch

from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.specs import AttentionSpec, MambaSpec


def layer_pool_positions(plan: KVCachePlan) -> dict[str, int]:
    """Attention layer name -> the page position (pool tensor index) it uses."""
    return {name: i for g in plan.attention_groups for i, name in enumerate(g.layer_names)}


def allocate_kv_cache(plan: KVCachePlan, *,
                      device: torch.device | str = "cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    """Layer name -> its cache tensors: ``(kv,)`` with kv (num_blocks, kv_planes, block_size, num_kv_heads,
    head_size) for attention; one (num_state_slots, *shape) tensor per state for Mamba."""
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    attention = plan.attention_groups
    if attention:
        layer_bytes = plan.page_bytes // plan.layers_per_block
        pool = [torch.zeros((plan.num_blocks, layer_bytes), dtype=torch.uint8, device=device)
                for _ in range(plan.layers_per_block)]                       # (num_blocks, layer_bytes) each
        for group in attention:
            spec = group.spec
            assert isinstance(spec, AttentionSpec)
            itemsize = torch.empty((), dtype=spec.dtype).element_size()
            if layer_bytes % itemsize:
                raise ValueError(f"group {group.group_id}: a {layer_bytes}-byte pool row cannot hold "
                                 f"{spec.dtype} elements; use one KV dtype per model")
            for i, name in enumerate(group.layer_names):
                raw = pool[i][:, :spec.bytes_per_block]                       # (num_blocks, bytes_per_block)
                out[name] = (raw.view(spec.dtype).view(plan.num_blocks, spec.kv_planes, spec.block_size,
                                                       spec.num_kv_heads, spec.head_size),)
    for group in plan.mamba_groups:
        spec = group.spec
        assert isinstance(spec, MambaSpec)
        for name in group.layer_names:
            out[name] = tuple(torch.zeros((plan.num_state_slots, *shape), dtype=dtype, device=device)
                              for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))
    return out
