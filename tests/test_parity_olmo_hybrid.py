"""OLMo-Hybrid (Gated DeltaNet + post-norm attention) end to end against HF transformers (CPU, fp32).

A tiny random ``OlmoHybridForCausalLM`` (``_hf_mamba_models.olmo_hybrid``: DeltaNet layers with unequal key / value
head dims, two value heads per key head and beta doubled, written with the hub's names (split q/k/v convs,
``attention_layer_norm`` ...); OLMo-3 attention with post-norms and q/k normed over all heads) is written by
``save_pretrained`` and loaded by hybridkv from that directory. The engine checks are Qwen3-Next's
(``test_parity_lfm2.check_engine_greedy``): ``LLM.generate`` with 4-token blocks and an 8-token step budget, greedy
tokens equal to HF's and every sampled row's logits within 1e-4, with prefix caching off and on. The NoPE variant
(a null RoPE theta) is checked through a chunked prefill's prompt log-probabilities (``_parity``); the attention
against HF's module through ``LayerHarness``; the config translation against ``OlmoHybridConfig``.
"""

from __future__ import annotations

import pytest
import torch
from _hf_mamba_models import BUILDERS
from _layer_harness import LayerHarness
from _parity import check_prompt_logprobs
from test_layers_vs_hf import SCHEDULES, SEQ, additive_mask, assert_close, hidden, load_exact, randomize, same_names
from test_parity_lfm2 import Checkpoint, check_engine_greedy, check_gpu_backend, check_reference_forward
from transformers import OlmoHybridConfig
from transformers.models.olmo_hybrid import modeling_olmo_hybrid as hf_olmo_hybrid

from hybridkv.layers.attention import AttentionLayer
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.models import MLP, Attention, GatedDeltaNet


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf = BUILDERS["olmo_hybrid"]()
    path = tmp_path_factory.mktemp("olmo_hybrid")
    hf.save_pretrained(path)
    return Checkpoint(hf, path)


@pytest.mark.slow            # ~10 s on 2 cores per caching mode, plus the HF oracle (~5 s, once per module)
@pytest.mark.parametrize("caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_engine_greedy_matches_hf(ckpt: Checkpoint, caching: bool) -> None:
    check_engine_greedy(ckpt, caching, {"GatedDeltaNet", "Attention"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_backend_matches_hf(ckpt: Checkpoint, backend: str) -> None:
    check_gpu_backend(ckpt, backend)


@pytest.mark.slow            # the module's HF oracle
def test_reference_forward_matches_hf(ckpt: Checkpoint) -> None:
    check_reference_forward(ckpt)


def test_nope_prompt_logprobs_match_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A null ``rope_theta``: HF builds no rotary embedding; every prompt row of a chunked prefill matches."""
    hf = BUILDERS["olmo_hybrid_nope"]()
    assert hf.model.rotary_emb is None
    path = tmp_path_factory.mktemp("olmo_hybrid_nope")
    hf.save_pretrained(path)
    prompt = torch.randint(3, hf.config.vocab_size, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float()
    check_prompt_logprobs(path, prompt, {tuple(prompt): ([], logits)}, label="NoPE: ")


# -- the attention against HF's module --------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_attention_matches_hf(sched: str, rope: bool) -> None:
    """q and k each normed over all heads (weights (heads * head_dim,)), then RoPE (or none), GQA."""
    cfg = OlmoHybridConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                           layer_types=["linear_attention", "full_attention"], pad_token_id=None, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0 if rope else None})
    cfg._attn_implementation = "eager"
    hf = hf_olmo_hybrid.OlmoHybridAttention(cfg, 1).eval()
    randomize(hf, 0)
    config = hf_config_to_hybrid({"architectures": ["OlmoHybridForCausalLM"], **cfg.to_dict()})
    ours = AttentionLayer(32, config.layers[1].mixer, cache_name="attn", norm_eps=1e-6)
    load_exact(ours, same_names(hf, [f"{p}_proj.weight" for p in "qkvo"] + ["q_norm.weight", "k_norm.weight"]))
    x = hidden(SEQ, 32, seed=1)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=3).run(x, SCHEDULES[sched])
    pe = None
    if rope:
        rotary = hf_olmo_hybrid.OlmoHybridRotaryEmbedding(cfg)
        pe = rotary(x[None], torch.arange(SEQ)[None])
    with torch.no_grad():
        want = hf(hidden_states=x[None], position_embeddings=pe, attention_mask=additive_mask(SEQ))[0][0]
    assert_close(out, want)


# -- config translation, against HF's own config class ----------------------------------------------------------
_BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, pad_token_id=None, eos_token_id=None)


@pytest.mark.parametrize("extra", [
    dict(num_hidden_layers=8),                                             # full attention on layers 3 and 7
    dict(num_hidden_layers=3),                                             # none of i % 4 == 3: the last
    dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
         num_key_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_allow_neg_eigval=False),
])
def test_config_translation_follows_hf(extra: dict) -> None:
    hf = OlmoHybridConfig(**_BASE, **extra)
    config = hf_config_to_hybrid({"architectures": ["OlmoHybridForCausalLM"], **hf.to_dict()})
    assert config.norm == "rms" and config.norm_eps == hf.rms_norm_eps
    deltanet = GatedDeltaNet(num_k_heads=hf.linear_num_key_heads, num_v_heads=hf.linear_num_value_heads,
                             head_k_dim=hf.linear_key_head_dim, head_v_dim=hf.linear_value_head_dim,
                             norm_eps=1e-5, beta_scale=2.0 if hf.linear_allow_neg_eigval else 1.0)
    for layer, kind in zip(config.layers, hf.layer_types, strict=True):
        assert layer.ffn == MLP(intermediate_size=hf.intermediate_size)
        if kind == "full_attention":
            assert layer.mixer == Attention(num_heads=4, num_kv_heads=hf.num_key_value_heads, head_dim=8,
                                            rope=layer.mixer.rope, qk_norm="rms_full")
            assert layer.mixer.rope.theta == hf.rope_parameters["rope_theta"]
            assert (layer.pre_norm, layer.sandwich_norm) == (False, True)
        else:
            assert layer.mixer == deltanet and layer.pre_norm and not layer.sandwich_norm


def test_defaults_and_rope_spellings() -> None:
    """A config of nothing but its ``model_type`` reads as HF's class defaults; a null theta in either spelling
    (4.x ``rope_theta``, 5.x ``rope_parameters``) is NoPE, as HF builds no rotary embedding then."""
    assert hf_config_to_hybrid({"model_type": "olmo_hybrid"}) == hf_config_to_hybrid(OlmoHybridConfig().to_dict())
    raw = {"model_type": "olmo_hybrid", **_BASE, "num_hidden_layers": 4}

    def rope(**keys: object) -> object:
        return hf_config_to_hybrid({**raw, **keys}).layers[3].mixer.rope

    assert rope().theta == 10000.0 and rope(rope_theta=5e5).theta == 5e5
    assert rope(rope_theta=None) is None
    assert rope(rope_parameters={"rope_type": "default", "rope_theta": None}) is None


def test_config_errors() -> None:
    base = {"architectures": ["OlmoHybridForCausalLM"], **_BASE, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="hidden_act"):
        hf_config_to_hybrid({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="at least one linear_attention and one full_attention"):
        hf_config_to_hybrid({**base, "layer_types": ["linear_attention"] * 2})
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        hf_config_to_hybrid({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="must divide num_v_heads"):
        hf_config_to_hybrid({**base, "linear_num_key_heads": 3})


def test_hf_in_memory_names_load_too(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The names HF's model holds after its load-time renames (one ``conv1d``, ``input_layernorm`` /
    ``post_attention_layernorm`` on both layer kinds) load to the same model as the hub's."""
    from safetensors.torch import save_file

    from hybridkv.engine.model_runner import reference_logits
    from hybridkv.loaders.checkpoint import load_hf_checkpoint

    hf = BUILDERS["olmo_hybrid"]()
    path = tmp_path_factory.mktemp("olmo_hybrid_in_memory")
    hf.config.save_pretrained(path)
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    assert "model.layers.0.linear_attn.conv1d.weight" in tensors and "model.layers.0.input_layernorm.weight" in tensors
    save_file(tensors, str(path / "model.safetensors"))
    seq = torch.randint(3, hf.config.vocab_size, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    got = reference_logits(load_hf_checkpoint(path, dtype=torch.float32), seq)
    assert (got - want).abs().max().item() <= 1e-4
