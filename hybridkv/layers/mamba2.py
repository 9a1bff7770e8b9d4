"""Mamba2 mixer over per-request state slots (HF ``Mamba2Mixer`` semantics; docs/design.md, "Mamba2").

in_proj -> [z | xBC | dt]; causal depthwise conv over xBC (conv state = last kernel-1 inputs);
SSD scan over x with B, C, dt (SSM state fp32); y = gated group RMSNorm(y, z) (or, without the norm,
y * silu(z)); out_proj. Decodes (1-token continuations, batched first) take the one-step update ops;
everything else the packed chunked scan with per-request initial states (inside the mixed-step graphs, every
request: ``engine/mixed_metadata.py``).

Falcon-H1's µP factors are config data: the input, each in_proj section (z, x, B, C, dt) and the output
are scaled by fixed multipliers (HF's non-persistent ``mup_vector``, rebuilt here from the config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridkv.backends.registry import KernelBackend
from hybridkv.config_base import check_fields, positive
from hybridkv.forward_context import current_ops, metadata_op
from hybridkv.layers.kind import DecayMixerConfig, register_mixer
from hybridkv.layers.linear import ColumnParallelLinear, RowParallelLinear
from hybridkv.layers.norms import GatedGroupRMSNorm
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, local_units
from hybridkv.layers.state_slots import StateSlotMixer

if TYPE_CHECKING:
    from hybridkv.models.config import HybridConfig


@register_mixer
@dataclass(frozen=True, kw_only=True)
class Mamba2(DecayMixerConfig):
    """Mamba2 mixer (HF semantics, docs/design.md "Semantics"). State per request: conv (conv_dim, conv_kernel - 1)
    and SSM (num_heads, head_dim, state_size) in fp32.

    The output is gated by an RMSNorm over ``n_groups`` groups of the inner dim, ``norm(y * silu(z))``
    (``norm_before_gate``: ``norm(y) * silu(z)``); with ``gated_norm=False`` it is plain ``y * silu(z)``
    (Falcon-H1 without mamba_rms_norm). ``proj_bias`` is the in_proj bias and, unless ``out_proj_bias``
    says otherwise, the out_proj bias. Falcon-H1 µP: the input is scaled by ``input_multiplier``, the
    in_proj output's z, x, B, C, dt sections by ``zxbcdt_multipliers``, the output by
    ``output_multiplier``."""

    ops = ("causal_conv1d", "causal_conv1d_update", "ssd_chunk_scan", "ssd_state_update", "gated_rms_norm")

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    out_proj_bias: bool | None = None
    norm_eps: float = 1e-5
    gated_norm: bool = True
    norm_before_gate: bool = False
    input_multiplier: float = 1.0
    zxbcdt_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    output_multiplier: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self)
        positive("Mamba2", num_heads=self.num_heads, head_dim=self.head_dim, state_size=self.state_size,
                 n_groups=self.n_groups, conv_kernel=self.conv_kernel, chunk_size=self.chunk_size)
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2.n_groups={self.n_groups} must divide num_heads={self.num_heads}")
        low, high = self.time_step_limit
        if not 0 <= low <= high:
            raise ValueError(f"Mamba2.time_step_limit must be (low, high) with 0 <= low <= high, "
                             f"got {self.time_step_limit!r}")
        positive("Mamba2", norm_eps=self.norm_eps)

    @property
    def kind(self) -> str:
        return "mamba2"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """(conv state, SSM state) shapes on one tensor-parallel rank: its heads, and its groups (split, or
        the one group its heads read when n_groups < tensor_parallel_size)."""
        tp = tensor_parallel_size
        heads = local_units(self.num_heads, tp, "num_heads")
        groups = local_units(self.n_groups, tp, "n_groups", replicate=True)
        conv_dim = heads * self.head_dim + 2 * groups * self.state_size
        return (conv_dim, self.conv_kernel - 1), (heads, self.head_dim, self.state_size)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        local_units(self.num_heads, tensor_parallel_size, "num_heads")
        local_units(self.n_groups, tensor_parallel_size, "n_groups", replicate=True)

    def matrix_elements(self, hidden: int, width: int) -> int:
        inner = self.intermediate_size
        in_proj = hidden * (2 * inner + 2 * self.n_groups * self.state_size + self.num_heads)
        return in_proj + self.conv_dim * self.conv_kernel + inner * hidden

    def build(self, hidden_size: int, *, cache_name: str, tp: TensorParallel,
              model_config: HybridConfig) -> Mamba2Layer:
        return Mamba2Layer(hidden_size, self, cache_name=cache_name, tp=tp)


class Mamba2Layer(StateSlotMixer):
    """Tensor parallel (``tp``): heads split, with their z/x channels, dt, A, D, dt bias and gated-norm
    channels; B/C groups split when n_groups divides by the ranks, else each rank keeps the one group its
    heads read (replicated); the conv channels follow x, B, C. in_proj is column-parallel section by section,
    out_proj row-parallel; the scans are local, the conv and SSM states per rank hold only its heads."""

    graph_breaks = True     # reads the step's inputs only inside ``metadata_op`` (``engine/mixed_graphs.py``)
    static_slots = True     # ... and that op, given every request as a scan, reads device inputs only: the mixed
    #                         graphs capture it (``engine/mixed_metadata.py``)

    def __init__(self, hidden_size: int, cfg: Mamba2, *, cache_name: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cache_name=cache_name)
        self.cfg = cfg
        h, p, gs = cfg.num_heads, cfg.head_dim, cfg.n_groups * cfg.state_size
        heads = Split(h * p, h, what=f"{cache_name} Mamba2.num_heads")
        groups = Split(gs, cfg.n_groups, replicate=True, what=f"{cache_name} Mamba2.n_groups")
        per_head = Split(h, h, what=f"{cache_name} Mamba2.num_heads")
        self.num_heads = per_head.local_size(tp.size)
        self.n_groups = groups.local_size(tp.size) // cfg.state_size
        self.intermediate_size = self.num_heads * p
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * cfg.state_size
        self.in_proj = ColumnParallelLinear(hidden_size, cfg.intermediate_size + cfg.conv_dim + h,
                                            bias=cfg.proj_bias, tp=tp,
                                            sections=(heads, heads, groups, groups, per_head))   # z x B C dt
        # HF stores the depthwise conv as (conv_dim, 1, kernel); we keep that layout for loading.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = (GatedGroupRMSNorm(cfg.intermediate_size, n_groups=cfg.n_groups, eps=cfg.norm_eps,
                                       norm_before_gate=cfg.norm_before_gate, tp=tp) if cfg.gated_norm else None)
        out_bias = cfg.proj_bias if cfg.out_proj_bias is None else cfg.out_proj_bias
        self.out_proj = RowParallelLinear(cfg.intermediate_size, hidden_size, bias=out_bias, tp=tp,
                                          sections=(heads,))
        conv = Shard(0, (heads, groups, groups))
        self.tp_shards = {"conv1d.weight": conv, "conv1d.bias": conv, **dict.fromkeys(
            ("dt_bias", "A_log", "D"), Shard(0, (per_head,)))}
        mup = None                  # (in_proj out,) per-section multipliers, rebuilt from the config
        if any(m != 1.0 for m in cfg.zxbcdt_multipliers):
            local_gs = self.n_groups * cfg.state_size
            sizes = (self.intermediate_size, self.intermediate_size, local_gs, local_gs, self.num_heads)
            mup = torch.cat([torch.full((n,), float(m))
                             for n, m in zip(sizes, cfg.zxbcdt_multipliers, strict=True)])
        self.register_buffer("mup_vector", mup, persistent=False)
        self._A_cache: tuple[tuple[int, int | None], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size)
        cfg = self.cfg
        if cfg.input_multiplier != 1.0:
            x = x * cfg.input_multiplier
        projected = self.in_proj(x)
        if self.mup_vector is not None:
            projected = projected * self.mup_vector
        z, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        y = metadata_op(self._mix, xbc, dt, shape=(x.shape[0], self.num_heads, cfg.head_dim), dtype=x.dtype,
                        key=self.cache_name)
        return self._output(y, z, current_ops())

    def _mix(self, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """The step's part of the forward (``metadata_op``): conv and SSM over each request's state slot, the
        decodes as one-step updates. xbc: (n, conv_dim), dt: (n, heads) -> y (n, heads, head_dim)."""
        cfg = self.cfg
        meta, be, conv_states, ssm_states = self.step_inputs()
        weight = self.conv1d.weight.squeeze(1)                              # (conv_dim, kernel)
        A = self._A()
        ssm_kw = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=cfg.time_step_limit)
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if nd and nd == meta.num_reqs:          # decodes only (every CUDA-graph step): no copy into y
            xbc_d = be.causal_conv1d_update(xbc, conv_states=conv_states, weight=weight, bias=self.conv1d.bias,
                                            state_indices=meta.state_indices, activation="silu")
            xs, B, C = self._split_xbc(xbc_d)
            return be.ssd_state_update(ssm_states, xs, dt, A, B, C, state_indices=meta.state_indices, **ssm_kw)
        y = torch.empty(xbc.shape[0], self.num_heads, cfg.head_dim, dtype=xbc.dtype, device=xbc.device)
        if nd:
            dec_idx = meta.state_indices[:nd]
            xbc_d = be.causal_conv1d_update(xbc[:ndt], conv_states=conv_states, weight=weight,
                                            bias=self.conv1d.bias, state_indices=dec_idx, activation="silu")
            xs, B, C = self._split_xbc(xbc_d)
            y[:ndt] = be.ssd_state_update(ssm_states, xs, dt[:ndt], A, B, C, state_indices=dec_idx, **ssm_kw)
        if nd < meta.num_reqs:
            idx, init = meta.state_indices[nd:], meta.has_initial_state[nd:]
            xbc_p = be.causal_conv1d(xbc[ndt:], weight, self.conv1d.bias, conv_states=conv_states,
                                     query_start_loc=meta.prefill_query_start_loc, state_indices=idx,
                                     has_initial_state=init, activation="silu")
            xs, B, C = self._split_xbc(xbc_p)
            y[ndt:] = be.ssd_chunk_scan(xs, dt[ndt:], A, B, C, chunk_size=cfg.chunk_size,
                                        query_start_loc=meta.prefill_query_start_loc, ssm_states=ssm_states,
                                        state_indices=idx, has_initial_state=init, **ssm_kw)
        return y

    def _output(self, y: torch.Tensor, z: torch.Tensor, be: KernelBackend) -> torch.Tensor:
        """y: (num_tokens, heads, head_dim) scan output, z: the gate -> out_proj(gated norm) (num_tokens, hidden)."""
        y = y.reshape(y.shape[0], self.intermediate_size)
        norm = self.norm
        if norm is not None and norm.spans_ranks:     # its group's sum of squares is all-reduced
            y = norm(y, z)
        else:
            y = be.gated_rms_norm(y, z, norm.weight if norm is not None else None,
                                  n_groups=norm.n_groups if norm is not None else 1,
                                  eps=norm.eps if norm is not None else 0.0,
                                  norm_before_gate=norm is not None and norm.norm_before_gate)
        out = self.out_proj(y)                                              # (num_tokens, hidden_size)
        return out * self.cfg.output_multiplier if self.cfg.output_multiplier != 1.0 else out

    def _A(self) -> torch.Tensor:
        """-exp(A_log) in fp32 (heads,), computed once per storage and version of ``A_log`` (an in-place weight
        load bumps the version; an inference tensor has none, so only a new storage refreshes it)."""
        a_log = self.A_log
        key = (a_log.data_ptr(), None if a_log.is_inference() else a_log._version)
        if self._A_cache is None or self._A_cache[0] != key:
            with torch.no_grad():
                self._A_cache = (key, -torch.exp(self.A_log.float()))
        return self._A_cache[1]

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, n = self.cfg, xbc.shape[0]
        gs = self.n_groups * cfg.state_size
        xs, B, C = xbc.split([self.intermediate_size, gs, gs], dim=-1)
        return (xs.reshape(n, self.num_heads, cfg.head_dim), B.reshape(n, self.n_groups, cfg.state_size),
                C.reshape(n, self.n_groups, cfg.state_size))
