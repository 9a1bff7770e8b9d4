"""Bad layer mixes are clear errors naming the layer and field; oversized windows/chunks plan as full."""

from __future__ import annotations

import pytest

from hybridkv.kv_groups import FullAttentionSpec, SlidingWindowSpec
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, MoE


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
    (lambda: HybridConfig(vocab_size=10, hidden_size=8, layers=()), "layers is empty"),
])
def test_bad_layer_descriptions(make, match):
    with pytest.raises(ValueError, match=match):
        make()


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
