"""The torch cache tensors of a plan: one byte pool of pages, viewed per layer.

The pool is one (num_blocks, page_bytes) byte tensor. Layer ``i`` of an attention group views bytes
``[i * b, (i + 1) * b)`` of every page (``b``: its spec's bytes per block) as (num_blocks, kv_planes, block_size,
num_kv_heads, head_size) in its spec's dtype (2 planes, K and V; MLA's latent cache 1); groups of different KV
shapes hold different numbers of layers, so each fills the page with its own shape (``plan._layers_per_group``). A
block id belongs to one group at a time, so the groups never touch the same bytes, and one block id addresses the
same page in all of its group's layers. A KV-sharing layer (a group's reader) gets its donor's view: no bytes of its
own. Mamba layers get their own (num_state_slots, *shape) tensors per state (host-memory checkpoints:
``engine/host_checkpoints.py``).

Everything starts at zero: the null block and the null slot read as zeros, so padded batch rows stay
finite.
"""

from __future__ import annotations

import torch

from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.kv_groups.specs import AttentionSpec, MambaSpec


def layer_pool_positions(plan: KVCachePlan) -> dict[str, int]:
    """Attention layer name -> its position in its group's page (its byte offset: position x bytes per block)."""
    return {name: i for g in plan.attention_groups for i, name in enumerate(g.layer_names)}


def allocate_kv_cache(plan: KVCachePlan, *,
                      device: torch.device | str = "cpu") -> dict[str, tuple[torch.Tensor, ...]]:
    """Layer name -> its cache tensors: ``(kv,)`` with kv (num_blocks, kv_planes, block_size, num_kv_heads,
    head_size) for attention (a KV-sharing layer: its donor's very tensor); one (num_state_slots, *shape) tensor
    per state for Mamba."""
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    attention = plan.attention_groups
    if attention:
        pool = torch.zeros((plan.num_blocks, plan.page_bytes), dtype=torch.uint8, device=device)
        for group in attention:
            spec = group.spec
            assert isinstance(spec, AttentionSpec)
            itemsize = torch.empty((), dtype=spec.dtype).element_size()
            if plan.page_bytes % itemsize:
                raise ValueError(f"group {group.group_id}: a {plan.page_bytes}-byte pool page cannot hold "
                                 f"{spec.dtype} elements; use one KV dtype per model")
            b = spec.bytes_per_block
            for i, name in enumerate(group.layer_names):
                raw = pool[:, i * b:(i + 1) * b]                              # (num_blocks, bytes_per_block)
                out[name] = (raw.view(spec.dtype).view(plan.num_blocks, spec.kv_planes, spec.block_size,
                                                       spec.num_kv_heads, spec.head_size),)
            for reader, donor in group.readers:
                out[reader] = out[donor]
    for group in plan.mamba_groups:
        spec = group.spec
        assert isinstance(spec, MambaSpec)
        for name in group.layer_names:
            out[name] = tuple(torch.zeros((plan.num_state_slots, *shape), dtype=dtype, device=device)
                              for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))
    return out

