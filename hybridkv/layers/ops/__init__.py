
from hybridkv.layers.ops.attention_ref import paged_attention_ref, write_kv_ref  # noqa: F401
from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref  # noqa: F401
from hybridkv.layers.ops.gated_delta_ref import (  # noqa: F401
    gated_delta_rule_ref,
    gated_delta_rule_update_ref,
    kda_ref,
    kda_update_ref,
)
from hybridkv.layers.ops.selective_scan_ref import (  # noqa: F401
    selective_scan_ref,
    selective_state_update_mamba1_ref,
)
from hybridkv.layers.ops.ssd_ref import ssd_chunk_scan_ref, ssd_state_update_ref  # noqa: F401
