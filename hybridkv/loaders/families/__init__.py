"""Hub weight maps, one module per family; importing this package registers them all.

Keep this an import list (one module a line, sorted): each module registers its maps with
``@register_weight_map`` on import.
"""

from hybridkv.loaders.families import (  # noqa: F401
    bamba,
    cohere2,
    exaone4,
    falcon_h1,
    gemma,
    gemma3n,
    gemma4,
    gpt_oss,
    granite_moe_hybrid,
    granite_swa,
    granitemoe_swa,
    jamba,
    kimi_linear,
    lfm2,
    llama4,
    mamba2,
    mistral,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_next,
    zamba2,
)
