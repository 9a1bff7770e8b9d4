"""Kimi-Linear (Kimi Delta Attention + NoPE multi-head latent attention + experts) end to end against HF transformers
(CPU, fp32).

A tiny random ``KimiLinearForCausalLM`` (``kimi_linear`` below: KDA layers of two heads with per-channel decays,
MLA layers whose latent cache holds 16 + 8 channels per token, a dense first layer, then sigmoid-routed experts in
two groups with a correction bias, renormalised and scaled, beside a shared expert) is written by
``save_pretrained`` and loaded by hybridkv from that directory. Through ``LLM.generate`` with 4-token blocks and an
8-token step budget (every prompt a chunked prefill: conv and recurrent states carried across chunks, the latent
cache read through block tables) greedy tokens must equal HF's (an argmax over full forwards, no HF cache) and
log-probabilities be within 1e-4 (``_parity``), with prefix caching off and on; with caching on a prompt sharing a
22-token prefix with an earlier one starts from a state checkpoint, alone and in one batch. The config translation
is checked against HF's ``KimiLinearConfig`` (and the hub's ``linear_attn_config`` spelling), the experts against
HF's ``KimiLinearMoE``, and ``hybridkv plan`` runs on the bundled Kimi-Linear-48B-A3B config.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _hf_mamba_models import _COMMON, VOCAB, _finish
from _hf_models import full_logits, hf_greedy
from _parity import TOL, check_engine_matches_hf, check_prompt_logprobs
from _tp_helpers import max_logit_diff, prompts, run
from test_layers_vs_hf import assert_close, hidden, randomize
from test_parity_lfm2 import GREEDY, generate_with_logits, make_llm
from transformers import KimiLinearConfig, KimiLinearForCausalLM, PreTrainedModel
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

from hybridkv.engine.model_runner import reference_logits
from hybridkv.kv_groups.specs import MambaSpec, MLAAttentionSpec
from hybridkv.layers.moe import MoEFeedForward
from hybridkv.layers.parallel import TensorParallel
from hybridkv.loaders import hf_config_to_hybrid
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.models import MLP, KimiDeltaAttention, MoE, MultiLatentAttention

NEW_TOKENS = 16
REPO = Path(__file__).resolve().parents[1]


def kimi_linear(seed: int = 0) -> PreTrainedModel:
    """KDA, KDA, MLA, KDA, MLA: KDA 2 heads of 16, conv width 4; MLA 4 heads, latent 16, nope 8 + rope 8, v 12
    (q_proj, as the released model); layer 0 a dense SwiGLU MLP, the others 8 experts in 2 groups (top-1 group),
    top-2 by sigmoid score + correction bias, renormalised, scaled by 1.5, with one shared expert."""
    config = KimiLinearConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        tie_word_embeddings=False)
    return _finish(KimiLinearForCausalLM(config), seed)


def _prompts() -> list[list[int]]:
    """A short prompt, a 37-token one and its 9-token extension (what ``check_engine_matches_hf`` runs)."""
    gen = torch.Generator().manual_seed(1234)
    base = [torch.randint(3, VOCAB - 4, (n,), generator=gen).tolist() for n in (3, 37)]
    return base + [base[1] + torch.randint(3, VOCAB - 4, (9,), generator=gen).tolist()]


def _shared_prefix_prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, VOCAB, 22).tolist()             # not block-aligned: 5 blocks + 2 tokens
    return {"short": rng.integers(3, VOCAB, 5).tolist(), "first": prefix + rng.integers(3, VOCAB, 7).tolist(),
            "second": prefix + rng.integers(3, VOCAB, 12).tolist()}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """The HF model and the checkpoint ``save_pretrained`` wrote."""
    hf = kimi_linear()
    path = tmp_path_factory.mktemp("kimi_linear")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def ckpt(written: tuple[PreTrainedModel, Path]) -> tuple[PreTrainedModel, Path, dict]:
    """The HF model, its checkpoint, and HF's greedy tokens and full-sequence logits per prompt (~17 s)."""
    hf, path = written
    expected = {}
    with torch.no_grad():
        for prompt in _prompts() + list(_shared_prefix_prompts().values()):
            tokens = hf_greedy(hf, prompt, NEW_TOKENS)
            expected[tuple(prompt)] = (tokens, full_logits(hf, prompt + tokens))
    return hf, path, expected


@pytest.mark.slow            # ~15 s per caching mode on 2 cores, plus the module's HF oracle
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_engine_matches_hf(ckpt: tuple[PreTrainedModel, Path, dict], prefix_caching: bool) -> None:
    _, path, expected = ckpt
    check_engine_matches_hf(path, _prompts(), expected, new_tokens=NEW_TOKENS, prefix_caching=prefix_caching)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True], ids=["no_prefix_caching", "prefix_caching"])
def test_state_checkpoint_inside_shared_prefix(ckpt: tuple[PreTrainedModel, Path, dict], caching: bool) -> None:
    """A prompt sharing a 22-token prefix with an earlier one: with caching it starts from a KDA state checkpoint
    (and the MLA blocks of that prefix); each sampled row's logits within 1e-4 of HF's; then all three in one batch
    (the short prompt decodes while the others are still in chunked prefill), twice."""
    _, path, expected = ckpt
    prompts = _shared_prefix_prompts()
    llm = make_llm(path, caching)
    kinds = {type(m).__name__ for _, m in llm.model.config.stateful_mixers()}
    assert kinds == {"KimiDeltaAttention", "MultiLatentAttention"}
    cached = {}
    for key, prompt in prompts.items():
        want_tokens, full = expected[tuple(prompt)]
        tokens, logits, cached[key] = generate_with_logits(llm, prompt)
        assert tokens == want_tokens, f"{key}: greedy tokens differ from HF"
        err = (logits - full[len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]).abs().max().item()
        assert err <= TOL, f"{key}: max |logit diff| {err:.3g} > {TOL}"
    if caching:
        assert 0 < cached["second"] <= 20          # a state checkpoint inside the shared prefix
    else:
        assert set(cached.values()) == {0}
    for _ in range(2):
        outs = llm.generate(list(prompts.values()), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [expected[tuple(p)][0] for p in prompts.values()]
    assert (min(o.num_cached_tokens for o in outs) > 0) == caching


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch", "fla"])
def test_gpu_backend_matches_hf(ckpt: tuple[PreTrainedModel, Path, dict], backend: str) -> None:
    """On CUDA (triton: its conv1d, KDA and paged-attention kernels over the latent cache; fla: its KDA kernels):
    eager synchronous steps give HF's tokens and logits; with decode steps captured as CUDA graphs, a batch with
    prefix caching gives the same tokens."""
    if backend == "fla":
        pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    _, path, expected = ckpt
    eager = make_llm(path, True, device="cuda", backend=backend, cuda_graphs=False, async_scheduling=False)
    prompts = _shared_prefix_prompts()
    for key, prompt in prompts.items():
        want_tokens, full = expected[tuple(prompt)]
        tokens, logits, _ = generate_with_logits(eager, prompt)
        assert tokens == want_tokens, f"{key}: greedy tokens differ from HF"
        assert (logits.cpu() - full[len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]).abs().max().item() <= TOL
    if backend == "triton":
        graphs = make_llm(path, True, device="cuda", backend=backend, cuda_graphs=True)
        outs = graphs.generate(list(prompts.values()), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [expected[tuple(p)][0] for p in prompts.values()]


@pytest.mark.slow
def test_prompt_logprobs_match_hf(ckpt: tuple[PreTrainedModel, Path, dict]) -> None:
    """Every prompt token's log-probability (a prefill's every row, through the chunked prefill)."""
    _, path, expected = ckpt
    check_prompt_logprobs(path, _prompts()[1], expected)


def test_reference_forward_matches_hf(tmp_path: Path) -> None:
    """The whole sequence as one prefill, every position (not only the sampled ones); the checkpoint's latent
    cache is one (16 + 8)-wide row per token and its KDA states (3 x 32 conv channels, 2 x 16 x 16)."""
    hf = kimi_linear(seed=3)
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    specs = model.config.kv_specs(block_size=4)
    assert specs["layers.2"] == MLAAttentionSpec(block_size=4, kv_lora_rank=16, qk_rope_head_dim=8,
                                                 dtype=torch.float32)
    assert specs["layers.0"] == MambaSpec(block_size=4, shapes=((96, 3), (2, 16, 16)),
                                          dtypes=(torch.float32, torch.float32))
    seq = torch.randint(3, VOCAB, (41,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = full_logits(hf, seq)
    assert (reference_logits(model, seq) - want).abs().max().item() <= TOL


# -- tensor parallelism ----------------------------------------------------------------------------------------
def test_hf_loading_gives_each_rank_its_shard(written: tuple[PreTrainedModel, Path]) -> None:
    """No processes: rank 0 and rank 1 of 2 read exactly their shards of the hub tensors (the per-projection
    q/k/v convs into the stacked conv by heads, A_log / dt_bias by heads, MLA's kv_b_proj by heads with the latent
    path whole, per-expert w1 / w3 / w2)."""
    _, path = written
    full = load_hf_checkpoint(path, dtype=torch.float32)
    params = dict(full.named_parameters())
    for rank in range(2):
        shard = load_hf_checkpoint(path, dtype=torch.float32, tp=TensorParallel(rank=rank, size=2))
        rules = shard.parameter_shards()
        assert "layers.0.mixer.conv1d.weight" in rules and "layers.2.mixer.kv_b_proj.weight" in rules
        for name, p in shard.named_parameters():
            want = rules[name].take(params[name], shard.tp) if name in rules else params[name]
            assert torch.equal(p, want), f"rank {rank}: {name}"


@pytest.mark.slow            # two gloo processes on 2 cores
def test_tp2_matches_tp1(written: tuple[PreTrainedModel, Path]) -> None:
    """The checkpoint served at tensor_parallel_size=2 gives tp 1's greedy tokens with logits within 1e-5 (KDA and
    MLA heads split, KDA state copies on prefix hits)."""
    _, path = written
    batch = prompts(VOCAB, n=3, seed=3)
    one = run(path, 1, batch, max_model_len=128)
    two = run(path, 2, batch, max_model_len=128)
    assert two.tokens == one.tokens
    assert max_logit_diff(one, two) <= 1e-5
    assert two.copies, "prefix hits should have copied KDA states"


# -- config translation, against HF's own config class ----------------------------------------------------------
_BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, linear_num_heads=2, linear_head_dim=16,
             moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("extra", [
    dict(num_hidden_layers=9),                                       # HF's default mix: MLA on 4 and 8
    dict(num_hidden_layers=4, layer_types=["full_attention", "linear_attention"] * 2, first_k_dense_replace=2),
    dict(num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"], q_lora_rank=24, attention_bias=True),
    dict(num_hidden_layers=4, n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=False,
         routed_scaling_factor=2.0),
])
def test_config_translation_follows_hf(extra: dict) -> None:
    hf = KimiLinearConfig(**(_BASE | extra))
    config = hf_config_to_hybrid({"architectures": ["KimiLinearForCausalLM"], **hf.to_dict()})
    assert config.norm == "rms" and config.norm_eps == hf.rms_norm_eps
    assert config.max_position_embeddings == hf.max_position_embeddings
    for layer, kind, mlp in zip(config.layers, hf.layer_types, hf.mlp_layer_types, strict=True):
        if kind == "full_attention":
            assert layer.mixer == MultiLatentAttention(
                num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                q_lora_rank=hf.q_lora_rank, bias=hf.attention_bias)
        else:
            assert layer.mixer == KimiDeltaAttention(num_heads=2, head_dim=16, conv_kernel=4, norm_eps=hf.rms_norm_eps)
        if mlp == "sparse":
            assert layer.ffn == MoE(num_experts=8, top_k=2, intermediate_size=16, router="sigmoid_bias",
                                    renormalize=hf.norm_topk_prob, routed_scaling_factor=hf.routed_scaling_factor,
                                    num_groups=hf.n_group, topk_groups=hf.topk_group,
                                    shared_intermediate_size=16 * hf.n_shared_experts)
        else:
            assert layer.ffn == MLP(intermediate_size=hf.intermediate_size)


def test_hub_linear_attn_config_as_hf_reads_it() -> None:
    """The hub's spelling: KDA sizes and 1-indexed layer lists in ``linear_attn_config``, read as HF does."""
    linear = {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 4, "head_dim": 8,
              "short_conv_kernel_size": 3}
    raw = {"model_type": "kimi_linear", **_BASE, "num_hidden_layers": 4, "linear_attn_config": linear,
           "mla_use_nope": True, "moe_router_activation_func": "sigmoid"}
    hf = KimiLinearConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    ours = hf_config_to_hybrid(raw)
    assert [type(layer.mixer).__name__ for layer in ours.layers] == [
        "KimiDeltaAttention" if t == "linear_attention" else "MultiLatentAttention" for t in hf.layer_types]
    assert ours.layers[0].mixer == KimiDeltaAttention(num_heads=hf.linear_num_heads, head_dim=hf.linear_head_dim,
                                                      conv_kernel=hf.linear_conv_kernel_dim, norm_eps=1e-5)


def test_config_errors() -> None:
    base = {"architectures": ["KimiLinearForCausalLM"], **_BASE, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="hidden_act"):
        hf_config_to_hybrid({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        hf_config_to_hybrid({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="unknown layer type 'mamba'"):
        hf_config_to_hybrid({**base, "layer_types": ["mamba", "full_attention"]})
    with pytest.raises(ValueError, match="mlp_layer_types has 3 entries"):
        hf_config_to_hybrid({**base, "mlp_layer_types": ["dense"] * 3})
    with pytest.raises(ValueError, match="mla_use_nope"):
        hf_config_to_hybrid({**base, "mla_use_nope": False})
    with pytest.raises(ValueError, match="moe_router_activation_func"):
        hf_config_to_hybrid({**base, "moe_router_activation_func": "softmax"})
    with pytest.raises(ValueError, match="num_key_value_heads=2 must equal num_attention_heads=4"):
        hf_config_to_hybrid({**base, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="no kind for layers \\[2\\]"):
        hf_config_to_hybrid({**base, "linear_attn_config": {"full_attn_layers": [1], "kda_layers": []}})
    with pytest.raises(ValueError, match="not a layer number in 1..2"):
        hf_config_to_hybrid({**base, "linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1, 2]}})


def test_moe_with_shared_expert_matches_hf() -> None:
    """Sigmoid scores + correction bias chosen within the best group, renormalised, scaled; an ungated shared
    expert: the existing ``sigmoid_bias`` MoE."""
    cfg = KimiLinearConfig(**(_BASE | dict(num_hidden_layers=2, n_group=2, topk_group=1, routed_scaling_factor=1.7,
                                           mlp_layer_types=["sparse", "sparse"])))
    cfg._experts_implementation = "eager"
    hf = hf_kimi.KimiLinearMoE(cfg).eval()
    randomize(hf, 1, scale=0.3)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    moe = hf_config_to_hybrid({"architectures": ["KimiLinearForCausalLM"], **cfg.to_dict()}).layers[0].ffn
    ours = MoEFeedForward(32, moe)
    params = dict(hf.named_parameters())
    gate, up = params["experts.gate_up_proj"].detach().chunk(2, dim=1)
    tensors = {"router.weight": params["gate.weight"], "correction_bias": hf.gate.e_score_correction_bias,
               "gate_proj": gate, "up_proj": up, "down_proj": params["experts.down_proj"],
               **{f"shared.{p}_proj.weight": params[f"shared_experts.{p}_proj.weight"] for p in ("gate", "up", "down")}}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(tensors.pop(name))
    assert not tensors
    x = hidden(20, 32, seed=2)
    with torch.no_grad():
        assert_close(ours(x), hf(x[None])[0])


# -- the bundled config of the released model -------------------------------------------------------------------
def test_plan_command_on_the_bundled_config() -> None:
    """``hybridkv plan kimi-linear-48b-a3b`` (the byte arithmetic is checked in test_plan_real_configs.py): the 7
    MLA layers form one latent-cache group, the 20 KDA layers one state-slot group."""
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "plan", "kimi-linear-48b-a3b", "--max-model-len",
                          "131072", "--json"], capture_output=True, text=True, cwd=REPO, check=True)
    groups = {g["spec"]: g for g in json.loads(out.stdout)["groups"]}
    assert groups["mla(512+64)"]["layer_ranges"] == "3,7,11,15,19,23,26"
    assert groups["mamba(12288x3 + 32x128x128)"]["layer_ranges"] == "0-2,4-6,8-10,12-14,16-18,20-22,24-25"
