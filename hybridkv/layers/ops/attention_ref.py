"""Reference paged attention and KV write: the oracle every fast kernel is checked against.

Pure torch, any device, fp32 accumulation. Readability over speed: one loop over requests (this is an
oracle, not the hot path). It reads keys *only* through the block-table columns a request's ``seq_len``
covers, so a block the metadata does not reference is never touched (tests poison such blocks with NaN).
Positions are relative to ``key_start`` (masks need only differences), so trimmed and virtual batches need
nothing special here.

Attention sinks (gpt-oss): a learned logit per query head joins every softmax denominator (it takes part in the
max and adds ``exp(sink - max)`` to the sum) but carries no value, so each query's weights sum to less than one.
It is per query row, so a trimmed table or a local-attention virtual request (one query, one softmax) gets it
once, like any other row; a row with no visible key gives all its weight to the sink, i.e. a zero output.
"""

from __future__ import annotations

import torch

from hybridkv.layers.ops.registry import reference_op
from hybridkv.metadata import CommonAttentionMetadata

__all__ = ["paged_attention_ref", "write_kv_ref"]


@reference_op("write_kv")
def write_kv_ref(
    k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim), written in place
    slot_mapping: torch.Tensor,  # (num_tokens,) int64, slot = block_id * block_size + offset
) -> None:
    """Write each token's K/V at its slot. Block and offset index separately, so any cache strides work
    (the pool keeps K and V of a block side by side: ``kv[:, 0]`` / ``kv[:, 1]`` are strided views)."""
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"k/v/slot_mapping: shapes {tuple(k.shape)}, {tuple(v.shape)}, {tuple(slot_mapping.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    bs = k_cache.shape[1]
    idx = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    block, offset = idx // bs, idx % bs
    k_cache[block, offset] = k.to(k_cache.dtype)
    v_cache[block, offset] = v.to(v_cache.dtype)


@reference_op("paged_attention")
def paged_attention_ref(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, num_kv_heads, head_dim)
    cam: CommonAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # (num_heads,) sink logits
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim), q's dtype
    """Attention of every query token over its request's keys, read through ``cam.block_table_tensor``.

    Masks: causal (``k <= p``) when ``cam.causal``; window ``p - W < k`` when ``sliding_window`` is set
    (HF semantics, W keys including the query itself). ``softcap`` applies ``softcap * tanh(s / softcap)``
    to the scaled logits. GQA: query head h uses kv head ``h // (num_heads // num_kv_heads)``. A query with
    no visible key (impossible when causal) gets a zero output instead of NaN. ``sinks``: one logit per query
    head in the units of the scaled (and softcapped) logits, added to each softmax's denominator only (module
    docstring); the sink itself is not softcapped.
    """
    num_tokens, num_heads, head_dim = q.shape
    nb, bs, num_kv_heads, kd = k_cache.shape
    if num_tokens != cam.num_actual_tokens:
        raise ValueError(f"q: has {num_tokens} tokens, metadata has {cam.num_actual_tokens}")
    if kd != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache: shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} vs q {tuple(q.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"q: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if bs != cam.block_size:
        raise ValueError(f"k_cache: block size {bs} != metadata block_size {cam.block_size}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be positive, got {sliding_window}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks: shape {tuple(sinks.shape)}, expected ({num_heads},) (one per query head)")
    sink_col = sinks.float().to(q.device)[:, None, None] if sinks is not None else None     # (heads, 1, 1)
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    qsl = cam.query_start_loc_cpu.tolist()
    seq_lens = cam.seq_lens_cpu.tolist()
    bt = cam.block_table_tensor.to(k_cache.device)
    for r in range(cam.num_reqs):
        t0, t1, s = qsl[r], qsl[r + 1], seq_lens[r]
        if t1 == t0:
            continue
        ids = bt[r, : -(-s // bs)].long()  # only the referenced blocks
        k = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:s].float()  # (s, kv_heads, d)
        v = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:s].float()
        k = k.repeat_interleave(group, dim=1).to(q.device)  # (s, heads, d)
        v = v.repeat_interleave(group, dim=1).to(q.device)
        qr = q[t0:t1].float()  # (n, heads, d)
        logits = torch.einsum("nhd,khd->hnk", qr, k) * scale  # (heads, n, s)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        pos_q = torch.arange(s - (t1 - t0), s, device=q.device)[:, None]  # relative query positions
        pos_k = torch.arange(s, device=q.device)[None, :]
        visible = torch.ones(t1 - t0, s, dtype=torch.bool, device=q.device)
        if cam.causal:
            visible &= pos_k <= pos_q
        if sliding_window is not None:
            visible &= pos_q - pos_k < sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sink_col is not None:      # one more logit per row without a value: its weight is dropped
            logits = torch.cat([logits, sink_col.expand(-1, t1 - t0, 1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :s]
        else:
            probs = torch.softmax(logits, dim=-1).masked_fill(~visible.any(-1, keepdim=True), 0.0)  # no key -> 0
        out[t0:t1] = torch.einsum("hnk,khd->nhd", probs, v)
    return out.to(q.dtype)
