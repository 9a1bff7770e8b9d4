"""Mamba-1 mixer over per-request state slots (HF ``JambaMambaMixer`` semantics).

in_proj -> [x | z]; causal depthwise conv over x (conv state = last kernel-1 inputs); x_proj -> [dt | B | C],
optionally RMS-normed (Jamba's dt/b/c layernorms); dt_proj's weight maps dt to the inner dim and its bias
is added inside the scan (delta_bias, as HF does); selective scan (SSM state fp32, per channel and
state entry); y = (scan + D * x) * silu(z); out_proj. Decodes (1-token continuations, batched first)
take the one-step update ops; everything else the packed scan with per-request initial states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import metadata_op
from hybridkv.layers.kind import DecayMixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.norms import RMSNorm
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, local_units
from hybridkv.layers.state_slots import StateSlotMixer

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class Mamba1(DecayMixerConfig):
    """Mamba-1 selective-scan mixer (Jamba: with RMS norms on dt, B and C)."""

    ops = ("causal_conv1d", "causal_conv1d_update", "selective_scan", "selective_state_update")

    intermediate_size: int
    state_size: int
    dt_rank: int
    conv_kernel: int = 4
    dt_norm: bool = False
    conv_bias: bool = True
    proj_bias: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_fields(self)
        positive("Mamba1", intermediate_size=self.intermediate_size, state_size=self.state_size,
                 dt_rank=self.dt_rank, conv_kernel=self.conv_kernel)

    @property
    def kind(self) -> str:
        return "mamba1"

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, SSM state) shapes on one tensor-parallel rank: its share of the channels."""
        inter = local_units(self.intermediate_size, tensor_parallel_size, "intermediate_size")
        return (inter, self.conv_kernel - 1), (inter, self.state_size)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.intermediate_size, tensor_parallel_size, "intermediate_size")

    def matrix_elements(self, hidden: int, width: int) -> int:
        inner = self.intermediate_size
        return inner * (3 * hidden + self.conv_kernel + 2 * self.dt_rank + 3 * self.state_size)

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> Mamba1Layer:
        return Mamba1Layer(hidden_size, self, cache_name=cache_name, tp=tp)


class Mamba1Layer(StateSlotMixer):
    """Tensor parallel (``tp``): the inner channels split (x/z halves of in_proj, conv, dt_proj outputs,
    A, D); x_proj reads the split channels, so it is row-parallel and every rank gets the full dt/B/C (a
    small all-reduce); out_proj is row-parallel."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, hidden_size: int, cfg: Mamba1, *, cache_name: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cache_name=cache_name)
        self.cfg = cfg
        n, rank = cfg.state_size, cfg.dt_rank
        channels = Split(cfg.intermediate_size, cfg.intermediate_size,
                         what=f"{cache_name} Mamba1.intermediate_size")
        inter = channels.local_size(tp.size)
        self.in_proj = ColumnParallelLinear(hidden_size, 2 * cfg.intermediate_size, bias=cfg.proj_bias, tp=tp,
                                            sections=(channels, channels))
        # HF stores the depthwise conv as (inter, 1, kernel); we keep that layout for loading.
        self.conv1d = nn.Conv1d(inter, inter, cfg.conv_kernel, groups=inter, bias=cfg.conv_bias)
        self.x_proj = RowParallelLinear(cfg.intermediate_size, rank + 2 * n, tp=tp, sections=(channels,))
        self.dt_proj = ColumnParallelLinear(rank, cfg.intermediate_size, bias=True, tp=tp, sections=(channels,))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(inter, 1))
        self.D = nn.Parameter(torch.ones(inter))
        self.out_proj = RowParallelLinear(cfg.intermediate_size, hidden_size, bias=cfg.proj_bias, tp=tp,
                                          sections=(channels,))
        self.tp_shards = dict.fromkeys(("conv1d.weight", "conv1d.bias", "A_log", "D"), Shard(0, (channels,)))
        if cfg.dt_norm:
            self.dt_layernorm = RMSNorm(rank, eps=cfg.norm_eps)
            self.b_layernorm = RMSNorm(n, eps=cfg.norm_eps)
            self.c_layernorm = RMSNorm(n, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        cfg = self.cfg
        xs, z = self.in_proj(x).chunk(2, dim=-1)                            # (num_tokens, inter) each
        u = metadata_op(self._conv, xs, shape=tuple(xs.shape), dtype=xs.dtype)
        dt, B, C = self.x_proj(u).split([cfg.dt_rank, cfg.state_size, cfg.state_size], dim=-1)
        if cfg.dt_norm:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.linear(dt, self.dt_proj.weight)              # (num_tokens, inter); bias added in the scan
        y = metadata_op(self._scan, u, dt, B, C, z, shape=tuple(xs.shape), dtype=xs.dtype)
        return self.out_proj(y)                                             # (num_tokens, hidden_size)

    def _conv(self, xs: torch.Tensor) -> torch.Tensor:
        """The step's conv (``metadata_op``) over each request's conv state: (n, inter) -> (n, inter)."""
        meta, be, conv_states, _ = self.step_inputs()
        weight = self.conv1d.weight.squeeze(1)                              # (inter, kernel)
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        u = torch.empty_like(xs)
        if nd:
            u[:ndt] = be.causal_conv1d_update(xs[:ndt], conv_states=conv_states, weight=weight,
                                              bias=self.conv1d.bias, state_indices=meta.state_indices[:nd],
                                              activation="silu")
        if nd < meta.num_reqs:
            u[ndt:] = be.causal_conv1d(xs[ndt:], weight, self.conv1d.bias, conv_states=conv_states,
                                       query_start_loc=meta.prefill_query_start_loc,
                                       state_indices=meta.state_indices[nd:],
                                       has_initial_state=meta.has_initial_state[nd:], activation="silu")
        return u

    def _scan(self, u: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor
              ) -> torch.Tensor:
        """The step's selective scan (``metadata_op``) over each request's SSM state, the decodes as one-step
        updates: u, dt, z (n, inter), B, C (n, state) -> y (n, inter)."""
        meta, be, _, ssm_states = self.step_inputs()
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        A = -torch.exp(self.A_log.float())                                  # (inter, state)
        y = torch.empty_like(u)
        if nd:
            y[:ndt] = be.selective_state_update(ssm_states, u[:ndt], dt[:ndt], A, B[:ndt], C[:ndt],
                                                state_indices=meta.state_indices[:nd], z=z[:ndt],
                                                dt_bias=self.dt_proj.bias, dt_softplus=True, D=self.D)
        if nd < meta.num_reqs:
            y[ndt:] = be.selective_scan(u[ndt:], dt[ndt:], A, B[ndt:], C[ndt:],
                                        query_start_loc=meta.prefill_query_start_loc, ssm_states=ssm_states,
                                        state_indices=meta.state_indices[nd:],
                                        has_initial_state=meta.has_initial_state[nd:],
                                        D=self.D, z=z[ndt:], delta_bias=self.dt_proj.bias,
                                        delta_softplus=True)
        return y
