"""GraniteMoE-SWA (``GraniteMoeSWAForCausalLM``): Granite-SWA's attention tensors (the Llama names plus
``self_attn.sinks``) with GraniteMoE's feed-forward ones (``block_sparse_moe.*``, and ``shared_mlp.*`` when the
shared experts are on), each read by its family's map.

transformers 5.24 has no weight renaming for this family, so ``save_pretrained`` writes its in-memory names
(``experts.gate_up_proj`` / ``experts.down_proj`` / ``router.weight``); GraniteMoE's hub spelling
(``input_linear`` / ``output_linear`` / ``router.layer``) is read too."""

from __future__ import annotations

from hybridkv.loaders.families.granite_moe_hybrid import granite_moe_ffn
from hybridkv.loaders.families.granite_swa import granite_swa_attention
from hybridkv.loaders.families.mistral import decoder_map
from hybridkv.loaders.weights import Target, register_weight_map
from hybridkv.models.config import HybridConfig


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    return granite_swa_attention(i, rest) or granite_moe_ffn(i, rest, config)


granitemoe_swa = register_weight_map("GraniteMoeSWAForCausalLM")(decoder_map(layer=_layer))
