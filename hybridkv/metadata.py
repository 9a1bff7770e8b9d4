"""CommonAttentionMetadata: one step's batch for one KV-cache group.

It is the one contract between kv_groups (who fill block tables), transforms (pure rewrites of a batch) and
the attention kernels. Host twins are numpy int32 because vectorised numpy is the hot path (torch op
overhead alone would eat the per-step budget); device fields are torch tensors on ``device``.

Positions are *relative* to ``key_start``: column 0 of a block-table row holds the key at absolute
position ``key_start``. Kernels only ever need differences of positions (causal and window masks), so after
sliding-window trimming or local-attention virtual batching nothing changes for them.

Every field declares how it slices (``field(metadata={"slice": ...})``); microbatch slicing and request
permutation dispatch on that declaration, so a new field without a rule fails a test instead of being
silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any

import numpy as np
import torch

from hybridkv import envs

__all__ = [
    "SLICE_KINDS",
    "CommonAttentionMetadata",
    "FieldRule",
    "debug_enabled",
    "field_rules",
    "host_to_device",
]

#: How a field slices: per request, (num_reqs+1) cumulative offsets, per token, per block-table row, or a
#: scalar (derived scalars are recomputed from the sliced arrays, the others kept).
SLICE_KINDS = ("request", "request_offsets", "token", "block_row", "scalar")
_max = np.maximum.reduce  # a direct ufunc reduction: ndarray.max goes through a Python wrapper


def debug_enabled() -> bool:
    """True when ``HYBRIDKV_DEBUG`` is on (``hybridkv.envs``): builders and transforms then validate every CAM
    they return."""
    return envs.debug()


def host_to_device(arr: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Device twin of a host array; on the CPU it shares memory (zero copy), so never mutate either."""
    t = torch.from_numpy(arr)
    dev = device if isinstance(device, torch.device) else torch.device(device)
    return t if dev.type == "cpu" else t.to(dev, non_blocking=True)


PACK_ALIGN = 16
"""Byte alignment of each array in ``host_to_device_many``'s buffer. Triton compiles a kernel per pointer alignment
class (16 bytes or not): with 8, whether a twin is 16-aligned would depend on the lengths of the arrays packed
before it, and a step whose metadata fell the other way compiled a new kernel (~1 s) inside the serving loop."""


def packed_offsets(nbytes: Sequence[int]) -> np.ndarray:
    """Start of each of arrays of ``nbytes`` bytes packed from ``PACK_ALIGN`` boundaries, then the total size."""
    return np.cumsum([0] + [-(-n // PACK_ALIGN) * PACK_ALIGN for n in nbytes])


def host_to_device_many(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Device twins of several small host arrays made with one copy: packed into one pinned buffer (each from a
    ``PACK_ALIGN``-byte boundary), one non-blocking copy, the twins views of it (a step's metadata is tens of
    arrays of a few KB: one copy each costs ~20 µs of host time). On the CPU: zero-copy, as ``host_to_device``."""
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets = packed_offsets([a.nbytes for a in arrays])
    host = torch.empty(max(int(offsets[-1]), 8), dtype=torch.uint8, pin_memory=True)
    buf = host.numpy()
    for a, off in zip(arrays, offsets.tolist(), strict=False):
        buf[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    flat = host.to(dev, non_blocking=True)     # (the pinned block is reused only once this copy has run)
    return [flat[off:off + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
            for a, off in zip(arrays, offsets.tolist(), strict=False)]


@cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _spec(kind: str, **extra: Any) -> dict[str, Any]:
    return {"slice": kind, **extra}


@dataclass(frozen=True, kw_only=True)
class FieldRule:
    """A field's slicing declaration, read once per class (the per-call dispatch must stay cheap).

    ``on_cut``: how a per-request value changes when its request is cut by a token split ("sub_tail": minus
    the tokens cut off the end; "add_head": plus the tokens cut off the start). ``twin``: the host array a
    device tensor mirrors (on the CPU the tensor is rebuilt from it with no copy). ``derived``: a scalar
    recomputed from the arrays (otherwise a scalar is kept).
    """

    name: str
    kind: str
    on_cut: str | None = None
    twin: str | None = None
    derived: bool = False


@cache
def field_rules(cls: type) -> tuple[FieldRule, ...]:
    """Rules of every dataclass field of ``cls``, host fields before their device twins."""
    rules = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("slice") not in SLICE_KINDS:
            raise TypeError(f"{cls.__name__}.{f.name}: no valid 'slice' declaration (one of {SLICE_KINDS})")
        rules.append(
            FieldRule(
                name=f.name,
                kind=f.metadata["slice"],
                on_cut=f.metadata.get("on_cut"),
                twin=f.metadata.get("twin"),
                derived=bool(f.metadata.get("derived", False)),
            )
        )
    return tuple(sorted(rules, key=lambda r: r.twin is not None))


def _as_int_array(name: str, value: Any, ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:  # ragged nested lists
        raise ValueError(f"{name}: cannot be read as a {ndim}-D integer array ({e})") from None
    if arr.size == 0 and arr.ndim == ndim:
        arr = arr.astype(np.int64)
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr


@dataclass(frozen=True, kw_only=True)
class CommonAttentionMetadata:
    """One step's batch for ONE KV-cache group (decodes, prefills and chunked prefills mixed).

    Request r owns tokens ``query_start_loc[r]:query_start_loc[r+1]`` of the flat token axis; its queries sit
    at relative positions ``num_computed_tokens[r] .. seq_lens[r]-1`` and it reads keys at relative positions
    ``0 .. seq_lens[r]-1`` through ``block_table[r]``. Absolute position = ``key_start[r]`` + relative.
    Arrays are shared between CAMs (transforms return views where they can): never mutate them.
    """

    # (num_reqs+1,) cumulative query offsets
    query_start_loc: torch.Tensor = field(metadata=_spec("request_offsets", twin="query_start_loc_cpu"))
    query_start_loc_cpu: np.ndarray = field(metadata=_spec("request_offsets"))
    # (num_reqs,) keys per request, counted from key_start; the last query of the request sits at seq_len-1
    seq_lens: torch.Tensor = field(metadata=_spec("request", on_cut="sub_tail", twin="seq_lens_cpu"))
    seq_lens_cpu: np.ndarray = field(metadata=_spec("request", on_cut="sub_tail"))
    # (num_reqs,) keys before this step's queries (= seq_lens - query_lens), relative to key_start
    num_computed_tokens_cpu: np.ndarray = field(metadata=_spec("request", on_cut="add_head"))
    # (num_reqs,) absolute position of block-table column 0; a multiple of block_size
    key_start: torch.Tensor = field(metadata=_spec("request", twin="key_start_cpu"))
    key_start_cpu: np.ndarray = field(metadata=_spec("request"))
    # (num_reqs, max_blocks) physical block ids; 0 is the null block
    block_table_tensor: torch.Tensor = field(metadata=_spec("block_row", twin="block_table_cpu"))
    block_table_cpu: np.ndarray = field(metadata=_spec("block_row"))
    # (num_actual_tokens,) int64: where the KV of each query token is written (block_id * block_size + off)
    slot_mapping: torch.Tensor = field(metadata=_spec("token"))
    block_size: int = field(metadata=_spec("scalar"))
    num_reqs: int = field(metadata=_spec("scalar", derived=True))
    num_actual_tokens: int = field(metadata=_spec("scalar", derived=True))
    max_query_len: int = field(metadata=_spec("scalar", derived=True))
    max_seq_len: int = field(metadata=_spec("scalar", derived=True))
    causal: bool = field(default=True, metadata=_spec("scalar"))

    # ------------------------------------------------------------------ derived views

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @property
    def query_lens_cpu(self) -> np.ndarray:
        """(num_reqs,) int32 query tokens per request."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def max_blocks(self) -> int:
        return int(self.block_table_cpu.shape[1])

    # ------------------------------------------------------------------ construction

    @staticmethod
    def derive_scalars(query_start_loc_cpu: np.ndarray, seq_lens_cpu: np.ndarray) -> dict[str, int]:
        """The scalar fields marked ``derived`` (recomputed whenever the arrays change)."""
        n = int(seq_lens_cpu.shape[0])
        return {
            "num_reqs": n,
            "num_actual_tokens": int(query_start_loc_cpu[-1]),
            "max_query_len": int((query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).max()) if n else 0,
            "max_seq_len": int(seq_lens_cpu.max()) if n else 0,
        }

    @classmethod
    def from_host(
        cls,
        *,
        query_start_loc_cpu: np.ndarray,
        seq_lens_cpu: np.ndarray,
        key_start_cpu: np.ndarray,
        block_table_cpu: np.ndarray,
        slot_mapping: torch.Tensor,
        block_size: int,
        device: torch.device,
        causal: bool = True,
        query_lens_cpu: np.ndarray | None = None,
        query_start_loc: torch.Tensor | None = None,
    ) -> CommonAttentionMetadata:
        """Assemble a CAM from int32 host arrays (no checks): device twins and derived fields are filled in.

        This is the transforms' constructor: ``query_lens_cpu`` may be passed when already known, and
        ``query_start_loc`` when the offsets are unchanged (no host-to-device copy). ``build`` is the
        checked entry point for callers.
        """
        qsl = query_start_loc_cpu
        q = qsl[1:] - qsl[:-1] if query_lens_cpu is None else query_lens_cpu
        n = q.shape[0]
        # zero-copy twins on the CPU (the common case on the host path)
        to_dev = torch.from_numpy if device.type == "cpu" else partial(host_to_device, device=device)
        cam = cls(
            query_start_loc=to_dev(query_start_loc_cpu) if query_start_loc is None else query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=to_dev(seq_lens_cpu),
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=seq_lens_cpu - q,
            key_start=to_dev(key_start_cpu),
            key_start_cpu=key_start_cpu,
            block_table_tensor=to_dev(block_table_cpu),
            block_table_cpu=block_table_cpu,
            slot_mapping=slot_mapping,
            block_size=block_size,
            causal=causal,
            num_reqs=n,
            num_actual_tokens=int(query_start_loc_cpu[-1]),
            max_query_len=int(q.max()) if n else 0,
            max_seq_len=int(seq_lens_cpu.max()) if n else 0,
        )
        if debug_enabled():
            cam.validate()
        return cam

    def with_keys(
        self,
        *,
        seq_lens_cpu: np.ndarray,
        key_start_cpu: np.ndarray,
        block_table_cpu: np.ndarray,
        num_computed_tokens_cpu: np.ndarray,
    ) -> CommonAttentionMetadata:
        """The same requests and queries reading another span of their keys (what trimming and a 1:1 local
        split change): offsets, slot mapping and the query scalars are kept, so only the new int32 host
        arrays get device twins (no checks; validated under HYBRIDKV_DEBUG)."""
        device = self.device
        to_dev = torch.from_numpy if device.type == "cpu" else partial(host_to_device, device=device)
        cam = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc_cpu,
            seq_lens=to_dev(seq_lens_cpu),
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=num_computed_tokens_cpu,
            key_start=to_dev(key_start_cpu),
            key_start_cpu=key_start_cpu,
            block_table_tensor=to_dev(block_table_cpu),
            block_table_cpu=block_table_cpu,
            slot_mapping=self.slot_mapping,
            block_size=self.block_size,
            causal=self.causal,
            num_reqs=self.num_reqs,
            num_actual_tokens=self.num_actual_tokens,
            max_query_len=self.max_query_len,
            max_seq_len=int(_max(seq_lens_cpu)) if self.num_reqs else 0,
        )
        if debug_enabled():
            cam.validate()
        return cam

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int] | np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        block_table: Any,
        block_size: int,
        device: str | torch.device = "cpu",
        key_start: Sequence[int] | np.ndarray | None = None,
        causal: bool = True,
    ) -> CommonAttentionMetadata:
        """Checked constructor: offsets, slot mapping and maxima are computed (vectorised) from the inputs.

        ``seq_lens`` counts keys from ``key_start`` (default 0); ``block_table`` is (num_reqs, max_blocks).
        """
        if not isinstance(block_size, (int, np.integer)) or block_size <= 0:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        block_size = int(block_size)
        q = _as_int_array("query_lens", query_lens, 1)
        s = _as_int_array("seq_lens", seq_lens, 1)
        n = q.shape[0]
        if s.shape[0] != n:
            raise ValueError(f"seq_lens: has {s.shape[0]} entries but query_lens has {n}")
        bt = _as_int_array("block_table", block_table, 2) if n else np.zeros((0, 0), np.int64)
        if bt.shape[0] != n:
            raise ValueError(f"block_table: has {bt.shape[0]} rows but there are {n} requests")
        ks = np.zeros(n, np.int64) if key_start is None else _as_int_array("key_start", key_start, 1)
        if ks.shape[0] != n:
            raise ValueError(f"key_start: has {ks.shape[0]} entries but there are {n} requests")
        if (q < 0).any():
            raise ValueError(f"query_lens: negative length at request {int(np.argmax(q < 0))}")
        if (s < 0).any():
            raise ValueError(f"seq_lens: negative length at request {int(np.argmax(s < 0))}")
        if (q > s).any():
            r = int(np.argmax(q > s))
            raise ValueError(f"query_lens: request {r} has query_len {q[r]} > seq_len {s[r]}")
        if ((ks < 0) | (ks % block_size != 0)).any():
            raise ValueError(f"key_start: must be non-negative multiples of block_size={block_size}")
        if n and (bt < 0).any():
            raise ValueError("block_table: negative block id (the null block is 0, never -1)")
        need = -(-s // block_size)
        if n and (need > bt.shape[1]).any():
            r = int(np.argmax(need > bt.shape[1]))
            raise ValueError(
                f"block_table: request {r} needs {need[r]} blocks for seq_len {s[r]} "
                f"but the table has {bt.shape[1]} columns"
            )
        if int(q.sum()) >= 2**31 or (n and int(s.max()) + int(ks.max()) >= 2**31):
            raise ValueError("query_lens: token counts overflow int32")

        q32, s32 = q.astype(np.int32), s.astype(np.int32)
        bt32 = np.ascontiguousarray(bt, dtype=np.int32)
        qsl = np.zeros(n + 1, np.int32)
        np.cumsum(q32, out=qsl[1:])
        slots = _slot_mapping(qsl, s32 - q32, bt32, block_size)
        dev = torch.device(device)
        return cls.from_host(
            query_start_loc_cpu=qsl,
            seq_lens_cpu=s32,
            key_start_cpu=ks.astype(np.int32),
            block_table_cpu=bt32,
            slot_mapping=host_to_device(slots, dev),
            block_size=block_size,
            device=dev,
            causal=causal,
        )

    # ------------------------------------------------------------------ checks

    def validate(self, *, check_device: bool | None = None) -> None:
        """Cheap consistency checks; raises ValueError naming the offending field.

        Host/device agreement (and the slot mapping against the block table) is checked when the device is
        the CPU, when ``HYBRIDKV_DEBUG=1``, or when ``check_device=True`` (it syncs a GPU).
        """
        n, t, bs = self.num_reqs, self.num_actual_tokens, self.block_size
        qsl = self.query_start_loc_cpu
        if isinstance(qsl, np.ndarray) and qsl.ndim == 1 and qsl.shape[0] != n + 1:
            raise ValueError(f"num_reqs: {n} but query_start_loc_cpu has {qsl.shape[0]} offsets")
        host = {
            "query_start_loc_cpu": (self.query_start_loc_cpu, (n + 1,)),
            "seq_lens_cpu": (self.seq_lens_cpu, (n,)),
            "num_computed_tokens_cpu": (self.num_computed_tokens_cpu, (n,)),
            "key_start_cpu": (self.key_start_cpu, (n,)),
            "block_table_cpu": (self.block_table_cpu, (n, None)),
        }
        for name, (arr, shape) in host.items():
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int32:
                raise ValueError(f"{name}: must be a numpy int32 array, got {type(arr).__name__}")
            if arr.ndim != len(shape) or any(
                w is not None and w != a for w, a in zip(shape, arr.shape, strict=True)
            ):
                raise ValueError(f"{name}: shape {arr.shape} does not match num_reqs={n}")
        if bs <= 0:
            raise ValueError(f"block_size: must be positive, got {bs}")
        q = np.diff(qsl)
        if qsl[0] != 0 or (q < 0).any():
            raise ValueError("query_start_loc_cpu: must start at 0 and be non-decreasing")
        if qsl[-1] != t:
            raise ValueError(f"num_actual_tokens: {t} != query_start_loc_cpu[-1]={qsl[-1]}")
        s = self.seq_lens_cpu
        if (s < q).any():
            raise ValueError("seq_lens_cpu: a request has fewer keys than queries")
        if not np.array_equal(self.num_computed_tokens_cpu, s - q):
            raise ValueError("num_computed_tokens_cpu: != seq_lens - query_lens")
        ks = self.key_start_cpu
        if ((ks < 0) | (ks % bs != 0)).any():
            raise ValueError("key_start_cpu: must be non-negative multiples of block_size")
        width = self.block_table_cpu.shape[1]
        if n and ((-(-s // bs)) > width).any():
            raise ValueError("block_table_cpu: too narrow for seq_lens")
        if n and width and self.block_table_cpu.min() < 0:
            raise ValueError("block_table_cpu: negative block id (the null block is 0)")
        dev = {
            "query_start_loc": (self.query_start_loc, torch.int32, (n + 1,)),
            "seq_lens": (self.seq_lens, torch.int32, (n,)),
            "key_start": (self.key_start, torch.int32, (n,)),
            "block_table_tensor": (self.block_table_tensor, torch.int32, (n, width)),
            "slot_mapping": (self.slot_mapping, torch.int64, (t,)),
        }
        for name, (ten, dtype, shape) in dev.items():
            if not isinstance(ten, torch.Tensor) or ten.dtype != dtype:
                raise ValueError(f"{name}: must be a torch {dtype} tensor")
            if tuple(ten.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(ten.shape)} != expected {shape}")
            if ten.device != self.device:
                raise ValueError(f"{name}: on {ten.device}, the batch is on {self.device}")
        scalars = self.derive_scalars(qsl, s)
        for name, value in scalars.items():
            if getattr(self, name) != value:
                raise ValueError(f"{name}: {getattr(self, name)} != {value} implied by the arrays")
        if check_device is None:
            check_device = self.device.type == "cpu" or debug_enabled()
        if check_device:
            self._validate_device()

    def _validate_device(self) -> None:
        pairs = {
            "query_start_loc": (self.query_start_loc, self.query_start_loc_cpu),
            "seq_lens": (self.seq_lens, self.seq_lens_cpu),
            "key_start": (self.key_start, self.key_start_cpu),
            "block_table_tensor": (self.block_table_tensor, self.block_table_cpu),
        }
        for name, (ten, arr) in pairs.items():
            if not np.array_equal(ten.cpu().numpy(), arr):
                raise ValueError(f"{name}: device tensor differs from its host twin")
        expect = _slot_mapping(
            self.query_start_loc_cpu, self.num_computed_tokens_cpu, self.block_table_cpu, self.block_size
        )
        if not np.array_equal(self.slot_mapping.cpu().numpy(), expect):
            raise ValueError("slot_mapping: differs from block_table + positions")

    def replace(self, **changes: Any) -> CommonAttentionMetadata:
        """``dataclasses.replace`` (validated under HYBRIDKV_DEBUG)."""
        cam = dataclasses.replace(self, **changes)
        if debug_enabled():
            cam.validate()
        return cam


def _slot_mapping(qsl: np.ndarray, num_computed: np.ndarray, bt: np.ndarray, block_size: int) -> np.ndarray:
    """(num_tokens,) int64 slots of each query token: block id of its column * block_size + offset."""
    q = np.diff(qsl)
    n_tok = int(qsl[-1])
    if n_tok == 0:
        return np.zeros(0, np.int64)
    n, width = bt.shape
    req = np.repeat(np.arange(n, dtype=np.int64), q)
    pos = np.arange(n_tok, dtype=np.int64) + np.repeat((num_computed - qsl[:-1]).astype(np.int64), q)
    blk = bt.ravel().take(req * width + pos // block_size).astype(np.int64)
    return blk * block_size + pos % block_size
