"""The ``fla`` vendor ops: flash-linear-attention's gated delta rule and KDA kernels behind our packed-batch /
state-slot contracts (``gated_delta_ref``), in-place state updates included.

API targeted (read from source): fla-core 0.6.0 (``pip install flash-linear-attention``; pure Triton, no build).
fla takes a flat packed row with ``cu_seqlens`` and one initial state per sequence, and returns the final states:

- ``gated_delta_rule`` / ``kda`` (prefill): ``chunk_gated_delta_rule`` / ``chunk_kda`` on the packed row
  (``q[None]``, ...) with ``cu_seqlens`` = our ``query_start_loc``, ``initial_state`` gathered from the slots (zeros
  where a request has none, so a fresh slot's garbage is never read) and ``output_final_state=True``; the final
  states are scattered back to the slots. fla derives its chunk indices from ``cu_seqlens`` on the host (a sync),
  so prefill is refused under CUDA-graph capture.
- ``gated_delta_rule_update`` / ``kda_update`` (decode): fla's continuous-batching recurrent kernel
  (``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` and ``inplace_final_state=True``): every request one
  token, its state read from and written back to its slot in place. The gated delta rule goes through the same
  kernel with its per-head decay broadcast over the key channels (exp of the same value: the same recurrence), which
  avoids the gather / scatter that ``fused_recurrent_gated_delta_rule`` (no state indices) would need.
- The in-op gate (``A_log`` / ``dt_bias``) is computed here in torch (``-exp(A_log) * softplus(g + dt_bias)``) and
  passed as the log decay: fla's own gate option changed shape and name across versions.

A configuration the kernels cannot run raises ``UnsupportedConfig`` before any state is touched. ``auto`` takes only
the ops measured faster than ours (``registry._AUTO_OPS``: the chunked KDA prefill); ``backend="fla"`` asks for all.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.backends.base import UnsupportedConfig
from hybridkv.layers.ops.gated_delta_ref import _check_params, _decay, beta_from_logits

logger = logging.getLogger("hybridkv.backends")

__all__ = ["fla_ops", "make_delta_prefill", "make_delta_update"]

BACKEND = "fla"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_K_DIM = 256           # fla's chunk kernels assert head_k_dim <= 256


def _device_reason(*tensors: torch.Tensor) -> str | None:
    """Why these tensors cannot go to the CUDA kernels (None: they can). Tests without a GPU replace this."""
    for t in tensors:
        if not t.is_cuda:
            return f"tensors are on {t.device.type}, the kernels run on CUDA"
    return None


def _reason(q: torch.Tensor, v: torch.Tensor, ssm_states: torch.Tensor) -> str | None:
    if q.dtype not in _FLOAT_DTYPES or v.dtype not in _FLOAT_DTYPES:
        return f"dtypes q {q.dtype} / v {v.dtype} (fla takes fp32 / fp16 / bf16)"
    if ssm_states.dtype != torch.float32:
        return f"state dtype {ssm_states.dtype} (fla's kernels keep fp32 states)"
    return _device_reason(q, v, ssm_states)


def _check(op: str, reason: str | None) -> None:
    if reason is not None:
        raise UnsupportedConfig(BACKEND, op, reason)


def make_delta_prefill(chunk_fn: Callable[..., Any], *, per_channel: bool) -> Callable[..., torch.Tensor]:
    """Our ``gated_delta_rule`` (``per_channel=False``) or ``kda`` prefill contract on fla's
    ``chunk_gated_delta_rule`` / ``chunk_kda``."""
    op = "kda" if per_channel else "gated_delta_rule"

    def delta_prefill_vendor(
        q: torch.Tensor,  # (num_tokens, num_k_heads, head_k_dim)
        k: torch.Tensor,  # (num_tokens, num_k_heads, head_k_dim)
        v: torch.Tensor,  # (num_tokens, num_v_heads, head_v_dim)
        g: torch.Tensor,  # (num_tokens, num_v_heads) or, KDA, (num_tokens, num_v_heads, head_k_dim)
        beta: torch.Tensor,  # (num_tokens, num_v_heads)
        *,
        query_start_loc: torch.Tensor,  # (num_reqs + 1,)
        ssm_states: torch.Tensor,  # (num_slots, num_v_heads, head_k_dim, head_v_dim) fp32, updated at state_indices
        state_indices: torch.Tensor,  # (num_reqs,)
        has_initial_state: torch.Tensor,  # (num_reqs,) bool
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        A_log: torch.Tensor | None = None,  # (num_v_heads,)
        dt_bias: torch.Tensor | None = None,  # (num_v_heads,) or, KDA, (num_v_heads, head_k_dim)
        chunk_size: int = 64,
        beta_scale: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_v_heads, head_v_dim), v's dtype
        """Same contract as the reference (``gated_delta_ref``)."""
        _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        n = query_start_loc.numel() - 1
        _check(op, _reason(q, v, ssm_states)
               or (f"head_k_dim {q.shape[2]} > {_MAX_HEAD_K_DIM}" if q.shape[2] > _MAX_HEAD_K_DIM else None)
               or ("prefill under CUDA-graph capture (fla reads the sequence lengths on the host)"
                   if v.is_cuda and torch.cuda.is_current_stream_capturing() else None))
        if n == 0:
            return torch.empty_like(v)
        dev = v.device
        slots = state_indices.to(device=ssm_states.device, dtype=torch.long)
        init = ssm_states[slots].to(device=dev, dtype=torch.float32)  # (n, num_v_heads, head_k_dim, head_v_dim)
        init = torch.where(has_initial_state.to(dev).view(-1, 1, 1, 1), init, torch.zeros_like(init))
        if v.shape[0] == 0:                            # every request is empty: slots keep their initial state
            ssm_states[slots] = init.to(ssm_states)
            return torch.empty_like(v)
        decay = _decay(g, A_log, dt_bias, torch.float32)
        beta = beta_from_logits(beta, beta_scale)
        out, final = chunk_fn(q[None], k[None], v[None], decay[None], beta[None], scale=scale, initial_state=init,
                              output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                              cu_seqlens=query_start_loc.to(device=dev, dtype=torch.long))
        ssm_states[slots] = final.to(device=ssm_states.device, dtype=ssm_states.dtype)
        return out[0].to(v.dtype)

    delta_prefill_vendor.__name__ = f"{op}_fla"
    return _without_beta_scale(delta_prefill_vendor) if per_channel else delta_prefill_vendor


def make_delta_update(recurrent_fwd: Callable[..., Any], *, per_channel: bool) -> Callable[..., torch.Tensor]:
    """Our ``gated_delta_rule_update`` / ``kda_update`` (decode) contract on fla's continuous-batching recurrent
    kernel ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``."""
    op = "kda_update" if per_channel else "gated_delta_rule_update"

    def delta_update_vendor(
        ssm_states: torch.Tensor,  # (num_slots, num_v_heads, head_k_dim, head_v_dim) fp32, updated at state_indices
        q: torch.Tensor,  # (batch, num_k_heads, head_k_dim)
        k: torch.Tensor,  # (batch, num_k_heads, head_k_dim)
        v: torch.Tensor,  # (batch, num_v_heads, head_v_dim)
        g: torch.Tensor,  # (batch, num_v_heads) or, KDA, (batch, num_v_heads, head_k_dim)
        beta: torch.Tensor,  # (batch, num_v_heads)
        *,
        state_indices: torch.Tensor,  # (batch,)
        scale: float | None = None,
        use_qk_l2norm: bool = False,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        beta_scale: float | None = None,
    ) -> torch.Tensor:  # like v
        """Same contract as the reference (``gated_delta_ref``)."""
        _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
        _check(op, _reason(q, v, ssm_states) or (
            "state slots that are not contiguous (num_v_heads, head_k_dim, head_v_dim) blocks (fla's indexing)"
            if not ssm_states[0:1].is_contiguous() and ssm_states.shape[0] > 0 else None))
        batch, _, head_k_dim = q.shape
        if batch == 0:
            return torch.empty_like(v)
        decay = _decay(g, A_log, dt_bias, torch.float32)
        beta = beta_from_logits(beta, beta_scale)
        if not per_channel:
            decay = decay[..., None].expand(*decay.shape, head_k_dim)  # exp(g) on every key channel
        out, _ = recurrent_fwd(
            q=q[:, None].contiguous(), k=k[:, None].contiguous(), v=v[:, None].contiguous(),
            g=decay[:, None].contiguous(), beta=beta[:, None].contiguous(), scale=scale, initial_state=ssm_states,
            inplace_final_state=True, ssm_state_indices=state_indices.to(device=v.device, dtype=torch.int32),
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
        return out[:, 0].to(v.dtype)

    delta_update_vendor.__name__ = f"{op}_fla"
    return _without_beta_scale(delta_update_vendor) if per_channel else delta_update_vendor


def _without_beta_scale(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """KDA's contract: the gated delta rule's without ``beta_scale`` (its layer passes beta itself)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def kda(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "beta_scale" in kwargs:
            raise TypeError(f"{fn.__name__}() got an unexpected keyword argument 'beta_scale'")
        return fn(*args, **kwargs)

    kda.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "beta_scale"])
    return kda


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def fla_ops() -> dict[str, Callable[..., torch.Tensor]]:
    """The ops the ``fla`` backend replaces. ImportError: the package missing or broken."""
    # the only place fla is imported
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    logger.info("fla: gated_delta_rule, kda (chunked prefill) and their decode updates from fla-core %s",
                _version("fla-core"))
    return {
        "gated_delta_rule": make_delta_prefill(chunk_gated_delta_rule, per_channel=False),
        "gated_delta_rule_update": make_delta_update(fused_recurrent_kda_fwd, per_channel=False),
        "kda": make_delta_prefill(chunk_kda, per_channel=True),
        "kda_update": make_delta_update(fused_recurrent_kda_fwd, per_channel=True),
    }
