"""Prefix-cache checkpoints of recurrent states in host memory: the tier where the device's checkpoint slots move
what they evict, and where a hit is copied back from (``StateSlotPool``'s host slots, ids from
``plan.num_state_slots`` on; ``ModelRunner.copy_states`` applies a batch of copies through ``HostCheckpoints``).

A host slot is one page-locked row holding every recurrent layer's states (each from a 16-byte boundary), so
moving a checkpoint is one DMA. A move to host memory does not hold up the steps: the device slot's states are
gathered into a staging row on the compute stream (one small kernel per state tensor for the whole batch, then
the slot may be overwritten), and a side stream copies the row out while the next steps run. A restore is on the
compute stream (the next forward reads it) and waits for the side stream only when it reads a host row that a
move still in flight writes. The staging rows are device memory of the plan (``num_staging_slots``): half for
moves out, taken in turn (a row is free again once its copy out has landed), half for restores; a batch with
more runs in rounds. The engine lets the stores of a step move only as many checkpoints as rows are free
(``moves_available``: past that, one a store evicts is lost), so the steps never wait for the host link: on a
Mamba2 1B model's mixed traffic the checkpoints come at about the PCIe bandwidth.

    device slot X --gather--> staging row --side stream DMA--> host row h     (demote: X may be rewritten now)
    host row h --DMA--> staging row --scatter--> working slot w               (restore: before the forward)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.metadata import PACK_ALIGN, host_to_device


class HostCheckpoints:
    """The host rows, the staging rows and the copies between them and the device state tensors."""

    def __init__(self, plan: KVCachePlan, caches: dict[str, tuple[torch.Tensor, ...]], device: torch.device) -> None:
        self.first = plan.num_state_slots                 # pool id of host row 0
        rows = plan.num_staging_slots
        self.half = max(1, rows // 2)                     # staging rows per direction
        states = [t for g in plan.mamba_groups for name in g.layer_names for t in caches[name]]
        sizes = [t[0].numel() * t.element_size() for t in states]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // PACK_ALIGN) * PACK_ALIGN)
        self.row_bytes = offsets[-1]
        cuda = device.type == "cuda"
        self.host = torch.empty((plan.num_host_checkpoint_slots, self.row_bytes), dtype=torch.uint8)
        if cuda and self.host.numel():
            # Page-locked in place: ``pin_memory=True`` goes through PyTorch's pinned-memory cache, which rounds
            # a request up to a power of two (40 GiB asked would lock 64).
            cudart, ptr = torch.cuda.cudart(), self.host.data_ptr()
            err = cudart.cudaHostRegister(ptr, self.host.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.host.numel()} bytes failed: {err}")
            weakref.finalize(self, cudart.cudaHostUnregister, ptr)
        self.staging = torch.empty((2 * self.half, self.row_bytes), dtype=torch.uint8, device=device)
        # (device state (num_slots, *shape), its part of the staging rows viewed as (rows, *shape))
        self._parts = list(zip(states, offsets[:-1], sizes, strict=True))
        self.layout = [(t, self.staging[:, o:o + n].view(t.dtype).view(2 * self.half, *t.shape[1:]))
                       for t, o, n in self._parts]
        self.device = device
        self.side = torch.cuda.Stream(device) if cuda else None
        # Moves out use staging rows 0 .. half - 1 in turn; each row's event marks its copy out landed.
        self._row_done: list[torch.cuda.Event | None] = [None] * self.half
        self._next_row = 0
        self._writing: dict[int, torch.cuda.Event] = {}   # host row -> the copy out writing it (may have landed)

    def states_of(self, slot: int) -> list[torch.Tensor]:
        """Host slot ``slot`` (a pool id) as one tensor per device state tensor, in plan order (views)."""
        row = self.host[slot - self.first]
        return [row[o:o + n].view(t.dtype).view(t.shape[1:]) for t, o, n in self._parts]

    def moves_available(self) -> int:
        """Moves out ``demote`` can start now without the compute stream waiting for an earlier one (any number
        off a GPU, where copies are synchronous)."""
        if self.side is None:
            return 1 << 30
        return sum(e is None or e.query() for e in self._row_done)

    def demote(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device slot -> host slot for each pair (host slots as pool ids). Past ``moves_available`` (more
        moves than rows in one batch, or rows still in flight) the compute stream waits for the oldest row."""
        main = torch.cuda.current_stream(self.device) if self.side is not None else None
        for i in range(0, len(pairs), self.half):
            chunk = pairs[i:i + self.half]
            rows = [(self._next_row + j) % self.half for j in range(len(chunk))]
            self._next_row = (self._next_row + len(chunk)) % self.half
            for r in rows:
                done = self._row_done[r]
                if main is not None and done is not None and not done.query():
                    main.wait_event(done)
            src, at = host_to_device(np.array([[s for s, _ in chunk], rows], np.int64), self.device)
            for state, view in self.layout:
                view[at] = state[src]
            if main is None:
                for r, (_, h) in zip(rows, chunk, strict=True):
                    self.host[h - self.first].copy_(self.staging[r])
                continue
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                for r, (_, h) in zip(rows, chunk, strict=True):
                    self.host[h - self.first].copy_(self.staging[r], non_blocking=True)
                    self._row_done[r] = self._writing[h - self.first] = self.side.record_event()

    def restore(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host slot -> device slot for each pair (host slots as pool ids), on the compute stream."""
        for i in range(0, len(pairs), self.half):
            chunk = pairs[i:i + self.half]
            k = len(chunk)
            base = self.half                              # the restores' half of the staging rows
            for j, (h, _) in enumerate(chunk):
                landed = self._writing.pop(h - self.first, None)
                if landed is not None:                    # (a wait on a completed event costs nothing)
                    torch.cuda.current_stream(self.device).wait_event(landed)
                self.staging[base + j].copy_(self.host[h - self.first], non_blocking=True)
            dst = host_to_device(np.array([d for _, d in chunk], np.int64), self.device)
            for state, view in self.layout:
                state[dst] = view[base:base + k]
