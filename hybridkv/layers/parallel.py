"""Tensor-parallel building blocks: this process's place in its group, and how a full tensor splits.

The sharding rules are data: a tensor dim is a concatenation of ``Split`` sections (attention heads, Mamba
groups, MLP channels, vocabulary rows), each dealt to the ranks in contiguous runs of whole units. A module
declares, per parameter, the ``Shard`` (dim + sections) it holds, in ``tp_shards``; loaders and the random
init produce the *full* tensor and cut this rank's part with ``Shard.take``, so checkpoint weight maps stay
unaware of parallelism. Process startup lives in ``hybridkv.engine.distributed``; here are only the shape
arithmetic and the two collectives a forward needs. At size 1 nothing communicates and every cut is the
identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """``rank`` of ``size`` in the compute process group ``group`` (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel: rank {self.rank} is not in [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (partial sums of a row-parallel product)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0 (vocab-parallel logits); other ranks
        get None. A gather, not an all-gather: only rank 0 samples, so only it needs the full rows."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TensorParallel()


def local_units(units: int, tp_size: int, what: str, *, replicate: bool = False) -> int:
    """How many of ``units`` (heads, groups, channels) one rank holds. They must split evenly; with
    ``replicate``, fewer units than ranks is allowed when they divide the ranks (each rank then keeps the
    one unit its run of ranks shares, e.g. a GQA kv head). The error names the dimension."""
    if units % tp_size == 0:
        return units // tp_size
    if replicate and tp_size % units == 0:
        return 1
    rule = f"divisible by tensor_parallel_size={tp_size}"
    if replicate:
        rule += " or divide it (to be replicated)"
    raise ValueError(f"{what}={units} must be {rule}")


@dataclass(frozen=True)
class Split:
    """One section of a tensor dim: ``size`` elements made of ``units`` equal units. ``replicate`` allows
    fewer units than ranks (see ``local_units``); ``pad`` deals ``cdiv(size, tp)`` elements to each rank and
    zero-pads the last parts (vocabulary rows, which need not divide)."""

    size: int
    units: int
    what: str = "features"
    replicate: bool = False
    pad: bool = False

    def __post_init__(self) -> None:
        if self.size <= 0 or self.units <= 0 or self.size % self.units:
            raise ValueError(f"Split({self.what}): size={self.size} is not a whole number of "
                             f"{self.units} units")

    def local_size(self, tp_size: int) -> int:
        if self.pad:
            return -(-self.size // tp_size)
        return local_units(self.units, tp_size, self.what, replicate=self.replicate) * (self.size // self.units)

    def part(self, tp_size: int, rank: int) -> tuple[int, int]:
        """(start, length) of rank ``rank``'s elements in the full section (length < local_size: padded)."""
        local = self.local_size(tp_size)
        if self.pad:
            start = min(rank * local, self.size)
            return start, min(local, self.size - start)
        if self.units % tp_size == 0:
            return rank * local, local
        unit = self.size // self.units                 # replicated: the one unit of this run of ranks
        return (rank * self.units // tp_size) * unit, unit


@dataclass(frozen=True)
class Shard:
    """A parameter's dim ``dim`` is the concatenation of ``sections``; this rank holds its part of each,
    concatenated in the same order (so a fused z|x|B|C|dt projection stays fused locally)."""

    dim: int
    sections: tuple[Split, ...]

    @property
    def full_size(self) -> int:
        return sum(s.size for s in self.sections)

    def local_size(self, tp_size: int) -> int:
        return sum(s.local_size(tp_size) for s in self.sections)

    def full_shape(self, local_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
        shape = list(local_shape)
        if shape[self.dim] != self.local_size(tp_size):
            raise ValueError(f"Shard: local dim {self.dim} is {shape[self.dim]}, expected "
                             f"{self.local_size(tp_size)}")
        shape[self.dim] = self.full_size
        return tuple(shape)

    def take(self, full: torch.Tensor, tp: TensorParallel, *, offset: int = 0) -> torch.Tensor:
        """This rank's part of ``full``. ``offset``: leading dims already indexed away (a loader writing
        expert e of a stacked (E, ...) parameter passes the (...) sub-tensor with offset 1)."""
        dim = self.dim - offset
        if dim < 0:
            raise ValueError(f"Shard: cannot take a part along dim {self.dim} of a sub-tensor indexed "
                             f"{offset} dims deep")
        if full.shape[dim] != self.full_size:
            raise ValueError(f"tensor of shape {tuple(full.shape)} has {full.shape[dim]} along dim {dim}; the "
                             f"sharded parameter expects {self.full_size} "
                             f"({' + '.join(f'{s.what} {s.size}' for s in self.sections)})")
        if tp.size == 1:
            return full
        pieces, base = [], 0
        for s in self.sections:
            start, length = s.part(tp.size, tp.rank)
            pieces.append(full.narrow(dim, base + start, length))
            missing = s.local_size(tp.size) - length
            if missing:
                shape = list(full.shape)
                shape[dim] = missing
                pieces.append(full.new_zeros(shape))
            base += s.size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def shard_rules(module: torch.nn.Module) -> dict[str, Shard]:
    """Parameter name -> its ``Shard``, from every submodule's ``tp_shards`` declaration (parameters not
    listed are replicated: norms, routers, biases of row-parallel layers, small adapters)."""
    out: dict[str, Shard] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, shard in getattr(mod, "tp_shards", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out
