"""The shared attention block pool and the Mamba state-slot pool (host-side bookkeeping only).

Block pool. Block 0 is the null block: never handed out, never freed; empty or skipped table entries
point at it. A live block has ``ref_count`` = the number of request-table entries holding it (> 1 only
when requests share it through the prefix cache). A free block is either *plain* (no registered hash;
kept on a stack) or *cached* (its hash is still registered, so a prefix-cache lookup can revive it; kept
in an LRU ordered by time of freeing). Allocation takes plain blocks first, then the least-recently-freed
cached block, evicting its hash: a plain free block holds nothing anyone can look up, so reusing it
first only ever keeps more of the cache alive. Every operation is O(1) per block, in numpy: the plain stack is
an array, and the LRU a queue of the freed id arrays, each block stamped with its latest free (an entry whose
block was revived or freed again since is stale and skipped when evictions reach it; the queue is compacted
when stale entries outnumber live ones). An OrderedDict with one Python store per block had made returning a
finished Gemma-3-like request's ~900 blocks (13 groups) most of prefix caching's host cost per step.

The hash -> block map is kept per group: a block id addresses a page of one group's layers, so a key
found in group A says nothing about group B. A block belongs to at most one group at a time.

State-slot pool. Slot 0 is null. Slots ``1 .. num_working`` are working slots (one per running request);
the last ``num_checkpoint_slots`` slots hold prefix-cache checkpoints: a request's state at a
block-aligned length, keyed by the chained block hash at that length, evicted by kind then recency (see
``CheckpointKind``), never while a request that hit it waits for its copy or a waiting request wants it.
Ids ``num_slots .. num_slots + num_host_slots - 1`` are checkpoint slots in host memory: a checkpoint the
device slots evict moves there (a copy the caller queues, ``take_demotions``) instead of being lost, and a hit
on it copies it straight into the request's working slot.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from hybridkv.kv_groups.hashing import BlockHash

NULL_BLOCK = 0
NULL_SLOT = 0


class BlockPool:
    """Reference-counted pool of ``num_blocks`` blocks (null block 0 included) shared by ``num_groups``.

    Prefix-cache index: one dict maps a key to an *entry*; ``entry_blocks[entry, g]`` is the block
    caching that key in group ``g`` (0 = none). Column ``g`` is group g's own hash -> block map, but
    registering a block position for all G groups costs one dict operation and one numpy write, not G
    dict operations (Gemma-3 has 31 groups)."""

    _COMPACT_SLACK = 1024       # stale LRU entries beyond twice the live ones before the queue is compacted

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool.num_blocks must be >= 2 (block 0 is null), got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"BlockPool.num_groups must be >= 1, got {num_groups}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.ref_count = np.zeros(num_blocks, np.int32)                   # (num_blocks,)
        self._owner = np.zeros(num_blocks, np.int32)                      # group of a live/cached block
        self._block_entry = np.full(num_blocks, -1, np.int64)             # block -> entry, -1 = no key
        # Plain free blocks; the top is the end, so block 1 is handed out first.
        self._stack = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)   # (num_blocks - 1,)
        self._top = num_blocks - 1
        # Cached free blocks, oldest first: (ids, stamps) arrays; an entry is live while its block is cached free
        # (``_in_lru``) with that stamp (``_stamp``: the block's latest free).
        self._lru: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._lru_entries = 0                                             # entries queued, live or stale
        self._num_lru = 0                                                 # live entries: cached free blocks
        self._in_lru = np.zeros(num_blocks, np.bool_)                     # (num_blocks,)
        self._stamp = np.zeros(num_blocks, np.int64)                      # (num_blocks,)
        self._clock = 0
        # Entries: each holds >= 1 keyed block, so num_blocks entries always suffice.
        self._key_index: dict[BlockHash, int] = {}
        self._entry_key: list[BlockHash | None] = [None] * num_blocks       # (E,)
        self._entry_blocks = np.zeros((num_blocks, num_groups), np.int32) # (E, G)
        self._entry_count = np.zeros(num_blocks, np.int32)               # (E,) groups holding the key
        self._free_entries = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
        self._entries_top = num_blocks
        self._gids_cache: dict[tuple[int, ...], np.ndarray] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (plain free + cached free)."""
        return self._top + self._num_lru

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_lru

    def lru_order(self) -> list[int]:
        """The cached free blocks, least recently freed first (tests and invariants; O(queue))."""
        return [int(b) for ids, stamps in self._lru for b in ids[self._live(ids, stamps)]]

    def _live(self, ids: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        return self._in_lru[ids] & (self._stamp[ids] == stamps)

    def live_blocks_per_group(self) -> np.ndarray:
        """(num_groups,) distinct blocks with ref_count > 0, per owning group. O(num_blocks): for stats,
        not for the per-step path."""
        return np.bincount(self._owner[self.ref_count > 0], minlength=self.num_groups)

    def lookup(self, group_id: int, block_hash: BlockHash) -> int:
        """The block caching ``block_hash`` in ``group_id`` (live or free), or the null block."""
        e = self._key_index.get(block_hash)
        return NULL_BLOCK if e is None else int(self._entry_blocks[e, group_id])

    def cached_blocks(self, block_hashes: Sequence[BlockHash], group_ids: Sequence[int]) -> np.ndarray:
        """(len(group_ids), n) the block caching each key in each group (a hit's blocks: one dict lookup per
        key, not per key and group). Every key must be cached in every group."""
        entries = self.entries(block_hashes)
        blocks = self._entry_blocks[entries[:, None], list(group_ids)].T
        assert (entries >= 0).all() and (blocks != NULL_BLOCK).all(), "a hit block was evicted between search and take"
        return blocks

    def is_cached(self, group_id: int, block_hash: BlockHash) -> bool:
        return self.lookup(group_id, block_hash) != NULL_BLOCK

    def entries(self, block_hashes: Sequence[BlockHash]) -> np.ndarray:
        """(n,) int64 index entry of each key, -1 = not cached anywhere (one dict lookup per key)."""
        get = self._key_index.get
        return np.fromiter((get(h, -1) for h in block_hashes), np.int64, len(block_hashes))

    def cached_mask(self, block_hashes: Sequence[BlockHash], group_ids: Sequence[int], *,
                    entries: np.ndarray | None = None) -> np.ndarray:
        """(n,) bool: key j is cached in every one of ``group_ids`` (``entries``: ``entries(block_hashes)``
        when the caller has them, e.g. for several managers)."""
        if entries is None:
            entries = self.entries(block_hashes)
        known = entries >= 0
        out = np.zeros(len(block_hashes), np.bool_)
        if known.any():
            out[known] = (self._entry_blocks[entries[known]][:, list(group_ids)] != NULL_BLOCK).all(axis=1)
        return out

    def block_hash(self, block_id: int) -> BlockHash | None:
        e = self._block_entry[block_id]
        return None if e < 0 else self._entry_key[e]

    def cached_hashes(self, group_id: int) -> dict[BlockHash, int]:
        """One group's hash -> block map, as a dict (for tests and debugging)."""
        col = self._entry_blocks[:, group_id]
        return {h: int(col[e]) for h, e in self._key_index.items() if col[e] != NULL_BLOCK}

    def num_freed_by(self, block_ids: np.ndarray) -> int:
        """How many blocks ``free(block_ids)`` would return to the free queue (no state change)."""
        if block_ids.size == 0:
            return 0
        rc = self.ref_count[block_ids]
        if np.count_nonzero(rc == 1) == rc.size:      # each id held once, so the ids are distinct
            return int(block_ids.size)
        ids, counts = np.unique(block_ids[block_ids != NULL_BLOCK], return_counts=True)
        return int((self.ref_count[ids] == counts).sum())

    # -- mutations -------------------------------------------------------------------------------
    def allocate(self, num_per_group: int, group_ids: Sequence[int]) -> np.ndarray:
        """Take ``num_per_group`` blocks for each of ``group_ids``: (len(group_ids), num_per_group) int32.

        The caller checks ``num_free_blocks`` first; running short here is a programming error."""
        g = len(group_ids)
        n = num_per_group * g
        if n > self.num_free_blocks:
            raise RuntimeError(f"BlockPool.allocate({n}) with only {self.num_free_blocks} free blocks")
        take = min(n, self._top)
        ids = self._stack[self._top - take:self._top][::-1].copy()           # (take,)
        self._top -= take
        if take < n:
            evicted = self._pop_lru(n - take)
            self._evict_keys(evicted)
            ids = np.concatenate([ids, evicted])
        self.ref_count[ids] = 1
        out = ids.reshape(g, num_per_group)
        self._owner[out] = self._group_column(group_ids)
        return out

    def _pop_lru(self, n: int) -> np.ndarray:
        """The ``n`` least recently freed cached blocks, taken out of the LRU (the caller evicts their keys)."""
        out: list[np.ndarray] = []
        while n:
            ids, stamps = self._lru.popleft()
            self._lru_entries -= ids.size
            live = np.flatnonzero(self._live(ids, stamps))
            if live.size > n:                     # the rest of this entry stays at the front
                rest = live[n]
                self._lru.appendleft((ids[rest:], stamps[rest:]))
                self._lru_entries += ids.size - rest
                live = live[:n]
            out.append(ids[live])
            n -= live.size
        taken = np.concatenate(out) if len(out) != 1 else out[0]
        self._in_lru[taken] = False
        self._num_lru -= taken.size
        return taken.astype(np.int32, copy=False)

    def _push_lru(self, ids: np.ndarray) -> None:
        """Cached blocks freed now, in this order, to the LRU's young end."""
        stamps = np.arange(self._clock, self._clock + ids.size, dtype=np.int64)
        self._clock += ids.size
        self._stamp[ids] = stamps
        self._in_lru[ids] = True
        self._num_lru += ids.size
        self._lru.append((ids.astype(np.int32), stamps))
        self._lru_entries += ids.size
        if self._lru_entries > 2 * self._num_lru + self._COMPACT_SLACK:     # mostly stale: keep the live ones
            ids = np.concatenate([i for i, _ in self._lru])
            stamps = np.concatenate([t for _, t in self._lru])
            live = self._live(ids, stamps)
            self._lru = deque([(ids[live], stamps[live])])
            self._lru_entries = int(live.sum())

    def _group_column(self, group_ids: Sequence[int]) -> np.ndarray:
        """(G, 1) int64 array of ``group_ids`` (cached: the step path passes the same tuple)."""
        col = self._gids_cache.get(tuple(group_ids))
        if col is None:
            col = self._gids_cache[tuple(group_ids)] = np.asarray(group_ids, np.int64)[:, None]
        return col

    def free(self, block_ids: np.ndarray) -> None:
        """Drop one reference per entry of ``block_ids`` (1-D; null entries ignored). Blocks reaching
        zero go to the free queue in the given order, so pass a request's blocks last-first to evict
        its tail before its (more shareable) head."""
        if block_ids.size == 0:
            return
        rc = self.ref_count
        held = rc[block_ids]
        if np.count_nonzero(held == 1) == held.size:    # common: each id held once here, so distinct
            rc[block_ids] = 0
            zero = block_ids
        else:
            ids = block_ids[block_ids != NULL_BLOCK]
            if ids.size == 0:
                return
            held = rc[ids]
            if (held <= 0).any():
                raise RuntimeError(f"BlockPool.free of a free block: {ids[held <= 0].tolist()}")
            np.subtract.at(rc, ids, 1)
            zero = ids[rc[ids] == 0]
            if zero.size > 1:
                _, first = np.unique(zero, return_index=True)
                zero = zero[np.sort(first)]
            if zero.size == 0:
                return
        entries = self._block_entry[zero]
        if np.minimum.reduce(entries) < 0:      # blocks without a key go on the plain stack
            keyed = entries >= 0
            plain = zero[~keyed]
            self._stack[self._top:self._top + plain.size] = plain[::-1]
            self._top += plain.size
            zero = zero[keyed]
        if zero.size:       # (an empty entry would never be compacted away: one a free call, without prefix caching)
            self._push_lru(zero)                      # keyed ones to the LRU

    def touch(self, group_id: int, block_ids: Sequence[int] | np.ndarray) -> None:
        """Take one more reference to distinct cached blocks (a prefix hit), reviving free ones."""
        ids = np.asarray(block_ids, np.int64)
        revived = ids[self.ref_count[ids] == 0]
        self._in_lru[revived] = False                 # (their queue entries go stale)
        self._num_lru -= revived.size
        self._owner[revived] = group_id
        self.ref_count[ids] += 1

    def cache_blocks(self, group_ids: Sequence[int], hashes: Sequence[BlockHash],
                     block_ids: np.ndarray) -> None:
        """Register full blocks: ``block_ids`` (len(group_ids), k) holds, per group, the blocks whose
        keys are ``hashes`` (k,). A block that already has a key keeps it; a key that another block
        already caches in that group keeps that block (first wins; the duplicate stays plain). Null
        entries are skipped."""
        k = len(hashes)
        if k == 0:
            return
        gids = self._group_column(group_ids)                                      # (G, 1)
        if self._key_index.keys().isdisjoint(hashes) and len(set(hashes)) == k:
            known = self._block_entry[block_ids]                             # (G, k)
            if np.maximum.reduce(known, axis=None) < 0 and np.minimum.reduce(block_ids, axis=None) > NULL_BLOCK:
                # Fast path (every decode step): new keys, fresh non-null blocks, few numpy calls.
                top = self._entries_top - k
                fresh = self._free_entries[top:top + k].copy()                 # (k,)
                self._entries_top = top
                fl = fresh.tolist()
                self._key_index.update(zip(hashes, fl, strict=True))
                ek = self._entry_key
                for e, h in zip(fl, hashes, strict=True):
                    ek[e] = h
                self._entry_blocks[fresh[None, :], gids] = block_ids
                self._block_entry[block_ids] = fresh[None, :]
                self._entry_count[fresh] = len(group_ids)
                return
        held = (block_ids != NULL_BLOCK).any(axis=0)
        if not held.all():                   # positions every group already freed: nothing to register
            keep = np.flatnonzero(held)
            self.cache_blocks(group_ids, [hashes[j] for j in keep.tolist()], block_ids[:, keep])
            return
        if len(set(hashes)) != k:            # the same key twice in one batch: one at a time
            for j in range(k):
                self.cache_blocks(group_ids, hashes[j:j + 1], block_ids[:, j:j + 1])
            return
        get = self._key_index.get
        ent_list = [get(h, -1) for h in hashes]
        n_new = ent_list.count(-1)
        entries = np.array(ent_list, np.int64)                                # (k,)
        new = entries < 0
        if n_new:
            top = self._entries_top - n_new
            fresh = self._free_entries[top:top + n_new].copy()
            self._entries_top = top
            entries[new] = fresh
            new_keys = [h for h, e in zip(hashes, ent_list, strict=True) if e < 0]
            self._key_index.update(zip(new_keys, fresh.tolist(), strict=True))
            for e, h in zip(fresh.tolist(), new_keys, strict=True):
                self._entry_key[e] = h
        write = (block_ids != NULL_BLOCK) & (self._block_entry[block_ids] < 0)
        if n_new != k:                       # first wins where the key already has a block
            write &= self._entry_blocks[entries[None, :], gids] == NULL_BLOCK
        ents = np.broadcast_to(entries[None, :], block_ids.shape)
        e, b = ents[write], block_ids[write]
        self._entry_blocks[e, np.broadcast_to(gids, block_ids.shape)[write]] = b
        self._block_entry[b] = e
        np.add.at(self._entry_count, e, 1)
        if n_new:                            # entries nobody took: release them
            for ent in entries[new][self._entry_count[entries[new]] == 0].tolist():
                self._release_entry(ent)

    def _release_entry(self, e: int) -> None:
        del self._key_index[self._entry_key[e]]
        self._entry_key[e] = None
        self._free_entries[self._entries_top] = e
        self._entries_top += 1

    def _evict_keys(self, blocks: np.ndarray) -> None:
        """Forget the keys of cached blocks about to be reused."""
        ents = self._block_entry[blocks]
        keyed = ents >= 0
        if not keyed.any():
            return
        blocks, ents = blocks[keyed], ents[keyed]
        self._entry_blocks[ents, self._owner[blocks]] = NULL_BLOCK
        self._block_entry[blocks] = -1
        np.subtract.at(self._entry_count, ents, 1)
        for e in np.unique(ents[self._entry_count[ents] == 0]).tolist():
            self._release_entry(e)

    def check_invariants(self) -> None:
        """Raise AssertionError when the internal structures disagree (tests, debug mode)."""
        rc = self.ref_count
        assert rc[NULL_BLOCK] == 0 and (rc >= 0).all(), "negative or null ref count"
        plain = self._stack[:self._top]
        lru = np.asarray(self.lru_order(), np.int64)
        assert lru.size == self._num_lru == int(self._in_lru.sum()), "the LRU's count drifted"
        assert self._lru_entries == sum(ids.size for ids, _ in self._lru), "the LRU's entry count drifted"
        free = np.concatenate([plain, lru]).astype(np.int64)
        assert np.unique(free).size == free.size, "a block is free twice"
        assert NULL_BLOCK not in free, "the null block is free"
        assert (rc[free] == 0).all(), "a free block is referenced"
        assert free.size + int((rc > 0).sum()) == self.num_blocks - 1, "a block is neither free nor live"
        keyed = self._block_entry >= 0
        assert not keyed[plain].any() and keyed[lru].all(), "free queues mixed up"
        used = set(self._key_index.values())
        assert len(used) == len(self._key_index) == self.num_blocks - self._entries_top, "entry leak"
        assert not used & set(self._free_entries[:self._entries_top].tolist()), "a used entry is free"
        for h, e in self._key_index.items():
            assert self._entry_key[e] == h, "entry key is stale"
            row = self._entry_blocks[e]
            held = np.flatnonzero(row)
            assert held.size == self._entry_count[e] > 0, "entry count drifted"
            assert (self._block_entry[row[held]] == e).all(), "block -> entry is stale"
            assert (self._owner[row[held]] == held).all(), "a cached block is in another group's column"
        assert int(keyed.sum()) == int(self._entry_count.sum()), "keyed blocks missing from the index"


class CheckpointKind(enum.IntEnum):
    """Why a Mamba checkpoint was taken. A store first takes the slot of the least recently used *cold*
    checkpoint (not stored or hit since the storing request arrived: whatever its kind, the traffic has moved
    on), else of a checkpoint of its own kind or a lower one (the lowest kind first, least recently used
    first), never a warm one of a higher kind: one long request's chunk-end checkpoints cannot flush a
    prefix that many requests share, nor a prompt's end, and old prompts cannot starve new answers."""

    BOUNDARY = 0        # a prefill chunk end inside a prompt (a later prompt may share part of a long one)
    ANSWER = 1          # prompt + output so far of a decoding request (the next chat turn starts there)
    PROMPT = 2          # the last block boundary of a prompt (repeats, retries, regenerations)
    SHARED = 3          # the end of a prefix that several unfinished requests have in common


class StateSlotPool:
    """Working slots for running requests plus checkpoint slots for the prefix cache, on the device and
    (``num_host_slots``) in host memory.

    A checkpoint is a request's state at a block-aligned length, keyed by the chained block hash there.
    Protection, strongest first: *pinned* (a request hit it and waits for its copy), *wanted* (a waiting
    request's best hit when it arrived), then by ``CheckpointKind`` and recency. Stores go to device slots; the
    checkpoint a store evicts moves to a host slot when the host tier has one it may take (by the same rules),
    and is lost otherwise. A store that finds no device slot it may take is refused (the cache degrades,
    correctness does not)."""

    def __init__(self, num_slots: int, num_checkpoint_slots: int = 0, num_host_slots: int = 0) -> None:
        if num_checkpoint_slots < 0 or num_slots < 2 + num_checkpoint_slots:
            raise ValueError(f"StateSlotPool needs num_slots >= 2 + num_checkpoint_slots (slot 0 is null), "
                             f"got num_slots={num_slots}, num_checkpoint_slots={num_checkpoint_slots}")
        if num_host_slots < 0 or (num_host_slots and not num_checkpoint_slots):
            raise ValueError(f"StateSlotPool: num_host_slots must be >= 0, and host slots only take checkpoints "
                             f"evicted from device ones (num_checkpoint_slots > 0), got num_host_slots="
                             f"{num_host_slots}, num_checkpoint_slots={num_checkpoint_slots}")
        self.num_slots = num_slots
        self.num_checkpoint_slots = num_checkpoint_slots
        self.num_host_slots = num_host_slots
        self.num_working_slots = num_slots - 1 - num_checkpoint_slots
        total = num_slots + num_host_slots
        self._free = list(range(self.num_working_slots, 0, -1))          # top = end, slot 1 first
        self._in_use = np.zeros(num_slots, np.bool_)
        self._ckpt: dict[BlockHash, int] = {}                            # key -> checkpoint slot (either tier)
        self._key: dict[int, BlockHash] = {}                             # checkpoint slot -> key
        # Per checkpoint slot, read and written one slot at a time: lists (numpy scalar access costs more).
        self._kind = [0] * total
        # Per tier (device, host), per kind: stored checkpoints, oldest first.
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in CheckpointKind]
        self._host_lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in CheckpointKind]
        self._free_ckpt = list(range(num_slots - 1, self.num_working_slots, -1))
        self._free_host = list(range(total - 1, num_slots - 1, -1))
        self._demotions: list[tuple[int, int]] = []    # (device slot, host slot) copies for the caller to queue
        self._pins = [0] * total
        self._wants = [0] * total
        self._uses = [0] * total                       # hits and stores of the same key since it was stored
        self._growing = [False] * total                # the answer checkpoint of a request still decoding
        self._num_growing = 0
        self._last = [0] * total                       # clock of the last store or hit
        self.clock = 0                                 # ticks at every store and hit
        self.num_stored = 0             # checkpoints written (new keys)
        self.num_evicted = 0            # ... that replaced another request's checkpoint (lost from both tiers)
        self.num_demoted = 0            # checkpoints moved from a device slot to a host slot
        self.num_host_busy = 0          # ... lost instead: the copies to host memory were all in flight
        self.host_move_budget: int | None = None    # moves to host memory stores may start now (None: any)
        self.num_refused = 0            # stores without a slot they were allowed to take

    @property
    def num_free_slots(self) -> int:
        """Free working slots."""
        return len(self._free)

    @property
    def num_checkpoints(self) -> int:
        return len(self._ckpt)

    @property
    def num_host_checkpoints(self) -> int:
        return self.num_host_slots - len(self._free_host)

    def is_host(self, slot: int) -> bool:
        """Whether ``slot`` is a host-memory checkpoint slot."""
        return slot >= self.num_slots

    def _lru_of(self, slot: int) -> list[OrderedDict[int, None]]:
        return self._host_lru if slot >= self.num_slots else self._lru

    def take_demotions(self) -> list[tuple[int, int]]:
        """(device slot, host slot) state copies that stores since the last call made: each must be applied
        before the device slot is written again (in the same batch of copies: before its new store's copy)."""
        out, self._demotions = self._demotions, []
        return out

    def checkpoints(self) -> dict[BlockHash, int]:
        return dict(self._ckpt)

    def allocate(self, n: int) -> np.ndarray:
        """(n,) int32 working slots; the caller checks ``num_free_slots`` first."""
        if n > len(self._free):
            raise RuntimeError(f"StateSlotPool.allocate({n}) with only {len(self._free)} free slots")
        out = np.array(self._free[len(self._free) - n:][::-1], np.int32)
        del self._free[len(self._free) - n:]
        self._in_use[out] = True
        return out

    def free(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            if s == NULL_SLOT:
                continue
            if not self._in_use[s] or s > self.num_working_slots:
                raise RuntimeError(f"StateSlotPool.free of slot {s}, which is not a working slot in use")
            self._in_use[s] = False
            self._free.append(s)

    # -- checkpoints -----------------------------------------------------------------------------
    def lookup_checkpoint(self, key: BlockHash) -> int:
        return self._ckpt.get(key, NULL_SLOT)

    @property
    def stored_keys(self) -> dict[BlockHash, int]:
        """Key -> slot of every stored checkpoint, for membership tests on the lookup path (do not modify)."""
        return self._ckpt

    def key_of(self, slot: int) -> BlockHash | None:
        """The key a checkpoint slot holds (None: free)."""
        return self._key.get(slot)

    def kind_of(self, slot: int) -> CheckpointKind:
        return CheckpointKind(self._kind[slot])

    def touch(self, slot: int) -> None:
        """A hit: the checkpoint becomes its kind's most recently used."""
        self._lru_of(slot)[self._kind[slot]].move_to_end(slot)
        self.clock += 1
        self._last[slot] = self.clock

    def pin(self, slot: int) -> None:
        """Keep a checkpoint from eviction until ``unpin`` (a hit whose copy has not been queued yet)."""
        self._pins[slot] += 1
        self._uses[slot] += 1
        self.touch(slot)

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1

    def want(self, slot: int) -> None:
        """Keep a checkpoint a waiting request means to start from, until ``unwant``."""
        self._wants[slot] += 1

    def unwant(self, slot: int) -> None:
        self._wants[slot] -= 1

    def _evictable(self, slot: int) -> bool:
        return self._pins[slot] == 0 and self._wants[slot] == 0

    def settle(self, slot: int) -> None:
        """The request whose answer checkpoint ``slot`` is has finished or moved on: from now on another
        answer checkpoint may evict it."""
        if self._growing[slot]:
            self._growing[slot] = False
            self._num_growing -= 1

    def _drop(self, slot: int) -> None:
        self.settle(slot)
        del self._ckpt[self._key.pop(slot)]
        del self._lru_of(slot)[self._kind[slot]][slot]

    def _put(self, key: BlockHash, slot: int, kind: CheckpointKind, growing: bool = False) -> None:
        self._ckpt[key] = slot
        self._key[slot] = key
        self._kind[slot] = kind
        self._lru_of(slot)[kind][slot] = None
        self._uses[slot] = 0
        self.clock += 1
        self._last[slot] = self.clock
        if growing:
            self._growing[slot] = True
            self._num_growing += 1
        self.num_stored += 1

    def _reusable(self, replace: int) -> bool:
        return replace != NULL_SLOT and replace in self._key and self._evictable(replace) and not self._uses[replace]

    def _victim(self, kind: CheckpointKind, since: int, tier: list[OrderedDict[int, None]] | None = None) -> int:
        """The stored checkpoint a new one of ``kind``, taken for a request that arrived at clock ``since``,
        would take the slot of (0: none may be taken), among the device slots or ``tier``'s."""
        tier = self._lru if tier is None else tier
        cold, bound = NULL_SLOT, since + 1          # cold: last used at or before ``since``
        for lru in tier:                 # each list is in order of last use: its cold entries come first
            for s in lru:
                if self._last[s] >= bound:
                    break
                if self._evictable(s) and not self._growing[s]:
                    cold, bound = s, self._last[s]
                    break
        if cold != NULL_SLOT:
            return cold
        answer = kind == CheckpointKind.ANSWER
        for k in range(kind + 1):
            lru = tier[k]
            if answer and k == kind:
                if tier is self._lru and len(lru) == self._num_growing:   # every answer is still growing
                    continue
                slot = next((s for s in lru if self._evictable(s) and not self._growing[s]), NULL_SLOT)
            else:
                slot = next((s for s in lru if self._evictable(s)), NULL_SLOT)
            if slot != NULL_SLOT:
                return slot
        return NULL_SLOT

    def has_room(self, kind: CheckpointKind, *, replace: int = NULL_SLOT, since: int = 0) -> bool:
        """Whether ``store_checkpoint`` of a new key of ``kind`` would get a slot (no state change; lets a
        caller skip hashing for a checkpoint it could not keep). Counts a refusal when not."""
        if self._free_ckpt or self._reusable(replace) or self._victim(kind, since) != NULL_SLOT:
            return True
        self.num_refused += 1
        return False

    def store_checkpoint(self, key: BlockHash, kind: CheckpointKind = CheckpointKind.PROMPT, *,
                         replace: int = NULL_SLOT, growing: bool = False, since: int = 0) -> tuple[int, bool]:
        """A checkpoint slot for ``key``: (slot, True) when the caller must copy the state into it, (slot,
        False) when ``key`` is already stored (it takes the higher of the two kinds and becomes most recent),
        (0, False) when no slot may be taken. ``replace``: a checkpoint slot the caller owns and no longer
        needs (a decoding request's previous answer checkpoint); it is reused unless another request started
        from it, means to, or reached the same state. ``growing``: the new checkpoint is the answer of a
        request still decoding, which no other answer checkpoint evicts until ``settle`` (neither is any
        use before its request ends: evicting one for the other would only copy states back and forth).
        ``since``: the clock when the storing request arrived (checkpoints last used before are cold)."""
        slot = self._ckpt.get(key, NULL_SLOT)
        if slot != NULL_SLOT:
            self._uses[slot] += 1
            if kind > self._kind[slot]:
                # e.g. a decoding request's answer checkpoint that another request's prompt ends at: a higher kind
                # protects it from answer stores now, so it no longer holds the growing answer's exemption
                self.settle(slot)
                tier = self._lru_of(slot)
                del tier[self._kind[slot]][slot]
                self._kind[slot] = kind
                tier[kind][slot] = None
                self.clock += 1                 # (the end of its kind's list: its most recent use is now)
                self._last[slot] = self.clock
            else:
                self.touch(slot)
            return slot, False
        if self._reusable(replace):
            self._drop(replace)
            self._put(key, replace, kind, growing)
            return replace, True
        if self._free_ckpt:
            slot = self._free_ckpt.pop()
        else:
            slot = self._victim(kind, since)
            if slot == NULL_SLOT:
                self.num_refused += 1
                return NULL_SLOT, False
            self._demote(slot, since)
        self._put(key, slot, kind, growing)
        return slot, True

    def _demote(self, slot: int, since: int) -> None:
        """Free device checkpoint ``slot``: its checkpoint moves to a host slot (a free one, else the one the
        host tier's rules give up for it) or, with none, is lost."""
        self.settle(slot)
        host = NULL_SLOT
        budget = self.host_move_budget
        if self.num_host_slots and budget is not None and budget <= 0:
            self.num_host_busy += 1         # (a stall of the steps would cost more than the checkpoint)
        elif self._free_host:
            host = self._free_host.pop()
        elif self.num_host_slots:
            host = self._victim(CheckpointKind(self._kind[slot]), since, self._host_lru)
            if host != NULL_SLOT:
                self._drop(host)
                self.num_evicted += 1
        if host == NULL_SLOT:
            self._drop(slot)
            self.num_evicted += 1
            return
        key, kind = self._key.pop(slot), self._kind[slot]
        del self._lru[kind][slot]
        self._ckpt[key] = host
        self._key[host] = key
        self._kind[host] = kind
        self._uses[host], self._last[host] = self._uses[slot], self._last[slot]
        # in order of last use, as the eviction rules read it: behind the host checkpoints hit since this one
        lru, later = self._host_lru[kind], []
        while lru and self._last[next(reversed(lru))] > self._last[host]:
            later.append(lru.popitem()[0])
        lru[host] = None
        for s in reversed(later):
            lru[s] = None
        self._demotions.append((slot, host))
        self.num_demoted += 1
        if budget is not None:
            self.host_move_budget = budget - 1

    def check_invariants(self) -> None:
        free = self._free
        assert len(set(free)) == len(free) and NULL_SLOT not in free, "slot free twice or null free"
        assert not self._in_use[free].any(), "a free slot is in use"
        assert len(free) + int(self._in_use.sum()) == self.num_working_slots, "a working slot leaked"
        host = [s for s in self._key if s >= self.num_slots]
        assert len(self._ckpt) - len(host) + len(self._free_ckpt) == self.num_checkpoint_slots, \
            "checkpoint slot leaked"
        assert len(host) + len(self._free_host) == self.num_host_slots, "host checkpoint slot leaked"
        assert all(self._key[s] == k for k, s in self._ckpt.items()), "checkpoint map is stale"
        assert len(self._key) == len(self._ckpt), "slot -> key map is stale"
        listed = [s for lru in self._lru for s in lru]
        listed_host = [s for lru in self._host_lru for s in lru]
        assert all(s < self.num_slots for s in listed) and all(s >= self.num_slots for s in listed_host), \
            "a checkpoint is listed in the other tier"
        assert sorted(listed + listed_host) == sorted(self._key), "recency lists disagree with the stored checkpoints"
        assert all(self._kind[s] == k for tier in (self._lru, self._host_lru) for k, lru in enumerate(tier)
                   for s in lru), "kind drifted"
        assert all(all(self._last[a] <= self._last[b] for a, b in zip(lru, list(lru)[1:], strict=False))
                   for tier in (self._lru, self._host_lru) for lru in tier), "a recency list is out of order"
        assert min(self._pins) >= 0 and min(self._wants) >= 0, "negative pin or want count"
        assert not (set(self._free_ckpt) | set(self._free_host)) & set(self._key), \
            "a free checkpoint slot holds a key"
        growing = [s for s, g in enumerate(self._growing) if g]
        assert len(growing) == self._num_growing, "growing count drifted"
        assert all(s in self._lru[CheckpointKind.ANSWER] for s in growing), "a growing slot is not an answer"
