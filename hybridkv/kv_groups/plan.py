"""Grouping layers by spec and sizing the pools for a memory budget.

Layers with equal specs form a group; each group has its own block table. Attention groups share one
block pool whose unit is a *page* of ``page_bytes``: a block id owned by a group addresses that page, and each
of the group's layers keeps its ``block_size`` tokens at its own byte offset in it. Every group must fill whole
pages, so each attention spec's layers are split into groups of consecutive layers whose bytes per block add up to
the page: with one KV shape, ``gcd(layer counts)`` layers per group, e.g. Llama-4-Scout (12 global + 36 chunked)
-> 4 groups of 12, Gemma-3-27B (10 + 52) -> 31 groups of 2; with several shapes (Gemma-4's global layers have twice
the head dim of its sliding ones) a narrower spec's group holds proportionally more layers, so each group is sized
by its own shape and nothing is padded (E4B: 20 sliding + 4 global layers -> 5 groups of 4 + 2 groups of 2).
Only when no such split exists (layer counts that do not divide) are narrower groups padded to the widest.

Cross-layer KV sharing (``KVSharingSpec``): a layer that reads another layer's cache joins its donor's group as a
reader; it owns no bytes of the page, so the plan, the pool and the block tables are those of the model without it.

Mamba layers never enter the block pool: their fixed-size states live in a slot pool sized by the
number of concurrent requests (+ prefix-cache checkpoint slots, ``checkpoint_slots``), so attention keeps
its small native block size and nothing is padded to a state's size (docs/design.md, "Beyond existing
runtimes"). Slot 0 and block 0 are null entries, never handed out, so padded rows of a batch always point
somewhere harmless.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridkv.kv_groups.specs import AttentionSpec, KVCacheSpec, KVSharingSpec, MambaSpec
from hybridkv.utils import format_bytes

DEFAULT_STEP_TOKENS = 2048
CHECKPOINTS_PER_SEQUENCE = 2            # a prompt's end and its answer's end
CHECKPOINT_BUDGET_FRACTION = 3          # checkpoints take at most 1/3 of the KV budget
HOST_STAGING_SLOTS = 16                 # device rows for checkpoint copies to / from host memory (half each way)


def checkpoint_slots(layer_specs: Mapping[str, KVCacheSpec], *, kv_memory: int, max_num_seqs: int) -> int:
    """Mamba prefix-cache checkpoint slots for a budget: two per sequence the engine may run at once (where
    its prompt ends, for repeats, and where its answer ends, for the next chat turn; a prefix shared by
    several sequences needs one for all of them), within a third of ``kv_memory``. 0 without Mamba layers.
    Fewer checkpoints than the traffic needs only lose hits (``StateSlotPool`` keeps the most useful)."""
    state_bytes = sum(spec.bytes_per_block for spec in layer_specs.values() if not spec.is_attention)
    if not state_bytes:
        return 0
    return max(1, min(CHECKPOINTS_PER_SEQUENCE * max_num_seqs,
                      kv_memory // (CHECKPOINT_BUDGET_FRACTION * state_bytes)))


@dataclass(frozen=True, kw_only=True)
class KVCacheGroup:
    """Layers that share one spec and one block table; ``readers``: (layer, donor) pairs of KV-sharing layers
    that read a ``layer_names`` layer's cache and own none."""

    group_id: int
    spec: KVCacheSpec
    layer_names: tuple[str, ...]
    readers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise ValueError(f"KVCacheGroup {self.group_id} has no layers")
        for reader, donor in self.readers:
            if donor not in self.layer_names:
                raise ValueError(f"KVCacheGroup {self.group_id}: reader {reader!r} names donor {donor!r}, "
                                 f"which is not one of its layers")

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def cache_names(self) -> tuple[str, ...]:
        """Every layer that reads this group's inputs and blocks: its owners, then its readers."""
        return self.layer_names + tuple(reader for reader, _ in self.readers)


def _layers_per_group(counts: Mapping[AttentionSpec, int]) -> dict[AttentionSpec, int]:
    """Layers per group for each attention spec (``counts``: its layers): groups whose bytes per block are equal,
    the fewest layers that allow it; else (a count that no exact split divides) ``gcd(counts)`` layers each, the
    pages sized for the widest spec."""
    sizes = {spec: spec.bytes_per_block for spec in counts}
    unit = math.lcm(*sizes.values())
    fill = {spec: unit // size for spec, size in sizes.items()}        # layers of a spec filling `unit` bytes
    if all(counts[spec] % fill[spec] == 0 for spec in counts):
        m = math.gcd(*(counts[spec] // fill[spec] for spec in counts))
        return {spec: m * fill[spec] for spec in counts}
    per_group = math.gcd(*counts.values())
    return dict.fromkeys(counts, per_group)


def _split_readers(layer_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVSharingSpec]:
    """The KV-sharing layers, each checked against its donor: a layer with a cache of its own, of the same spec."""
    readers = {name: spec for name, spec in layer_specs.items() if isinstance(spec, KVSharingSpec)}
    for name, spec in readers.items():
        donor = layer_specs.get(spec.donor)
        if donor is None:
            raise ValueError(f"layer {name!r} shares the KV cache of {spec.donor!r}, which is not a planned layer")
        if isinstance(donor, KVSharingSpec):
            raise ValueError(f"layer {name!r} shares the KV cache of {spec.donor!r}, which itself keeps none "
                             f"(name the layer that owns it)")
        if donor != spec.target:
            raise ValueError(f"layer {name!r} expects {spec.target.describe()} from {spec.donor!r}, which keeps "
                             f"{donor.describe()}")
    return readers


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Group layers with equal specs, in order of first appearance; split attention specs into groups that fill
    whole pool pages (``_layers_per_group``); a KV-sharing layer joins its donor's group as a reader."""
    if not layer_specs:
        raise ValueError("no layers to plan: the layer -> spec mapping is empty")
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"layer {name!r}: expected a KVCacheSpec, got {type(spec).__name__}")
    readers = _split_readers(layer_specs)
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if name not in readers:
            by_spec.setdefault(spec, []).append(name)

    attention = [spec for spec in by_spec if spec.is_attention]
    block_sizes = {spec.block_size for spec in attention}
    if len(block_sizes) > 1:
        raise ValueError(f"attention layers must share one block_size, got {sorted(block_sizes)}")
    per_group = _layers_per_group({s: len(by_spec[s]) for s in attention}) if attention else {}

    groups: list[KVCacheGroup] = []
    for spec, names in by_spec.items():
        step = per_group[spec] if spec.is_attention else len(names)
        for start in range(0, len(names), step):
            owners = tuple(names[start:start + step])
            shared = tuple((r, s.donor) for r, s in readers.items() if s.donor in owners)
            groups.append(KVCacheGroup(group_id=len(groups), spec=spec, layer_names=owners, readers=shared))
    return tuple(groups)


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One group's share of a plan, for one max-length request."""

    group: KVCacheGroup
    blocks_per_request: int       # steady (decode) need of one max-length request; slots for Mamba
    bytes_per_request: int
    bytes_per_request_if_full: int

    def to_dict(self, plan: KVCachePlan) -> dict[str, Any]:
        spec = self.group.spec
        out: dict[str, Any] = {
            "group_id": self.group.group_id,
            "kind": spec.kind,
            "spec": spec.describe(),
            "layers": list(self.group.layer_names),
            "block_size": spec.block_size,
            "bytes_per_block": spec.bytes_per_block * len(self.group.layer_names),
            "blocks_per_request_max": self.blocks_per_request,
            "bytes_per_request_max": self.bytes_per_request,
        }
        if self.group.readers:
            out["kv_shared_layers"] = {reader: donor for reader, donor in self.group.readers}
        if spec.is_attention:
            out["num_blocks"] = plan.num_blocks        # shared pool
        else:
            out["num_slots"] = plan.num_state_slots
        return out


@dataclass(frozen=True, kw_only=True)
class KVCachePlan:
    """How a memory budget is split into a block pool and a state-slot pool."""

    groups: tuple[KVCacheGroup, ...]
    group_plans: tuple[GroupPlan, ...] = field(repr=False)
    max_model_len: int
    step_tokens: int
    budget_bytes: int
    block_size: int
    layers_per_block: int                 # layers in the largest attention group (narrower specs: more per page)
    page_bytes: int                       # one pool block: each group's layers x block_size tokens
    num_blocks: int                       # in the shared attention pool, null block 0 included
    num_state_slots: int                  # in the Mamba slot pool, null slot 0 included
    num_checkpoint_slots: int             # of those, reserved for prefix-cache state checkpoints
    num_host_checkpoint_slots: int = 0    # checkpoint slots in host memory (outside the budget)
    num_staging_slots: int = 0            # device state rows the host slots' copies go through (in the budget)
    reserved_step_blocks: int             # transient prefill-chunk blocks, reserved once per step
    padding_bytes: int                    # bytes allocated but never needed at max concurrency
    kv_shared_bytes_per_request: int      # what KV-sharing layers would hold per max-length request with caches
    max_concurrent_requests: int          # max-length requests that fit at once
    max_concurrent_requests_if_all_full: int

    @property
    def attention_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if g.spec.is_attention)

    @property
    def mamba_groups(self) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if not g.spec.is_attention)

    @property
    def bytes_per_request_max(self) -> int:
        return sum(gp.bytes_per_request for gp in self.group_plans)

    @property
    def bytes_per_request_if_all_full_attention(self) -> int:
        return sum(gp.bytes_per_request_if_full for gp in self.group_plans)

    @property
    def state_bytes_per_slot(self) -> int:
        return sum(g.spec.bytes_per_block * len(g.layer_names) for g in self.mamba_groups)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of the prefix-cache checkpoint slots (part of ``allocated_bytes``)."""
        return self.num_checkpoint_slots * self.state_bytes_per_slot

    @property
    def host_checkpoint_bytes(self) -> int:
        """Host memory of the checkpoint slots there (not part of the device budget)."""
        return self.num_host_checkpoint_slots * self.state_bytes_per_slot

    @property
    def allocated_bytes(self) -> int:
        return self.num_blocks * self.page_bytes + \
            (self.num_state_slots + self.num_staging_slots) * self.state_bytes_per_slot

    @property
    def concurrency_vs_all_full(self) -> float:
        return self.max_concurrent_requests / max(1, self.max_concurrent_requests_if_all_full)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "step_tokens": self.step_tokens,
            "budget_bytes": self.budget_bytes,
            "allocated_bytes": self.allocated_bytes,
            "block_size": self.block_size,
            "layers_per_block": self.layers_per_block,
            "page_bytes": self.page_bytes,
            "num_blocks": self.num_blocks,
            "num_state_slots": self.num_state_slots,
            "num_checkpoint_slots": self.num_checkpoint_slots,
            "checkpoint_bytes": self.checkpoint_bytes,
            "num_host_checkpoint_slots": self.num_host_checkpoint_slots,
            "host_checkpoint_bytes": self.host_checkpoint_bytes,
            "num_staging_slots": self.num_staging_slots,
            "reserved_step_blocks": self.reserved_step_blocks,
            "groups": [gp.to_dict(self) for gp in self.group_plans],
            "bytes_per_request_max": self.bytes_per_request_max,
            "bytes_per_request_if_all_full_attention": self.bytes_per_request_if_all_full_attention,
            "padding_bytes": self.padding_bytes,
            "kv_shared_layers": sum(len(g.readers) for g in self.groups),
            "kv_shared_bytes_per_request": self.kv_shared_bytes_per_request,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_concurrent_requests_if_all_full_attention": self.max_concurrent_requests_if_all_full,
            "concurrency_vs_all_full_attention": round(self.concurrency_vs_all_full, 3),
        }

    def summary(self) -> str:
        """A few plain lines; the CLI renders the full table."""
        slots = ""
        if self.num_state_slots:
            slots = f" + {self.num_state_slots} state slots x {format_bytes(self.state_bytes_per_slot)}"
            if self.num_checkpoint_slots:
                slots += (f" ({self.num_checkpoint_slots} for prefix-cache checkpoints, "
                          f"{format_bytes(self.checkpoint_bytes)})")
            if self.num_host_checkpoint_slots:
                slots += (f" + {self.num_host_checkpoint_slots} checkpoint slots in host memory "
                          f"({format_bytes(self.host_checkpoint_bytes)}; {self.num_staging_slots} device rows "
                          f"to copy through)")
        shared = ""
        if self.kv_shared_bytes_per_request:
            readers = sum(len(g.readers) for g in self.groups)
            shared = (f"; {readers} KV-sharing layers save {format_bytes(self.kv_shared_bytes_per_request)} "
                      f"per request")
        return (f"{len(self.groups)} groups, {self.num_blocks} blocks x {format_bytes(self.page_bytes)}"
                f"{slots}; {format_bytes(self.bytes_per_request_max)} per "
                f"{self.max_model_len}-token request; {self.max_concurrent_requests} concurrent "
                f"({self.concurrency_vs_all_full:.2f}x all-full-attention){shared}")


def plan_kv_cache(
    layer_specs: Mapping[str, KVCacheSpec],
    *,
    max_model_len: int,
    kv_memory: int,
    max_num_seqs: int | None = None,
    step_tokens: int | None = None,
    num_checkpoint_slots: int = 0,
    host_checkpoint_memory: int = 0,
) -> KVCachePlan:
    """Split ``kv_memory`` bytes into pools and report how many ``max_model_len`` requests fit.

    ``step_tokens`` is the scheduler's per-step token budget (max_num_batched_tokens): the transient
    blocks of prefill chunks in flight are reserved once for the step, not once per request.
    ``num_checkpoint_slots`` is the most Mamba checkpoint slots to hold (``checkpoint_slots``): they come
    from what the working slots and one max-length request leave, so they never cost a working slot nor
    make a budget too small (the plan's ``num_checkpoint_slots`` says how many it holds).
    ``host_checkpoint_memory``: host bytes for more checkpoint slots, where those the device slots evict move
    (``StateSlotPool``), copied through ``HOST_STAGING_SLOTS`` device rows taken from the checkpoint slots; only
    with more device checkpoint slots than that."""
    for name, value in (("max_model_len", max_model_len), ("kv_memory", kv_memory)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if max_num_seqs is not None and max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if num_checkpoint_slots < 0:
        raise ValueError(f"num_checkpoint_slots must be >= 0, got {num_checkpoint_slots}")
    if host_checkpoint_memory < 0:
        raise ValueError(f"host_checkpoint_memory must be >= 0, got {host_checkpoint_memory}")
    step = min(step_tokens or DEFAULT_STEP_TOKENS, max_model_len)

    groups = group_layers(layer_specs)
    attention = [g for g in groups if g.spec.is_attention]
    per_group = max((len(g.layer_names) for g in attention), default=0)
    block_size = attention[0].spec.block_size if attention else groups[0].spec.block_size
    page_bytes = max((len(g.layer_names) * g.spec.bytes_per_block for g in attention), default=0)

    group_plans = []
    for g in groups:
        n = g.spec.steady_blocks_per_request(max_model_len)
        if isinstance(g.spec, AttentionSpec):
            full = g.spec.as_full_attention().steady_blocks_per_request(max_model_len)
            group_plans.append(GroupPlan(group=g, blocks_per_request=n, bytes_per_request=n * page_bytes,
                                         bytes_per_request_if_full=full * page_bytes))
        else:
            assert isinstance(g.spec, MambaSpec)
            nbytes = g.spec.bytes_per_block * len(g.layer_names)
            group_plans.append(GroupPlan(group=g, blocks_per_request=1, bytes_per_request=nbytes,
                                         bytes_per_request_if_full=nbytes))

    blocks_per_request = sum(gp.blocks_per_request for gp in group_plans if gp.group.spec.is_attention)
    full_blocks_per_request = sum(gp.bytes_per_request_if_full // page_bytes for gp in group_plans
                                  if gp.group.spec.is_attention) if page_bytes else 0
    slot_bytes = sum(gp.bytes_per_request for gp in group_plans if not gp.group.spec.is_attention)
    reserved = sum(g.spec.transient_blocks_per_step(step) for g in attention)
    fixed_bytes = (1 + reserved) * page_bytes + slot_bytes            # null block, step reserve, null slot
    per_request = blocks_per_request * page_bytes + slot_bytes
    per_request_full = full_blocks_per_request * page_bytes + slot_bytes

    fits = (kv_memory - fixed_bytes) // per_request if kv_memory > fixed_bytes else 0
    if fits < 1:
        raise ValueError(
            f"kv_memory={format_bytes(kv_memory)} is too small for one request of max_model_len="
            f"{max_model_len}: it needs {format_bytes(per_request + fixed_bytes)} ({format_bytes(per_request)}"
            f" per request + {format_bytes(fixed_bytes)} for null entries and the step reserve)")
    concurrent = min(fits, max_num_seqs) if max_num_seqs else fits

    # Working state slots: enough for every max-length request that fits, and more (up to max_num_seqs,
    # within half the budget and leaving one max-length request's blocks) so that shorter requests are not
    # capped by slots while blocks sit idle. Checkpoints take none of them (they must not cost concurrency).
    working = concurrent
    if slot_bytes and max_num_seqs and max_num_seqs > concurrent:
        working = max(concurrent, min(max_num_seqs, (kv_memory // 2) // slot_bytes - 1,
                                      (kv_memory - fixed_bytes - blocks_per_request * page_bytes) // slot_bytes))
    checkpoints = 0
    if slot_bytes and num_checkpoint_slots:
        spare = kv_memory - fixed_bytes - working * slot_bytes - blocks_per_request * page_bytes
        checkpoints = max(0, min(num_checkpoint_slots, spare // slot_bytes))
    host = staging = 0
    if checkpoints > HOST_STAGING_SLOTS and host_checkpoint_memory >= slot_bytes:
        host, staging = host_checkpoint_memory // slot_bytes, HOST_STAGING_SLOTS
        checkpoints -= staging
    num_state_slots = (1 + checkpoints + working) if slot_bytes else 0
    num_blocks = (kv_memory - (num_state_slots + staging) * slot_bytes) // page_bytes if page_bytes else 0
    if blocks_per_request:      # extra slots took memory from the pool: recount max-length requests
        concurrent = min(concurrent, (num_blocks - 1 - reserved) // blocks_per_request)
    # The all-full yardstick keeps no step reserve: full attention has no transient blocks.
    fixed_full = page_bytes + (1 + checkpoints + staging) * slot_bytes
    fits_full = max(0, (kv_memory - fixed_full) // per_request_full)
    # Padding: page bytes a group's layers do not fill (only where no exact split exists, ``_layers_per_group``).
    padding = concurrent * sum(
        gp.blocks_per_request * (page_bytes - len(gp.group.layer_names) * gp.group.spec.bytes_per_block)
        for gp in group_plans if gp.group.spec.is_attention)
    saved = sum(spec.target.steady_blocks_per_request(max_model_len) * spec.target.bytes_per_block
                for spec in layer_specs.values() if isinstance(spec, KVSharingSpec))
    return KVCachePlan(
        groups=groups, group_plans=tuple(group_plans), max_model_len=max_model_len, step_tokens=step,
        budget_bytes=kv_memory, block_size=block_size, layers_per_block=per_group, page_bytes=page_bytes,
        num_blocks=num_blocks, num_state_slots=num_state_slots, num_checkpoint_slots=checkpoints,
        num_host_checkpoint_slots=host, num_staging_slots=staging,
        reserved_step_blocks=reserved, padding_bytes=padding, kv_shared_bytes_per_request=saved,
        max_concurrent_requests=concurrent,
        max_concurrent_requests_if_all_full=min(fits_full, max_num_seqs) if max_num_seqs else fits_full,
    )
