"""Dense feed-forward layers: gated (SwiGLU / GeGLU) and plain (relu², NemotronH)."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.layers.activations import get_activation
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.parallel import SINGLE, Split, TensorParallel


class DenseMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` when gated, else ``down(act(up(x)))``; HF weight names.

    Falcon-H1's µP factors scale the gate pre-activation (``gate_multiplier``) and the output
    (``down_multiplier``). Tensor parallel: gate/up column-parallel, down row-parallel (one all-reduce;
    ``reduce=False`` returns the partial sum for a caller that reduces once for several branches)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 gated: bool = True, bias: bool = False, tp: TensorParallel = SINGLE, reduce: bool = True,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> None:
        super().__init__()
        self.act = get_activation(activation)
        self.gate_multiplier = gate_multiplier
        self.down_multiplier = down_multiplier
        channels = (Split(intermediate_size, intermediate_size, what="MLP.intermediate_size"),)
        self.gate_proj = (ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp, sections=channels)
                          if gated else None)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp, sections=channels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp, sections=channels,
                                           reduce=reduce)

    def forward(self, x: torch.Tensor, gate_up_delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: (num_tokens, hidden_size). ``gate_up_delta``: (num_tokens, 2 * intermediate on this rank) added
        to the gate|up projections before the activation (Zamba2's per-use adapter on a shared MLP)."""
        up = self.up_proj(x)
        if self.gate_proj is None:
            if gate_up_delta is not None:
                raise ValueError("DenseMLP: gate_up_delta needs a gated MLP")
            out = self.down_proj(self.act(up))
        else:
            gate = self.gate_proj(x)
            if gate_up_delta is not None:
                delta_gate, delta_up = gate_up_delta.chunk(2, dim=-1)
                gate, up = gate + delta_gate, up + delta_up
            if self.gate_multiplier != 1.0:
                gate = gate * self.gate_multiplier
            out = self.down_proj(self.act(gate) * up)
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out
