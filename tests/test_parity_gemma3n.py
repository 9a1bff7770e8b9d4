"""Gemma-3n's text decoder through the whole stack against HF transformers, in fp32.

The tiny random models (``tests/_hf_models.py``: 8 layers "SSFSSFSF", window 6) have every Gemma-3n feature on: the
last 3 layers read an earlier layer's KV cache (one of each kind), 4 AltUp streams (predict / correct, the output
scale, the embedding and unembedding projections), the Laurel branch, activation sparsity on the first two layers'
gates, MLP widths per layer, per-layer inputs from a table shorter than the vocabulary, RoPE per layer type, the
weightless value norm and the final softcap; the multimodal checkpoint adds an audio tower and embedders the loader
skips. Each is written by ``save_pretrained`` and loaded by ``LLM(path)`` with 4-token blocks and an 8-token step
budget: the same greedy tokens as HF (an argmax loop over full forwards) and per-step log-probabilities within 1e-4
of HF's full forward, with prefix caching on (hits) and off. The prompts, tolerances and checks are Gemma-4's
(``test_parity_gemma4``).
"""

from __future__ import annotations

from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from _parity import (
    check_engine_matches_hf,
    check_prompt_logprobs,
    check_reference_forward,
    check_triton_graphs_match_hf,
    hf_checkpoint,
)
from test_parity_gemma4 import NEW_TOKENS, TOL, _prompts
from transformers import PreTrainedModel

from hybridkv import LLM
from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.models.config import MLP, Attention

FAMILIES = ("gemma3n", "gemma3n_multimodal")


@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, PreTrainedModel, Path, dict]:
    """The family, the HF model, its checkpoint, and HF's greedy tokens and logits per prompt."""
    return hf_checkpoint(request.param, 0, tmp_path_factory.mktemp(request.param), _prompts(),
                         new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_engine_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict], prefix_caching: bool) -> None:
    name, _, path, expected = checkpoint
    check_engine_matches_hf(path, _prompts(), expected, new_tokens=NEW_TOKENS, prefix_caching=prefix_caching,
                            label=f"{name}: ")


def test_prompt_logprobs_match_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    name, _, path, expected = checkpoint
    check_prompt_logprobs(path, _prompts()[1], expected, label=f"{name}: ")


def test_reference_forward_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """The loaded model alone (one no-cache forward), independent of the engine."""
    name, hf, path, _ = checkpoint
    check_reference_forward(hf, path, _prompts(), label=f"{name}: ")


def test_engine_matches_hf_quick(tmp_path: Path) -> None:
    """The quick tier's end-to-end check: prompts of 3, 20 and 25 tokens (windows crossed 3-4 times, the last
    extending the second), 8 greedy tokens, prefix caching on (the second pass and the extending prompt hit)."""
    hf = hf_models.FAMILIES["gemma3n"](0)
    path = hf_models.save(hf, tmp_path)
    gen = torch.Generator().manual_seed(99)
    short = [torch.randint(3, hf_models.VOCAB - 4, (n,), generator=gen).tolist() for n in (3, 20)]
    prompts = short + [short[1] + torch.randint(3, hf_models.VOCAB - 4, (5,), generator=gen).tolist()]
    expected = {}
    for prompt in prompts:
        tokens = hf_models.hf_greedy(hf, prompt, 8)
        expected[tuple(prompt)] = (tokens, hf_models.full_logits(hf, prompt + tokens))
    check_engine_matches_hf(path, prompts, expected, new_tokens=8, prefix_caching=True, label="gemma3n quick: ")


def test_sharing_layers_own_no_pages(tmp_path: Path) -> None:
    """Layers 5-7 read the caches of layers 2, 4 and 2 and own no pages; the allocator hands each its donor's
    tensor."""
    path = hf_models.save(hf_models.gemma3n(0), tmp_path)
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu", kv_cache_memory="8MiB")
    plan = llm.engine.plan
    readers = {r: d for g in plan.groups for r, d in g.readers}
    assert readers == {"layers.5": "layers.2", "layers.6": "layers.4", "layers.7": "layers.2"}
    assert not {n for g in plan.groups for n in g.layer_names} & set(readers)
    caches = llm.engine.runner.caches
    assert all(caches[r][0] is caches[d][0] for r, d in readers.items())


def test_config_follows_hf_modules() -> None:
    """Per layer, our KV donor, MLP width and activation sparsity are what HF's modules give; AltUp, Laurel and the
    per-layer inputs carry the config's sizes; the same for ``Gemma3nConfig`` (the multimodal wrapper)."""
    config = hf_models.gemma3n_text_config()
    with torch.device("meta"):
        hf = hf_models.Gemma3nForCausalLM(config)
    wrapped = hf_models.Gemma3nConfig(text_config=config.to_dict()).to_dict()
    for source in (config.to_dict(), wrapped):
        ours = hf_config_to_hybrid(source)
        for i, (layer, theirs) in enumerate(zip(ours.layers, hf.model.layers, strict=True)):
            attn, mixer, mlp = theirs.self_attn, layer.mixer, layer.ffn
            assert isinstance(mixer, Attention) and isinstance(mlp, MLP)
            assert (mixer.head_dim, mixer.scale, mixer.value_norm) == (attn.head_dim, attn.scaling,
                                                                       not attn.is_kv_shared_layer), i
            assert (mixer.kv_source is not None) == attn.is_kv_shared_layer, i
            assert (mixer.sliding_window is not None) == attn.is_sliding, i
            assert (mlp.intermediate_size, mlp.activation_sparsity) == (theirs.mlp.intermediate_size,
                                                                        theirs.mlp.activation_sparsity), i
        assert [m.kv_source for m in (layer.mixer for layer in ours.layers)][5:] == [2, 4, 2]
        assert (ours.altup.num_inputs, ours.altup.active_index, ours.laurel_rank) == (4, 0, 4)
        assert (ours.per_layer_input_size, ours.per_layer_vocab_size, ours.final_softcap) == (8, 128, 30.0)


def test_hf_defaults_and_hub_spelling() -> None:
    """``Gemma3nTextConfig()`` (the E4B-style defaults): every 5th layer global, the first 10 layers sparse at 0.95,
    the last 15 sharing KV; the hub spelling of RoPE (``rope_theta`` / ``rope_local_base_freq``) gives the same."""
    config = hf_config_to_hybrid(hf_models.Gemma3nTextConfig().to_dict())
    mixers = [layer.mixer for layer in config.layers]
    assert len(mixers) == 35 and [i for i, m in enumerate(mixers) if m.sliding_window is None] == list(range(4, 35, 5))
    assert [layer.ffn.activation_sparsity for layer in config.layers] == [0.95] * 10 + [0.0] * 25
    assert [i for i, m in enumerate(mixers) if m.kv_source is not None] == list(range(20, 35))
    assert {m.kv_source for m in mixers[20:]} == {18, 19}
    hub = {k: v for k, v in hf_models.Gemma3nTextConfig().to_dict().items() if k != "rope_parameters"}
    hub |= {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None}
    assert hf_config_to_hybrid(hub) == config


def test_unsupported_configs_are_refused() -> None:
    base = hf_models.gemma3n_text_config().to_dict()
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        hf_config_to_hybrid(base | {"num_kv_shared_layers": 8})
    with pytest.raises(ValueError, match="activation_sparsity_pattern"):
        hf_config_to_hybrid(base | {"activation_sparsity_pattern": [0.5] * 3})
    with pytest.raises(ValueError, match="activation_sparsity"):
        hf_config_to_hybrid(base | {"activation_sparsity_pattern": [1.0] * 8})
    with pytest.raises(ValueError, match="intermediate_size"):
        hf_config_to_hybrid(base | {"intermediate_size": [48] * 7})
    with pytest.raises(ValueError, match="tensor parallelism"):
        hf_config_to_hybrid(base).check_tensor_parallel(2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_backend_and_cuda_graphs_on_gpu_match_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """On CUDA with the triton backend (KV-sharing layers reading their donors' blocks, AltUp's streams and the
    sparse gates inside captured decode graphs too): eager steps and CUDA-graph decode steps, with prefix caching,
    give HF's tokens and log-probabilities within 1e-4."""
    name, _, path, expected = checkpoint
    check_triton_graphs_match_hf(name, path, _prompts(), expected, new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparsity", [0.95, 0.6, 0.3])
def test_gaussian_topk_is_hfs(dtype: torch.dtype, sparsity: float) -> None:
    """``gaussian_topk`` equals HF's ``Gemma3nTextMLP._gaussian_topk`` bit for bit (the quantile rounded to the
    dtype as HF rounds it), and zeroes about ``sparsity`` of a Gaussian row."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    from hybridkv.layers.mlp import DenseMLP, gaussian_topk

    config = hf_models.gemma3n_text_config(activation_sparsity_pattern=[sparsity] * 8)
    theirs = Gemma3nTextMLP(config, layer_idx=0)
    ours = DenseMLP(32, 48, activation="gelu_tanh", activation_sparsity=sparsity)
    gate = torch.randn(64, 4096, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = gaussian_topk(gate, ours.std_multiplier)
    assert torch.equal(out, theirs._gaussian_topk(gate))
    assert abs((out == 0).float().mean().item() - sparsity) < 0.02


@pytest.mark.parametrize("overrides", [dict(altup_correct_scale=False), dict(altup_active_idx=1, altup_num_inputs=2),
                                       dict(num_kv_shared_layers=0, laurel_rank=1)])
def test_reference_forward_variants_match_hf(overrides: dict, tmp_path: Path) -> None:
    """The other AltUp settings (no output scale; another active stream, 2 streams) and no KV sharing: the loaded
    model's no-cache forward against HF's."""
    hf = hf_models._gemma3n_finish(hf_models.Gemma3nForCausalLM(hf_models.gemma3n_text_config(**overrides)), 0)
    model = load_hf_checkpoint(hf_models.save(hf, tmp_path), dtype=torch.float32, device="cpu")
    prompt = _prompts()[1]
    diff = (reference_logits(model, prompt) - hf_models.full_logits(hf, prompt)).abs().max().item()
    assert diff <= TOL, f"{overrides}: max |logit diff| {diff}"
