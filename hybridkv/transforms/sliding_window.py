"""Sliding-window trimming: block tables that reference only blocks some query can still see.

Window semantics are HF's: a query at p sees keys p - W < k <= p (W keys including itself). The earliest
query of a row sees the earliest keys, so every block-table column wholly before ``first_query - W + 1``
is dead for the whole row. Trimming drops those columns, shifts the row left and raises ``key_start`` by
the dropped keys, so kernels read only live blocks and a freed (possibly reused) block id is never read.
The window mask still applies inside the first kept block. vLLM keeps such stale ids in its tables.

Example (the test ``test_trim_docstring_example``; W = 3, block_size = 2; k = key, q = query,
x = key that no query of the row can see, [..] = one block; block ids of row r are 10 * (r + 1) + column)::

    position    0 1   2 3   4 5   6 7
    request 0  [x x] [x x] [k k] [q]      seq_len 7, q_len 1 -> drop 2 blocks: key_start 4, seq_len 3
    request 1  [k k] [q q] [q]            seq_len 5, q_len 3 -> drop 0 blocks
    request 2  [x x] [x k] [k q] [q q]    seq_len 8, q_len 3 -> drop 1 block:  key_start 2, seq_len 6

    block_table [[10, 11, 12, 13], [20, 21, 22, 0], [30, 31, 32, 33]]
    ->          [[12, 13, 0], [20, 21, 22], [31, 32, 33]]
"""

from __future__ import annotations

import numpy as np

from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms.block_rows import floordiv, gather_block_rows

__all__ = ["trim_sliding_window"]


def window_drop(num_computed: np.ndarray, sliding_window: int, block_size: int) -> np.ndarray | None:
    """Whole blocks before each row's window (its earliest query at ``num_computed`` (n,), relative to the
    row's key_start), or None when no row has one to drop."""
    over = num_computed - (sliding_window - 1)           # keys before the earliest query's window
    if np.maximum.reduce(over) < block_size:
        return None
    return floordiv(np.maximum(over, 0, out=over), block_size)


def trim_sliding_window(cam: CommonAttentionMetadata, sliding_window: int) -> CommonAttentionMetadata:
    """Drop each row's leading blocks that lie wholly outside the window of all its queries.

    Returns ``cam`` itself when nothing can be dropped. Composes with any input ``key_start`` (positions
    are relative to it) and is idempotent. The table shrinks to the widest remaining row; columns past a
    row's last key are null (0).
    """
    if not isinstance(sliding_window, (int, np.integer)) or isinstance(sliding_window, bool):
        raise ValueError(f"sliding_window: must be an int, got {sliding_window!r}")
    if sliding_window <= 0:
        raise ValueError(f"sliding_window: must be positive, got {sliding_window}")
    bs = cam.block_size
    drop = window_drop(cam.num_computed_tokens_cpu, int(sliding_window), bs) if cam.num_reqs else None
    if drop is None:
        return cam
    shift = drop * bs
    seq = cam.seq_lens_cpu - shift
    nblk = floordiv(seq + (bs - 1), bs)
    bt = gather_block_rows(cam.block_table_cpu, np.arange(cam.num_reqs), drop, nblk, int(np.maximum.reduce(nblk)))
    return cam.with_keys(
        seq_lens_cpu=seq,
        key_start_cpu=cam.key_start_cpu + shift,
        block_table_cpu=bt,
        num_computed_tokens_cpu=cam.num_computed_tokens_cpu - shift,
    )
