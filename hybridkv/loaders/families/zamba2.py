"""Zamba2 (``Zamba2ForCausalLM``): Mamba2 layers; "hybrid" layers first run a shared transformer block
(ours: ``shared_blocks.{b}``, borrowed by each use ``layers.{i}.shared``) whose output, through the
layer's ``linear``, is added to the Mamba input.

Hub layout: a mamba layer is ``layers.{i}.{input_layernorm,mamba}``, a hybrid layer
``layers.{i}.{linear,mamba_decoder.*,shared_transformer.*}``. The shared block's weights are tied
across its uses; transformers 5.23 ``save_pretrained`` writes them once, under the block's first use,
and other exports may repeat them under every use. So the copy under a block's first use is read and
the copies under later uses are read past (they are the same tensors). Inside that copy each use ``j``
of the block has its own low-rank adapters, ``...adapter_list.{j}.{0,1}.weight`` (``j`` counts hybrid
layers in order), which go to the layer of use ``j``. ``feed_forward.gate_up_proj`` is fused gate|up."""

from __future__ import annotations

from hybridkv.loaders.families.bamba import fused_gate_up, mamba2_modules, mamba2_param
from hybridkv.loaders.families.mistral import decoder_map
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig

_TOP = {"embed_tokens.weight": "embed_tokens.weight", "final_layernorm.weight": "norm.weight"}
_MAMBA_LAYER = {**mamba2_modules("mamba", "mixer"), **mamba2_modules("mamba_decoder.mamba", "mixer"),
                "input_layernorm": "input_norm", "mamba_decoder.input_layernorm": "input_norm",
                "linear": "shared.linear"}
_BLOCK = {"input_layernorm": "input_norm", "pre_ff_layernorm": "ffn_norm",
          **{f"self_attn.{p}_proj": f"attention.{p}_proj" for p in "qkvo"},
          "feed_forward.down_proj": "mlp.down_proj"}
_ADAPTERS = {**{f"self_attn.linear_{p}_adapter_list": f"attention.{p}_adapter" for p in "qkv"},
             "feed_forward.gate_up_proj_adapter_list": "mlp_adapter"}
_ADAPTER_PARTS = {"0.weight": "down.weight", "1.weight": "up.weight"}


def _uses(config: HybridConfig) -> dict[int, tuple[int, int]]:
    """Shared-block use index -> (layer index, block id)."""
    return {layer.shared_block.use_index: (i, layer.shared_block.block_id)
            for i, layer in enumerate(config.layers) if layer.shared_block is not None}


def _shared_block(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    """``rest`` of ``layers.{i}.shared_transformer.``."""
    uses = _uses(config)
    here = next((block for layer, block in uses.values() if layer == i), None)
    if here is None:
        return None
    first_layer = uses[min(u for u, (_, b) in uses.items() if b == here)][0]
    if i != first_layer:
        return []                                       # a tied copy of the first use's tensors
    if rest.startswith(("feed_forward.gate_up_proj.", "feed_forward.gate_up_proj_bias")):
        return fused_gate_up(f"shared_blocks.{here}.mlp", "." + rest.rpartition(".")[2])
    for hf, ours in _ADAPTERS.items():
        if rest.startswith(hf + "."):
            index, _, part = rest.removeprefix(hf + ".").partition(".")
            use = uses.get(int(index)) if index.isdigit() else None
            if use is None or use[1] != here or part not in _ADAPTER_PARTS:
                return None
            return [Target(name=f"layers.{use[0]}.shared.{ours}.{_ADAPTER_PARTS[part]}")]
    return rename_module(rest, _BLOCK, prefix=f"shared_blocks.{here}.")


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    if rest.startswith("shared_transformer."):
        return _shared_block(i, rest.removeprefix("shared_transformer."), config)
    for hf in ("mamba", "mamba_decoder.mamba"):
        if found := mamba2_param(rest, hf, f"layers.{i}.mixer"):
            return found
    return rename_module(rest, _MAMBA_LAYER, prefix=f"layers.{i}.")


zamba2 = register_weight_map("Zamba2ForCausalLM")(decoder_map(layer=_layer, top=_TOP))
