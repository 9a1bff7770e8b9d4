"""Reference Mamba2 SSD (state-space duality) scan over packed requests with per-request state slots.

The oracle for the SSM half of a Mamba2 layer: a fast kernel (mamba-ssm's ``mamba_chunk_scan_combined``
/ ``selective_state_update``, or our own Triton) must reproduce these outputs and final states.
Upstream ``mamba_chunk_scan_combined`` takes one initial state per batch row, so with packed sequences
every request after the first starts from zero; here every request continues from its own slot.

Semantics (HF ``Mamba2Mixer``; docs/design.md, "Mamba2"), per head h and token t:
    dt = clamp(softplus(dt_raw + dt_bias), *dt_limit);  dA = exp(dt * A[h])
    state = dA * state + dt * (x ⊗ B)       state: (headdim, dstate), B from head h's group
    y = state @ C + D[h] * x;  optionally y *= silu(z)
All math in fp32; y is returned in x's dtype; the state pool is expected in fp32. Packed-batch
conventions (query_start_loc, state_indices, has_initial_state) are those of ``conv1d_ref``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridkv.layers.ops.conv1d_ref import _check_shape, _check_state_indices, _packed_layout
from hybridkv.layers.ops.registry import reference_op

__all__ = ["ssd_chunk_scan_ref", "ssd_state_update_ref"]


def _discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """fp32 dt after bias, softplus, then clamp to dt_limit (HF's order; the clamp is always applied)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _check_ssd_params(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_states: torch.Tensor,
) -> int:
    """Validate shapes shared by the scan and the decode step; return heads per group."""
    _check_shape("x", x, (None, None, None))
    n, nheads, headdim = x.shape
    _check_shape("dt", dt, (n, nheads))
    _check_shape("A", A, (nheads,))
    _check_shape("ssm_states", ssm_states, (None, nheads, headdim, None))
    dstate = ssm_states.shape[-1]
    _check_shape("B", B, (n, None, dstate))
    ngroups = B.shape[1]
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(f"B has {ngroups} groups, which must divide nheads={nheads}")
    _check_shape("C", C, (n, ngroups, dstate))
    if D is not None and D.shape != (nheads,):
        _check_shape("D", D, (nheads, headdim))
    if z is not None:
        _check_shape("z", z, (n, nheads, headdim))
    if dt_bias is not None:
        _check_shape("dt_bias", dt_bias, (nheads,))
    return nheads // ngroups


def _skip_and_gate(
    y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """y + D * x, then * silu(z); all fp32. D is (nheads,) or (nheads, headdim)."""
    if D is not None:
        d = D.float()
        y = y + (d[:, None] if d.dim() == 1 else d) * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf above the diagonal.

    Summed directly (masked cumsum), not as cumsum[i] - cumsum[j], to avoid cancellation.
    """
    length = a.shape[-1]
    strictly_lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    terms = a[..., :, None].expand(*a.shape, length).masked_fill(~strictly_lower, 0.0)  # [i, j] = a[i], i > j
    out = terms.cumsum(dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return out.masked_fill(~lower, -math.inf)


@reference_op("ssd_chunk_scan")
def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """Mamba2 SSD scan of packed requests in chunked matmul form, continuing from and updating slots.

    Shapes: x (num_tokens, nheads, headdim); dt (num_tokens, nheads) raw; A (nheads,) negative;
    B, C (num_tokens, ngroups, dstate); D (nheads,) or (nheads, headdim) or None; z like x or None;
    dt_bias (nheads,) or None; ssm_states (num_slots, nheads, headdim, dstate) fp32, read where
    has_initial_state and overwritten at state_indices with each request's final state.
    Returns y (num_tokens, nheads, headdim) in x's dtype.

    Why the chunked form: it is the algorithm the fast kernels implement (intra-chunk quadratic part
    with a decay mask + inter-chunk state passing), so it pins down chunking as well as the math: chunks
    are aligned to each request's first token, and a request's tail chunk is padded with dt = 0 (decay 1,
    no input), which leaves the state exact. It equals the per-token recurrence to fp32 rounding.
    """
    heads_per_group = _check_ssd_params(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_tokens, nheads, headdim = x.shape
    device = x.device
    qsl, seq_lens, token_req, token_pos = _packed_layout(
        num_tokens, query_start_loc, state_indices, has_initial_state, ssm_states.shape[0], device
    )
    num_reqs = seq_lens.numel()
    slots = state_indices.to(device=ssm_states.device, dtype=torch.long)
    has_init = has_initial_state.to(device)

    # 1. Discretise in fp32 and give each head its group's B and C.
    dt = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # (num_tokens, nheads)
    xf = x.float()  # (num_tokens, nheads, headdim)
    Bh = B.float().repeat_interleave(heads_per_group, dim=1)  # (num_tokens, nheads, dstate)
    Ch = C.float().repeat_interleave(heads_per_group, dim=1)  # (num_tokens, nheads, dstate)

    # 2. Lay tokens out in chunks aligned per request; padding rows stay zero (dt = 0: decay 1, no input).
    chunks_per_req = (seq_lens + chunk_size - 1) // chunk_size  # (num_reqs,)
    first_chunk = torch.cumsum(chunks_per_req, 0) - chunks_per_req  # (num_reqs,)
    num_chunks = int(chunks_per_req.sum())
    row = (first_chunk[token_req] + token_pos // chunk_size) * chunk_size + token_pos % chunk_size

    def to_chunks(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((num_chunks * chunk_size, *t.shape[1:]))
        out[row] = t
        return out.view(num_chunks, chunk_size, *t.shape[1:])

    dtx = to_chunks(dt[..., None] * xf)  # (num_chunks, L, nheads, headdim)
    Bc, Cc = to_chunks(Bh), to_chunks(Ch)  # (num_chunks, L, nheads, dstate)
    log_dA = to_chunks(dt * A.float()).transpose(1, 2)  # (num_chunks, nheads, L)
    log_dA_cum = log_dA.cumsum(-1)  # (num_chunks, nheads, L): log decay from chunk start through l

    # 3. Intra-chunk (diagonal blocks):
    #    y[l] += sum_{s <= l} (C[l]·B[s]) * exp(sum_{s<k<=l} log_dA[k]) * dt[s] x[s]
    decay = torch.exp(_segsum(log_dA))  # (num_chunks, nheads, L, L)
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay
    y_diag = torch.einsum("chls,cshp->clhp", scores, dtx)  # (num_chunks, L, nheads, headdim)

    # 4. Each chunk's own contribution to the state at its end (decay from s to the chunk end).
    # log_decay_to_end[s] = sum_{k>s} log_dA[k]: a shifted reverse cumsum (no cancelling subtraction).
    log_decay_from = torch.flip(torch.cumsum(torch.flip(log_dA, [-1]), -1), [-1])  # sum_{k>=s}
    log_decay_to_end = F.pad(log_decay_from[..., 1:], (0, 1))  # (num_chunks, nheads, L)
    chunk_states = torch.einsum("cshn,chs,cshp->chpn", Bc, torch.exp(log_decay_to_end), dtx)
    chunk_decay = torch.exp(log_dA_cum[..., -1])  # (num_chunks, nheads)

    # 5. Inter-chunk state passing: sequential over a request's chunks, parallel over requests.
    init = ssm_states[slots].to(device=device, dtype=torch.float32)  # (num_reqs, nheads, headdim, dstate)
    state = torch.where(has_init.view(-1, 1, 1, 1), init, torch.zeros_like(init))
    start_states = torch.zeros_like(chunk_states)  # (num_chunks, nheads, headdim, dstate)
    max_chunks = int(chunks_per_req.max()) if num_reqs else 0
    for c in range(max_chunks):
        reqs = torch.nonzero(chunks_per_req > c).squeeze(1)
        ids = first_chunk[reqs] + c
        start_states[ids] = state[reqs]
        state[reqs] = chunk_decay[ids][:, :, None, None] * state[reqs] + chunk_states[ids]
    ssm_states[slots] = state.to(ssm_states)

    # 6. Inter-chunk (off-diagonal blocks): the chunk's start state, decayed to position l, read by C[l].
    decay_from_start = torch.exp(log_dA_cum).transpose(1, 2)[..., None]  # (num_chunks, L, nheads, 1)
    y_off = torch.einsum("clhn,chpn->clhp", Cc, start_states) * decay_from_start

    y = (y_diag + y_off).reshape(num_chunks * chunk_size, nheads, headdim)[row]
    # y: (num_tokens, nheads, headdim)
    return _skip_and_gate(y, x, D, z).to(x.dtype)


@reference_op("ssd_state_update")
def ssd_state_update_ref(
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
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """One Mamba2 decode step for a batch of requests, each continuing from its slot.

    Shapes: ssm_states (num_slots, nheads, headdim, dstate) fp32, updated in place at state_indices
    (batch,), distinct; x (batch, nheads, headdim); dt (batch, nheads) raw; A (nheads,);
    B, C (batch, ngroups, dstate); D, z, dt_bias as in ``ssd_chunk_scan_ref``. Returns y like x.

    Why: mirrors mamba-ssm ``selective_state_update(..., state_batch_indices=...)`` with the head-tied
    A/dt/D that Mamba2 uses. Unlike mamba-ssm and HF's decode path, dt_limit is applied here too, so a
    decode step equals ``ssd_chunk_scan_ref`` on a one-token request (a no-op for the default limit).
    """
    heads_per_group = _check_ssd_params(x, dt, A, B, C, D, z, dt_bias, ssm_states)
    batch = x.shape[0]
    _check_state_indices(state_indices, batch, ssm_states.shape[0])
    slots = state_indices.to(device=ssm_states.device, dtype=torch.long)

    dt = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # (batch, nheads)
    Bh = B.float().repeat_interleave(heads_per_group, dim=1)  # (batch, nheads, dstate)
    Ch = C.float().repeat_interleave(heads_per_group, dim=1)  # (batch, nheads, dstate)
    dA = torch.exp(dt * A.float())  # (batch, nheads)

    state = ssm_states[slots].to(device=x.device, dtype=torch.float32)  # (batch, nheads, headdim, dstate)
    dtx = dt[..., None] * x.float()  # (batch, nheads, headdim)
    state = dA[..., None, None] * state + dtx[..., None] * Bh[:, :, None, :]
    ssm_states[slots] = state.to(ssm_states)
    y = torch.einsum("bhpn,bhn->bhp", state, Ch)  # (batch, nheads, headdim)
    return _skip_and_gate(y, x, D, z).to(x.dtype)
