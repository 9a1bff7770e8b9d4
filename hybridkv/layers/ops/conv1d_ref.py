"""Reference causal depthwise conv1d over packed variable-length batches with per-request state slots.

This is the oracle for the conv half of a Mamba layer: every fast kernel (causal-conv1d's
``causal_conv1d_fn`` / ``causal_conv1d_update`` with ``conv_state_indices``, or our own Triton kernel)
is checked against it. It is written for clarity, computes in fp32 and runs on any device.

Packed-batch conventions shared by every ``*_ref`` state-space kernel (see also ``ssd_ref`` and
``selective_scan_ref``):

- tokens of all requests are concatenated; ``query_start_loc`` (num_reqs + 1,) holds cumulative offsets;
- request ``r`` owns state slot ``state_indices[r]`` of a pool (slots must be distinct);
- ``has_initial_state[r]`` says whether request ``r`` continues from its slot (chunked-prefill
  continuation, decode) or starts from zeros (the slot's old contents are then never read, so a fresh
  slot may hold garbage, even NaN);
- the slots used are overwritten in place with each request's final state; no other slot is touched.
  A request with zero tokens leaves its slot holding its initial state (zeros if it has none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridkv.layers.ops.registry import reference_op

__all__ = ["causal_conv1d_ref", "causal_conv1d_update_ref"]


# ----------------------------------------------------------------------------- shared packed-batch helpers


def _check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise ValueError naming ``name`` unless ``tensor.shape`` matches ``shape`` (None = any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    ok = tensor.dim() == len(shape) and all(
        e is None or e == s for s, e in zip(tensor.shape, shape, strict=True)
    )
    if not ok:
        want = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {want}")


def _check_state_indices(state_indices: torch.Tensor, num_reqs: int, num_slots: int) -> None:
    """state_indices must be (num_reqs,) distinct integers in [0, num_slots)."""
    _check_shape("state_indices", state_indices, (num_reqs,))
    if state_indices.is_floating_point() or state_indices.dtype == torch.bool:
        raise ValueError(f"state_indices must be an integer tensor, got {state_indices.dtype}")
    idx = state_indices.long()
    if num_reqs and (int(idx.min()) < 0 or int(idx.max()) >= num_slots):
        raise ValueError(f"state_indices must lie in [0, {num_slots}), got {state_indices.tolist()}")
    if torch.unique(idx).numel() != num_reqs:
        raise ValueError(f"state_indices must be distinct, got {state_indices.tolist()}")


def _packed_layout(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_slots: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the packed-batch metadata; return (qsl, seq_lens, token_req, token_pos), int64 on device.

    qsl (num_reqs + 1,); seq_lens (num_reqs,); token_req (num_tokens,) the request of each token;
    token_pos (num_tokens,) the token's position inside its request. Validation reads values (a host
    sync): this is an oracle, not a hot path.
    """
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise ValueError(
            f"query_start_loc must be 1-D (num_reqs + 1,), got shape {tuple(query_start_loc.shape)}"
        )
    if query_start_loc.is_floating_point() or query_start_loc.dtype == torch.bool:
        raise ValueError(f"query_start_loc must be an integer tensor, got {query_start_loc.dtype}")
    num_reqs = query_start_loc.numel() - 1
    _check_state_indices(state_indices, num_reqs, num_slots)
    _check_shape("has_initial_state", has_initial_state, (num_reqs,))
    if has_initial_state.dtype != torch.bool:
        raise ValueError(f"has_initial_state must be a bool tensor, got {has_initial_state.dtype}")

    qsl = query_start_loc.to(device=device, dtype=torch.long)
    seq_lens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens or bool((seq_lens < 0).any()):
        raise ValueError(
            f"query_start_loc must rise from 0 to num_tokens={num_tokens}, got {query_start_loc.tolist()}"
        )

    token_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=qsl.device), seq_lens, output_size=num_tokens
    )  # (num_tokens,)
    token_pos = torch.arange(num_tokens, device=qsl.device) - qsl[token_req]  # (num_tokens,)
    return qsl, seq_lens, token_req, token_pos


def _check_activation(activation: str | None) -> None:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _apply_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)


# ----------------------------------------------------------------------------- kernels


@reference_op("causal_conv1d")
def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv1d of packed requests, each continuing from (and updating) its state slot.

    Shapes: x (num_tokens, dim); weight (dim, width); bias (dim,) or None;
    conv_states (num_slots, dim, width - 1), the last width - 1 *inputs* of each slot's sequence, oldest
    first; query_start_loc (num_reqs + 1,); state_indices, has_initial_state (num_reqs,). Returns
    y (num_tokens, dim) in x's dtype.

    Why: pins down causal-conv1d's ``causal_conv1d_fn(..., initial_states, return_final_states)``
    semantics per request of a packed batch: output t of a request sees inputs t - width + 1 .. t, where
    inputs before the request's first token come from its slot (or are zeros). The new slot contents
    are the last width - 1 inputs of (old state ++ new tokens), so a request shorter than width - 1
    shifts the old state rather than replacing it. (HF's cache keeps ``width`` columns instead; its
    last width - 1 columns equal ours.)
    """
    _check_activation(activation)
    _check_shape("x", x, (None, None))
    num_tokens, dim = x.shape
    _check_shape("weight", weight, (dim, None))
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"weight must have width >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        _check_shape("bias", bias, (dim,))
    _check_shape("conv_states", conv_states, (None, dim, width - 1))
    device = x.device
    qsl, seq_lens, token_req, _ = _packed_layout(
        num_tokens, query_start_loc, state_indices, has_initial_state, conv_states.shape[0], device
    )
    num_reqs = seq_lens.numel()
    hist = width - 1
    slots = state_indices.to(device=conv_states.device, dtype=torch.long)
    has_init = has_initial_state.to(device)

    # Initial history of each request, masked with `where` so a fresh slot's garbage is never read.
    init = conv_states[slots].to(device=device, dtype=torch.float32).transpose(1, 2)  # (num_reqs, hist, dim)
    init = torch.where(has_init.view(-1, 1, 1), init, torch.zeros_like(init))

    # Extended packed sequence: each request's tokens preceded by its (width - 1)-input history.
    # Request r occupies ext rows [qsl[r] + r * hist, qsl[r + 1] + (r + 1) * hist).
    ext = x.new_zeros((num_tokens + num_reqs * hist, dim), dtype=torch.float32)
    req = torch.arange(num_reqs, device=device)
    hist_rows = (qsl[:-1] + req * hist)[:, None] + torch.arange(hist, device=device)  # (num_reqs, hist)
    ext[hist_rows.reshape(-1)] = init.reshape(-1, dim)
    tok = torch.arange(num_tokens, device=device)
    ext[tok + (token_req + 1) * hist] = x.float()

    # Token t's window is ext rows t + token_req[t] * hist + (0 .. width - 1), oldest first.
    window_rows = (tok + token_req * hist)[:, None] + torch.arange(width, device=device)
    windows = ext[window_rows]  # (num_tokens, width, dim)
    y = torch.einsum("tkd,dk->td", windows, weight.float())  # (num_tokens, dim)
    if bias is not None:
        y = y + bias.float()
    y = _apply_activation(y, activation)

    # New state: the last width - 1 rows of each request's extended sequence.
    last_rows = (qsl[1:] + (req + 1) * hist)[:, None] - hist + torch.arange(hist, device=device)
    new_state = ext[last_rows]  # (num_reqs, width - 1, dim)
    conv_states[slots] = new_state.transpose(1, 2).to(conv_states)
    return y.to(x.dtype)


@reference_op("causal_conv1d_update")
def causal_conv1d_update_ref(
    x: torch.Tensor,
    *,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of the causal conv for a batch of requests, each continuing from its slot.

    Shapes: x (batch, dim); conv_states (num_slots, dim, width - 1), updated in place at
    ``state_indices`` (batch,), distinct; weight (dim, width); bias (dim,) or None. Returns y (batch, dim).

    Why: mirrors causal-conv1d's ``causal_conv1d_update(..., conv_state_indices=...)``; equals
    ``causal_conv1d_ref`` on one-token requests that all have an initial state.
    """
    _check_activation(activation)
    _check_shape("x", x, (None, None))
    batch, dim = x.shape
    _check_shape("weight", weight, (dim, None))
    width = weight.shape[1]
    if width < 1:
        raise ValueError(f"weight must have width >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        _check_shape("bias", bias, (dim,))
    _check_shape("conv_states", conv_states, (None, dim, width - 1))
    _check_state_indices(state_indices, batch, conv_states.shape[0])
    slots = state_indices.to(device=conv_states.device, dtype=torch.long)

    old = conv_states[slots].to(device=x.device, dtype=torch.float32)  # (batch, dim, width - 1)
    window = torch.cat([old, x.float()[:, :, None]], dim=-1)  # (batch, dim, width)
    y = (window * weight.float()).sum(-1)  # (batch, dim)
    if bias is not None:
        y = y + bias.float()
    y = _apply_activation(y, activation)
    conv_states[slots] = window[:, :, 1:].to(conv_states)
    return y.to(x.dtype)
