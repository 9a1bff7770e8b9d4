"""A small paged driver for cache-using layers, outside any model or engine.

``LayerHarness(module)`` finds the cache layers inside ``module`` (anything with ``cache_name`` and
``bind_cache``: attention, Mamba2, Mamba1), groups them by KV-cache spec, allocates their caches and
state slots, and runs steps: ``step({request_id: new_hidden_states})`` packs the requests (decodes
first, as the scheduler guarantees), builds one CAM per group with the real builders, sets the forward
context and calls ``module(x, positions)``; it returns each request's output rows.

It is deliberately hostile to a wrong layer: block ids and state slots are handed out in a shuffled
order (the null block / slot 0 is never used), unused blocks and fresh slots hold NaN, and a block is
freed (its table entry becomes the null block, its contents NaN again, its id reusable) as soon as its
group's ``skipped_tokens`` says no future query reads it, so reading a stale or never-written entry
turns the output into NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridkv.backends.builders import build_group_inputs
from hybridkv.backends.registry import get_backend
from hybridkv.forward_context import ForwardContext, forward_context
from hybridkv.kv_groups.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.models.config import Attention, MultiLatentAttention
from hybridkv.utils import cdiv


def spec_for(layer: nn.Module, *, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The KV-cache spec of one cache layer, from its config (as ``HybridConfig.kv_specs`` derives it)."""
    cfg = layer.cfg
    if isinstance(cfg, MultiLatentAttention):
        return MLAAttentionSpec(block_size=block_size, kv_lora_rank=cfg.kv_lora_rank,
                                qk_rope_head_dim=cfg.qk_rope_head_dim, dtype=dtype)
    if isinstance(cfg, Attention):
        common = dict(block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=cfg.head_dim,
                      dtype=dtype)
        if cfg.sliding_window is not None:
            return SlidingWindowSpec(sliding_window=cfg.sliding_window, **common)
        if cfg.attention_chunk_size is not None:
            return ChunkedLocalAttentionSpec(attention_chunk_size=cfg.attention_chunk_size, **common)
        return FullAttentionSpec(**common)
    return MambaSpec(block_size=block_size, shapes=cfg.state_shapes(), dtypes=(dtype, torch.float32))


@dataclass
class _Group:
    spec: KVCacheSpec
    layers: list[nn.Module]
    tensors: list[tuple[torch.Tensor, ...]]          # per layer: (k, v) caches (MLA: the latent one) or slot pools
    free: list[int]                                  # free block ids / slots, handed out in this order
    tables: dict[Any, list[int]] = field(default_factory=dict)   # request -> block ids (0 = freed) / [slot]


class LayerHarness:
    """Paged driver for the cache layers inside ``module`` (see the module docstring).

    ``max_len`` bounds a request's length and ``max_reqs`` the live requests; pools are sized for that
    plus a few spare entries so ids really are shuffled. Requests are created by their first step and
    live until ``finish``."""

    def __init__(self, module: nn.Module, *, max_len: int, max_reqs: int = 4, block_size: int = 4,
                 seed: int = 0, backend: str = "torch") -> None:
        self.module = module
        self.block_size = block_size
        self.max_len = max_len
        self.rng = np.random.default_rng(seed)
        param = next(module.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.backend = get_backend(backend, self.device)
        self.computed: dict[Any, int] = {}
        by_spec: dict[KVCacheSpec, list[nn.Module]] = {}
        for m in module.modules():
            if hasattr(m, "cache_name") and hasattr(m, "bind_cache"):
                by_spec.setdefault(spec_for(m, block_size=block_size, dtype=self.dtype), []).append(m)
        if not by_spec:
            raise ValueError("LayerHarness: the module has no cache layers")
        self.groups = [self._allocate(spec, layers, max_reqs) for spec, layers in by_spec.items()]

    def _allocate(self, spec: KVCacheSpec, layers: list[nn.Module], max_reqs: int) -> _Group:
        spare = 3
        nan = dict(fill_value=float("nan"), device=self.device)
        if spec.is_attention:
            n = 1 + max_reqs * cdiv(self.max_len, self.block_size) + spare
            shape = (n, self.block_size, spec.num_kv_heads, spec.head_size)
            tensors = [tuple(torch.full(shape, dtype=spec.dtype, **nan) for _ in range(spec.kv_planes))
                       for _ in layers]
        else:
            n = 1 + max_reqs + spare
            pairs = list(zip(spec.shapes, spec.dtypes, strict=True))
            tensors = [tuple(torch.full((n, *s), dtype=d, **nan) for s, d in pairs) for _ in layers]
        for layer, t in zip(layers, tensors, strict=True):
            layer.bind_cache(*t)
        free = [int(i) for i in self.rng.permutation(np.arange(1, n))]
        return _Group(spec=spec, layers=layers, tensors=tensors, free=free)

    # ------------------------------------------------------------------ steps

    def step(self, new_tokens: Mapping[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
        """Run one step. ``new_tokens[r]``: (n_r, hidden) hidden states of request r's next n_r tokens.
        Returns ``{r: (n_r, hidden) output}``."""
        reqs = list(new_tokens)
        is_decode = [new_tokens[r].shape[0] == 1 and self.computed.get(r, 0) > 0 for r in reqs]
        reqs = [r for r, d in zip(reqs, is_decode, strict=True) if d] + \
               [r for r, d in zip(reqs, is_decode, strict=True) if not d]
        q = np.array([new_tokens[r].shape[0] for r in reqs], np.int64)
        done = np.array([self.computed.get(r, 0) for r in reqs], np.int64)
        seq = done + q
        if (q < 1).any() or (seq > self.max_len).any():
            raise ValueError(f"step: query lens {q.tolist()} / seq lens {seq.tolist()} out of range")
        x = torch.cat([new_tokens[r] for r in reqs]).to(self.device, self.dtype)
        positions = torch.from_numpy(np.concatenate([np.arange(d, s) for d, s in zip(done, seq,
                                                                                      strict=True)]))
        inputs: dict[str, Any] = {}
        for group in self.groups:
            table, block_size = self._table(group, reqs, seq)
            cam = CommonAttentionMetadata.build(query_lens=q, seq_lens=seq, block_table=table,
                                                block_size=block_size, device=self.device)
            built = build_group_inputs(group.spec, cam)
            inputs.update({layer.cache_name: built for layer in group.layers})
        with torch.no_grad(), forward_context(ForwardContext(inputs=inputs, backend=self.backend)):
            out = self.module(x, positions.to(self.device))
        for r, s in zip(reqs, seq, strict=True):
            self.computed[r] = int(s)
        for group in self.groups:
            self._free_skipped(group, reqs)
        bounds = np.concatenate([[0], np.cumsum(q)])
        return {r: out[bounds[i]:bounds[i + 1]] for i, r in enumerate(reqs)}

    def _take(self, group: _Group) -> int:
        if not group.free:
            raise RuntimeError("LayerHarness: pool exhausted (raise max_reqs or max_len)")
        return group.free.pop()

    def _table(self, group: _Group, reqs: Sequence[Any], seq: np.ndarray) -> tuple[np.ndarray, int]:
        """Grow each request's blocks to cover its new length; return the group's table and block size."""
        if not group.spec.is_attention:
            for r in reqs:
                if r not in group.tables:
                    group.tables[r] = [self._take(group)]
            # One "block" (the state slot) covers the whole sequence, as in the model runner.
            return np.array([group.tables[r] for r in reqs], np.int64), int(seq.max())
        rows = []
        for r, s in zip(reqs, seq, strict=True):
            ids = group.tables.setdefault(r, [])
            while len(ids) < cdiv(int(s), self.block_size):
                ids.append(self._take(group))
            rows.append(ids)
        width = max(len(row) for row in rows)
        table = np.zeros((len(rows), width), np.int64)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        return table, self.block_size

    def _free_skipped(self, group: _Group, reqs: Sequence[Any]) -> None:
        """Free (poison, null out, recycle) every block wholly made of skipped tokens."""
        if not group.spec.is_attention:
            return
        for r in reqs:
            ids = group.tables[r]
            dead = group.spec.skipped_tokens(self.computed[r]) // self.block_size
            for i in range(dead):
                if ids[i]:
                    self._poison(group, ids[i])
                    group.free.insert(int(self.rng.integers(0, len(group.free) + 1)), ids[i])
                    ids[i] = 0

    @staticmethod
    def _poison(group: _Group, block: int) -> None:
        for tensors in group.tensors:
            for t in tensors:
                t[block] = float("nan")

    def finish(self, request: Any) -> None:
        """Release a request's blocks / slot (poisoned, so a later request cannot inherit them)."""
        for group in self.groups:
            for block in group.tables.pop(request, []):
                if block:
                    self._poison(group, block)
                    group.free.insert(int(self.rng.integers(0, len(group.free) + 1)), block)
        self.computed.pop(request, None)

    # ------------------------------------------------------------------ conveniences

    def run(self, x: torch.Tensor, chunks: Sequence[int], *, request: Any = 0) -> torch.Tensor:
        """Feed one request's (n, hidden) states in consecutive steps of ``chunks`` tokens (summing to n);
        returns the concatenated (n, hidden) outputs."""
        if sum(chunks) != x.shape[0]:
            raise ValueError(f"run: chunks {list(chunks)} do not sum to {x.shape[0]} tokens")
        outs, start = [], 0
        for n in chunks:
            outs.append(self.step({request: x[start:start + n]})[request])
            start += n
        return torch.cat(outs)


def schedule(n: int, prefill_chunks: Sequence[int], num_decodes: int) -> list[int]:
    """Chunk lengths for an n-token run: the given prefill chunks, then whatever is left as one chunk,
    then ``num_decodes`` single-token steps."""
    rest = n - sum(prefill_chunks) - num_decodes
    if rest < 0:
        raise ValueError(f"schedule: {list(prefill_chunks)} + {num_decodes} decodes exceed {n} tokens")
    return [*prefill_chunks, *([rest] if rest else []), *([1] * num_decodes)]


def torch_and_triton_outputs(layer: nn.Module, xs: dict[str, torch.Tensor], steps: list[dict[str, int]], *,
                             max_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer`` stepped through ``steps`` (request -> tokens this step, rows of ``xs[request]`` in order) on the
    torch backend, then on the triton backend: each run's outputs, concatenated in step and request order."""
    from hybridkv.backends.triton_backend import triton_backend

    outs = []
    for backend in ("torch", "triton"):
        harness = LayerHarness(layer, max_len=max_len, max_reqs=len(xs), seed=seed)
        if backend == "triton":
            harness.backend = triton_backend()
        done, got = dict.fromkeys(xs, 0), []
        for step in steps:
            out = harness.step({r: xs[r][done[r]:done[r] + n] for r, n in step.items()})
            got += [out[r] for r in sorted(out)]
            for r, n in step.items():
                done[r] += n
        outs.append(torch.cat(got))
    return outs[0], outs[1]

