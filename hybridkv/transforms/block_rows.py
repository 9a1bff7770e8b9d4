"""Vectorised block-table row surgery shared by the transforms (no Python loop over requests)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["floordiv", "gather_block_rows"]


def floordiv(x: np.ndarray, d: int) -> np.ndarray:
    """``x // d`` for a positive int d; an arithmetic shift when d is a power of two (the usual case)."""
    return x >> (d.bit_length() - 1) if d & (d - 1) == 0 else x // d


def _windows(a: np.ndarray, width: int) -> np.ndarray:
    """(a.size - width + 1, width) read-only strided view: row i is a[i : i + width] (no copy)."""
    return np.ndarray((a.size - width + 1, width), a.dtype, a, 0, (a.itemsize, a.itemsize))


@lru_cache(maxsize=64)
def _prefix_masks(width: int) -> np.ndarray:
    """(width + 1, width) int32: row k is k ones, then zeros (shared: never mutate)."""
    return (np.arange(width)[None, :] < np.arange(width + 1)[:, None]).astype(np.int32)


def gather_block_rows(
    block_table: np.ndarray, rows: np.ndarray, col0: np.ndarray, num_blocks: np.ndarray, width: int
) -> np.ndarray:
    """(len(rows), width) int32: row ``rows[i]`` of ``block_table`` from column ``col0[i]`` on, with the
    null block (0) past ``num_blocks[i]`` columns (callers guarantee ``col0 + num_blocks <= max_blocks``).

    Rows of the output are contiguous runs of the flattened table, so they are copied as runs out of a
    strided "sliding window" view, and the null padding is a multiply by rows of a cached prefix mask:
    ~3x faster than 2-D fancy indexing with a broadcast index grid, which matters at batch 256+.
    """
    n_rows = len(rows)
    if n_rows == 0 or width == 0:
        return np.zeros((n_rows, width), np.int32)
    table = np.ascontiguousarray(block_table, dtype=np.int32)
    start = rows * table.shape[1]
    start += col0
    np.minimum(start, table.size, out=start)
    flat = table.ravel()
    if int(np.maximum.reduce(start)) + width > flat.size:  # the last row's window runs off the end: pad (a copy)
        flat = np.concatenate((flat, np.zeros(width, np.int32)))
    out = _windows(flat, width)[start]
    out *= _prefix_masks(width)[np.minimum(num_blocks, width)]
    return out
