"""Cohere2 / Command-R7B (``Cohere2ForCausalLM``): the Llama tensor names with one norm per layer.

The single ``input_layernorm`` (a LayerNorm without bias) feeds attention and the MLP alike (our ``input_norm``
of a ``parallel_ffn`` layer); there is no ``post_attention_layernorm``. The output layer is tied to the
embeddings in the released checkpoints (no ``lm_head.weight``)."""

from __future__ import annotations

from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, LLAMA_MLP, decoder_map
from hybridkv.loaders.weights import register_weight_map, rename_module

_LAYER_MODULES = {**LLAMA_ATTENTION, **LLAMA_MLP, "input_layernorm": "input_norm"}

cohere2 = register_weight_map("Cohere2ForCausalLM")(decoder_map(
    layer=lambda i, rest, config: rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")))
