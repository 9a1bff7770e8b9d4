"""Linear layers shaped for tensor parallelism. At ``tp_size == 1`` they are plain ``nn.Linear``;
the sharding rules live here so layers never special-case parallelism."""

from __future__ import annotations

import torch
from torch import nn


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks (q/k/v, gate/up, in_proj): no communication in forward."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, tp_size: int = 1) -> None:
        if out_features % tp_size:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} not divisible by "
                             f"tp_size={tp_size}")
        super().__init__(in_features, out_features // tp_size, bias=bias)
        self.tp_size = tp_size


class RowParallelLinear(nn.Linear):
    """Input features split across ranks (o_proj, down_proj, out_proj): partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, tp_size: int = 1) -> None:
        if in_features % tp_size:
            raise ValueError(f"RowParallelLinear: in_features={in_features} not divisible by "
                             f"tp_size={tp_size}")
        super().__init__(in_features // tp_size, out_features, bias=bias)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out if self.bias is None else out + self.bias


class LowRankAdapter(nn.Module):
    """``up(down(x))``: a LoRA-style delta added to a projection's output (Zamba2's per-use adapters on
    a shared block). ``down``/``up`` are HF's ``Sequential`` entries ``0``/``1``."""

    def __init__(self, in_features: int, rank: int, out_features: int) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, in_features) -> (num_tokens, out_features)
        return self.up(self.down(x))
