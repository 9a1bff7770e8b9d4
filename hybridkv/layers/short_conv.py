"""LFM2's gated short convolution over per-request state slots (HF ``Lfm2ShortConv`` semantics).

in_proj -> [B | C | x]; y = out_proj(C * conv(B * x)) with a depthwise causal conv of width ``conv_kernel`` and
no activation; the conv state holds the last width - 1 gated inputs B * x. It is the Mamba conv op with
``activation=None`` (``layers/ops/conv1d_ref.py``, the Triton twin on GPU), so its state is a one-tensor
``MambaSpec``: slots, prefix-cache checkpoints and state copies are the Mamba machinery unchanged. Decodes
(1-token continuations, batched first) take the one-step update; everything else the packed conv with
per-request initial states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import metadata_op
from hybridkv.layers.kind import RecurrentMixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, local_units
from hybridkv.layers.state_slots import StateSlotMixer

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class ShortConv(RecurrentMixerConfig):
    """LFM2's gated short convolution (HF ``Lfm2ShortConv``): ``in_proj`` gives B, C, x (``channels`` each),
    ``y = out_proj(C * conv(B * x))`` with a depthwise causal conv of width ``conv_kernel`` (HF ``conv_L_cache``)
    and no activation. State per request: the conv state (channels, conv_kernel - 1), the last gated inputs;
    ``bias`` is HF's ``conv_bias``, which biases in_proj, the conv and out_proj alike."""

    ops = ("causal_conv1d", "causal_conv1d_update")

    channels: int
    conv_kernel: int = 3
    bias: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        positive("ShortConv", channels=self.channels, conv_kernel=self.conv_kernel)
        if self.conv_kernel < 2:
            raise ValueError(f"ShortConv.conv_kernel must be at least 2 (a state of width - 1 inputs), "
                             f"got {self.conv_kernel}")

    @property
    def kind(self) -> str:
        return "short_conv"

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state,) shape on one tensor-parallel rank: its share of the channels."""
        channels = local_units(self.channels, tensor_parallel_size, "channels")
        return ((channels, self.conv_kernel - 1),)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.channels, tensor_parallel_size, "channels")

    def matrix_elements(self, hidden: int, width: int) -> int:
        return self.channels * (4 * hidden + self.conv_kernel)

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> ShortConvLayer:
        return ShortConvLayer(hidden_size, self, cache_name=cache_name, tp=tp)


class ShortConvLayer(StateSlotMixer):
    """Tensor parallel (``tp``): the channels split: each of in_proj's B, C, x sections column-parallel, the conv
    channels and the conv state with them (everything between the projections is per channel), out_proj
    row-parallel (one all-reduce)."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, hidden_size: int, cfg: ShortConv, *, cache_name: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cache_name=cache_name)
        self.cfg = cfg
        channels = Split(cfg.channels, cfg.channels, what=f"{cache_name} ShortConv.channels")
        self.channels = channels.local_size(tp.size)
        self.in_proj = ColumnParallelLinear(hidden_size, 3 * cfg.channels, bias=cfg.bias, tp=tp,
                                            sections=(channels, channels, channels))          # B C x
        # HF stores the depthwise conv as (channels, 1, kernel); we keep that layout for loading.
        self.conv = nn.Conv1d(self.channels, self.channels, cfg.conv_kernel, groups=self.channels, bias=cfg.bias)
        self.out_proj = RowParallelLinear(cfg.channels, hidden_size, bias=cfg.bias, tp=tp, sections=(channels,))
        self.tp_shards = dict.fromkeys(("conv.weight", "conv.bias"), Shard(0, (channels,)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        B, C, xs = self.in_proj(x).split(self.channels, dim=-1)            # (num_tokens, channels) each
        bx = B * xs
        y = metadata_op(self._conv, bx, shape=tuple(bx.shape), dtype=bx.dtype)
        return self.out_proj(C * y)                                         # (num_tokens, hidden_size)

    def _conv(self, bx: torch.Tensor) -> torch.Tensor:
        """The step's part of the forward (``metadata_op``): the causal conv over each request's conv state, the
        decodes as one-step updates. bx: (n, channels) -> (n, channels)."""
        meta, be, conv_states = self.step_inputs()
        weight, bias = self.conv.weight.squeeze(1), self.conv.bias         # (channels, kernel)
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if nd and nd == meta.num_reqs:          # decodes only (every CUDA-graph step): no copy into y
            return be.causal_conv1d_update(bx, conv_states=conv_states, weight=weight, bias=bias,
                                           state_indices=meta.state_indices, activation=None)
        y = torch.empty_like(bx)
        if nd:
            y[:ndt] = be.causal_conv1d_update(bx[:ndt], conv_states=conv_states, weight=weight, bias=bias,
                                              state_indices=meta.state_indices[:nd], activation=None)
        y[ndt:] = be.causal_conv1d(bx[ndt:], weight, bias, conv_states=conv_states,
                                   query_start_loc=meta.prefill_query_start_loc,
                                   state_indices=meta.state_indices[nd:],
                                   has_initial_state=meta.has_initial_state[nd:], activation=None)
        return y
