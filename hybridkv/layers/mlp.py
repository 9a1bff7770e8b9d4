"""Dense feed-forward layers: gated (SwiGLU / GeGLU) and plain (relu², NemotronH)."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.forward_context import current_ops
from hybridkv.layers.activations import get_activation
from hybridkv.layers.linear import ColumnParallelLinear, PackedLinears, RowParallelLinear
from hybridkv.layers.parallel import SINGLE, Split, TensorParallel


class DenseMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` when gated, else ``down(act(up(x)))``; HF weight names.

    Falcon-H1's µP factors scale the gate pre-activation (``gate_multiplier``) and the output
    (``down_multiplier``). ``activation_sparsity`` (Gemma-3n): ``gaussian_topk`` on the gate before the
    activation (tensor parallelism refused by the config: its statistics span the whole width). Tensor parallel:
    gate/up column-parallel, down row-parallel (one all-reduce; ``reduce=False`` returns the partial sum for a
    caller that reduces once for several branches)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 gated: bool = True, bias: bool = False, tp: TensorParallel = SINGLE, reduce: bool = True,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0,
                 activation_sparsity: float = 0.0) -> None:
        super().__init__()
        # the Gaussian quantile of the sparsity, in fp32 as HF computes it (0: dense)
        self.std_multiplier = (float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(activation_sparsity)))
                               if activation_sparsity else None)
        get_activation(activation)          # fails early on an unknown name
        self.activation = activation
        self.gate_multiplier = gate_multiplier
        self.down_multiplier = down_multiplier
        channels = (Split(intermediate_size, intermediate_size, what="MLP.intermediate_size"),)
        self.gate_proj = (ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp, sections=channels)
                          if gated else None)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, tp=tp, sections=channels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp, sections=channels,
                                           reduce=reduce)
        self.packed: PackedLinears | None = None          # gate|up as one GEMM (``fuse_projections``)

    def fuse_projections(self) -> None:
        """Pack gate/up into one weight (views keep the parameters): one GEMM instead of two."""
        if self.packed is not None and self.packed.valid():
            return                                  # already packed: packing again would move the weights
        if self.gate_proj is not None and PackedLinears.can_pack(self.gate_proj, self.up_proj):
            self.packed = PackedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, gate_up_delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: (num_tokens, hidden_size). ``gate_up_delta``: (num_tokens, 2 * intermediate on this rank) added
        to the gate|up projections before the activation (Zamba2's per-use adapter on a shared MLP)."""
        ops = current_ops()
        if self.gate_proj is None:
            if gate_up_delta is not None:
                raise ValueError("DenseMLP: gate_up_delta needs a gated MLP")
            h = ops.linear_act_mul(x, self.up_proj.weight, self.up_proj.bias, activation=self.activation,
                                   gated=False)
        elif self.packed is not None and self.packed.valid() and gate_up_delta is None \
                and self.std_multiplier is None:
            # (num_tokens, inter): projection and activation in one op (one kernel at decode sizes)
            h = ops.linear_act_mul(x, self.packed.weight, self.packed.bias, activation=self.activation,
                                   gate_multiplier=self.gate_multiplier)
        else:
            if self.packed is not None and self.packed.valid():
                gate_up = ops.linear(x, self.packed.weight, self.packed.bias)     # (num_tokens, 2 * inter)
            else:
                gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
            if gate_up_delta is not None:
                gate_up = gate_up + gate_up_delta
            if self.std_multiplier is not None:
                gate, up = gate_up.chunk(2, dim=-1)
                gate_up = torch.cat([gaussian_topk(gate, self.std_multiplier), up], dim=-1)
            h = ops.act_mul(gate_up, activation=self.activation, gate_multiplier=self.gate_multiplier)
        out = self.down_proj(h)
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out


def gaussian_topk(gate: torch.Tensor, std_multiplier: float) -> torch.Tensor:
    """Gemma-3n's activation sparsity: ``relu(g - (mean(g) + std(g) * m))`` per row (population std), with m the
    standard normal quantile of the target sparsity: about that fraction of a Gaussian row is zeroed."""
    m = torch.tensor(std_multiplier).to(gate.dtype).item()     # rounded to the dtype as HF's; a host scalar
    cutoff = gate.mean(dim=-1, keepdim=True) + gate.std(dim=-1, keepdim=True, unbiased=False) * m
    return torch.relu(gate - cutoff)
