"""Reference Mamba-1 selective scan (Jamba's SSM) over packed requests with per-request state slots.

The oracle for mamba-ssm's ``selective_scan_fn`` / ``selective_state_update`` as used by Jamba-style
Mamba-1 layers, extended to packed variable-length batches in which each request continues from its
own state slot (HF's multi-token path always starts from zero).

Semantics (HF ``JambaMambaMixer.slow_forward`` / mamba-ssm ``selective_scan_ref``), per channel d:
    delta = softplus(delta_raw + delta_bias)              (no clamp, unlike Mamba2's dt_limit)
    state = exp(delta * A[d]) * state + delta * u * B     state: (dstate,), A[d]: (dstate,)
    y = state · C + D[d] * u;  optionally y *= silu(z)
Mamba-1 decays differ per (channel, state) entry, so there is no matmul (SSD) form: the reference is a
plain recurrence over positions, vectorised over requests and channels. All math in fp32; y in u's
dtype. Packed-batch conventions (query_start_loc, state_indices, has_initial_state) are those of
``conv1d_ref``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.layers.ops.conv1d_ref import _check_shape, _check_state_indices, _packed_layout
from hybridkv.layers.ops.registry import reference_op

__all__ = ["selective_scan_ref", "selective_state_update_mamba1_ref"]


def _discretize_delta(
    delta: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool
) -> torch.Tensor:
    delta = delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()
    return F.softplus(delta) if delta_softplus else delta


def _check_mamba1_params(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
    u_name: str,
    delta_name: str,
) -> None:
    _check_shape(u_name, u, (None, None))
    n, dim = u.shape
    _check_shape(delta_name, delta, (n, dim))
    _check_shape("A", A, (dim, None))
    dstate = A.shape[1]
    _check_shape("B", B, (n, dstate))
    _check_shape("C", C, (n, dstate))
    if D is not None:
        _check_shape("D", D, (dim,))
    if z is not None:
        _check_shape("z", z, (n, dim))
    if delta_bias is not None:
        _check_shape(f"{delta_name}_bias", delta_bias, (dim,))
    _check_shape("ssm_states", ssm_states, (None, dim, dstate))


def _skip_and_gate(
    y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    if D is not None:
        y = y + D.float() * u.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


@reference_op("selective_scan")
def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
) -> torch.Tensor:
    """Mamba-1 selective scan of packed requests, continuing from and updating their state slots.

    Shapes: u, delta (num_tokens, dim) (delta raw); A (dim, dstate) negative; B, C (num_tokens, dstate);
    D (dim,) or None; z (num_tokens, dim) or None; delta_bias (dim,) or None;
    ssm_states (num_slots, dim, dstate) fp32, read where has_initial_state and overwritten at
    state_indices with each request's final state. Returns y (num_tokens, dim) in u's dtype.

    Why: pins down Jamba's SSM with per-request initial states in a packed batch, the case neither
    HF nor upstream ``selective_scan_fn`` covers.
    """
    _check_mamba1_params(u, delta, A, B, C, D, z, delta_bias, ssm_states, "u", "delta")
    num_tokens, dim = u.shape
    device = u.device
    qsl, seq_lens, _, _ = _packed_layout(
        num_tokens, query_start_loc, state_indices, has_initial_state, ssm_states.shape[0], device
    )
    num_reqs = seq_lens.numel()
    slots = state_indices.to(device=ssm_states.device, dtype=torch.long)
    has_init = has_initial_state.to(device)

    delta = _discretize_delta(delta, delta_bias, delta_softplus)  # (num_tokens, dim)
    dA = torch.exp(delta[:, :, None] * A.float())  # (num_tokens, dim, dstate)
    dBu = (delta * u.float())[:, :, None] * B.float()[:, None, :]  # (num_tokens, dim, dstate)
    Cf = C.float()  # (num_tokens, dstate)

    init = ssm_states[slots].to(device=device, dtype=torch.float32)  # (num_reqs, dim, dstate)
    state = torch.where(has_init.view(-1, 1, 1), init, torch.zeros_like(init))
    y = u.new_zeros((num_tokens, dim), dtype=torch.float32)
    max_len = int(seq_lens.max()) if num_reqs else 0
    for i in range(max_len):  # position i of every request that is that long, all at once
        reqs = torch.nonzero(seq_lens > i).squeeze(1)
        t = qsl[reqs] + i  # token index of position i in each of those requests
        state[reqs] = dA[t] * state[reqs] + dBu[t]
        y[t] = torch.einsum("rdn,rn->rd", state[reqs], Cf[t])
    ssm_states[slots] = state.to(ssm_states)
    return _skip_and_gate(y, u, D, z).to(u.dtype)


@reference_op("selective_state_update")
def selective_state_update_mamba1_ref(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
) -> torch.Tensor:
    """One Mamba-1 decode step for a batch of requests, each continuing from its slot.

    Shapes: ssm_states (num_slots, dim, dstate) fp32, updated in place at state_indices (batch,),
    distinct; x, dt (batch, dim) (dt raw); A (dim, dstate); B, C (batch, dstate); D (dim,), z (batch, dim),
    dt_bias (dim,) or None. Returns y (batch, dim) in x's dtype.

    Why: mirrors mamba-ssm ``selective_state_update(..., state_batch_indices=...)`` without heads; equals
    ``selective_scan_ref`` on one-token requests that all have an initial state.
    """
    _check_mamba1_params(x, dt, A, B, C, D, z, dt_bias, ssm_states, "x", "dt")
    batch = x.shape[0]
    _check_state_indices(state_indices, batch, ssm_states.shape[0])
    slots = state_indices.to(device=ssm_states.device, dtype=torch.long)

    dt = _discretize_delta(dt, dt_bias, dt_softplus)  # (batch, dim)
    state = ssm_states[slots].to(device=x.device, dtype=torch.float32)  # (batch, dim, dstate)
    state = (
        torch.exp(dt[:, :, None] * A.float()) * state + (dt * x.float())[:, :, None] * B.float()[:, None, :]
    )
    ssm_states[slots] = state.to(ssm_states)
    y = torch.einsum("bdn,bn->bd", state, C.float())  # (batch, dim)
    return _skip_and_gate(y, x, D, z).to(x.dtype)
