"""The ``triton`` kernel backend: own Triton kernels for paged attention and the KV write.

Attention (prefill, decode and mixed batches in one kernel, any block size, GQA, causal + sliding window
+ softcap) and the KV write come from ``hybridkv.backends.triton_attention``. The SSM ops (causal conv1d,
Mamba2 SSD chunk scan / state update, Mamba-1 selective scan / state update) are NOT Triton kernels yet:
this backend uses the torch references for them (correct, slow on long prefills), and says so in the log
when it is built.
"""

from __future__ import annotations

import dataclasses
import logging

from hybridkv.backends.registry import KernelBackend, torch_backend

logger = logging.getLogger("hybridkv.backends")


def triton_backend() -> KernelBackend:
    from hybridkv.backends.triton_attention import paged_attention_triton, write_kv_triton

    logger.info("kernel backend triton: Triton paged attention + KV write; SSM ops (conv1d, SSD, "
                "selective scan) use the torch references")
    return dataclasses.replace(torch_backend(), name="triton", paged_attention=paged_attention_triton,
                               write_kv=write_kv_triton)
