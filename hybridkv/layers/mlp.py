"""Dense feed-forward layers: gated (SwiGLU / GeGLU) and plain (relu², NemotronH)."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.layers.activations import get_activation
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear


class DenseMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` when gated, else ``down(act(up(x)))``; HF weight names."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 gated: bool = True, bias: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        self.act = get_activation(activation)
        self.gate_proj = (ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp_size=tp_size)
                          if gated else None)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp_size=tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
