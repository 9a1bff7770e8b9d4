"""Tiny random HF transformers models of the attention families and Mamba2, saved as real checkpoints.

Each builder returns an HF model (eager attention, fp32, eval) whose weights are re-drawn at a larger
scale than HF's init (std 0.02 gives near-uniform logits, where greedy decoding is decided by noise):
matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1) (N(0, 1/hidden)
when tied), norm weights near their identity value, Mamba's
A_log / dt_bias / D left as HF initialises them. Windows and chunks are 4-8 tokens, so prompts of a
few dozen tokens cross them many times.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3nConfig,
    Gemma3nForCausalLM,
    Gemma3nForConditionalGeneration,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteMoeSWAConfig,
    GraniteMoeSWAForCausalLM,
    GraniteSWAConfig,
    GraniteSWAForCausalLM,
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    Mamba2Config,
    Mamba2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

VOCAB = 160
_SMALL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter (see the module docstring for the scales)."""
    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    tied = model.get_output_embeddings() is None or (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("A_log", "dt_bias", "D"):
            continue
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name and p.ndim == 1:
            p.copy_(0.1 * noise + (0.0 if gemma else 1.0))
        elif leaf == "bias":
            p.copy_(0.1 * noise)
        elif "embed" in name:    # tied (Gemma): also the output layer, so scaled like one
            p.copy_(noise / p.shape[-1] ** 0.5 if tied else noise)
        elif "experts" in name and p.ndim == 3:           # Llama-4 fused experts: (E, in, out)
            p.copy_(noise / p.shape[1] ** 0.5)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


def _finish(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    randomize(model, seed)
    return model.eval()


def _eager(config):
    config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = "eager"
    return config


def llama4_text_config(**overrides) -> Llama4TextConfig:
    """4 layers: chunked RoPE, chunked RoPE (MoE), chunked RoPE, global NoPE (MoE); chunk 8;
    temperature tuning with floor_scale 4 so the NoPE layer's q scale changes every few tokens."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              no_rope_layers=[1, 1, 1, 0], moe_layers=[1, 3], num_local_experts=4, num_experts_per_tok=1,
              attention_chunk_size=8, floor_scale=4, attn_scale=0.25, use_qk_norm=True,
              max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    kw.update(overrides)
    return _eager(Llama4TextConfig(**kw))


def llama4(seed: int = 0) -> PreTrainedModel:
    return _finish(Llama4ForCausalLM(llama4_text_config()), seed)


def llama4_multimodal(seed: int = 0) -> PreTrainedModel:
    from transformers import Llama4VisionConfig

    vision = Llama4VisionConfig(image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=32, pixel_shuffle_ratio=0.5, **_SMALL_VISION)
    config = Llama4Config(text_config=llama4_text_config().to_dict(), vision_config=vision.to_dict(),
                          image_token_index=VOCAB - 1)
    return _finish(Llama4ForConditionalGeneration(_eager(config)), seed)


def mistral(seed: int = 0) -> PreTrainedModel:
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                           max_position_embeddings=4096, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    return _finish(MistralForCausalLM(_eager(config)), seed)


def gemma2(seed: int = 0) -> PreTrainedModel:
    """Sliding 5 / global alternating, attention softcap 20, final softcap 5 (so both bite). Untied:
    with random tied embeddings greedy decoding collapses into repeating one token (the multimodal
    Gemma-3 below keeps them tied)."""
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                          query_pre_attn_scalar=16, attn_logit_softcapping=20.0, final_logit_softcapping=5.0,
                          max_position_embeddings=4096, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    return _finish(Gemma2ForCausalLM(_eager(config)), seed)


def gemma3_text_config(**overrides) -> Gemma3TextConfig:
    """Pattern sliding, sliding, global, sliding (window 4); local and global RoPE differ (linear x2)."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
              query_pre_attn_scalar=16, max_position_embeddings=4096,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                                  "factor": 2.0}})
    kw.update(overrides)
    return _eager(Gemma3TextConfig(**kw))


def gemma3(seed: int = 0) -> PreTrainedModel:
    return _finish(Gemma3ForCausalLM(gemma3_text_config(tie_word_embeddings=False)), seed)


def gemma3_multimodal(seed: int = 0) -> PreTrainedModel:
    from transformers import SiglipVisionConfig

    vision = SiglipVisionConfig(image_size=28, patch_size=14, **_SMALL_VISION)
    config = Gemma3Config(text_config=gemma3_text_config().to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2,
                          eoi_token_index=VOCAB - 3)
    return _finish(Gemma3ForConditionalGeneration(_eager(config)), seed)


def mamba2(seed: int = 0) -> PreTrainedModel:
    """3 layers, 4 heads x 16, 2 groups, state 8, SSD chunk 8 (so the scan crosses chunks)."""
    config = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, expand=2, state_size=8,
                          n_groups=2, conv_kernel=4, chunk_size=8, num_hidden_layers=3,
                          tie_word_embeddings=False, use_cache=False)
    return _finish(Mamba2ForCausalLM(config), seed)


def gpt_oss_config(**overrides) -> GptOssConfig:
    """4 layers: sliding (window 4), full, sliding, full; 4 experts, top-2; YaRN RoPE with a short original
    context (32 positions, factor 4, betas 4 / 0.25) so the ramp between extrapolated and interpolated
    frequencies spans dims 0-3 of head_dim 16's 8 and the attention factor is 1.14; the SwiGLU limit at 1.0 (the
    released 7.0 never bites at these scales) so both clamps act."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
              swiglu_limit=1.0, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0,
              rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 4.0,
                               "beta_slow": 0.25, "truncate": False, "original_max_position_embeddings": 32})
    kw.update(overrides)
    return _eager(GptOssConfig(**kw))


@torch.no_grad()
def gpt_oss(seed: int = 0) -> PreTrainedModel:
    """The sinks drawn at magnitudes 1-3 with random signs (HF's init, std 0.02, would leave them inert)."""
    model = _finish(GptOssForCausalLM(gpt_oss_config()), seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    for layer in model.model.layers:
        sinks = layer.self_attn.sinks
        sign = torch.randint(0, 2, sinks.shape, generator=gen) * 2 - 1
        sinks.copy_(sign * (1 + 2 * torch.rand(sinks.shape, generator=gen)))
    return model


@torch.no_grad()
def _random_sinks(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Sinks drawn at magnitudes 1-3 with random signs (HF's init, zeros or std 0.02, would leave them inert)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for layer in model.model.layers:
        sinks = layer.self_attn.sinks
        sign = torch.randint(0, 2, sinks.shape, generator=gen) * 2 - 1
        sinks.copy_(sign * (1 + 2 * torch.rand(sinks.shape, generator=gen)))
    return model


def cohere2(seed: int = 0) -> PreTrainedModel:
    """Sliding (window 4, interleaved RoPE), sliding, sliding, global NoPE (pattern 4); biased attention; the
    parallel block under one bias-free LayerNorm; logit_scale 0.5; untied (tied random embeddings collapse
    greedy decoding into one repeated token, see ``gemma2``)."""
    config = Cohere2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, sliding_window_pattern=4,
                           attention_bias=True, logit_scale=0.5, max_position_embeddings=4096,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    return _finish(Cohere2ForCausalLM(_eager(config)), seed)


def exaone4(seed: int = 0) -> PreTrainedModel:
    """Pattern "LLLG" as layer types: sliding (window 4) x3 with RoPE, global NoPE; q/k norms; post-norms only."""
    config = Exaone4Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                           sliding_window_pattern=4, max_position_embeddings=4096, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    return _finish(Exaone4ForCausalLM(_eager(config)), seed)


def granite_swa(seed: int = 0) -> PreTrainedModel:
    """Global (NoPE: theta 0), sliding (window 4) x2, global; two RoPE bases; sinks; µP multipliers."""
    config = GraniteSWAConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                              layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                           "full_attention"],
                              layer_rope_theta=[0, 1000.0, 100.0, 1000.0], attention_bias=True, mlp_bias=True,
                              embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                              logits_scaling=2.0, max_position_embeddings=4096, tie_word_embeddings=False,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    return _random_sinks(_finish(GraniteSWAForCausalLM(_eager(config)), seed), seed)


def granitemoe_swa(seed: int = 0, *, shared: bool = True) -> PreTrainedModel:
    """Granite-SWA's layer mix (global NoPE, sliding (window 4) x2 on two RoPE bases, global), sinks and µP
    multipliers, with 4 experts top-2 on every layer; ``shared``: the shared MLP beside them (HF's default: off)."""
    config = GraniteMoeSWAConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                 layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                              "full_attention"],
                                 layer_rope_theta=[0, 1000.0, 100.0, 1000.0], attention_bias=True,
                                 num_local_experts=4, num_experts_per_tok=2,
                                 shared_intermediate_size=48 if shared else 0,
                                 embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                 logits_scaling=2.0, max_position_embeddings=4096, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    return _random_sinks(_finish(GraniteMoeSWAForCausalLM(_eager(config)), seed), seed)


_GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma4_text_config(**overrides) -> Gemma4TextConfig:
    """8 layers "SSFSSFSF", window 6; the last 3 share KV (layer 5 reads 2's, 6 reads 4's, 7 reads 2's) and
    have double-wide MLPs; global layers of head dim 32 (sliding: 16), proportional RoPE (theta 10^4: the rotated
    quarter turns visibly at these lengths); per-layer inputs of 8; final softcap."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=6, layer_types=_GEMMA4_TYPES,
              num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
              use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=256,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 10_000.0}})
    kw.update(overrides)
    return _eager(Gemma4TextConfig(**kw))


@torch.no_grad()
def _gemma4_finish(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """``randomize``, with Gemma-4's norms near 1 (they scale by w, not 1 + w) and random layer scalars. Softmax scale
    1 on unit-RMS q and k makes attention logits ~N(0, head_dim): q/k norm weights near 0.5 keep them ~N(0, head_dim
    / 16). Post-normed branches (three per layer) still amplify rounding: HF's own fp32 log-probabilities sit ~2e-5
    from its fp64 ones on these models (weights near 1 gave ~3e-4, too close to the parity tolerance)."""
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name and p.ndim == 1:
            p.add_(0.5 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0)
        elif name.endswith(("router.scale", "router.per_expert_scale")):    # the MoE router's scales: off 1
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return model.eval()


def gemma4(seed: int = 0) -> PreTrainedModel:
    """Distinct global KV shape (head dim 32 vs 16), separate k / v projections."""
    return _gemma4_finish(Gemma4ForCausalLM(gemma4_text_config()), seed)


def gemma4_k_eq_v(seed: int = 0) -> PreTrainedModel:
    """``attention_k_eq_v``: the global layers have 1 KV head of dim 32 whose values are their keys."""
    return _gemma4_finish(Gemma4ForCausalLM(gemma4_text_config(attention_k_eq_v=True, num_global_key_value_heads=1)),
                          seed)


def gemma4_global512(seed: int = 0) -> PreTrainedModel:
    """The released global shape: 8 q heads on one KV head of 512 (sliding layers: one KV head of 16)."""
    return _gemma4_finish(Gemma4ForCausalLM(gemma4_text_config(num_attention_heads=8, num_key_value_heads=1,
                                                               global_head_dim=512)), seed)


def gemma4_moe(seed: int = 0) -> PreTrainedModel:
    """The 26B-A4B block: every layer's dense MLP beside 4 routed experts of 24 (top 2)."""
    return _gemma4_finish(Gemma4ForCausalLM(gemma4_text_config(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                                               moe_intermediate_size=24)), seed)


def gemma4_multimodal(seed: int = 0) -> PreTrainedModel:
    """The text decoder inside ``Gemma4ForConditionalGeneration`` (no vision / audio config: text only)."""
    config = _eager(Gemma4Config(text_config=gemma4_text_config().to_dict(), vision_config=None, audio_config=None))
    return _gemma4_finish(Gemma4ForConditionalGeneration(config), seed)


def gemma3n_text_config(**overrides) -> Gemma3nTextConfig:
    """8 layers "SSFSSFSF", window 6; the last 3 share KV (layer 5 reads 2's, 6 reads 4's, 7 reads 2's); MLP widths
    per layer with activation sparsity 0.95 and 0.6 on the first two; 4 AltUp streams, Laurel rank 4, per-layer
    inputs of 8 from a table of 128 rows (ids past it read row 0); final softcap."""
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=[48, 64, 48, 40, 48, 64, 48, 56], num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6, layer_types=_GEMMA4_TYPES,
              num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
              activation_sparsity_pattern=[0.95, 0.6] + [0.0] * 6, altup_num_inputs=4, laurel_rank=4,
              final_logit_softcapping=30.0, max_position_embeddings=256,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    kw.update(overrides)
    return _eager(Gemma3nTextConfig(**kw))


@torch.no_grad()
def _gemma3n_finish(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Gemma-4's scales (norms near 1, q/k norms near 0.5), with AltUp's output scales drawn around 1 and its
    router and coefficients larger than ``randomize`` makes them, so each layer's stream mixing is visible."""
    _gemma4_finish(model, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    for name, p in model.named_parameters():
        if name.endswith("correct_output_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        elif name.endswith(("altup.modality_router.weight", "prediction_coefs.weight", "correction_coefs.weight")):
            p.mul_(4.0 if "router" in name else 0.5)
    return model.eval()


def gemma3n(seed: int = 0) -> PreTrainedModel:
    return _gemma3n_finish(Gemma3nForCausalLM(gemma3n_text_config()), seed)


def gemma3n_multimodal(seed: int = 0) -> PreTrainedModel:
    """The text decoder inside ``Gemma3nForConditionalGeneration``, beside a tiny audio tower and the multimodal
    embedders (all skipped by the loader). HF builds the vision tower through timm, which the tests do not need:
    it stands in as one small linear (text-only input never reaches it; its tensors are still in the checkpoint
    under ``model.vision_tower.``)."""
    from unittest import mock

    from transformers import Gemma3nAudioConfig, Gemma3nVisionConfig
    from transformers.models.gemma3n import modeling_gemma3n

    config = _eager(Gemma3nConfig(text_config=gemma3n_text_config().to_dict(),
                                  vision_config=Gemma3nVisionConfig(hidden_size=16, vocab_size=8).to_dict(),
                                  audio_config=Gemma3nAudioConfig(
                                      hidden_size=16, vocab_size=8, conf_num_attention_heads=2,
                                      conf_num_hidden_layers=1, sscp_conv_channel_size=[4, 4]).to_dict()))
    build = modeling_gemma3n.AutoModel.from_config

    def from_config(cfg, *args, **kwargs):
        if isinstance(cfg, Gemma3nVisionConfig):
            return torch.nn.Linear(4, 4, bias=False)
        return build(cfg, *args, **kwargs)

    with mock.patch.object(modeling_gemma3n.AutoModel, "from_config", side_effect=from_config):
        model = Gemma3nForConditionalGeneration(config)
    return _gemma3n_finish(model, seed)


FAMILIES: dict[str, Callable[[int], PreTrainedModel]] = {
    "llama4": llama4, "llama4_multimodal": llama4_multimodal, "mistral": mistral, "gemma2": gemma2,
    "gemma3": gemma3, "gemma3_multimodal": gemma3_multimodal, "mamba2": mamba2, "gpt_oss": gpt_oss,
    "cohere2": cohere2, "exaone4": exaone4, "granite_swa": granite_swa,
    "granitemoe_swa": granitemoe_swa, "granitemoe_swa_no_shared": lambda seed=0: granitemoe_swa(seed, shared=False),
    "gemma4": gemma4,
    "gemma4_k_eq_v": gemma4_k_eq_v, "gemma4_global512": gemma4_global512, "gemma4_moe": gemma4_moe,
    "gemma4_multimodal": gemma4_multimodal,
    "gemma3n": gemma3n, "gemma3n_multimodal": gemma3n_multimodal,
}


def save(model: PreTrainedModel, directory: Path, **kwargs) -> Path:
    """``save_pretrained``, with config.json's special floats spelled as released hub checkpoints spell
    them (bare ``Infinity``): transformers 5.x writes ``{"__float__": "Infinity"}`` instead, which
    hybridkv's config reader does not decode yet (reported)."""
    model.save_pretrained(str(directory), **kwargs)
    file = directory / "config.json"

    def decode(obj: dict) -> object:
        return float(obj["__float__"]) if set(obj) == {"__float__"} else obj

    file.write_text(json.dumps(json.loads(file.read_text(), object_hook=decode), indent=2))
    return directory


@torch.no_grad()
def full_logits(model: PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 logits (len, vocab) of one no-cache forward over ``tokens``.

    Llama-4's multimodal wrapper runs its ``language_model`` on text-only input (same embedding table, same
    layers), and that is what is called here: transformers 5.24's wrapper fails after that call, building its
    output from an ``image_outputs`` field the language model's output does not have."""
    ids = torch.tensor([list(tokens)])
    if isinstance(model, Llama4ForConditionalGeneration):
        model = model.language_model
    return model(input_ids=ids, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by argmax over repeated full forwards (no HF cache path involved)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(full_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]
