"""Block tables: request row x logical block -> block id, on the host (numpy) with a device mirror.

Entry ``[row, j]`` holds the block with tokens ``j*bs .. (j+1)*bs - 1`` of the request in ``row``; empty
or skipped entries hold the null block 0 (never None), so padded rows and freed window entries point at
a block that exists. Columns are logical (absolute) block indices: a sliding-window row keeps leading
nulls rather than shifting, so ``pos // bs`` addresses a token directly and trimming is a pure
metadata transform.

``MultiGroupBlockTable`` stores all attention groups in one (G, rows, cols) array: groups that share a
block size move in lockstep, so one fancy-indexing op serves every group (slot mapping, new blocks).

Device mirror. On the CPU the mirror shares memory with the host array (``commit`` is a no-op). On an
accelerator the host array is pinned and ``commit(num_rows)`` enqueues a non-blocking copy of the used
rows; the engine must not write those host rows again before the stream has consumed the copy (in a
step loop the per-step device->host sync of sampled tokens orders this).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.kv_groups.block_pool import NULL_BLOCK


def _mirror(host: np.ndarray, device: torch.device, share: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(host tensor over ``host``'s memory, device tensor). Pinned host memory only on accelerators."""
    host_t = torch.from_numpy(host)
    if share is None:
        share = device.type == "cpu"
    if share:
        if device.type != "cpu":
            raise ValueError("BlockTable.share_host_memory=True needs a CPU device")
        return host_t, host_t
    return host_t, torch.zeros(host.shape, dtype=torch.int32, device=device)


def token_ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten per-request ranges: (index of the request per element, starts[i] + 0..counts[i]-1).

    starts, counts: (R,) -> both outputs (sum(counts),). No per-request Python loop."""
    counts = counts.astype(np.int64, copy=False)
    total = int(counts.sum())
    owner = np.repeat(np.arange(counts.size), counts)                          # (T,)
    first = np.cumsum(counts) - counts                                          # (R,)
    values = np.arange(total, dtype=np.int64) + np.repeat(starts - first, counts)
    return owner, values


class BlockTable:
    """One group's table: ``np`` (max_num_reqs, max_blocks_per_req) int32 on the host, ``tensor`` on
    the device."""

    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, *, block_size: int,
                 device: torch.device | str = "cpu", share_host_memory: bool | None = None,
                 _host: np.ndarray | None = None, _device: torch.Tensor | None = None,
                 _num_blocks: np.ndarray | None = None) -> None:
        for name, v in (("max_num_reqs", max_num_reqs), ("max_blocks_per_req", max_blocks_per_req),
                        ("block_size", block_size)):
            if v <= 0:
                raise ValueError(f"BlockTable.{name} must be positive, got {v}")
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        if _host is not None:
            assert _device is not None
            self.np, self.tensor = _host, _device
        else:
            self.np = np.zeros((max_num_reqs, max_blocks_per_req), np.int32)
            self._host_t, self.tensor = _mirror(self.np, self.device, share_host_memory)
            if self._host_t is not self.tensor and self.device.type == "cuda":
                self._host_t = self._host_t.pin_memory()
                self.np = self._host_t.numpy()
        # (max_num_reqs,) used columns per row; shared by the groups of a MultiGroupBlockTable.
        self.num_blocks = np.zeros(max_num_reqs, np.int32) if _num_blocks is None else _num_blocks
        self._device_cols = 0

    # -- row ops ---------------------------------------------------------------------------------
    def set_row(self, row: int, block_ids: np.ndarray | list[int]) -> None:
        n = len(block_ids)
        self.np[row, :n] = block_ids
        self.np[row, n:self.num_blocks[row]] = NULL_BLOCK
        self.num_blocks[row] = n

    def append_blocks(self, row: int, block_ids: np.ndarray | list[int]) -> None:
        start = int(self.num_blocks[row])
        self.np[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def null_blocks(self, row: int, start: int, end: int) -> None:
        """Point entries ``start .. end-1`` of ``row`` at the null block (freed, e.g. out of window)."""
        self.np[row, start:end] = NULL_BLOCK

    def clear_row(self, row: int) -> None:
        self.np[row, :self.num_blocks[row]] = NULL_BLOCK
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Move ``src`` into ``dst`` (batch condensing); ``src`` becomes empty."""
        n = max(int(self.num_blocks[src]), int(self.num_blocks[dst]))
        self.np[dst, :n] = self.np[src, :n]
        self.num_blocks[dst] = self.num_blocks[src]
        self.clear_row(src)

    def swap_rows(self, a: int, b: int) -> None:
        n = max(int(self.num_blocks[a]), int(self.num_blocks[b]))
        self.np[[a, b], :n] = self.np[[b, a], :n]
        self.num_blocks[[a, b]] = self.num_blocks[[b, a]]

    # -- device + slot mapping -------------------------------------------------------------------
    def commit(self, num_rows: int) -> None:
        """Copy rows ``0 .. num_rows-1`` (their used columns) to the device tensor, non-blocking; a no-op
        when the mirror shares host memory (CPU)."""
        host = torch.from_numpy(self.np)
        if num_rows and self.tensor.data_ptr() != host.data_ptr():
            used = int(self.num_blocks[:num_rows].max())
            cols, self._device_cols = max(used, self._device_cols), used    # also re-null shrunk rows
            self.tensor[:num_rows, :cols].copy_(host[:num_rows, :cols], non_blocking=True)

    def slot_mapping(self, req_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """(T,) int64 cache slots ``table[row, pos // bs] * bs + pos % bs`` of tokens at ``positions``
        in rows ``req_rows`` (both (T,), one entry per token)."""
        bs = self.block_size
        pos = positions.astype(np.int64, copy=False)
        return self.np[req_rows, pos // bs].astype(np.int64) * bs + pos % bs


class MultiGroupBlockTable:
    """The block tables of ``num_groups`` attention groups of one block size, stored together."""

    def __init__(self, num_groups: int, max_num_reqs: int, max_blocks_per_req: int, *, block_size: int,
                 device: torch.device | str = "cpu", share_host_memory: bool | None = None) -> None:
        if num_groups <= 0:
            raise ValueError(f"MultiGroupBlockTable.num_groups must be positive, got {num_groups}")
        self.num_groups = num_groups
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        # (G*R*C + C,): the tables, then one row of nulls that a window starting in the last row may read.
        size = num_groups * max_num_reqs * max_blocks_per_req
        flat = np.zeros(size + max_blocks_per_req, np.int32)
        self.np = flat[:size].reshape(num_groups, max_num_reqs, max_blocks_per_req)    # (G, R, C)
        host_t, self.tensor = _mirror(self.np, self.device, share_host_memory)
        if host_t is not self.tensor and self.device.type == "cuda":
            flat = torch.from_numpy(flat).pin_memory().numpy()
            self.np = flat[:size].reshape(num_groups, max_num_reqs, max_blocks_per_req)
        self._flat = flat
        self._group_offsets = (np.arange(num_groups, dtype=np.int64)
                               * (max_num_reqs * max_blocks_per_req))[:, None]           # (G, 1)
        self.num_blocks = np.zeros(max_num_reqs, np.int32)        # (R,) used columns, same in every group
        self._device_cols = 0
        self._tables = [BlockTable(max_num_reqs, max_blocks_per_req, block_size=block_size,
                                   device=self.device, _host=self.np[g], _device=self.tensor[g],
                                   _num_blocks=self.num_blocks)
                        for g in range(num_groups)]

    def __getitem__(self, group: int) -> BlockTable:
        """A view of one group's table (shares memory; its ``num_blocks`` is its own)."""
        return self._tables[group]

    def __len__(self) -> int:
        return self.num_groups

    def clear_row(self, row: int) -> None:
        self.np[:, row, :self.num_blocks[row]] = NULL_BLOCK
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Move ``src`` into the empty row ``dst`` in every group (batch condensing)."""
        n = int(self.num_blocks[src])
        self.np[:, dst, :n] = self.np[:, src, :n]
        self.num_blocks[dst] = n
        self.clear_row(src)

    def swap_rows(self, a: int, b: int) -> None:
        n = max(int(self.num_blocks[a]), int(self.num_blocks[b]))
        self.np[:, [a, b], :n] = self.np[:, [b, a], :n]
        self.num_blocks[[a, b]] = self.num_blocks[[b, a]]

    def commit(self, num_rows: int) -> None:
        """Copy rows ``0 .. num_rows-1`` (their used columns) of every group to the device tensor,
        non-blocking; a no-op when the mirror shares host memory (CPU). Columns past every row's
        ``num_blocks`` are null; the previous commit's width is re-copied once, so a shrunk row leaves
        no stale block ids on the device."""
        host = torch.from_numpy(self.np)
        if num_rows and self.tensor.data_ptr() != host.data_ptr():
            used = int(self.num_blocks[:num_rows].max())
            cols, self._device_cols = max(used, self._device_cols), used    # also re-null shrunk rows
            self.tensor[:, :num_rows, :cols].copy_(host[:, :num_rows, :cols], non_blocking=True)

    def row_windows(self, groups: slice, rows: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
        """(len(groups), B, width) int32: in each of ``groups``, row ``rows[i]`` (B,) from column
        ``start[i]`` on (``start[i] <= max_blocks_per_req``); entries past the row's last column are null.

        One gather for all groups: each output row is a contiguous run of the flat tables, copied out of a
        strided "sliding window" view (the trailing null row keeps the last window in bounds). Only a row
        whose window crosses its row end (``start + width > max_blocks_per_req``) needs its tail nulled."""
        C = self.max_blocks_per_req
        first = self._group_offsets[groups] + (rows * C + start)                     # (G', B)
        item = self._flat.itemsize
        windows = np.ndarray((self._flat.size - width + 1, width), np.int32, self._flat, 0, (item, item))
        out = windows[first]
        if int(np.maximum.reduce(start, initial=0)) + width > C:
            cross = np.flatnonzero(start + width > C)
            out[:, cross] *= np.arange(width) < (C - start[cross])[:, None]
        return out

    def slot_mapping(self, req_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """(G, T) int64 slots of tokens at ``positions`` (T,) in rows ``req_rows`` (T,), every group."""
        blk, off = np.divmod(positions, self.block_size)                                 # (T,) each
        idx = req_rows.astype(np.int64, copy=False) * self.max_blocks_per_req + blk + self._group_offsets
        out = np.multiply(self._flat[idx], self.block_size, dtype=np.int64)
        out += off
        return out
