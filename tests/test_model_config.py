"""Bad layer mixes are clear errors naming the layer and field; oversized windows/chunks plan as full. Every
field is conformed to its type (JSON lists become tuples, ints floats where a float is meant) or refused with
an error naming it: wrong types, NaN / infinite values, sizes beyond int32, more layers than ``MAX_LAYERS``;
HF configs are checked the same way before a converter runs."""

from __future__ import annotations

import time

import pytest

from hybridkv.kv_groups import FullAttentionSpec, SlidingWindowSpec
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, MoE, Rope
from hybridkv.models.config import MAX_LAYERS


def attn(**kw) -> Attention:
    return Attention(**({"num_heads": 4, "num_kv_heads": 2, "head_dim": 8} | kw))


@pytest.mark.parametrize(("make", "match"), [
    (lambda: attn(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (lambda: attn(sliding_window=0), "sliding_window must be positive"),
    (lambda: attn(attention_chunk_size=-4), "attention_chunk_size must be positive"),
    (lambda: attn(sliding_window=4, attention_chunk_size=8), "not both"),
    (lambda: Mamba2(num_heads=6, head_dim=8, state_size=4, n_groups=4), "n_groups=4 must divide num_heads=6"),
    (lambda: MoE(num_experts=2, top_k=3, intermediate_size=8), "top_k=3 exceeds num_experts=2"),
    (lambda: MLP(intermediate_size=8, activation="swish3"), "MLP.activation"),
    (lambda: Layer(mixer="mamba3"), "unknown kind"),
    (lambda: Layer(), "needs a mixer, a feed-forward, or both"),
    (lambda: Layer(mixer=attn(), parallel_ffn=True), "parallel_ffn needs a mixer and a feed-forward"),
    (lambda: Layer(mixer=attn(), ffn=MLP(intermediate_size=8), parallel_ffn=True, sandwich_norm=True),
     "pre-norm only"),
    (lambda: HybridConfig(vocab_size=10, hidden_size=8, norm="layer_rms", layers=(Layer(mixer=attn()),)),
     "HybridConfig.norm must be one of"),
    (lambda: HybridConfig(vocab_size=10, hidden_size=8, norm="layer", layers=(Layer(mixer=attn(qk_norm="rms")),)),
     "no q/k norm flavour"),
    (lambda: HybridConfig(vocab_size=10, hidden_size=8, residual_in_fp32=True,
                          layers=(Layer(mixer=attn(), sandwich_norm=True, pre_norm=False),)), "needs pre-norms"),
    (lambda: HybridConfig(vocab_size=10, hidden_size=8, layers=()), "layers is empty"),
])
def test_bad_layer_descriptions(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def config(**kw) -> HybridConfig:
    return HybridConfig(**({"vocab_size": 10, "hidden_size": 16, "layers": (Layer(mixer=attn()),)} | kw))


@pytest.mark.parametrize(("make", "match"), [
    (lambda: config(hidden_size="64"), r"HybridConfig\.hidden_size must be an integer, got '64' \(str\)"),
    (lambda: config(hidden_size=True), r"hidden_size must be an integer, got True \(bool\)"),
    (lambda: config(hidden_size=64.0), r"hidden_size must be an integer, got 64\.0 \(float\)"),
    (lambda: config(hidden_size=10**12), r"hidden_size=1000000000000 is out of range \(at most 2147483647\)"),
    (lambda: config(norm_eps=float("nan")), r"HybridConfig\.norm_eps must be finite"),
    (lambda: config(logits_multiplier="2"), r"logits_multiplier must be a number, got '2'"),
    (lambda: config(layers=(Layer(mixer=attn()),) * (MAX_LAYERS + 1)), rf"{MAX_LAYERS + 1} layers is more than"),
    (lambda: config(layers=({"mixer": None},)), r"HybridConfig\.layers\[0\] must be a Layer"),
    (lambda: config(eos_token_ids=[1, "2"]), r"eos_token_ids\[1\] must be an integer"),
    (lambda: attn(rope=Rope(theta=float("inf"))), r"Rope\.theta must be finite"),
    (lambda: attn(qkv_bias="yes"), r"Attention\.qkv_bias must be true or false, got 'yes'"),
    (lambda: attn(head_dim=None), r"Attention\.head_dim must be an integer, got None"),
    (lambda: Layer(mixer={"type": "Attention"}), r"Layer\.mixer: unknown kind dict"),
    (lambda: Mamba2(num_heads=4, head_dim=8, state_size=4, time_step_limit=(0.1, 0.01)), "0 <= low <= high"),
    (lambda: Mamba2(num_heads=4, head_dim=8, state_size=4, zxbcdt_multipliers=(1.0,)), "needs 5 values"),
    (lambda: MoE(num_experts=2, top_k=1, intermediate_size=8, shared_intermediate_size=-1), "must be >= 0"),
])
def test_fields_of_the_wrong_type_or_range(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_fields_are_conformed_to_their_types():
    cfg = config(eos_token_ids=[1, 2], layers=[Layer(mixer=attn(qkv_bias=1, rope=Rope(theta=500)))])
    assert cfg.eos_token_ids == (1, 2) and isinstance(cfg.layers, tuple)
    mixer = cfg.layers[0].mixer
    assert mixer.qkv_bias is True and mixer.rope.theta == 500.0 and isinstance(mixer.rope.theta, float)
    assert Mamba2(num_heads=4, head_dim=8, state_size=4).time_step_limit[1] == float("inf")
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg


def test_absurd_sizes_are_refused_before_anything_is_built():
    """Without looping over a million layers (the HF converters build one ``Layer`` per layer)."""
    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"MistralForCausalLM: num_hidden_layers=1000000 is out of range"):
        hf_config_to_hybrid(base | {"num_hidden_layers": 10**6})
    with pytest.raises(ValueError, match=r"MistralForCausalLM: hidden_size must be an integer, got '16'"):
        hf_config_to_hybrid(base | {"hidden_size": "16"})
    with pytest.raises(ValueError, match=r"num_attention_heads=0 is out of range"):
        hf_config_to_hybrid(base | {"num_attention_heads": 0})
    with pytest.raises(ValueError, match=r"hybrid_override_pattern has 1000000 entries"):
        hf_config_to_hybrid({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M" * 10**6})
    data = config().to_dict()
    data["hybridkv_config"]["layers"] *= 10**6
    with pytest.raises(ValueError, match=r"config\.layers: 1000000 layers is more than"):
        HybridConfig.from_dict(data)
    assert time.monotonic() - start < 1.0


def test_serialised_config_errors_name_the_layer():
    cfg = HybridConfig(vocab_size=10, hidden_size=16, layers=(Layer(mixer=attn()), Layer(mixer=attn())))
    data = cfg.to_dict()
    data["hybridkv_config"]["layers"][1]["mixer"]["num_kv_heads"] = 3
    with pytest.raises(ValueError, match=r"layers\[1\]\.mixer: Attention\.num_kv_heads=3"):
        HybridConfig.from_dict(data)
    data["hybridkv_config"]["layers"][1]["mixer"]["type"] = "Mamba3"
    with pytest.raises(ValueError, match=r"layers\[1\]\.mixer: unknown config type 'Mamba3'"):
        HybridConfig.from_dict(data)


def test_kv_spec_errors_name_the_layer():
    cfg = HybridConfig(vocab_size=10, hidden_size=16, layers=(Layer(mixer=attn()),
                                                               Layer(mixer=attn(attention_chunk_size=6))))
    with pytest.raises(ValueError, match=r"layers\.1 .*attention_chunk_size=6 is not a multiple of block_size=4"):
        cfg.kv_specs(block_size=4)


def test_window_or_chunk_beyond_max_positions_behaves_as_full():
    cfg = HybridConfig(vocab_size=10, hidden_size=16, max_position_embeddings=64, layers=(
        Layer(mixer=attn(sliding_window=64)), Layer(mixer=attn(attention_chunk_size=128)),
        Layer(mixer=attn(sliding_window=16))))
    specs = cfg.kv_specs(block_size=16)
    assert isinstance(specs["layers.0"], FullAttentionSpec)
    assert isinstance(specs["layers.1"], FullAttentionSpec)
    assert isinstance(specs["layers.2"], SlidingWindowSpec)


def test_hf_mamba_dims_must_agree():
    with pytest.raises(ValueError, match="inner size"):
        hf_config_to_hybrid({"architectures": ["Mamba2ForCausalLM"], "hidden_size": 64, "expand": 2,
                             "num_heads": 6, "head_dim": 16, "state_size": 8, "n_groups": 1,
                             "num_hidden_layers": 2, "vocab_size": 100})
