"""The ``mamba_ssm`` vendor ops: the Mamba2 SSD scan and the SSM decode steps from mamba-ssm, the causal conv1d
from causal-conv1d, adapted to our packed-batch / state-slot contracts (``conv1d_ref``, ``ssd_ref``,
``selective_scan_ref``), in-place state updates included.

API targeted (read from source): mamba-ssm 2.3.2.post1 (the same calls since 2.2.4) and causal-conv1d 1.7.0
(``conv_state_indices`` since 1.5). Upstream kernels take one initial state per *batch row* (packed sequences
after the first in a row start from zero) and the conv kernel returns no final states with ``seq_idx``, so:

- ``causal_conv1d`` (prefill): ONE packed channel-last row in which each request's tokens follow its
  width - 1 history (its slot, or zeros): the layout of ``causal_conv1d_ref``; ``seq_idx`` keeps requests apart.
  ``causal_conv1d_fn(row, weight, bias, seq_idx=...)``; outputs are read at the token rows, and the new slot
  contents are the last width - 1 rows of each request's segment (a request shorter than width - 1 shifts its
  old state, as in the reference). No host sync.
- ``causal_conv1d_update`` (decode): ``causal_conv1d_update(..., conv_state_indices=slots)``, in place.
- ``ssd_chunk_scan`` (prefill): ``mamba_chunk_scan_combined`` with one batch row per request, each with its own
  ``initial_states`` (slot or zeros) and ``return_final_states=True`` (fp32). One request: the packed tokens
  are the row (no copy). More: rows right-padded to the longest request with dt = 0 after discretisation
  (decay 1, no input, so the final state is exact); dt is discretised here (bias, softplus, clamp) so padding
  stays 0. Chunks are aligned to each request's first token, as in ``ssd_chunk_scan_ref``. The longest length
  costs one device->host copy per offsets tensor, i.e. per step (every layer of a group shares the tensor).
- ``ssd_state_update`` / ``selective_state_update`` (decode): mamba-ssm ``selective_state_update(...,
  state_batch_indices=slots)``, in place. Mamba2's per-head A / dt / dt_bias go in as stride-0 expansions (the
  kernel's tied fast path); dt is discretised here when ``dt_limit`` is not (0, inf) (the kernel has no clamp);
  D and dt_bias are always passed (upstream's wrapper fails on None).
- ``selective_scan`` (Mamba-1 prefill) is NOT replaced: upstream ``selective_scan_fn`` takes no initial state.

A configuration a kernel cannot run raises ``UnsupportedConfig`` before any state is touched.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.backends.base import UnsupportedConfig
from hybridkv.layers.ops.ssd_ref import _discretize_dt

logger = logging.getLogger("hybridkv.backends")

__all__ = [
    "make_causal_conv1d",
    "make_causal_conv1d_update",
    "make_mamba1_state_update",
    "make_ssd_chunk_scan",
    "make_ssd_state_update",
    "mamba_ssm_ops",
]

BACKEND = "mamba_ssm"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NO_LIMIT = (0.0, math.inf)


def _device_reason(*tensors: torch.Tensor) -> str | None:
    """Why these tensors cannot go to the CUDA kernels (None: they can). Tests without a GPU replace this."""
    for t in tensors:
        if not t.is_cuda:
            return f"tensors are on {t.device.type}, the kernels run on CUDA"
    return None


def _check(op: str, reason: str | None) -> None:
    if reason is not None:
        raise UnsupportedConfig(BACKEND, op, reason)


def _check_activation(activation: str | None) -> None:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


class _HostLengths:
    """Longest request of a device offsets tensor, copied to the host once per tensor object (all layers of a
    step share one offsets tensor). Holding the tensor keeps its memory, so identity cannot be recycled."""

    def __init__(self) -> None:
        self._src: torch.Tensor | None = None
        self._version = -1
        self._max = 0

    def max_len(self, query_start_loc: torch.Tensor) -> int:
        if query_start_loc is not self._src or query_start_loc._version != self._version:
            qsl = query_start_loc.tolist()
            self._max = max((b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)), default=0)
            self._src, self._version = query_start_loc, query_start_loc._version
        return self._max


_HOST_LENGTHS = _HostLengths()


# ----------------------------------------------------------------------------- causal-conv1d


def _conv_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    width = weight.shape[1]
    if not 2 <= width <= 4:
        return f"conv width {width} (causal-conv1d supports 2 to 4)"
    if x.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        return f"dtypes x {x.dtype} / weight {weight.dtype} (causal-conv1d takes fp32 / fp16 / bf16)"
    return None


def make_causal_conv1d(conv_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Our ``causal_conv1d`` (prefill) contract on causal-conv1d's ``causal_conv1d_fn``."""

    def causal_conv1d_vendor(
        x: torch.Tensor,  # (num_tokens, dim)
        weight: torch.Tensor,  # (dim, width)
        bias: torch.Tensor | None,  # (dim,)
        *,
        conv_states: torch.Tensor,  # (num_slots, dim, width - 1), updated in place at state_indices
        query_start_loc: torch.Tensor,  # (num_reqs + 1,)
        state_indices: torch.Tensor,  # (num_reqs,)
        has_initial_state: torch.Tensor,  # (num_reqs,) bool
        activation: str | None = "silu",
    ) -> torch.Tensor:  # (num_tokens, dim), x's dtype
        """Same contract as ``causal_conv1d_ref``."""
        _check_activation(activation)
        num_tokens, dim = x.shape
        hist = weight.shape[1] - 1
        if conv_states.shape[1:] != (dim, hist):
            raise ValueError(f"conv_states has shape {tuple(conv_states.shape)}, expected (*, {dim}, {hist})")
        _check("causal_conv1d", _conv_reason(x, weight)
               or (f"dim {dim} is not a multiple of 8 (causal-conv1d's channel-last layout)" if dim % 8 else None)
               or _device_reason(x, weight, conv_states))
        n = query_start_loc.numel() - 1
        if n == 0:
            return torch.empty_like(x)
        dev = x.device
        qsl = query_start_loc.to(device=dev, dtype=torch.long)  # (n + 1,)
        seq_lens = qsl[1:] - qsl[:-1]  # (n,)
        req = torch.arange(n, device=dev)
        span = torch.arange(hist, device=dev)
        rows = num_tokens + n * hist

        # Request r's segment of the row: its history, then its tokens (rows qsl[r] + r*hist ...).
        token_req = torch.repeat_interleave(req, seq_lens, output_size=num_tokens)  # (num_tokens,)
        tok_rows = torch.arange(num_tokens, device=dev) + (token_req + 1) * hist  # (num_tokens,)
        hist_rows = (qsl[:-1] + req * hist)[:, None] + span  # (n, hist)
        slots = state_indices.to(device=conv_states.device, dtype=torch.long)
        # history in x's dtype (the kernel's input dtype): exact when the pool has x's dtype, as the engine's does
        init = conv_states[slots].to(device=dev, dtype=x.dtype).transpose(1, 2)  # (n, hist, dim)
        init = torch.where(has_initial_state.to(dev).view(-1, 1, 1), init, torch.zeros_like(init))  # no NaN leak
        seg = x.new_empty((rows, dim))  # (rows, dim): every row is written below
        seg[hist_rows.reshape(-1)] = init.reshape(-1, dim)
        seg[tok_rows] = x
        seq_idx = torch.repeat_interleave(req.to(torch.int32), seq_lens + hist, output_size=rows).view(1, rows)

        if bias is not None and bias.dtype != weight.dtype:
            bias = bias.to(weight.dtype)
        out = conv_fn(seg.t().unsqueeze(0), weight, bias, seq_idx=seq_idx, activation=activation)  # (1, dim, rows)
        y = out[0].t()[tok_rows]  # (num_tokens, dim)
        last_rows = (qsl[1:] + (req + 1) * hist)[:, None] - hist + span  # (n, hist)
        conv_states[slots] = seg[last_rows].transpose(1, 2).to(device=conv_states.device, dtype=conv_states.dtype)
        return y

    return causal_conv1d_vendor


def make_causal_conv1d_update(update_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Our ``causal_conv1d_update`` (decode) contract on causal-conv1d's ``causal_conv1d_update``."""

    def causal_conv1d_update_vendor(
        x: torch.Tensor,  # (batch, dim)
        *,
        conv_states: torch.Tensor,  # (num_slots, dim, width - 1), updated in place at state_indices
        weight: torch.Tensor,  # (dim, width)
        bias: torch.Tensor | None,  # (dim,)
        state_indices: torch.Tensor,  # (batch,)
        activation: str | None = "silu",
    ) -> torch.Tensor:  # (batch, dim)
        """Same contract as ``causal_conv1d_update_ref``."""
        _check_activation(activation)
        batch, dim = x.shape
        if conv_states.shape[1:] != (dim, weight.shape[1] - 1):
            raise ValueError(f"conv_states has shape {tuple(conv_states.shape)}, expected "
                             f"(*, {dim}, {weight.shape[1] - 1})")
        _check("causal_conv1d_update", _conv_reason(x, weight)
               or (f"conv state dtype {conv_states.dtype} differs from x's {x.dtype} (causal-conv1d_update)"
                   if conv_states.dtype != x.dtype else None)
               or _device_reason(x, weight, conv_states))
        if batch == 0:
            return torch.empty_like(x)
        if bias is not None and bias.dtype != weight.dtype:
            bias = bias.to(weight.dtype)
        idx = state_indices.to(device=x.device, dtype=torch.int32)  # (batch,) the kernel reads int32
        return update_fn(x, conv_states, weight, bias, activation=activation, conv_state_indices=idx)

    return causal_conv1d_update_vendor


# ----------------------------------------------------------------------------- mamba-ssm


def _ssm_reason(x: torch.Tensor, *tensors: torch.Tensor) -> str | None:
    if x.dtype not in _FLOAT_DTYPES:
        return f"dtype {x.dtype} (mamba-ssm takes fp32 / fp16 / bf16)"
    return _device_reason(x, *tensors)


def make_ssd_chunk_scan(scan_fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """Our ``ssd_chunk_scan`` (Mamba2 prefill) contract on mamba-ssm's ``mamba_chunk_scan_combined``."""

    def ssd_chunk_scan_vendor(
        x: torch.Tensor,  # (num_tokens, nheads, headdim)
        dt: torch.Tensor,  # (num_tokens, nheads) raw
        A: torch.Tensor,  # (nheads,)
        B: torch.Tensor,  # (num_tokens, ngroups, dstate)
        C: torch.Tensor,  # (num_tokens, ngroups, dstate)
        *,
        chunk_size: int,
        query_start_loc: torch.Tensor,  # (num_reqs + 1,)
        ssm_states: torch.Tensor,  # (num_slots, nheads, headdim, dstate), updated in place at state_indices
        state_indices: torch.Tensor,  # (num_reqs,)
        has_initial_state: torch.Tensor,  # (num_reqs,) bool
        D: torch.Tensor | None = None,  # (nheads,) or (nheads, headdim)
        z: torch.Tensor | None = None,  # like x
        dt_bias: torch.Tensor | None = None,  # (nheads,)
        dt_softplus: bool = True,
        dt_limit: tuple[float, float] = _NO_LIMIT,
    ) -> torch.Tensor:  # (num_tokens, nheads, headdim), x's dtype
        """Same contract as ``ssd_chunk_scan_ref``."""
        num_tokens, nheads, headdim = x.shape
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        n = query_start_loc.numel() - 1
        _check("ssd_chunk_scan", _ssm_reason(x, ssm_states) or (
            "several requests under CUDA-graph capture (padding needs the longest length on the host)"
            if n > 1 and x.is_cuda and torch.cuda.is_current_stream_capturing() else None))
        if n == 0:
            return torch.empty_like(x)
        dev = x.device
        slots = state_indices.to(device=ssm_states.device, dtype=torch.long)
        init = ssm_states[slots].to(device=dev, dtype=torch.float32)  # (n, nheads, headdim, dstate)
        init = torch.where(has_initial_state.to(dev).view(-1, 1, 1, 1), init, torch.zeros_like(init))
        if num_tokens == 0:                            # every request is empty: slots keep their initial state
            ssm_states[slots] = init.to(ssm_states)
            return torch.empty_like(x)
        if n == 1:                                     # the packed tokens are the one row
            out, final = scan_fn(x[None], dt[None], A, B[None], C[None], chunk_size, D=D,
                                 z=None if z is None else z[None], dt_bias=dt_bias, initial_states=init,
                                 dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=True)
            y = out[0]
        else:
            max_len = _HOST_LENGTHS.max_len(query_start_loc)
            qsl = query_start_loc.to(device=dev, dtype=torch.long)
            seq_lens = qsl[1:] - qsl[:-1]
            token_req = torch.repeat_interleave(torch.arange(n, device=dev), seq_lens, output_size=num_tokens)
            row = token_req * max_len + torch.arange(num_tokens, device=dev) - qsl[token_req]  # (num_tokens,)

            def pad(t: torch.Tensor) -> torch.Tensor:  # (num_tokens, ...) -> (n, max_len, ...), zeros after
                out_t = t.new_zeros((n * max_len, *t.shape[1:]))
                out_t[row] = t
                return out_t.view(n, max_len, *t.shape[1:])

            dt_d = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # (num_tokens, nheads) fp32
            out, final = scan_fn(pad(x), pad(dt_d), A, pad(B), pad(C), chunk_size, D=D,
                                 z=None if z is None else pad(z), dt_bias=None, initial_states=init,
                                 dt_softplus=False, dt_limit=_NO_LIMIT, return_final_states=True)
            y = out.reshape(n * max_len, nheads, headdim)[row]
        ssm_states[slots] = final.to(device=ssm_states.device, dtype=ssm_states.dtype)
        return y

    return ssd_chunk_scan_vendor


def make_ssd_state_update(update_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Our ``ssd_state_update`` (Mamba2 decode) contract on mamba-ssm's ``selective_state_update``."""

    def ssd_state_update_vendor(
        ssm_states: torch.Tensor,  # (num_slots, nheads, headdim, dstate), updated in place at state_indices
        x: torch.Tensor,  # (batch, nheads, headdim)
        dt: torch.Tensor,  # (batch, nheads) raw
        A: torch.Tensor,  # (nheads,)
        B: torch.Tensor,  # (batch, ngroups, dstate)
        C: torch.Tensor,  # (batch, ngroups, dstate)
        *,
        state_indices: torch.Tensor,  # (batch,)
        D: torch.Tensor | None = None,  # (nheads,) or (nheads, headdim)
        z: torch.Tensor | None = None,  # like x
        dt_bias: torch.Tensor | None = None,  # (nheads,)
        dt_softplus: bool = True,
        dt_limit: tuple[float, float] = _NO_LIMIT,
    ) -> torch.Tensor:  # like x
        """Same contract as ``ssd_state_update_ref``."""
        batch, nheads, headdim = x.shape
        dstate = ssm_states.shape[-1]
        _check("ssd_state_update", _ssm_reason(x, ssm_states))
        if batch == 0:
            return torch.empty_like(x)
        in_kernel = dt_softplus and tuple(dt_limit) == _NO_LIMIT  # its bias + softplus; softplus >= 0: no clamp
        if in_kernel:
            dt_in = dt  # (batch, nheads) raw
            bias = dt_bias if dt_bias is not None else x.new_zeros(nheads, dtype=torch.float32)
        else:
            dt_in = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # (batch, nheads) fp32
            bias = x.new_zeros(nheads, dtype=torch.float32)
        if D is None:
            d_full = x.new_zeros((nheads, headdim), dtype=torch.float32)
        else:
            d_full = D[:, None].expand(nheads, headdim) if D.dim() == 1 else D
        return update_fn(ssm_states, x, dt_in[:, :, None].expand(batch, nheads, headdim),
                         A[:, None, None].expand(nheads, headdim, dstate), B, C, D=d_full, z=z,
                         dt_bias=bias[:, None].expand(nheads, headdim), dt_softplus=in_kernel,
                         state_batch_indices=state_indices)

    return ssd_state_update_vendor


def make_mamba1_state_update(update_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Our Mamba-1 ``selective_state_update`` (decode) contract on mamba-ssm's ``selective_state_update``."""

    def selective_state_update_vendor(
        ssm_states: torch.Tensor,  # (num_slots, dim, dstate), updated in place at state_indices
        x: torch.Tensor,  # (batch, dim)
        dt: torch.Tensor,  # (batch, dim) raw
        A: torch.Tensor,  # (dim, dstate)
        B: torch.Tensor,  # (batch, dstate)
        C: torch.Tensor,  # (batch, dstate)
        *,
        state_indices: torch.Tensor,  # (batch,)
        D: torch.Tensor | None = None,  # (dim,)
        z: torch.Tensor | None = None,  # (batch, dim)
        dt_bias: torch.Tensor | None = None,  # (dim,)
        dt_softplus: bool = True,
    ) -> torch.Tensor:  # (batch, dim)
        """Same contract as ``selective_state_update_mamba1_ref``."""
        batch, dim = x.shape
        _check("selective_state_update", _ssm_reason(x, ssm_states))
        if batch == 0:
            return torch.empty_like(x)
        zeros = x.new_zeros(dim, dtype=torch.float32)
        return update_fn(ssm_states, x, dt, A, B, C, D=zeros if D is None else D, z=z,
                         dt_bias=zeros if dt_bias is None else dt_bias, dt_softplus=dt_softplus,
                         state_batch_indices=state_indices)

    return selective_state_update_vendor


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def mamba_ssm_ops() -> dict[str, Callable[..., torch.Tensor]]:
    """The ops the ``mamba_ssm`` backend replaces. ImportError: a package missing or broken (e.g. no CUDA build)."""
    # the only place mamba-ssm and causal-conv1d are imported
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    logger.info("mamba_ssm: ssd_chunk_scan, ssd_state_update, selective_state_update from mamba-ssm %s; "
                "causal_conv1d, causal_conv1d_update from causal-conv1d %s; selective_scan (Mamba-1 prefill) "
                "stays on the base backend", _version("mamba-ssm"), _version("causal-conv1d"))
    return {
        "causal_conv1d": make_causal_conv1d(causal_conv1d_fn),
        "causal_conv1d_update": make_causal_conv1d_update(causal_conv1d_update),
        "ssd_chunk_scan": make_ssd_chunk_scan(mamba_chunk_scan_combined),
        "ssd_state_update": make_ssd_state_update(selective_state_update),
        "selective_state_update": make_mamba1_state_update(selective_state_update),
    }
