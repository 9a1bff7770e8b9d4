"""The ``triton`` kernel backend: own Triton kernels for paged attention and the KV write.

Attention (prefill, decode and mixed batches in one kernel, any block size, GQA, causal + sliding window
+ softcap) and the KV write come from ``hybridkv.backends.triton_attention``. The SSM ops (causal conv1d,
Mamba2 SSD chunk scan / state update, Mamba-1 selective scan / state update) are NOT Triton kernels yet:
this backend uses the torch references for them (correct, slow on long prefills), and says so in the log
when it is built.
"""

from __future__ import annotations

import logging

from hybridkv.backends.registry import KernelBackend

logger = logging.getLogger("hybridkv.backends")


def triton_backend() -> KernelBackend:
    from hybridkv.backends.triton_attention import paged_attention_triton, write_kv_triton
    from hybridkv.layers import ops

    logger.info("kernel backend triton: Triton paged attention + KV write; SSM ops (conv1d, SSD, "
                "selective scan) use the torch references")
    return KernelBackend(
        name="triton",
        paged_attention=paged_attention_triton,
        write_kv=write_kv_triton,
        causal_conv1d=ops.causal_conv1d_ref,
        causal_conv1d_update=ops.causal_conv1d_update_ref,
        ssd_chunk_scan=ops.ssd_chunk_scan_ref,
        ssd_state_update=ops.ssd_state_update_ref,
        selective_scan=ops.selective_scan_ref,
        selective_state_update=ops.selective_state_update_mamba1_ref,
    )
