"""The ``triton`` kernel backend: own Triton kernels for paged attention, the KV write and the Mamba2 ops.

- attention (prefill, decode and mixed batches in one kernel, any block size, GQA, causal + sliding window
  + softcap) and the KV write: ``hybridkv.backends.triton_attention``;
- causal depthwise conv1d over packed requests with state slots, and its one-token update:
  ``hybridkv.backends.triton_conv1d`` (used by the Mamba2 and the Mamba-1 mixers);
- Mamba2 SSD chunked scan with per-request initial / final states (one fused kernel) and the one-token
  state update: ``hybridkv.backends.triton_ssd``;
- the gated delta rule (Gated DeltaNet) and Kimi Delta Attention: chunked prefill with per-request initial / final
  states and the one-token decode update: ``hybridkv.backends.triton_gated_delta``;
- the elementwise work between GEMMs (residual add + RMS norm, activation x up, q/k norm + RoPE + KV write,
  Mamba2's gated norm), one launch each: ``hybridkv.backends.triton_fused``; in decode batches q/k norm +
  RoPE + KV write run inside the attention kernel (``rope_attention``);
- a MoE router's top-k choice and weights from its logits, one launch: ``hybridkv.backends.triton_moe``;
- dense linears at decode sizes (the gated activation fused into the gate|up projection, the greedy argmax
  into the logits head), cuBLAS for the shapes and row counts where it was faster (``triton_linear.takes``):
  ``hybridkv.backends.triton_linear``;
- greedy tokens (each row's argmax) in two short launches: ``hybridkv.backends.triton_sampling``.

On Hopper every kernel is launched with programmatic dependent launch (``hybridkv.backends.pdl``).

Mamba-1's selective scan and its state update (Jamba) are NOT Triton kernels yet: this backend uses the
torch references for them, and says so in the log when it is built.
"""

from __future__ import annotations

import logging

from hybridkv.backends.base import KernelBackend

logger = logging.getLogger("hybridkv.backends")


def triton_backend() -> KernelBackend:
    from hybridkv.backends import triton_fused as fused
    from hybridkv.backends import triton_gated_delta as delta
    from hybridkv.backends import triton_linear as linear
    from hybridkv.backends.triton_attention import paged_attention_triton, rope_attention_triton, write_kv_triton
    from hybridkv.backends.triton_conv1d import causal_conv1d_triton, causal_conv1d_update_triton
    from hybridkv.backends.triton_moe import linear_moe_route, moe_route
    from hybridkv.backends.triton_sampling import argmax_triton
    from hybridkv.backends.triton_ssd import ssd_chunk_scan_triton, ssd_state_update_triton

    logger.info("kernel backend triton: Triton paged attention + KV write, causal conv1d (+ update), Mamba2 "
                "SSD chunk scan (+ state update), gated delta rule and KDA (chunked + decode update), fused norms / "
                "activations / RoPE, MoE routing (with the router's GEMV at decode), greedy argmax, "
                "decode-size linears (%s); Mamba-1 selective scan uses the torch reference",
                linear.dispatch_description())
    # The ops it has kernels for; the rest (Mamba-1's) are the references.
    return KernelBackend(name="triton", paged_attention=paged_attention_triton,
                         write_kv=write_kv_triton, causal_conv1d=causal_conv1d_triton,
                         causal_conv1d_update=causal_conv1d_update_triton,
                         ssd_chunk_scan=ssd_chunk_scan_triton, ssd_state_update=ssd_state_update_triton,
                         gated_delta_rule=delta.gated_delta_rule_triton,
                         gated_delta_rule_update=delta.gated_delta_rule_update_triton,
                         kda=delta.kda_triton, kda_update=delta.kda_update_triton,
                         rms_norm=fused.rms_norm_triton, add_rms_norm=fused.add_rms_norm_triton,
                         act_mul=fused.act_mul_triton, linear=linear.linear, linear_act_mul=linear.linear_act_mul,
                         argmax=argmax_triton, linear_argmax=linear.linear_argmax,
                         qk_rope_write_kv=fused.qk_rope_write_kv_triton, rope_attention=rope_attention_triton,
                         gated_rms_norm=fused.gated_rms_norm_triton, moe_route=moe_route,
                         linear_moe_route=linear_moe_route,
                         cuda_graph_safe=True)
