"""Microbatch slicing: one step's metadata cut at token boundaries into n metadata objects.

Slicing is driven by each field's ``slice`` declaration (see ``hybridkv.metadata``), so no field can be
silently dropped. A request cut in two keeps its own causal view: the first part's ``seq_len`` stops at the
cut, the second part sees everything and counts the first part's tokens as computed.

Example (split at token 6; q = query token, k = cached key; request 1 is cut)::

    tokens     0 1 2 | 3 4 5 6 7 8 9          query_lens [3, 7], seq_lens [3, 9] (request 1 has 2 keys)
    part 0     q q q   q q q                  query_lens [3, 3], seq_lens [3, 5]
    part 1                   q q q q          query_lens [4],    seq_lens [9]   (num_computed 5)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridkv.metadata import CommonAttentionMetadata, debug_enabled, field_rules

__all__ = ["slice_microbatch", "split_microbatches"]


def _cut_fix(value: Any, rule: str | None, head: int, tail: int) -> Any:
    """Apply a field's ``on_cut`` rule to its per-request slice (copying, never mutating the input)."""
    if rule == "sub_tail" and tail:
        value = value.clone() if isinstance(value, torch.Tensor) else value.copy()
        value[-1] -= tail
    elif rule == "add_head" and head:
        value = value.clone() if isinstance(value, torch.Tensor) else value.copy()
        value[0] += head
    return value


def _slice(cam: CommonAttentionMetadata, t0: int, t1: int, r0: int, r1: int) -> CommonAttentionMetadata:
    """Tokens [t0, t1) = requests [r0, r1), the first/last possibly cut; dispatch on field declarations."""
    qsl = cam.query_start_loc_cpu
    head = t0 - int(qsl[r0])  # tokens of the first request that belong to an earlier part
    tail = int(qsl[r1]) - t1  # tokens of the last request that belong to a later part
    on_cpu = cam.device.type == "cpu"
    out: dict[str, Any] = {}
    for rule in field_rules(type(cam)):
        kind = rule.kind
        if kind == "scalar":
            if not rule.derived:
                out[rule.name] = getattr(cam, rule.name)
            continue
        if on_cpu and rule.twin is not None:  # same values as the host twin just computed, no copy
            out[rule.name] = torch.from_numpy(out[rule.twin])
            continue
        value = getattr(cam, rule.name)
        if kind in ("request", "block_row"):
            out[rule.name] = _cut_fix(value[r0:r1], rule.on_cut, head, tail)
        elif kind == "request_offsets":
            offs = value[r0 : r1 + 1] - t0  # a new array; interior offsets already lie inside (0, t1 - t0)
            offs[0] = 0
            offs[-1] = t1 - t0
            out[rule.name] = offs
        elif kind == "token":
            out[rule.name] = value[t0:t1]
        else:
            raise AssertionError(f"field {rule.name}: unknown slice kind {kind!r}")
    out.update(cam.derive_scalars(out["query_start_loc_cpu"], out["seq_lens_cpu"]))
    part = type(cam)(**out)
    if debug_enabled():
        part.validate()
    return part


def _request_ranges(qsl: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last request of each token range [starts[i], ends[i]) (non-empty ranges).

    A request belongs to every range holding one of its tokens; a request with no queries belongs to the
    range starting at its offset (trailing ones to the range that ends the batch).
    """
    n = len(qsl) - 1
    a = np.searchsorted(qsl, starts, side="left")
    r0 = np.where(qsl[a] == starts, a, a - 1)
    r1 = np.where(ends == qsl[-1], n, np.searchsorted(qsl, ends, side="left"))
    return r0, r1


def slice_microbatch(
    cam: CommonAttentionMetadata, token_start: int, token_end: int
) -> CommonAttentionMetadata:
    """The tokens ``[token_start, token_end)`` of ``cam`` as a batch of their own (non-empty range)."""
    t = cam.num_actual_tokens
    if not (0 <= token_start < token_end <= t):
        raise ValueError(f"token_start/token_end: need 0 <= {token_start} < {token_end} <= {t}")
    r0, r1 = _request_ranges(cam.query_start_loc_cpu, np.array([token_start]), np.array([token_end]))
    return _slice(cam, int(token_start), int(token_end), int(r0[0]), int(r1[0]))


def split_microbatches(
    cam: CommonAttentionMetadata,
    token_splits: Sequence[int] | np.ndarray | None = None,
    *,
    num_ubatches: int | None = None,
) -> list[CommonAttentionMetadata]:
    """Cut ``cam`` at the given token offsets (strictly increasing, inside (0, num_actual_tokens)), or into
    ``num_ubatches`` parts balanced by tokens. Returns a list; concatenating the parts' outputs in order
    equals the unsplit output. Empty parts are a ValueError.
    """
    t = cam.num_actual_tokens
    if (token_splits is None) == (num_ubatches is None):
        raise ValueError("token_splits: give exactly one of token_splits or num_ubatches")
    if num_ubatches is not None:
        if isinstance(num_ubatches, bool) or not isinstance(num_ubatches, (int, np.integer)):
            raise ValueError(f"num_ubatches: must be an int, got {num_ubatches!r}")
        if not 1 <= num_ubatches <= t:
            raise ValueError(f"num_ubatches: must be in [1, num_actual_tokens={t}], got {num_ubatches}")
        splits = (np.arange(1, num_ubatches, dtype=np.int64) * t) // num_ubatches
    else:
        splits = np.asarray(token_splits)
        if splits.ndim != 1 or (splits.size and not np.issubdtype(splits.dtype, np.integer)):
            raise ValueError(f"token_splits: expected a 1-D sequence of ints, got {token_splits!r}")
        if splits.size and (splits[0] <= 0 or splits[-1] >= t or (np.diff(splits) <= 0).any()):
            raise ValueError(
                f"token_splits: must be strictly increasing inside (0, {t}) (no empty parts), got {splits}"
            )
    bounds = np.concatenate(([0], splits, [t])).astype(np.int64)
    if t == 0:
        raise ValueError("token_splits: cannot split an empty batch (no empty parts)")
    r0, r1 = _request_ranges(cam.query_start_loc_cpu, bounds[:-1], bounds[1:])
    return [
        _slice(cam, int(bounds[i]), int(bounds[i + 1]), int(r0[i]), int(r1[i]))
        for i in range(len(bounds) - 1)
    ]
