"""LFM2 and LFM2-MoE (short convolutions + attention) end to end against HF transformers (CPU, fp32).

A tiny random ``Lfm2ForCausalLM`` (``_hf_mamba_models.lfm2``: convs with biases, q/k-normed attention, the SwiGLU
width rule) and ``Lfm2MoeForCausalLM`` (``lfm2_moe``: dense layers, then sigmoid-routed experts with an expert
bias) are written by ``save_pretrained`` and loaded by hybridkv from that directory. Every prompt runs through
``LLM.generate`` with 4-token blocks and an 8-token step budget, so each is a chunked prefill (the conv state
carried across chunks); greedy tokens must equal HF's (a full forward per step, no HF cache) and every sampled
position's logits be within 1e-4 — with prefix caching off and on. Two prompts share a 22-token prefix: with
caching on the second starts from a conv-state checkpoint (``num_cached_tokens`` > 0), one request after the other
and both in one batch. The config translation is checked against HF's own ``Lfm2Config`` / ``Lfm2MLP`` and
``Lfm2MoeConfig``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _hf_mamba_models import BUILDERS, VOCAB, hf_greedy
from transformers import Lfm2Config, Lfm2MoeConfig, PreTrainedModel
from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.models import MLP, Attention, MoE, ShortConv

NEW_TOKENS = 16
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class Checkpoint:
    def __init__(self, hf: PreTrainedModel, path: Path) -> None:
        rng = np.random.default_rng(7)
        prefix = rng.integers(3, VOCAB, 22).tolist()            # not block-aligned: 5 blocks + 2 tokens
        self.hf, self.path = hf, path
        self.prompts = {"short": rng.integers(3, VOCAB, 5).tolist(),
                        "first": prefix + rng.integers(3, VOCAB, 7).tolist(),
                        "second": prefix + rng.integers(3, VOCAB, 12).tolist()}
        self.oracle = {k: hf_greedy(hf, p, NEW_TOKENS) for k, p in self.prompts.items()}


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf = BUILDERS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return Checkpoint(hf, path)


def make_llm(path: Path, caching: bool, **kw: object) -> LLM:
    args = dict(block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu", kv_cache_memory=1 << 24,
                max_num_seqs=4, enable_prefix_caching=caching)
    return LLM(path, **(args | kw))  # type: ignore[arg-type]


def generate_with_logits(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor, int]:
    """One request through the engine: its tokens, the logits they were sampled from (captured at
    ``compute_logits_and_greedy``; with one request every row is a sampled position), its cached tokens."""
    rows: list[torch.Tensor] = []
    compute = llm.model.compute_logits_and_greedy

    def spy(hidden: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = compute(hidden, **kwargs)
        assert out is not None
        rows.append(out[0].detach().clone())
        return out

    llm.model.compute_logits_and_greedy = spy
    try:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    finally:
        del llm.model.compute_logits_and_greedy
    return list(out.outputs[0].token_ids), torch.cat(rows), out.num_cached_tokens


def check_engine_greedy(ckpt: Checkpoint, caching: bool, mixers: set[str]) -> None:
    """The stateful families' engine check: each prompt alone (tokens and every sampled row's logits), then all
    three in one batch, twice; ``mixers``: the checkpoint's stateful mixer kinds."""
    llm = make_llm(ckpt.path, caching)
    assert {type(m).__name__ for _, m in llm.model.config.stateful_mixers()} == mixers
    cached = {}
    for key, prompt in ckpt.prompts.items():          # one after the other: "second" may reuse "first"'s prefix
        want_tokens, want_logits = ckpt.oracle[key]
        tokens, logits, cached[key] = generate_with_logits(llm, prompt)
        assert tokens == want_tokens, f"{key}: greedy tokens differ from HF"
        err = (logits - want_logits).abs().max().item()
        assert err <= ATOL, f"{key}: max |logit diff| {err:.3g} > {ATOL}"
    if caching:
        assert 0 < cached["second"] <= 20          # a state checkpoint inside the shared prefix
    else:
        assert set(cached.values()) == {0}
    # All three in one batch (the shared prefix computed once with caching on; the short prompt decodes while
    # the others are still in chunked prefill), then again: every prompt a full-prefix hit.
    for _ in range(2):
        outs = llm.generate(list(ckpt.prompts.values()), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [ckpt.oracle[k][0] for k in ckpt.prompts]
    assert (min(o.num_cached_tokens for o in outs) > 0) == caching


def check_reference_forward(ckpt: Checkpoint) -> None:
    """The whole sequence as one prefill, every position (not only the sampled ones)."""
    model = load_hf_checkpoint(ckpt.path, dtype=torch.float32)
    seq = ckpt.prompts["second"] + ckpt.oracle["second"][0]
    with torch.no_grad():
        want = ckpt.hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    assert (reference_logits(model, seq) - want).abs().max().item() <= ATOL


def check_gpu_backend(ckpt: Checkpoint, backend: str) -> None:
    """On CUDA: eager synchronous steps (one forward per sampled row, as the spy needs) give HF's tokens and
    logits; on the triton backend, with decode steps captured as CUDA graphs, a batch with prefix caching gives the
    same tokens."""
    eager = make_llm(ckpt.path, True, device="cuda", backend=backend, cuda_graphs=False, async_scheduling=False)
    for key, prompt in ckpt.prompts.items():
        want_tokens, want_logits = ckpt.oracle[key]
        tokens, logits, _ = generate_with_logits(eager, prompt)
        assert tokens == want_tokens, f"{key}: greedy tokens differ from HF"
        assert (logits.cpu() - want_logits).abs().max().item() <= ATOL
    if backend == "triton":
        graphs = make_llm(ckpt.path, True, device="cuda", backend=backend, cuda_graphs=True)
        outs = graphs.generate(list(ckpt.prompts.values()), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [ckpt.oracle[k][0] for k in ckpt.prompts]


@pytest.mark.parametrize("caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_engine_greedy_matches_hf(ckpt: Checkpoint, caching: bool) -> None:
    check_engine_greedy(ckpt, caching, {"ShortConv", "Attention"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_backend_on_gpu_matches_hf(ckpt: Checkpoint) -> None:
    """The triton backend: its conv1d kernels with activation=None, fp32 attention in ieee precision."""
    check_gpu_backend(ckpt, "triton")


def test_reference_forward_matches_hf(ckpt: Checkpoint) -> None:
    check_reference_forward(ckpt)


# -- config translation, against HF's own config class and MLP ----------------------------------------------------
_BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)


@pytest.mark.parametrize("extra", [
    dict(intermediate_size=100, block_ffn_dim_multiplier=1.5, block_multiple_of=16),
    dict(intermediate_size=100, block_ffn_dim_multiplier=0.7, block_multiple_of=1),   # no rounding
    dict(intermediate_size=100, block_auto_adjust_ff_dim=False),          # as configured
    dict(intermediate_size=12288),                                        # LFM2-1.2B's rule: 8192
])
def test_mlp_width_is_hf_rule(extra: dict) -> None:
    hf = Lfm2Config(**_BASE, **extra)
    ours = hf_config_to_hybrid(hf.to_dict())
    assert {layer.ffn.intermediate_size for layer in ours.layers} == {Lfm2MLP(hf).w1.out_features}


@pytest.mark.parametrize("keys, kinds", [
    (dict(full_attn_idxs=[1, 3]), "CACA"),
    (dict(layer_types=["full_attention", "conv", "conv", "conv"]), "ACCC"),
    (dict(), "AAAA"),                                  # neither: HF makes every layer attention
])
def test_layer_kinds_follow_hf(keys: dict, kinds: str) -> None:
    hf = Lfm2Config(**_BASE, **keys)
    assert "".join("A" if t == "full_attention" else "C" for t in hf.layer_types) == kinds
    raw = {"architectures": ["Lfm2ForCausalLM"], **_BASE, **keys}   # the hub's spelling: no layer_types
    ours = hf_config_to_hybrid(raw)
    assert "".join("A" if isinstance(layer.mixer, Attention) else "C" for layer in ours.layers) == kinds
    conv = next((layer.mixer for layer in ours.layers if isinstance(layer.mixer, ShortConv)), None)
    assert conv is None or conv == ShortConv(channels=32, conv_kernel=3, bias=False)


def test_hub_spellings_win_as_in_hf() -> None:
    """``block_ff_dim`` over ``intermediate_size`` and ``tie_embedding`` over ``tie_word_embeddings``, as HF's
    ``Lfm2Config`` reads them; bad layer lists are errors naming the key."""
    raw = {"model_type": "lfm2", **_BASE, "intermediate_size": 64, "block_ff_dim": 96, "tie_word_embeddings": True,
           "tie_embedding": False, "conv_L_cache": 4, "conv_bias": True, "full_attn_idxs": [0]}
    hf = Lfm2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    ours = hf_config_to_hybrid(raw)
    assert ours.tie_word_embeddings is hf.tie_word_embeddings is False
    assert ours.layers[0].ffn.intermediate_size == Lfm2MLP(hf).w1.out_features
    assert ours.layers[1].mixer == ShortConv(channels=32, conv_kernel=4, bias=True)
    with pytest.raises(ValueError, match="full_attn_idxs"):
        hf_config_to_hybrid({**raw, "full_attn_idxs": [4]})
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        hf_config_to_hybrid({**raw, "layer_types": ["conv"] * 3})
    with pytest.raises(ValueError, match="unknown layer type 'mamba'"):
        hf_config_to_hybrid({**raw, "layer_types": ["conv", "mamba", "conv", "conv"]})


def test_lfm2_moe_dense_layers_then_experts() -> None:
    hf = Lfm2MoeConfig(**_BASE, intermediate_size=48, moe_intermediate_size=16, num_dense_layers=1, num_experts=4,
                       num_experts_per_tok=2, routed_scaling_factor=2.0, layer_types=["conv", "full_attention"] * 2)
    ours = hf_config_to_hybrid(hf.to_dict())
    assert [type(layer.ffn) for layer in ours.layers] == [MLP, MoE, MoE, MoE]
    assert ours.layers[0].ffn.intermediate_size == 48                  # no width rule for the MoE family
    assert ours.layers[1].ffn == MoE(num_experts=4, top_k=2, intermediate_size=16, router="sigmoid_bias",
                                     renormalize=True, routed_scaling_factor=2.0)
    raw = {"model_type": "lfm2_moe", **_BASE}
    with pytest.raises(ValueError, match="lacks layer_types"):
        hf_config_to_hybrid(raw)
    with pytest.raises(ValueError, match="use_expert_bias=false"):
        hf_config_to_hybrid({**raw, "layer_types": ["conv"] * 4, "use_expert_bias": False})
