"""Linear layers shaped for tensor parallelism; at ``tp.size == 1`` they are plain ``nn.Linear`` /
``nn.Embedding``. The sharding rules live here (and in ``parallel.Split`` sections that layers pass in), so
the layers and the model never special-case parallelism.

- ``ColumnParallelLinear``: output features split (q/k/v, gate/up, in_proj): no communication.
- ``RowParallelLinear``: input features split (o_proj, down_proj, out_proj): partial sums all-reduced.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary rows split (padded to a multiple of the
  ranks); lookups all-reduced, logits gathered to rank 0.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridkv.forward_context import current_ops
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel


def _sections(size: int, sections: tuple[Split, ...] | None, what: str) -> tuple[Split, ...]:
    """Default: one section of ``size`` channels; else check the sections add up to ``size``."""
    if sections is None:
        return (Split(size, size, what=what),)
    if sum(s.size for s in sections) != size:
        raise ValueError(f"{what}: sections {[s.size for s in sections]} do not add up to {size}")
    return sections


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks: each rank computes its slice of the outputs, no communication.
    ``sections`` describe a fused output (Mamba2's z|x|B|C|dt, each section split on its own)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, tp: TensorParallel = SINGLE,
                 sections: tuple[Split, ...] | None = None) -> None:
        sections = _sections(out_features, sections, "ColumnParallelLinear.out_features")
        shard = Shard(0, sections)
        super().__init__(in_features, shard.local_size(tp.size), bias=bias)
        self.tp = tp
        self.tp_shards = {"weight": shard, "bias": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_ops().linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Input features split across ranks: partial products are summed by one all-reduce, then the (full,
    replicated) bias is added once. ``reduce=False`` leaves the partial sum to a caller that adds more
    partials first (an MoE's shared expert beside its routed experts): one all-reduce instead of two."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, tp: TensorParallel = SINGLE,
                 sections: tuple[Split, ...] | None = None, reduce: bool = True) -> None:
        shard = Shard(1, _sections(in_features, sections, "RowParallelLinear.in_features"))
        if bias and not reduce:
            raise ValueError("RowParallelLinear: a bias needs reduce=True (it is added after the sum)")
        super().__init__(shard.local_size(tp.size), out_features, bias=bias)
        self.tp = tp
        self.reduce = reduce
        self.tp_shards = {"weight": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = current_ops()
        if self.tp.size == 1:
            return ops.linear(x, self.weight, self.bias)
        out = ops.linear(x, self.weight)
        if self.reduce:
            self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class PackedLinears:
    """Several linears that read the same input (q|k|v, gate|up) as one GEMM. Their weights (and biases) are
    copied into one tensor and each linear's parameters become views of it: no extra memory, the same
    ``state_dict``, and in-place weight loads still land in the packed tensor. A move of the module
    (``.to``) or a replaced parameter breaks the views; ``valid`` then says so and callers run the linears one
    by one."""

    def __init__(self, *linears: nn.Linear) -> None:
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            has_bias = linears[0].bias is not None
            self.bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
            self.sizes = [lin.weight.shape[0] for lin in linears]
            start = 0
            for lin, size in zip(linears, self.sizes, strict=True):
                lin.weight = nn.Parameter(self.weight[start:start + size], requires_grad=lin.weight.requires_grad)
                if has_bias:
                    lin.bias = nn.Parameter(self.bias[start:start + size], requires_grad=lin.bias.requires_grad)
                start += size
        self._linears = linears
        self._ptrs = self._pointers()

    def _pointers(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for lin in self._linears for p in (lin.weight, lin.bias) if p is not None)

    @staticmethod
    def can_pack(*linears: nn.Linear) -> bool:
        """Same input width, dtype and device, and all or none with a bias."""
        first = linears[0]
        return all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
                   and lin.weight.device == first.weight.device and (lin.bias is None) == (first.bias is None)
                   for lin in linears)

    def valid(self) -> bool:
        """Every parameter still a view of the packed tensors (a few pointer compares per call)."""
        return self._pointers() == self._ptrs

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: (num_tokens, in_features) -> each linear's output, as column views of one GEMM's result."""
        return list(current_ops().linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def _vocab_split(vocab_size: int) -> Split:
    return Split(vocab_size, vocab_size, what="vocab_size", pad=True)


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds ``cdiv(vocab, tp)`` rows (the last ones zero padding); a token outside this rank's
    rows looks up zeros, and the all-reduce assembles the embedding. Any vocabulary size works."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel = SINGLE) -> None:
        split = _vocab_split(num_embeddings)
        super().__init__(split.local_size(tp.size), embedding_dim)
        self.tp = tp
        self.vocab_start = split.part(tp.size, tp.rank)[0]
        self.tp_shards = {"weight": Shard(0, (split,))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Linear):
    """Vocabulary-parallel output layer: each rank computes the logits of its rows; ``forward`` gathers
    them on rank 0 (None on other ranks) and drops the padding columns."""

    def __init__(self, hidden_size: int, vocab_size: int, *, tp: TensorParallel = SINGLE) -> None:
        split = _vocab_split(vocab_size)
        super().__init__(hidden_size, split.local_size(tp.size), bias=False)
        self.tp = tp
        self.vocab_size = vocab_size
        self.tp_shards = {"weight": Shard(0, (split,))}

    def forward(self, hidden: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """``out_dtype``: the logits' dtype (fp32: stored so by the kernel on one rank; under tensor parallelism
        the shards are gathered in the model dtype, half the bytes, and converted on rank 0)."""
        if self.tp.size == 1:
            return current_ops().linear(hidden, self.weight, self.bias, out_dtype=out_dtype)
        full = self.tp.gather_last_dim(current_ops().linear(hidden, self.weight, self.bias))
        if full is None:
            return None
        full = full[..., :self.vocab_size]
        return full if out_dtype is None else full.to(out_dtype)


class LowRankAdapter(nn.Module):
    """``up(down(x))``: a LoRA-style delta added to a projection's output (Zamba2's per-use adapters on
    a shared block). ``down``/``up`` are HF's ``Sequential`` entries ``0``/``1``. ``down`` is replicated
    (rank-sized output); ``up`` is split like the projection it adds to (``sections``)."""

    def __init__(self, in_features: int, rank: int, out_features: int, *, tp: TensorParallel = SINGLE,
                 sections: tuple[Split, ...] | None = None) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = ColumnParallelLinear(rank, out_features, tp=tp, sections=sections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, in_features) -> (num_tokens, out_features on this rank)
        return self.up(self.down(x))
