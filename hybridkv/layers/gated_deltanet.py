"""Gated DeltaNet over per-request state slots (HF ``Qwen3NextGatedDeltaNet`` semantics; Qwen3.5's and
OLMo-Hybrid's variants as options).

Projections: in_proj_qkv -> [q | k | v], in_proj_z, in_proj_b, in_proj_a, each in head order (tensor parallelism
cuts each of q, k, v by key heads), packed into one GEMM (``fuse_projections``). Qwen3-Next's checkpoints store
in_proj_qkvz (per key head [q | k | v | z]) and in_proj_ba (per key head [b | a]); the loader reorders their rows
into these (``qwen3_next_rows``), so a decode step slices one GEMM's output where the grouped layout needed seven
copies per layer (q, k, v, z, b and a out of their groups, then q|k|v joined). OLMo-Hybrid scales beta by 2.
A depthwise causal conv with SiLU runs over q|k|v (conv state = the last kernel - 1 inputs); the gated delta rule
(``layers/ops/gated_delta_ref.py``, the Triton / fla twins on GPU) with L2-normalised q/k, beta = sigmoid(b) and the
decay computed in the op from a, A_log and dt_bias; then an RMS norm per value head gated by silu(z), out_proj.

Decodes (1-token continuations, batched first) take the one-token conv and recurrent updates; everything else the
packed conv and the chunked delta rule, each request continuing from its own slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridkv.backends.registry import KernelBackend
from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import current_ops, metadata_op
from hybridkv.layers.kind import DecayMixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, PackedLinears, RowParallelLinear
from hybridkv.layers.norms import HeadNormWeight
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, local_units
from hybridkv.layers.state_slots import StateSlotMixer

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class GatedDeltaNet(DecayMixerConfig):
    """Gated DeltaNet (HF ``Qwen3NextGatedDeltaNet``): ``in_proj_qkv`` gives q, k (``num_k_heads`` x
    ``head_k_dim``) and v (``num_v_heads`` x ``head_v_dim``) in the conv's channel order, ``in_proj_z`` the output
    gate z, ``in_proj_b`` / ``in_proj_a`` b and a per value head, each in head order (Qwen3.5's and OLMo-Hybrid's
    layout; Qwen3-Next's checkpoints group q|k|v|z and b|a per key head, ``qwen3_next_rows`` reorders them at load).
    A depthwise causal conv (width ``conv_kernel``, SiLU, no bias) runs over q|k|v; then the gated delta rule
    (``layers/ops/gated_delta_ref.py``) with L2-normalised q/k, the log decay ``g = -exp(A_log) * softplus(a +
    dt_bias)`` and ``beta = sigmoid(b)``; the output is ``out_proj(norm(o) * silu(z))``, an RMS norm per value head
    (weight (head_v_dim,), eps ``norm_eps``). ``beta_scale`` multiplies beta (OLMo-Hybrid's
    ``linear_allow_neg_eigval``: 2, so the delta rule's eigenvalues 1 - beta k.k reach [-1, 1]).

    State per request: the conv state (2 * key dim + value dim, conv_kernel - 1) and the recurrent state
    (num_v_heads, head_k_dim, head_v_dim) in fp32. ``chunk_size``: the chunked prefill's chunk."""

    ops = ("causal_conv1d", "causal_conv1d_update", "gated_delta_rule", "gated_delta_rule_update", "gated_rms_norm")

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    beta_scale: float = 1.0

    @classmethod
    def saved_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """Configs saved before the projections had one layout carry ``projections``: "flat" is today's layout;
        "grouped" (Qwen3-Next) saved in_proj_qkvz / in_proj_ba tensors that no longer exist."""
        fields = dict(fields)
        layout = fields.pop("projections", "flat")
        if layout != "flat":
            raise ValueError(f"GatedDeltaNet: this model was saved with projections={layout!r} (in_proj_qkvz / "
                             f"in_proj_ba), which this version no longer has; load the Hugging Face checkpoint "
                             f"instead (its loader reorders those rows) and save it again")
        return fields

    def __post_init__(self) -> None:
        check_fields(self)
        positive("GatedDeltaNet", num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                 head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel,
                 norm_eps=self.norm_eps, chunk_size=self.chunk_size)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"GatedDeltaNet.num_k_heads={self.num_k_heads} must divide "
                             f"num_v_heads={self.num_v_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"GatedDeltaNet.conv_kernel must be at least 2, got {self.conv_kernel}")
        positive("GatedDeltaNet", beta_scale=self.beta_scale)

    @property
    def kind(self) -> str:
        return "gated_deltanet"

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, recurrent state) shapes on one tensor-parallel rank: its key heads and the value heads
        they serve (the ranks must divide the key heads)."""
        k_heads = local_units(self.num_k_heads, tensor_parallel_size, "num_k_heads")
        v_heads = k_heads * (self.num_v_heads // self.num_k_heads)
        conv_dim = 2 * k_heads * self.head_k_dim + v_heads * self.head_v_dim
        return (conv_dim, self.conv_kernel - 1), (v_heads, self.head_k_dim, self.head_v_dim)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.num_k_heads, tensor_parallel_size, "num_k_heads")

    def matrix_elements(self, hidden: int, width: int) -> int:      # qkvz, ba, conv, out_proj
        return (hidden * (2 * self.conv_dim - 2 * self.key_dim + 2 * self.num_v_heads)
                + self.conv_dim * self.conv_kernel + self.value_dim * hidden)

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> GatedDeltaNetLayer:
        return GatedDeltaNetLayer(hidden_size, self, cache_name=cache_name, tp=tp)


class GatedDeltaNetLayer(StateSlotMixer):
    """Tensor parallel (``tp``): key heads split, each rank with the value heads they serve (so the ranks must
    divide ``num_k_heads``; a clear error otherwise): the input projections column-parallel by key head, the
    conv channels (q, k, v sections), A_log and dt_bias by heads, out_proj row-parallel (one all-reduce); the delta
    rule and the per-head norm are local, and so are the conv and recurrent states."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)

    def __init__(self, hidden_size: int, cfg: GatedDeltaNet, *, cache_name: str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cache_name=cache_name)
        self.cfg = cfg
        nk, nv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        what = f"{cache_name} GatedDeltaNet.num_k_heads"
        self.num_k_heads = Split(nk, nk, what=what).local_size(tp.size)
        self.num_v_heads = self.num_k_heads * (nv // nk)      # the value heads its key heads serve
        self.key_dim, self.value_dim = self.num_k_heads * dk, self.num_v_heads * dv
        keys, values = Split(cfg.key_dim, nk, what=what), Split(cfg.value_dim, nk, what=what)
        heads = Split(nv, nk, what=what)
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, cfg.conv_dim, bias=False, tp=tp,
                                                sections=(keys, keys, values))
        self.in_proj_z = ColumnParallelLinear(hidden_size, cfg.value_dim, bias=False, tp=tp, sections=(values,))
        self.in_proj_b = ColumnParallelLinear(hidden_size, nv, bias=False, tp=tp, sections=(heads,))
        self.in_proj_a = ColumnParallelLinear(hidden_size, nv, bias=False, tp=tp, sections=(heads,))
        conv_dim = 2 * self.key_dim + self.value_dim
        # HF stores the depthwise conv as (conv_dim, 1, kernel); we keep that layout for loading.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_v_heads + 1, dtype=torch.float32)))
        self.norm = HeadNormWeight(dv)
        self.out_proj = RowParallelLinear(cfg.value_dim, hidden_size, bias=False, tp=tp, sections=(values,))
        self.tp_shards = {"conv1d.weight": Shard(0, (keys, keys, values)),
                          **dict.fromkeys(("dt_bias", "A_log"), Shard(0, (heads,)))}
        self.packed: PackedLinears | None = None         # the input projections as one GEMM (``fuse_projections``)

    def _in_projs(self) -> tuple[nn.Linear, ...]:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def fuse_projections(self) -> None:
        """Pack the input projections (qkv|z|b|a) into one weight whose rows the parameters view: one GEMM (one
        weight-streaming launch at decode) instead of four."""
        if self.packed is not None and self.packed.valid():
            return
        if PackedLinears.can_pack(*self._in_projs()):
            self.packed = PackedLinears(*self._in_projs())

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        cfg = self.cfg
        mixed, z, b, a = self._project(x)
        o = metadata_op(self._mix, mixed, a, b, shape=(x.shape[0], self.num_v_heads, cfg.head_v_dim), dtype=x.dtype)
        return self._output(o, z, current_ops())

    def _mix(self, mixed: torch.Tensor, a: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The step's part of the forward (``metadata_op``): the conv and the gated delta rule over each request's
        state slot, the decodes as one-step updates. mixed: (n, conv_dim), a and beta: (n, v heads) ->
        (n, v heads, head_v_dim); beta holds logits (the ops take its sigmoid, times ``beta_scale``)."""
        cfg = self.cfg
        meta, be, conv_states, rec_states = self.step_inputs()
        weight = self.conv1d.weight.squeeze(1)                              # (conv_dim, kernel)
        rule = dict(scale=None, use_qk_l2norm=True, A_log=self.A_log, dt_bias=self.dt_bias,
                    beta_scale=cfg.beta_scale)
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if nd and nd == meta.num_reqs:          # decodes only (every CUDA-graph step): no copy into o
            mixed = be.causal_conv1d_update(mixed, conv_states=conv_states, weight=weight, bias=None,
                                            state_indices=meta.state_indices, activation="silu")
            return be.gated_delta_rule_update(rec_states, *self._split_qkv(mixed), a, beta,
                                              state_indices=meta.state_indices, **rule)
        o = torch.empty(mixed.shape[0], self.num_v_heads, cfg.head_v_dim, dtype=mixed.dtype, device=mixed.device)
        if nd:
            idx = meta.state_indices[:nd]
            m = be.causal_conv1d_update(mixed[:ndt], conv_states=conv_states, weight=weight, bias=None,
                                        state_indices=idx, activation="silu")
            o[:ndt] = be.gated_delta_rule_update(rec_states, *self._split_qkv(m), a[:ndt], beta[:ndt],
                                                 state_indices=idx, **rule)
        if nd < meta.num_reqs:
            idx, init = meta.state_indices[nd:], meta.has_initial_state[nd:]
            m = be.causal_conv1d(mixed[ndt:], weight, None, conv_states=conv_states,
                                 query_start_loc=meta.prefill_query_start_loc, state_indices=idx,
                                 has_initial_state=init, activation="silu")
            o[ndt:] = be.gated_delta_rule(*self._split_qkv(m), a[ndt:], beta[ndt:],
                                          query_start_loc=meta.prefill_query_start_loc, ssm_states=rec_states,
                                          state_indices=idx, has_initial_state=init, chunk_size=cfg.chunk_size,
                                          **rule)
        return o

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (n, hidden) -> the conv input q|k|v (n, conv_dim), the gate z (n, value_dim), b (beta's logits) and a
        (n, v heads); value head j serves key head j // (v heads / k heads). Packed, they are column views of one
        GEMM's rows: contiguous at decode (n = 1)."""
        packed = self.packed is not None and self.packed.valid()
        qkv, z, b, a = self.packed(x) if packed else [p(x) for p in self._in_projs()]
        return qkv.contiguous(), z, b, a.contiguous()

    def _split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, conv_dim) conv output -> q, k (n, k heads, head_k_dim), v (n, v heads, head_v_dim)."""
        n, cfg = mixed.shape[0], self.cfg
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(n, self.num_k_heads, cfg.head_k_dim), k.reshape(n, self.num_k_heads, cfg.head_k_dim),
                v.reshape(n, self.num_v_heads, cfg.head_v_dim))

    def _output(self, o: torch.Tensor, z: torch.Tensor, be: KernelBackend) -> torch.Tensor:
        """o: (n, v heads, head_v_dim) delta-rule output, z: (n, v heads * head_v_dim) the gate ->
        out_proj(norm(o) * silu(z)) (n, hidden). Each value head is one norm group: rows of head_v_dim."""
        n, dv = o.shape[0], self.cfg.head_v_dim
        y = be.gated_rms_norm(o.reshape(n * self.num_v_heads, dv), z.reshape(n * self.num_v_heads, dv),
                              self.norm.weight, n_groups=1, eps=self.cfg.norm_eps, norm_before_gate=True)
        return self.out_proj(y.view(n, self.value_dim))


def qwen3_next_rows(weight: torch.Tensor, part: str, cfg: GatedDeltaNet) -> torch.Tensor:
    """Rows of a Qwen3-Next checkpoint's fused projection in this layer's layout: ``in_proj_qkvz`` (per key head
    [q | k | v | z], (num_k_heads * (2 * head_k_dim + 2 * rep * head_v_dim), hidden)) -> ``part`` "qkv" (every q
    head, then every k head, then every v head) or "z"; ``in_proj_ba`` (per key head [b | a], (2 * num_v_heads,
    hidden)) -> "b" or "a"."""
    nk, dk, dv, rep = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads
    hidden = weight.shape[-1]
    if part in ("b", "a"):
        b, a = weight.view(nk, 2 * rep, hidden).split([rep, rep], dim=1)
        return (b if part == "b" else a).reshape(nk * rep, hidden)
    if part not in ("qkv", "z"):
        raise ValueError(f"qwen3_next_rows: part must be one of qkv, z, b, a; got {part!r}")
    q, k, v, z = weight.view(nk, 2 * dk + 2 * rep * dv, hidden).split([dk, dk, rep * dv, rep * dv], dim=1)
    if part == "z":
        return z.reshape(nk * rep * dv, hidden)
    return torch.cat([q.reshape(nk * dk, hidden), k.reshape(nk * dk, hidden), v.reshape(nk * rep * dv, hidden)])
