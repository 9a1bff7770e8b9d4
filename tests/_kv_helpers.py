"""Shared helpers for the kv_groups tests: tiny specs and plans, a state fingerprint, and a brute-force
oracle of prefix-cache hits and of what each kind must keep live."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.hashing import BlockHash
from hybridkv.kv_groups.plan import KVCachePlan, plan_kv_cache
from hybridkv.kv_groups.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridkv.utils import cdiv

F32 = torch.float32


def full(bs: int = 4, *, heads: int = 1, head_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head_size, dtype=F32)


def sliding(window: int, bs: int = 4, *, heads: int = 1, head_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=head_size, dtype=F32,
                             sliding_window=window)


def chunked(chunk: int, bs: int = 4, *, heads: int = 1, head_size: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head_size, dtype=F32,
                                     attention_chunk_size=chunk)


def mamba(bs: int = 4, *, shapes: tuple[tuple[int, ...], ...] = ((3, 4), (2, 2))) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=shapes, dtypes=tuple(F32 for _ in shapes))


def small_plan(layer_specs: dict[str, KVCacheSpec], *, num_blocks: int, num_working_slots: int = 4,
               num_checkpoint_slots: int = 0, max_model_len: int = 64, step_tokens: int | None = None,
               num_host_slots: int = 0) -> KVCachePlan:
    """A plan with exactly ``num_blocks`` pool blocks (null included) and the given slot counts."""
    plan = plan_kv_cache(layer_specs, max_model_len=max_model_len, kv_memory=1 << 30, max_num_seqs=4,
                         num_checkpoint_slots=num_checkpoint_slots, step_tokens=step_tokens)
    has_mamba = bool(plan.mamba_groups)
    return dataclasses.replace(
        plan, num_blocks=num_blocks if plan.attention_groups else 0,
        num_state_slots=(1 + num_checkpoint_slots + num_working_slots) if has_mamba else 0,
        num_host_checkpoint_slots=num_host_slots if has_mamba and num_checkpoint_slots else 0)


def fingerprint(c: KVCacheCoordinator, *, free_order: bool = True) -> Any:
    """Everything observable about a coordinator's state, comparable with ==. ``free_order=False``
    ignores the order of the free queues (blocks freed in one batch call vs one call per request)."""
    order = (lambda v: list(v)) if free_order else (lambda v: sorted(v))
    out: list[Any] = [c.block_tables.np.tobytes(), c._num_cols.tobytes(), c._num_computed.tobytes(),
                      c._num_cached.tobytes(), sorted(c.state._slotless) if c.state else [],
                      dict(c._rows), sorted(c._free_rows),
                      [list(h) for h in c._hashes],
                      [m.num_skipped.tobytes() for m in c.managers], [m.next_free.tobytes() for m in c.managers]]
    if c.pool:
        p = c.pool
        out += [p.ref_count.tobytes(), order(p._stack[:p._top].tolist()), order(p.lru_order()),
                dict(p._key_index), p._entry_blocks.tobytes(), p._block_entry.tobytes(),
                p._entry_count.tobytes(), p._free_entries[:p._entries_top].tobytes(), p._owner.tobytes()]
    if c.slots and c.state:
        s = c.slots
        out += [list(s._free), dict(s._ckpt), list(s._pins), list(s._wants), [list(q) for q in s._lru],
                [list(q) for q in s._host_lru], list(s._free_host), dict(c.state._copies),
                [a.tobytes() for a in c.state.row_arrays()]]
    return out


def visible_start(spec: KVCacheSpec, num_computed: int) -> int:
    """First key position any future query of a request with ``num_computed`` tokens can read."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (num_computed // spec.attention_chunk_size) * spec.attention_chunk_size
    return 0


def accepts(spec: KVCacheSpec, length: int, cached: set[BlockHash], hashes: Sequence[BlockHash],
            checkpoints: set[BlockHash], hash_bs: int) -> bool:
    """Does one group accept a prefix hit at ``length``? Checked directly from docs/design.md, "Semantics"."""
    if length == 0:
        return True
    if isinstance(spec, MambaSpec):
        return length % spec.block_size == 0 and hashes[length // hash_bs - 1] in checkpoints
    bs = spec.block_size
    k = length // bs
    if isinstance(spec, FullAttentionSpec):
        need = range(0, k)
    elif isinstance(spec, SlidingWindowSpec):
        need = range(max(0, k - cdiv(spec.sliding_window - 1, bs)), k)
    else:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        need = range((length // spec.attention_chunk_size) * spec.attention_chunk_size // bs, k)
    return all(hashes[j] in cached for j in need)


def brute_force_hit(c: KVCacheCoordinator, tokens: Sequence[int]) -> int:
    """Largest L (multiple of the hash block size, < len(tokens)) that every group accepts, by trying
    every L against the caches as they are now."""
    if not c.enable_prefix_caching or len(tokens) <= 1:
        return 0
    bs = c.block_size
    hashes = c.hasher.chain(tokens, (len(tokens) - 1) // bs)
    cached = {g.group_id: set(c.pool.cached_hashes(g.group_id)) for g in c.plan.attention_groups} \
        if c.pool else {}
    ckpts = set(c.slots.checkpoints()) if (c.state and c.state.checkpoints) else set()
    best = 0
    for length in range(0, len(hashes) * bs + 1, bs):
        if all(accepts(g.spec, length, cached.get(g.group_id, set()), hashes, ckpts, bs)
               for g in c.plan.groups):
            best = length
    return best


def apply_copies(states: dict[int, Any], src: np.ndarray, dst: np.ndarray) -> None:
    """Apply a batch of state copies with read-before-write semantics (what ``t[dst] = t[src]`` does)."""
    vals = [states.get(int(s)) for s in src]
    for d, v in zip(dst.tolist(), vals, strict=True):
        states[d] = v


def add_random_requests(engine: Any, rng: np.random.Generator, *, vocab: int, count: int, max_tokens: int) -> None:
    """``count`` greedy requests sharing a random prefix, added to an ``LLMEngine``; those a tight cache can
    never hold are skipped (the engine rejects them)."""
    from hybridkv import SamplingParams
    from hybridkv.engine.engine import RequestError

    prefix = rng.integers(1, vocab, int(rng.integers(0, 12))).tolist()
    for i in range(count):
        prompt = prefix + rng.integers(1, vocab, int(rng.integers(1, 30))).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, max_tokens)), ignore_eos=True)
        with contextlib.suppress(RequestError):
            engine.add_request(str(i), prompt, params)
