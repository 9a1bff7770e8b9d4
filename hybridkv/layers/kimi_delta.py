"""Kimi Delta Attention over per-request state slots (HF ``KimiLinearDeltaAttention`` semantics).

q_proj / k_proj / v_proj -> a depthwise causal conv with SiLU over q|k|v (one conv state: the last kernel - 1
inputs, as HF stacks the hub's q_conv1d / k_conv1d / v_conv1d); the per-channel log decay from the low-rank forget
gate (f_a_proj -> f_b_proj, computed in the op from A_log and dt_bias), beta = sigmoid(b_proj); KDA
(``layers/ops/gated_delta_ref.py``: ``kda`` / ``kda_update``, the Triton / fla twins on GPU) with L2-normalised
q/k; then an RMS norm per head gated by sigmoid(g_b_proj(g_a_proj(x))), o_proj.

Decodes (1-token continuations, batched first) take the one-token conv and recurrent updates; everything else the
packed conv and the chunked KDA, each request continuing from its own slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import metadata_op
from hybridkv.layers.kind import DecayMixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.norms import HeadNormWeight
from hybridkv.layers.ops.fused_ref import rms_normalize
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, local_units
from hybridkv.layers.state_slots import StateSlotMixer

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class KimiDeltaAttention(DecayMixerConfig):
    """Kimi Delta Attention (HF ``KimiLinearDeltaAttention``): the delta rule with a per-channel decay.
    ``q_proj`` / ``k_proj`` / ``v_proj`` give ``num_heads`` x ``head_dim`` each (keys and values alike); a depthwise
    causal conv (width ``conv_kernel``, SiLU, no bias) runs over q|k|v; the log decay per head and key channel is
    ``-exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (a low-rank gate), ``beta = sigmoid(b_proj(x))``;
    then KDA (``layers/ops/gated_delta_ref.py``) with L2-normalised q/k; the output is
    ``o_proj(norm(o) * sigmoid(g_b_proj(g_a_proj(x))))``, an RMS norm per head (weight (head_dim,), eps
    ``norm_eps``) gated by a sigmoid.

    State per request: the conv state (3 * num_heads * head_dim, conv_kernel - 1) and the recurrent state
    (num_heads, head_dim, head_dim) in fp32. ``chunk_size``: the chunked prefill's chunk."""

    ops = ("causal_conv1d", "causal_conv1d_update", "kda", "kda_update")

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    chunk_size: int = 64

    def __post_init__(self) -> None:
        check_fields(self)
        positive("KimiDeltaAttention", num_heads=self.num_heads, head_dim=self.head_dim,
                 conv_kernel=self.conv_kernel, norm_eps=self.norm_eps, chunk_size=self.chunk_size)
        if self.conv_kernel < 2:
            raise ValueError(f"KimiDeltaAttention.conv_kernel must be at least 2, got {self.conv_kernel}")

    @property
    def kind(self) -> str:
        return "kda"

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, recurrent state) shapes on one tensor-parallel rank: its heads."""
        heads = local_units(self.num_heads, tensor_parallel_size, "num_heads")
        return (3 * heads * self.head_dim, self.conv_kernel - 1), (heads, self.head_dim, self.head_dim)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.num_heads, tensor_parallel_size, "num_heads")

    def matrix_elements(self, hidden: int, width: int) -> int:      # q/k/v, conv, the low-rank gates, b, o_proj
        d, qkv = self.head_dim, self.qkv_dim
        return hidden * (4 * qkv + 2 * d + self.num_heads) + 3 * qkv * self.conv_kernel + 2 * d * qkv

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> KimiDeltaAttentionLayer:
        return KimiDeltaAttentionLayer(hidden_size, self, cache_name=cache_name, tp=tp)


class KimiDeltaAttentionLayer(StateSlotMixer):
    """Tensor parallel (``tp``): heads split (the ranks must divide ``num_heads``; a clear error otherwise):
    q/k/v_proj, f_b_proj, g_b_proj and b_proj column-parallel by heads, the conv channels (q, k, v sections),
    A_log and dt_bias by heads, o_proj row-parallel (one all-reduce); the low-rank f_a_proj / g_a_proj (hidden ->
    head_dim) are replicated; KDA and the per-head norm are local, and so are the conv and recurrent states.

    Parameter names and shapes are the hub's (``A_log`` (1, 1, heads, 1), ``dt_bias`` (heads * head_dim,)), except
    the three hub convs, stacked as ``conv1d.weight`` (3, heads * head_dim, 1, kernel) (q, k, v)."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, hidden_size: int, cfg: KimiDeltaAttention, *, cache_name: str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cache_name=cache_name)
        self.cfg = cfg
        h, d = cfg.num_heads, cfg.head_dim
        what = f"{cache_name} KimiDeltaAttention.num_heads"
        heads = Split(cfg.qkv_dim, h, what=what)
        self.num_heads = heads.local_size(tp.size) // d
        self.qkv_dim = self.num_heads * d
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, ColumnParallelLinear(hidden_size, cfg.qkv_dim, tp=tp, sections=(heads,)))
        self.conv1d = nn.Module()                      # hub name conv1d.weight; HF's (conv_dim, 1, kernel) stacked
        self.conv1d.weight = nn.Parameter(torch.zeros(3, self.qkv_dim, 1, cfg.conv_kernel))
        self.f_a_proj = nn.Linear(hidden_size, d, bias=False)
        self.f_b_proj = ColumnParallelLinear(d, cfg.qkv_dim, tp=tp, sections=(heads,))
        self.g_a_proj = nn.Linear(hidden_size, d, bias=False)
        self.g_b_proj = ColumnParallelLinear(d, cfg.qkv_dim, tp=tp, sections=(heads,))
        self.b_proj = ColumnParallelLinear(hidden_size, h, tp=tp, sections=(Split(h, h, what=what),))
        self.dt_bias = nn.Parameter(torch.zeros(self.qkv_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))
        self.o_norm = HeadNormWeight(d)
        self.o_proj = RowParallelLinear(cfg.qkv_dim, hidden_size, tp=tp, sections=(heads,))
        self.tp_shards = {"conv1d.weight": Shard(1, (heads,)), "dt_bias": Shard(0, (heads,)),
                          "A_log": Shard(2, (Split(h, h, what=what),))}

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        n, h, d = x.shape[0], self.num_heads, self.cfg.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)       # (n, 3 * qkv_dim)
        g = self.f_b_proj(self.f_a_proj(x)).view(n, h, d)          # raw gate: the op adds dt_bias, applies the decay
        beta = torch.sigmoid(self.b_proj(x))                                               # (n, heads)
        o = metadata_op(self._mix, mixed, g, beta, shape=(n, h, d), dtype=x.dtype)
        return self._output(o, x)

    def _mix(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The step's part of the forward (``metadata_op``): the convs and KDA over each request's state slot, the
        decodes as one-step updates. mixed: (n, 3 * qkv_dim), g: (n, heads, head_dim), beta: (n, heads) ->
        (n, heads, head_dim)."""
        cfg, h, d = self.cfg, self.num_heads, self.cfg.head_dim
        meta, be, conv_states, rec_states = self.step_inputs()
        weight = self.conv1d.weight.view(3 * self.qkv_dim, cfg.conv_kernel)
        rule = dict(scale=None, use_qk_l2norm=True, A_log=self.A_log.view(h), dt_bias=self.dt_bias.view(h, d))
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if nd and nd == meta.num_reqs:          # decodes only (every CUDA-graph step): no copy into o
            mixed = be.causal_conv1d_update(mixed, conv_states=conv_states, weight=weight, bias=None,
                                            state_indices=meta.state_indices, activation="silu")
            return be.kda_update(rec_states, *self._split_qkv(mixed), g, beta, state_indices=meta.state_indices,
                                 **rule)
        o = torch.empty(mixed.shape[0], h, d, dtype=mixed.dtype, device=mixed.device)
        if nd:
            idx = meta.state_indices[:nd]
            m = be.causal_conv1d_update(mixed[:ndt], conv_states=conv_states, weight=weight, bias=None,
                                        state_indices=idx, activation="silu")
            o[:ndt] = be.kda_update(rec_states, *self._split_qkv(m), g[:ndt], beta[:ndt], state_indices=idx, **rule)
        if nd < meta.num_reqs:
            idx, init = meta.state_indices[nd:], meta.has_initial_state[nd:]
            m = be.causal_conv1d(mixed[ndt:], weight, None, conv_states=conv_states,
                                 query_start_loc=meta.prefill_query_start_loc, state_indices=idx,
                                 has_initial_state=init, activation="silu")
            o[ndt:] = be.kda(*self._split_qkv(m), g[ndt:], beta[ndt:], query_start_loc=meta.prefill_query_start_loc,
                             ssm_states=rec_states, state_indices=idx, has_initial_state=init,
                             chunk_size=cfg.chunk_size, **rule)
        return o

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, 3 * qkv_dim) conv output -> q, k, v, each (n, heads, head_dim)."""
        return tuple(t.view(mixed.shape[0], self.num_heads, self.cfg.head_dim) for t in mixed.chunk(3, dim=-1))

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o: (n, heads, head_dim) KDA output -> o_proj(norm(o) * sigmoid(gate)) (n, hidden), each head one norm
        group; weight and gate applied in fp32 before the cast (HF ``KimiLinearRMSNormGated``)."""
        n = o.shape[0]
        gate = self.g_b_proj(self.g_a_proj(x)).view(n, self.num_heads, self.cfg.head_dim)
        y = self.o_norm.weight.float() * rms_normalize(o, self.cfg.norm_eps) * torch.sigmoid(gate.float())
        return self.o_proj(y.to(o.dtype).view(n, self.qkv_dim))

