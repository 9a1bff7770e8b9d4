"""What every kernel backend is: the op table (``KernelBackend``), the error a kernel raises for a configuration
it cannot run (``UnsupportedConfig``) and the complete reference backend (``torch_backend``).

The bottom of ``backends/``: the Triton and vendor modules build on it, and ``registry`` (which names and
composes backends) imports them, so imports only point down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["KernelBackend", "UnsupportedConfig", "torch_backend"]


class UnsupportedConfig(ValueError):
    """A vendor kernel cannot run this call's configuration (block size, dtype, head dim, device ...).

    Raised by a vendor op before it changes anything, so ``auto`` can run the replaced op instead."""

    def __init__(self, backend: str, op: str, constraint: str) -> None:
        self.backend, self.op, self.constraint = backend, op, constraint
        super().__init__(f"kernel backend {backend!r} cannot run {op}: {constraint} "
                         f"(backend='auto' falls back to the next backend for such calls)")


@dataclass(frozen=True, kw_only=True)
class KernelBackend:
    """One implementation of every op a layer calls (signatures: ``hybridkv.layers.ops.*_ref``).

    ``cuda_graph_safe``: its decode-path ops read only device metadata and never sync, so a captured
    decode step stays correct for any batch of the captured size (``engine/cuda_graphs.py``)."""

    name: str
    paged_attention: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]
    causal_conv1d: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    ssd_chunk_scan: Callable[..., torch.Tensor]
    ssd_state_update: Callable[..., torch.Tensor]
    selective_scan: Callable[..., torch.Tensor]
    selective_state_update: Callable[..., torch.Tensor]
    # gated delta rule (Gated DeltaNet) and Kimi Delta Attention: prefill and one-token decode (``gated_delta_ref``)
    gated_delta_rule: Callable[..., torch.Tensor]
    gated_delta_rule_update: Callable[..., torch.Tensor]
    kda: Callable[..., torch.Tensor]
    kda_update: Callable[..., torch.Tensor]
    # the elementwise work between GEMMs (``layers/ops/fused_ref.py``)
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor | None, torch.Tensor]]
    act_mul: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]
    linear_act_mul: Callable[..., torch.Tensor]
    argmax: Callable[..., torch.Tensor]
    linear_argmax: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_rope_write_kv: Callable[..., torch.Tensor]
    rope_attention: Callable[..., torch.Tensor]       # qk_rope_write_kv, then paged_attention
    gated_rms_norm: Callable[..., torch.Tensor]
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    cuda_graph_safe: bool = False


def torch_backend() -> KernelBackend:
    """The reference ops: complete, any device. Other backends replace the ops they have kernels for."""
    from hybridkv.layers import ops
    from hybridkv.layers.ops import fused_ref

    return KernelBackend(
        name="torch",
        paged_attention=ops.paged_attention_ref,
        write_kv=ops.write_kv_ref,
        causal_conv1d=ops.causal_conv1d_ref,
        causal_conv1d_update=ops.causal_conv1d_update_ref,
        ssd_chunk_scan=ops.ssd_chunk_scan_ref,
        ssd_state_update=ops.ssd_state_update_ref,
        selective_scan=ops.selective_scan_ref,
        selective_state_update=ops.selective_state_update_mamba1_ref,
        gated_delta_rule=ops.gated_delta_rule_ref,
        gated_delta_rule_update=ops.gated_delta_rule_update_ref,
        kda=ops.kda_ref,
        kda_update=ops.kda_update_ref,
        rms_norm=fused_ref.rms_norm_ref,
        add_rms_norm=fused_ref.add_rms_norm_ref,
        act_mul=fused_ref.act_mul_ref,
        linear=fused_ref.linear_ref,
        linear_act_mul=fused_ref.linear_act_mul_ref,
        argmax=fused_ref.argmax_ref,
        linear_argmax=fused_ref.linear_argmax_ref,
        qk_rope_write_kv=fused_ref.qk_rope_write_kv_ref,
        rope_attention=fused_ref.rope_attention_ref,
        gated_rms_norm=fused_ref.gated_rms_norm_ref,
        moe_route=fused_ref.moe_route_ref,
    )
