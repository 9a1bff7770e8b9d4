"""Mamba hybrid families end to end against HF transformers (CPU, fp32).

For each family (Bamba, Jamba, Zamba2, NemotronH, Falcon-H1, Granite-4.0-H; see ``_hf_mamba_models``)
a tiny random HF model is written by ``save_pretrained`` (hub weight names), loaded by hybridkv from
that directory, and run through the paged engine with 4-token blocks and an 8-token step budget, so
every prompt is a chunked prefill and the long one crosses 5 SSD chunks and 10 blocks. The oracle is
HF's greedy decoding with a full forward over the whole sequence at every step (no HF cache, which is
wrong or fragile for several of these families, docs/design.md "Oracles"). Greedy tokens must be identical for
32 new tokens and every sampled position's logits within 1e-4; a batched run must give the same tokens.
The loader also reads transformers 5.x in-memory names (fused / stacked experts, ``model.`` instead of
``backbone.``, Zamba2's shared block repeated under every use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from _hf_mamba_models import BUILDERS, VOCAB, hf_greedy
from safetensors.torch import save_file
from transformers import PreTrainedModel

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.models.hybrid import HybridModel

NEW_TOKENS = 32
ATOL = 1e-4
PROMPT_LENS = {"short": 5, "long": 40}     # long: 5 SSD chunks of 8, 10 blocks of 4, 5 steps of 8 tokens


@dataclass
class Family:
    name: str
    hf: PreTrainedModel
    path: Path
    prompts: dict[str, list[int]]
    oracle: dict[str, tuple[list[int], torch.Tensor]]     # prompt -> (HF greedy tokens, their logits)


# The quick tier (``-m "not slow"``) keeps one family with Mamba2, attention and MoE layers; the others are slow
# (their HF oracles alone take tens of seconds on 2 cores).
QUICK_FAMILIES = ("nemotron_h",)


@pytest.fixture(scope="module", params=[name if name in QUICK_FAMILIES else pytest.param(name, marks=pytest.mark.slow)
                                        for name in BUILDERS])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    hf = BUILDERS[name]()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    rng = np.random.default_rng(sum(map(ord, name)))
    prompts = {k: rng.integers(3, VOCAB, n).tolist() for k, n in PROMPT_LENS.items()}
    oracle = {k: hf_greedy(hf, p, NEW_TOKENS) for k, p in prompts.items()}
    return Family(name=name, hf=hf, path=path, prompts=prompts, oracle=oracle)


def make_llm(path: Path) -> LLM:
    return LLM(path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu",
               kv_cache_memory=1 << 25, max_num_seqs=4)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate_with_logits(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """One request through the engine; returns its tokens and the logits the engine sampled them from
    (captured at ``compute_logits_and_greedy``, which greedy steps call: with a single request every row it
    returns is a sampled position)."""
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
    return list(out.outputs[0].token_ids), torch.cat(rows)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_engine_greedy_matches_hf(family: Family) -> None:
    llm = make_llm(family.path)
    for key, prompt in family.prompts.items():
        want_tokens, want_logits = family.oracle[key]
        tokens, logits = generate_with_logits(llm, prompt)
        assert tokens == want_tokens, f"{family.name} {key} prompt: greedy tokens differ from HF"
        err = max_diff(logits, want_logits)
        assert err <= ATOL, f"{family.name} {key} prompt: max |logit diff| {err:.3g} > {ATOL}"
    # Both prompts in one batch: the short one decodes while the long one is still in chunked prefill.
    outs = llm.generate(list(family.prompts.values()), GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [family.oracle[k][0] for k in family.prompts]


def test_reference_forward_matches_hf(family: Family) -> None:
    """The whole sequence as one prefill, every position (not only the sampled ones)."""
    model = load_hf_checkpoint(family.path, dtype=torch.float32)
    seq = family.prompts["long"] + family.oracle["long"][0]
    with torch.no_grad():
        want = family.hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    assert max_diff(reference_logits(model, seq), want) <= ATOL


# ----------------------------------------------------------------------------- checkpoint names


HUB_NAMES = {   # what save_pretrained (transformers 5.23) writes: the hub layout, not the in-memory one
    "jamba": ["model.layers.1.feed_forward.experts.3.gate_proj.weight"],
    "nemotron_h": ["backbone.embeddings.weight", "backbone.layers.2.mixer.experts.7.up_proj.weight"],
    "granite_moe_hybrid": ["model.layers.0.block_sparse_moe.input_linear.weight",
                           "model.layers.0.block_sparse_moe.router.layer.weight"],
    "zamba2": ["model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.0.weight"],
    "lfm2_moe": ["model.layers.2.feed_forward.experts.7.w1.weight", "model.layers.2.feed_forward.expert_bias"],
}


def _saved_names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", list(HUB_NAMES))
def test_save_pretrained_writes_hub_names(name: str, tmp_path: Path) -> None:
    BUILDERS[name]().save_pretrained(tmp_path)
    names = _saved_names(tmp_path)
    assert set(HUB_NAMES[name]) <= names
    if name == "zamba2":   # the shared block is stored once, under its first use (layers 1 and 3)
        assert not any(n.startswith("model.layers.4.shared_transformer.") for n in names)


def _write_in_memory_checkpoint(hf: PreTrainedModel, path: Path) -> set[str]:
    """The HF model's in-memory ``state_dict`` names (5.x: fused/stacked experts, ``model.`` prefix,
    tied shared-block copies under every use), as a checkpoint."""
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    return set(state)


def _assert_same_parameters(a: HybridModel, b: HybridModel) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert torch.equal(p, pb[name]), name


@pytest.mark.parametrize("name", ["jamba", "nemotron_h", "granite_moe_hybrid", "zamba2", "lfm2_moe"])
def test_in_memory_names_load_the_same_weights(name: str, tmp_path: Path) -> None:
    hf = BUILDERS[name]()
    hf.save_pretrained(tmp_path / "hub")
    names = _write_in_memory_checkpoint(hf, tmp_path / "memory")
    assert names != _saved_names(tmp_path / "hub")        # really a different layout
    _assert_same_parameters(load_hf_checkpoint(tmp_path / "hub", dtype=torch.float32),
                            load_hf_checkpoint(tmp_path / "memory", dtype=torch.float32))


def test_zamba2_shared_weights_have_one_owner(tmp_path: Path) -> None:
    """Block 0 serves layers 1 and 4 from one set of weights with two KV caches; each use keeps its own
    adapters and output linear."""
    BUILDERS["zamba2"]().save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    names = [n for n, _ in model.named_parameters()]
    assert sum(n.startswith("shared_blocks.0.attention.q_proj") for n in names) == 1
    first, later = model.layers[1].shared, model.layers[4].shared
    assert first.attention._shared[0] is later.attention._shared[0] is model.shared_blocks["0"].attention
    assert first.attention.cache_name != later.attention.cache_name
    assert {"layers.1.shared", "layers.4.shared"} <= set(model.cache_layers())
    assert not torch.equal(first.mlp_adapter.down.weight, later.mlp_adapter.down.weight)
