"""Decode/prefill split: kernels often run decodes and prefills as two launches over one batch.

The batch is assumed ordered decodes first (``reorder_decodes_first`` gives the stable permutation,
``permute_requests`` applies it to a CAM), so the split is a single boundary::

    query_lens  [1, 1, 2, 1 | 7, 1, 4]     decode_threshold 2
    ->          4 decodes (5 tokens), 3 prefills (12 tokens); the 1 after the 7 counts as a prefill
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridkv.metadata import CommonAttentionMetadata, debug_enabled, field_rules, host_to_device

__all__ = ["permute_requests", "reorder_decodes_first", "split_decodes_and_prefills"]


def _check_threshold(decode_threshold: int) -> None:
    if isinstance(decode_threshold, bool) or not isinstance(decode_threshold, (int, np.integer)):
        raise ValueError(f"decode_threshold: must be an int, got {decode_threshold!r}")
    if decode_threshold <= 0:
        raise ValueError(f"decode_threshold: must be positive, got {decode_threshold}")


def split_decodes_and_prefills(
    cam: CommonAttentionMetadata, decode_threshold: int = 1, *, require_uniform: bool = False
) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens) of a decodes-first batch.

    Decodes are the leading requests with ``query_len <= decode_threshold``; with ``require_uniform`` they
    must also all have the first request's query length (for kernels that take one q length per batch).
    """
    _check_threshold(decode_threshold)
    qsl = cam.query_start_loc_cpu
    q = qsl[1:] - qsl[:-1]
    is_prefill = q > decode_threshold
    if require_uniform and q.size:
        is_prefill |= q != q[0]
    first = int(is_prefill.argmax()) if is_prefill.any() else cam.num_reqs
    num_decode_tokens = int(qsl[first])
    return first, cam.num_reqs - first, num_decode_tokens, cam.num_actual_tokens - num_decode_tokens


def reorder_decodes_first(query_lens: Sequence[int] | np.ndarray, decode_threshold: int = 1) -> np.ndarray:
    """Stable permutation putting requests with ``query_len <= decode_threshold`` first.

    ``new_batch[i] = old_batch[perm[i]]``. Stable (decodes and prefills each keep their order), unlike
    vLLM's in-place reorder which minimises swaps.
    """
    _check_threshold(decode_threshold)
    q = np.asarray(query_lens)
    if q.ndim != 1:
        raise ValueError(f"query_lens: expected a 1-D array, got shape {q.shape}")
    return np.argsort(q > decode_threshold, kind="stable")


def _permute_offsets(offsets: Any, p: Any) -> Any:
    """Cumulative offsets of the permuted lengths (numpy or torch, same dtype)."""
    lengths = (offsets[1:] - offsets[:-1])[p]
    out = offsets.clone() if isinstance(offsets, torch.Tensor) else offsets.copy()
    out[0] = 0
    if isinstance(out, torch.Tensor):
        out[1:] = torch.cumsum(lengths, 0)
    else:
        np.cumsum(lengths, out=out[1:])
    return out


def permute_requests(
    cam: CommonAttentionMetadata, perm: Sequence[int] | np.ndarray
) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Reorder the requests of ``cam``: request i of the result is request ``perm[i]`` of the input.

    Returns the new CAM and ``token_index`` (num_tokens,): token j of the new batch is token
    ``token_index[j]`` of the old one, so callers gather queries with it (and scatter outputs back with its
    inverse). Driven by the field declarations like microbatch slicing.
    """
    n = cam.num_reqs
    p = np.asarray(perm)
    if (
        p.shape != (n,)
        or not np.issubdtype(p.dtype, np.integer)
        or not np.array_equal(np.sort(p), np.arange(n))
    ):
        raise ValueError(f"perm: must be a permutation of range({n}), got {perm!r}")
    qsl = cam.query_start_loc_cpu
    q = (qsl[1:] - qsl[:-1])[p]
    new_qsl = np.zeros(n + 1, np.int32)
    np.cumsum(q, out=new_qsl[1:])
    token_index = np.arange(cam.num_actual_tokens) + np.repeat(
        (qsl[:-1][p] - new_qsl[:-1]).astype(np.int64), q
    )
    on_cpu = cam.device.type == "cpu"
    p_dev = None if on_cpu else host_to_device(p.astype(np.int64), cam.device)
    tok_dev = torch.from_numpy(token_index) if on_cpu else host_to_device(token_index, cam.device)
    out: dict[str, Any] = {}
    for rule in field_rules(type(cam)):
        kind, value = rule.kind, getattr(cam, rule.name)
        if on_cpu and rule.twin is not None:  # same values as the host twin just computed, no copy
            out[rule.name] = torch.from_numpy(out[rule.twin])
            continue
        is_t = isinstance(value, torch.Tensor)
        if kind in ("request", "block_row"):
            out[rule.name] = value[p_dev] if is_t else value[p]
        elif kind == "request_offsets":
            out[rule.name] = _permute_offsets(value, p_dev if is_t else p)
        elif kind == "token":
            out[rule.name] = value[tok_dev] if is_t else value[token_index]
        elif kind == "scalar":
            out[rule.name] = value  # counts and maxima do not change under a permutation
        else:
            raise AssertionError(f"field {rule.name}: unknown slice kind {kind!r}")
    new = type(cam)(**out)
    if debug_enabled():
        new.validate()
    return new, token_index
