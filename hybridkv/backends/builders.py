"""Per-group builders: one step's ``CommonAttentionMetadata`` for a group -> the inputs its kernels need.

Each group kind applies its transform once per step, and every layer of the group reuses the result:

- full attention: the CAM as is;
- sliding window W: ``trim_sliding_window`` (kernels never see, so never read, a block outside every window);
- chunked local C: ``make_local_attention_virtual_batches`` (any causal paged kernel then does chunked attention);
- Mamba: state-slot indices, has-initial-state flags and the decode/prefill split.

KV writes always use the untransformed slot mapping: transforms change what is *read*, not where a token lives.

Each attention kind also owns its *decode rule* (``decode_rows``, ``decode_table_width``): what its transform
makes of a decode batch (one query per row), as a few numpy ops on the rows as the coordinator keeps them.
CUDA-graph decode steps pack their persistent buffers with it (``engine/cuda_graphs.py``), skipping the CAM;
``tests/test_decode_packing.py`` holds it equal to the builders' CAMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.kv_groups.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.metadata import CommonAttentionMetadata, host_to_device
from hybridkv.transforms import make_local_attention_virtual_batches, trim_sliding_window
from hybridkv.transforms.block_rows import floordiv
from hybridkv.transforms.local_attention import query_chunk_columns
from hybridkv.transforms.sliding_window import window_drop

_max = np.maximum.reduce        # a direct ufunc reduction: ndarray.max goes through a Python wrapper


@dataclass(frozen=True, kw_only=True)
class AttentionInputs:
    cam: CommonAttentionMetadata     # what the attention kernel reads (possibly transformed)
    slot_mapping: torch.Tensor       # (num_tokens,) int64: where each token's K/V is written
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class MambaInputs:
    """Requests are ordered decodes first (the scheduler guarantees it); decodes use the one-step
    state update, the rest the packed chunked scan."""

    query_start_loc: torch.Tensor    # (num_reqs + 1,) int32
    state_indices: torch.Tensor      # (num_reqs,) int64: each request's working state slot
    has_initial_state: torch.Tensor  # (num_reqs,) bool: continues from its slot (else starts at zero)
    num_decodes: int
    num_decode_tokens: int
    # the prefill part, re-based to start at token 0
    prefill_query_start_loc: torch.Tensor
    num_reqs: int


def _build_full(spec: FullAttentionSpec, cam: CommonAttentionMetadata) -> AttentionInputs:
    return AttentionInputs(cam=cam, slot_mapping=cam.slot_mapping)


def _build_sliding(spec: SlidingWindowSpec, cam: CommonAttentionMetadata) -> AttentionInputs:
    return AttentionInputs(cam=trim_sliding_window(cam, spec.sliding_window), slot_mapping=cam.slot_mapping,
                           sliding_window=spec.sliding_window)


def _build_chunked(spec: ChunkedLocalAttentionSpec, cam: CommonAttentionMetadata) -> AttentionInputs:
    return AttentionInputs(cam=make_local_attention_virtual_batches(cam, spec.attention_chunk_size),
                           slot_mapping=cam.slot_mapping)


def _build_mamba(spec: MambaSpec, cam: CommonAttentionMetadata) -> MambaInputs:
    return build_mamba_inputs(query_start_loc=cam.query_start_loc, query_start_loc_cpu=cam.query_start_loc_cpu,
                              num_computed_tokens_cpu=cam.num_computed_tokens_cpu, max_query_len=cam.max_query_len,
                              state_slots_cpu=cam.block_table_cpu[:, 0])


def build_mamba_inputs(*, query_start_loc: torch.Tensor, query_start_loc_cpu: np.ndarray,
                       num_computed_tokens_cpu: np.ndarray, max_query_len: int,
                       state_slots_cpu: np.ndarray) -> MambaInputs:
    """A Mamba group's inputs from the batch-wide arrays and each request's working state slot (the
    runner calls this directly: a Mamba group needs no block table, slot mapping or CAM)."""
    # The leading run of 1-token continuations goes to the one-step update; a fresh 1-token request
    # has no state to continue from, so it stays with the scan (which starts it from zeros).
    qsl = query_start_loc_cpu
    n = num_computed_tokens_cpu.shape[0]
    started = num_computed_tokens_cpu > 0
    one_each = max_query_len == 1 and int(qsl[-1]) == n         # every request has exactly one query
    is_decode = started if one_each else (qsl[1:] - qsl[:-1] == 1) & started
    num_decodes = n if np.count_nonzero(is_decode) == n else int(np.argmin(is_decode))
    num_decode_tokens = int(qsl[num_decodes])
    device = query_start_loc.device
    # Host-side arrays, one copy each: a device op per field would cost more than the numpy work.
    return MambaInputs(query_start_loc=query_start_loc,
                       state_indices=host_to_device(state_slots_cpu.astype(np.int64), device),
                       has_initial_state=host_to_device(started, device), num_decodes=num_decodes,
                       num_decode_tokens=num_decode_tokens,
                       prefill_query_start_loc=host_to_device(qsl[num_decodes:] - num_decode_tokens, device),
                       num_reqs=n)


_BUILDERS: dict[type[KVCacheSpec], Callable] = {
    FullAttentionSpec: _build_full,
    MLAAttentionSpec: _build_full,          # full attention over a latent cache: the same metadata
    SlidingWindowSpec: _build_sliding,
    ChunkedLocalAttentionSpec: _build_chunked,
    MambaSpec: _build_mamba,
}


def build_group_inputs(spec: KVCacheSpec, cam: CommonAttentionMetadata) -> AttentionInputs | MambaInputs:
    """The inputs every layer of a group with ``spec`` reads this step."""
    builder = _BUILDERS.get(type(spec))
    if builder is None:
        raise TypeError(f"no metadata builder for spec kind {type(spec).__name__}")
    return builder(spec, cam)


# -- decode rules: what each kind's transform makes of a decode batch, without a CAM -------------------------------
@dataclass(frozen=True, kw_only=True)
class DecodeRows:
    """A group's decode batch after its transform, for rows that start at block ``start`` (the coordinator's
    form): the keys each row reads from its kept table's first key; the kept table's first column in the given
    rows (None: the rows as they are); blocks kept per row; the kept width (0 when the rows stay as they are)."""

    seq_lens: np.ndarray             # (n,) int32
    col0: np.ndarray | None = None   # (n,)
    num_blocks: np.ndarray | None = None   # (n,)
    width: int = 0


def _decode_full(spec: FullAttentionSpec, seq_lens: np.ndarray, key_start: np.ndarray | int) -> DecodeRows:
    return DecodeRows(seq_lens=seq_lens - key_start)          # every key from the row's start


def _decode_sliding(spec: SlidingWindowSpec, seq_lens: np.ndarray, key_start: np.ndarray | int) -> DecodeRows:
    """``trim_sliding_window`` for one query per row: whole blocks before the query's window [s - W, s) drop."""
    bs = spec.block_size
    seq = seq_lens - key_start
    drop = window_drop(seq - 1, spec.sliding_window, bs)
    if drop is None:
        return DecodeRows(seq_lens=seq)
    seq -= drop * bs
    nblk = floordiv(seq + (bs - 1), bs)
    return DecodeRows(seq_lens=seq, col0=drop, num_blocks=nblk, width=int(_max(nblk)))


def _decode_chunked(spec: ChunkedLocalAttentionSpec, seq_lens: np.ndarray, key_start: np.ndarray | int
                    ) -> DecodeRows:
    """``make_local_attention_virtual_batches`` for one query per row: the request from its query's chunk start."""
    bs = spec.block_size
    into, col0 = query_chunk_columns(seq_lens - 1, key_start, spec.attention_chunk_size, bs)
    into += 1
    if not col0.any():
        return DecodeRows(seq_lens=into)
    nblk = floordiv(into + (bs - 1), bs)
    return DecodeRows(seq_lens=into, col0=col0, num_blocks=nblk, width=int(_max(nblk)))


def _width_full(spec: FullAttentionSpec, full: int) -> int:
    return full


def _width_sliding(spec: SlidingWindowSpec, full: int) -> int:
    return min(full, -(-(spec.sliding_window - 1) // spec.block_size) + 2)


def _width_chunked(spec: ChunkedLocalAttentionSpec, full: int) -> int:
    return min(full, spec.attention_chunk_size // spec.block_size + 1)


@dataclass(frozen=True)
class _DecodeRule:
    rows: Callable[..., DecodeRows]       # (spec, seq_lens, key_start) -> the decode batch after the transform
    width: Callable[..., int]             # (spec, full table width) -> the widest row it reads


_DECODE_RULES: dict[type[KVCacheSpec], _DecodeRule] = {
    FullAttentionSpec: _DecodeRule(_decode_full, _width_full),
    MLAAttentionSpec: _DecodeRule(_decode_full, _width_full),
    SlidingWindowSpec: _DecodeRule(_decode_sliding, _width_sliding),
    ChunkedLocalAttentionSpec: _DecodeRule(_decode_chunked, _width_chunked),
}


def _decode_rule(spec: KVCacheSpec) -> _DecodeRule:
    rule = _DECODE_RULES.get(type(spec))
    if rule is None:
        raise TypeError(f"no decode rule for spec kind {type(spec).__name__}")
    return rule


def decode_rows(spec: KVCacheSpec, seq_lens: np.ndarray, start: np.ndarray | None) -> DecodeRows:
    """An attention group's decode batch (one query per row, at ``seq_lens`` - 1, (n,) int32) whose rows start at
    block ``start`` ((n,), None = column 0) after its builder's transform, down to when the transform keeps the
    table as is (with the transforms' own arithmetic: ``window_drop``, ``query_chunk_columns``)."""
    return _decode_rule(spec).rows(spec, seq_lens, 0 if start is None else start * spec.block_size)


def decode_table_width(spec: KVCacheSpec, *, max_model_len: int) -> int:
    """Widest block-table row a decode request of ``spec`` reads after its group's transform (what a captured
    graph's buffer holds for it)."""
    return _decode_rule(spec).width(spec, -(-max_model_len // spec.block_size))
