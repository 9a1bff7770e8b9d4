"""Reference for a Mamba2 layer's whole decode step between in_proj and out_proj: the conv update (silu),
the SSD state update and the gated RMS norm, composed from their ``*_ref`` twins exactly as the mixer
calls them, so a fused kernel (``backends/triton_mamba_decode.py``) is checked against the three-op path.

Padding rows (``state_indices < 0``, CUDA-graph buckets) are pinned down here because the composed refs
reject negative indices: such a row reads no state and writes none; it computes from zero conv and SSM
states (what the Triton kernels do for an index they never dereference), so its output is finite and
independent of every other row.
"""

from __future__ import annotations

import math

import torch

from hybridkv.layers.ops.conv1d_ref import causal_conv1d_update_ref
from hybridkv.layers.ops.fused_ref import gated_rms_norm_ref
from hybridkv.layers.ops.ssd_ref import ssd_state_update_ref

__all__ = ["mamba2_decode_out_dtype", "mamba2_decode_ref"]


def mamba2_decode_out_dtype(xbc: torch.Tensor, norm_weight: torch.Tensor | None, norm_before_gate: bool
                            ) -> torch.dtype:
    """The dtype ``gated_rms_norm_ref`` returns for y in xbc's dtype: promoted with the weight's only on the
    ``weight * normed`` path (norm after the gate)."""
    if norm_weight is not None and not norm_before_gate:
        return torch.promote_types(xbc.dtype, norm_weight.dtype)
    return xbc.dtype


def mamba2_decode_ref(
    xbc: torch.Tensor,
    z: torch.Tensor,
    dt: torch.Tensor,
    *,
    conv_states: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    A: torch.Tensor,
    state_indices: torch.Tensor,
    n_groups: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """One decode token per row: ``gated_rms_norm(ssd_state_update(split(conv1d_update(xbc))), z)``.

    Shapes: xbc (T, d_inner + 2 * n_groups * dstate), channels x | B | C; z (T, d_inner); dt (T, heads) raw;
    conv_states (slots, conv_dim, width - 1); conv_weight (conv_dim, width); conv_bias (conv_dim,) or None;
    ssm_states (slots, heads, headdim, dstate) fp32; A (heads,); state_indices (T,), distinct where >= 0,
    negative = padding (see the module docstring). ``n_groups`` is both the B/C groups and the norm's groups.
    Both state pools are updated in place. Returns (T, d_inner) in ``mamba2_decode_out_dtype``.
    Value checks read the device (a host sync): an oracle, not a hot path."""
    _, heads, headdim, dstate = ssm_states.shape
    d_inner, gs = heads * headdim, n_groups * dstate

    def step(rows: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        n = rows.numel()
        xbc_d = causal_conv1d_update_ref(xbc[rows], conv_states=conv, weight=conv_weight, bias=conv_bias,
                                         state_indices=idx, activation="silu")        # (n, conv_dim)
        xs, B, C = xbc_d.split([d_inner, gs, gs], dim=-1)
        y = ssd_state_update_ref(ssm, xs.reshape(n, heads, headdim), dt[rows], A,
                                 B.reshape(n, n_groups, dstate), C.reshape(n, n_groups, dstate),
                                 state_indices=idx, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit)                                   # (n, heads, headdim)
        return gated_rms_norm_ref(y.reshape(n, d_inner), z[rows], norm_weight, n_groups=n_groups, eps=norm_eps,
                                  norm_before_gate=norm_before_gate)

    idx = state_indices.to(xbc.device)
    real, pad = (idx >= 0).nonzero().flatten(), (idx < 0).nonzero().flatten()
    out = torch.empty(xbc.shape[0], d_inner, dtype=mamba2_decode_out_dtype(xbc, norm_weight, norm_before_gate),
                      device=xbc.device)
    if real.numel():
        out[real] = step(real, conv_states, ssm_states, idx[real])
    if pad.numel():
        n = pad.numel()
        zero_conv = conv_states.new_zeros((n, *conv_states.shape[1:]))
        zero_ssm = ssm_states.new_zeros((n, *ssm_states.shape[1:]))
        out[pad] = step(pad, zero_conv, zero_ssm, torch.arange(n, device=ssm_states.device))
    return out
