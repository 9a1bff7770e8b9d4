"""Gemma-4's text decoder through the whole stack against HF transformers, in fp32.

The tiny random models (``tests/_hf_models.py``: 8 layers "SSFSSFSF", window 6) have every Gemma-4 feature on:
the last 3 layers read an earlier layer's KV cache (one of each kind) with double-wide MLPs, global layers of
twice the sliding head dim (and with ``attention_k_eq_v`` one KV head whose values are its keys; with the MoE block
a dense MLP beside routed experts), proportional
RoPE, the weightless value norm, per-layer inputs, random layer scalars and the final softcap. Each is written by
``save_pretrained`` and loaded by ``LLM(path)`` with 4-token blocks and an 8-token step budget (prefills run in
chunks): the same 32 greedy tokens as HF and per-step log-probabilities within 1e-4 of HF's full forward, with
prefix caching on (hits) and off. The HF oracle is an argmax loop over full forwards (no HF cache code involved).
The plan's KV-sharing layers own no pages: the tests here check it on the loaded model's plan too.
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
from transformers import PreTrainedModel

from hybridkv import LLM
from hybridkv.kv_groups.specs import KVSharingSpec
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.models.config import Attention, DenseMoE

TOL = 1e-4
NEW_TOKENS = 32
# family -> seed: greedy output stays diverse for these prompts.
SEEDS = {"gemma4": 0, "gemma4_k_eq_v": 0, "gemma4_moe": 0, "gemma4_multimodal": 0}
QUICK = ()          # each checkpoint's HF oracle and engine runs take 20-40 s on 2 cores: the slow tier


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    base = [torch.randint(3, hf_models.VOCAB - 4, (n,), generator=gen).tolist() for n in (3, 37)]
    return base + [base[1] + torch.randint(3, hf_models.VOCAB - 4, (9,), generator=gen).tolist()]


@pytest.fixture(scope="module", params=[f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in SEEDS])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, PreTrainedModel, Path, dict]:
    """The family, the HF model, its checkpoint, and HF's greedy tokens and logits per prompt."""
    return hf_checkpoint(request.param, SEEDS[request.param], tmp_path_factory.mktemp(request.param), _prompts(),
                         new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_engine_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict], prefix_caching: bool) -> None:
    name, _, path, expected = checkpoint
    check_engine_matches_hf(path, _prompts(), expected, new_tokens=NEW_TOKENS, prefix_caching=prefix_caching,
                            label=f"{name}: ")


def test_engine_matches_hf_quick(tmp_path: Path) -> None:
    """The quick tier's end-to-end check: shorter prompts (3, 20 and 25 tokens, windows crossed 3-4 times), 8
    greedy tokens, prefix caching on (the second pass and the extending prompt hit the cache)."""
    hf = hf_models.FAMILIES["gemma4"](SEEDS["gemma4"])
    path = hf_models.save(hf, tmp_path)
    gen = torch.Generator().manual_seed(99)
    short = [torch.randint(3, hf_models.VOCAB - 4, (n,), generator=gen).tolist() for n in (3, 20)]
    prompts = short + [short[1] + torch.randint(3, hf_models.VOCAB - 4, (5,), generator=gen).tolist()]
    expected = {}
    for prompt in prompts:
        tokens = hf_models.hf_greedy(hf, prompt, 8)
        expected[tuple(prompt)] = (tokens, hf_models.full_logits(hf, prompt + tokens))
    check_engine_matches_hf(path, prompts, expected, new_tokens=8, prefix_caching=True, label="gemma4 quick: ")


def test_prompt_logprobs_match_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    name, _, path, expected = checkpoint
    check_prompt_logprobs(path, _prompts()[1], expected, label=f"{name}: ")


def test_reference_forward_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """The loaded model alone (one no-cache forward), independent of the engine."""
    name, hf, path, _ = checkpoint
    check_reference_forward(hf, path, _prompts(), label=f"{name}: ")


@pytest.mark.parametrize("name", ["gemma4", "gemma4_k_eq_v"])
def test_sharing_layers_own_no_pages(name: str, tmp_path: Path) -> None:
    """The engine's plan: layers 5-7 read the caches of layers 2, 4 and 2, no group lists them as owners, and the
    allocator hands each its donor's tensor; the global and sliding groups are sized by their own shapes."""
    hf = hf_models.FAMILIES[name](0)
    path = hf_models.save(hf, tmp_path)
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu", kv_cache_memory="8MiB")
    plan = llm.engine.plan
    readers = {r: d for g in plan.groups for r, d in g.readers}
    assert readers == {"layers.5": "layers.2", "layers.6": "layers.4", "layers.7": "layers.2"}
    assert not {n for g in plan.groups for n in g.layer_names} & set(readers)
    assert plan.padding_bytes == 0 and plan.kv_shared_bytes_per_request > 0
    caches = llm.engine.runner.caches
    assert all(caches[r][0] is caches[d][0] for r, d in readers.items())
    shapes = {(g.spec.num_kv_heads, g.spec.head_size) for g in plan.groups}
    k_eq_v = hf.config.get_text_config().attention_k_eq_v
    assert shapes == {(2, 16), (1 if k_eq_v else 2, 32)}


def test_config_follows_hf_modules() -> None:
    """Per layer, our head dim, KV heads, KV donor, MLP width, value norm and k_eq_v are what HF's modules and
    ``kv_sharing_modes`` give, for a config spelled with ``global_head_dim`` (as released) and for its
    ``to_dict()`` (``per_layer_config``)."""
    config = hf_models.gemma4_text_config(attention_k_eq_v=True, num_global_key_value_heads=1)
    with torch.device("meta"):
        hf = hf_models.Gemma4ForCausalLM(config)
    raw = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"} | {"global_head_dim": 32,
                                                                                      "num_global_key_value_heads": 1}
    for source in (config.to_dict(), raw):
        ours = hf_config_to_hybrid(source)
        modes = config.kv_sharing_modes
        for i, (layer, theirs) in enumerate(zip(ours.layers, hf.model.layers, strict=True)):
            attn = theirs.self_attn
            mixer = layer.mixer
            assert isinstance(mixer, Attention)
            assert (mixer.head_dim, mixer.num_kv_heads) == (attn.head_dim, config.num_attention_heads
                                                            // attn.num_key_value_groups), i
            assert (mixer.kv_source is not None) == (modes[i] == "reuse") == attn.is_kv_shared_layer, i
            assert mixer.k_eq_v == (not attn.is_kv_shared_layer and attn.v_proj is None), i
            assert layer.ffn.intermediate_size == theirs.mlp.intermediate_size, i
            assert (mixer.sliding_window is not None) == attn.is_sliding and mixer.scale == attn.scaling == 1.0
        donors = [m.kv_source for m in (layer.mixer for layer in ours.layers)]
        stores = [i for i, m in enumerate(modes) if m == "store"]
        assert sorted({d for d in donors if d is not None}) == stores == [2, 4]
    specs = hf_config_to_hybrid(config.to_dict()).kv_specs(block_size=4)
    assert [n for n, s in specs.items() if isinstance(s, KVSharingSpec)] == ["layers.5", "layers.6", "layers.7"]


@pytest.mark.parametrize(("head_dim", "factor"), [(32, 0.25), (512, 0.25), (64, 0.5)])
def test_proportional_rope_is_hfs(head_dim: int, factor: float) -> None:
    """Our proportional inverse frequencies (the whole head rotated, the first quarter of the pairs turning) are HF's
    ``_compute_proportional_rope_parameters`` for the global layers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hybridkv.layers.rotary import RotaryEmbedding
    from hybridkv.models.config import Rope

    config = hf_models.gemma4_text_config(global_head_dim=head_dim, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": factor, "rope_theta": 1e6}})
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    ours = RotaryEmbedding(head_dim, Rope(theta=1e6, scaling="proportional", partial_rotary_factor=factor))
    assert ours.rot_dim == head_dim and torch.equal(ours.inv_freq, theirs)


def test_moe_block_follows_hf_modules() -> None:
    """``enable_moe_block``: every layer a ``DenseMoE`` (dense MLP of the layer's width beside the experts)."""
    config = hf_models.gemma4_text_config(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                          moe_intermediate_size=24)
    with torch.device("meta"):
        hf = hf_models.Gemma4ForCausalLM(config)
    for layer, theirs in zip(hf_config_to_hybrid(config.to_dict()).layers, hf.model.layers, strict=True):
        assert isinstance(layer.ffn, DenseMoE) and layer.ffn.mlp.intermediate_size == theirs.mlp.intermediate_size
        moe = layer.ffn.moe
        assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, theirs.experts.intermediate_dim)


def test_unsupported_configs_are_refused() -> None:
    base = hf_models.gemma4_text_config().to_dict()
    with pytest.raises(ValueError, match="bidirectional"):
        hf_config_to_hybrid(base | {"use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        hf_config_to_hybrid(base | {"num_kv_shared_layers": 8})
    with pytest.raises(ValueError, match="none of the first"):      # shared full layers, no full layer before
        hf_config_to_hybrid(base | {"layer_types": ["sliding_attention"] * 7 + ["full_attention"]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_backend_and_cuda_graphs_on_gpu_match_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """On CUDA with the triton backend (KV-sharing layers: q-only prep then paged attention over the donor's
    blocks, inside captured decode graphs too; proportional RoPE, value norm; fp32 attention in ieee precision):
    eager steps and decode steps captured as CUDA graphs, with prefix caching, give HF's tokens and
    log-probabilities within 1e-4."""
    name, _, path, expected = checkpoint
    check_triton_graphs_match_hf(name, path, _prompts(), expected, new_tokens=NEW_TOKENS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_global_head_dim_512_on_gpu_runs_triton_and_graphs(tmp_path: Path) -> None:
    """Gemma-4's released global shape (8 q heads on one KV head of 512) on the explicit triton backend, which
    lets any refusal through: the paged kernel runs it, eager and inside captured decode graphs, with HF's tokens
    and log-probabilities within 1e-4."""
    name, _, path, expected = hf_checkpoint("gemma4_global512", 0, tmp_path, _prompts(), new_tokens=NEW_TOKENS)
    check_triton_graphs_match_hf(name, path, _prompts(), expected, new_tokens=NEW_TOKENS)
