"""NemotronH (``NemotronHForCausalLM``): every layer is one pre-norm plus one part, a Mamba2 mixer,
NoPE attention, a relu² MLP or a sigmoid-routed MoE (ours: ``mixer`` for the first two, ``ffn`` for the
others, with the layer's one norm as ``input_norm`` or ``ffn_norm`` accordingly).

The hub uses the ``backbone.`` prefix and one tensor per routed expert
(``mixer.experts.{e}.{up,down}_proj.weight``); ``save_pretrained`` in transformers 5.23 writes exactly
that. The 5.x in-memory form (``model.`` prefix, stacked ``mixer.experts.up_proj`` (E, I, H) /
``down_proj`` (E, H, I)) is read too. Multi-token-prediction weights (``mtp.``) are not part of the
decoder and are read past."""

from __future__ import annotations

from hybridkv.loaders.families.bamba import mamba2_modules, mamba2_param
from hybridkv.loaders.families.jamba import routed_experts
from hybridkv.loaders.families.mistral import IGNORED_SUFFIXES
from hybridkv.loaders.weights import Target, register_weight_map, rename_module, split_layer
from hybridkv.models.config import HybridConfig

_MIXER_MODULES = {**mamba2_modules("mixer", "mixer"),
                  **{f"mixer.{p}_proj": f"mixer.{p}_proj" for p in "qkvo"}}
_FFN_MODULES = {
    "mixer.up_proj": "ffn.up_proj", "mixer.down_proj": "ffn.down_proj",                  # dense MLP
    "mixer.gate": "ffn.router",
    **{f"mixer.shared_experts.{p}_proj": f"ffn.shared.{p}_proj" for p in ("up", "down")},
    "mixer.fc1_latent_proj": "ffn.fc1_latent_proj", "mixer.fc2_latent_proj": "ffn.fc2_latent_proj",
}
_TOP = {"embeddings.weight": "embed_tokens.weight", "embedding.weight": "embed_tokens.weight",
        "norm_f.weight": "norm.weight"}


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    has_mixer = i < len(config.layers) and config.layers[i].mixer is not None
    if rest in ("norm.weight", "norm.bias"):
        return [Target(name=f"layers.{i}.{'input_norm' if has_mixer else 'ffn_norm'}.{rest[5:]}")]
    if has_mixer:
        return (mamba2_param(rest, "mixer", f"layers.{i}.mixer")
                or rename_module(rest, _MIXER_MODULES, prefix=f"layers.{i}."))
    if rest == "mixer.gate.e_score_correction_bias":
        return [Target(name=f"layers.{i}.ffn.correction_bias")]
    if rest.startswith("mixer.experts."):
        return routed_experts(rest.removeprefix("mixer.experts."), f"layers.{i}.ffn", ("up", "down"))
    return rename_module(rest, _FFN_MODULES, prefix=f"layers.{i}.")


@register_weight_map("NemotronHForCausalLM")
def nemotron_h(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "lm_head.weight":
        return [Target(name="lm_head.weight")]
    if name.startswith("mtp."):
        return []
    prefix = next((p for p in ("backbone.", "model.") if name.startswith(p)), None)
    if prefix is None:
        return None
    name = name.removeprefix(prefix)
    if name.endswith(IGNORED_SUFFIXES):
        return []
    if name in _TOP:
        return [Target(name=_TOP[name])]
    layer = split_layer(name)
    return _layer(*layer, config) if layer is not None else None
