"""Pure-torch reference twins of every backend op, and the open op table they fill (``registry``): importing this
package imports every reference module, which registers its ops."""

from hybridkv.layers.ops.attention_ref import paged_attention_ref, write_kv_ref  # noqa: F401
from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref  # noqa: F401
from hybridkv.layers.ops.fused_ref import (  # noqa: F401
    act_mul_ref,
    add_rms_norm_ref,
    argmax_ref,
    gated_rms_norm_ref,
    linear_act_mul_ref,
    linear_argmax_ref,
    linear_ref,
    moe_route_ref,
    qk_rope_write_kv_ref,
    rms_norm_ref,
    rope_attention_ref,
)
from hybridkv.layers.ops.gated_delta_ref import (  # noqa: F401
    gated_delta_rule_ref,
    gated_delta_rule_update_ref,
    kda_ref,
    kda_update_ref,
)
from hybridkv.layers.ops.registry import reference_op, reference_ops  # noqa: F401
from hybridkv.layers.ops.selective_scan_ref import (  # noqa: F401
    selective_scan_ref,
    selective_state_update_mamba1_ref,
)
from hybridkv.layers.ops.ssd_ref import ssd_chunk_scan_ref, ssd_state_update_ref  # noqa: F401
