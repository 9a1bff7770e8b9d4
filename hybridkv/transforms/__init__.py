"""Pure, composable rewrites of CommonAttentionMetadata (they never mutate their input)."""

from hybridkv.transforms.compose import Transform, compose
from hybridkv.transforms.decode_prefill import (
    permute_requests,
    reorder_decodes_first,
    split_decodes_and_prefills,
)
from hybridkv.transforms.local_attention import (
    make_local_attention_virtual_batches,
    make_local_attention_virtual_batches_device,
    max_local_virtual_batches,
)
from hybridkv.transforms.microbatch import slice_microbatch, split_microbatches
from hybridkv.transforms.sliding_window import trim_sliding_window

__all__ = [
    "Transform",
    "compose",
    "make_local_attention_virtual_batches",
    "make_local_attention_virtual_batches_device",
    "max_local_virtual_batches",
    "permute_requests",
    "reorder_decodes_first",
    "slice_microbatch",
    "split_decodes_and_prefills",
    "split_microbatches",
    "trim_sliding_window",
]
