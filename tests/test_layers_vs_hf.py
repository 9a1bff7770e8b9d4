"""Every layer kind against the HF transformers module it reimplements, with copied weights (CPU, fp32).

Cache-using layers (attention, Mamba2, Mamba1) run through ``LayerHarness`` (paged caches, shuffled
block ids, freed blocks poisoned) as one full prefill and as several prefill chunks followed by
single-token decodes; the oracle is the HF module run once over the whole sequence with the right
additive mask (causal; window p - W < k <= p; chunk k // C == p // C), so every position is checked.
Weights are mapped HF -> ours explicitly, and every one of our parameters must be assigned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from _layer_harness import LayerHarness, schedule
from torch import nn
from transformers import (
    BambaConfig,
    FalconH1Config,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteMoeHybridConfig,
    JambaConfig,
    Llama4TextConfig,
    LlamaConfig,
    Mamba2Config,
    MistralConfig,
    MixtralConfig,
    NemotronHConfig,
    PretrainedConfig,
    Zamba2Config,
)
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.bamba import modeling_bamba as hf_bamba
from transformers.models.falcon_h1 import modeling_falcon_h1 as hf_falcon_h1
from transformers.models.gemma2 import modeling_gemma2 as hf_gemma2
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf_granite
from transformers.models.jamba import modeling_jamba as hf_jamba
from transformers.models.llama import modeling_llama as hf_llama
from transformers.models.llama4 import modeling_llama4 as hf_llama4
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
from transformers.models.mistral import modeling_mistral as hf_mistral
from transformers.models.mixtral import modeling_mixtral as hf_mixtral
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron_h
from transformers.models.zamba2 import modeling_zamba2 as hf_zamba2

from hybridkv.layers.activations import get_activation
from hybridkv.layers.attention import AttentionLayer
from hybridkv.layers.mamba1 import Mamba1Layer
from hybridkv.layers.mamba2 import Mamba2Layer
from hybridkv.layers.mlp import DenseMLP
from hybridkv.layers.moe import MoEFeedForward
from hybridkv.layers.norms import GatedGroupRMSNorm, RMSNorm, rms_normalize
from hybridkv.layers.rotary import RotaryEmbedding, rope_inv_freq
from hybridkv.models.config import MLP, Attention, HybridConfig, Layer, Mamba1, Mamba2, MoE, Rope, SharedBlock
from hybridkv.models.hybrid import SharedBlockUse, SharedTransformerBlock

ATOL = 1e-5
SEQ = 26                      # crosses windows 5-6 and chunks of 8 several times
SCHEDULES = {
    "prefill": schedule(SEQ, [], 0),
    "chunks+decodes": schedule(SEQ, [5, 7, 3], 6),     # [5, 7, 3, 5, 1, 1, 1, 1, 1, 1]
    "1tok+chunks+decodes": schedule(SEQ, [1, 9, 2], 9),
}


# ----------------------------------------------------------------------------- helpers


def randomize(module: nn.Module, seed: int, scale: float = 0.15) -> None:
    """Non-trivial weights everywhere (norm weights around 1, the rest around 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if name.endswith("norm.weight") else scale * noise)


def load_exact(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``module``'s parameters; every parameter must be named exactly once."""
    own = dict(module.named_parameters())
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    assert not missing and not unexpected, f"weight map: missing {missing}, unexpected {unexpected}"
    with torch.no_grad():
        for name, t in tensors.items():
            assert own[name].shape == t.shape, f"{name}: ours {tuple(own[name].shape)} vs {tuple(t.shape)}"
            own[name].copy_(t)


def same_names(hf: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Our parameter ``n`` <- HF parameter ``n`` (the layers follow HF's names)."""
    params = dict(hf.named_parameters())
    return {n: params[n].detach().clone() for n in names}


def additive_mask(n: int, *, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """(1, 1, n, n) additive mask: 0 where key k is visible from query p, -inf elsewhere."""
    p, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = k <= p
    if window is not None:
        ok &= p - window < k
    if chunk is not None:
        ok &= k // chunk == p // chunk
    return torch.zeros(n, n).masked_fill(~ok, float("-inf"))[None, None]


def hidden(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = (ours - ref).abs().max().item()
    assert err <= atol, f"max abs diff {err:.3g} > {atol:g}"


def eager(config: PretrainedConfig) -> PretrainedConfig:
    config._attn_implementation = "eager"
    return config


# ----------------------------------------------------------------------------- attention


ATTN_NAMES = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
H = 32   # hidden size of the attention cases


@dataclass(frozen=True, kw_only=True)
class AttnCase:
    """An HF attention module and our config for the same layer, plus how to drive both."""

    hf: nn.Module
    rotary: Callable[[torch.Tensor, torch.Tensor], object]   # (x, position_ids) -> HF position embeddings
    cfg: Attention
    weights: list[str]                                       # parameter names shared by HF and us
    mask: dict = field(default_factory=dict)                 # additive_mask kwargs (window / chunk)
    block_size: int = 4
    layer_kwargs: dict = field(default_factory=dict)         # AttentionLayer kwargs (norm_eps, gemma_norm)


def _llama() -> AttnCase:
    rope = {"rope_type": "default", "rope_theta": 100.0}
    cfg = eager(LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            attention_bias=True, rope_parameters=rope))
    rot = hf_llama.LlamaRotaryEmbedding(cfg)
    return AttnCase(hf=hf_llama.LlamaAttention(cfg, 0), rotary=rot,
                    cfg=Attention(num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True,
                                  rope=Rope(theta=100.0)),
                    weights=ATTN_NAMES + [n.replace("weight", "bias") for n in ATTN_NAMES])


def _mistral() -> AttnCase:
    cfg = eager(MistralConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                              sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 50.0}))
    return AttnCase(hf=hf_mistral.MistralAttention(cfg, 0), rotary=hf_mistral.MistralRotaryEmbedding(cfg),
                    cfg=Attention(num_heads=4, num_kv_heads=1, head_dim=16, sliding_window=5,
                                  rope=Rope(theta=50.0)),
                    weights=ATTN_NAMES, mask=dict(window=5), block_size=2)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
OUR_LLAMA3 = Rope(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)


def _llama4(layer: int) -> AttnCase:
    cfg = eager(Llama4TextConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_hidden_layers=2, no_rope_layers=[1, 0], attention_chunk_size=8,
                                 use_qk_norm=True, floor_scale=4, attn_scale=0.25, rms_norm_eps=1e-5,
                                 max_position_embeddings=16384, rope_parameters=LLAMA3))
    object.__setattr__(cfg, "attn_temperature_tuning", 4)   # the released config's int (HF's type says bool)
    common = dict(hf=hf_llama4.Llama4TextAttention(cfg, layer), weights=ATTN_NAMES,
                  rotary=hf_llama4.Llama4TextRotaryEmbedding(cfg), layer_kwargs=dict(norm_eps=1e-5))
    if layer == 0:   # chunked-local RoPE layer, weightless qk-norm after interleaved RoPE
        return AttnCase(cfg=Attention(num_heads=4, num_kv_heads=2, head_dim=16, attention_chunk_size=8,
                                      rope=dataclasses.replace(OUR_LLAMA3, interleaved=True),
                                      qk_norm="rms_weightless"),
                        mask=dict(chunk=8), **common)
    return AttnCase(cfg=Attention(num_heads=4, num_kv_heads=2, head_dim=16, rope=None,   # global NoPE
                                  temperature_tuning=(0.25, 4.0)), **common)


def _gemma2() -> AttnCase:
    cfg = eager(Gemma2Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_hidden_layers=2, sliding_window=6, query_pre_attn_scalar=24,
                             attn_logit_softcapping=2.0,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    assert cfg.layer_types[0] == "sliding_attention"
    return AttnCase(hf=hf_gemma2.Gemma2Attention(cfg, 0), rotary=hf_gemma2.Gemma2RotaryEmbedding(cfg),
                    cfg=Attention(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=6,
                                  scale=24 ** -0.5, softcap=2.0, rope=Rope(theta=10000.0)),
                    weights=ATTN_NAMES, mask=dict(window=6), block_size=2, layer_kwargs=dict(gemma_norm=True))


def _gemma3(layer: int) -> AttnCase:
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0}}
    cfg = eager(Gemma3TextConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_hidden_layers=2, sliding_window=5, query_pre_attn_scalar=12,
                                 layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
                                 rms_norm_eps=1e-6))
    rot, kind = hf_gemma3.Gemma3RotaryEmbedding(cfg), cfg.layer_types[layer]
    common = dict(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm="rms", scale=12 ** -0.5)
    if layer == 0:   # local layer: sliding window, local rope base
        ours, mask = Attention(sliding_window=5, rope=Rope(theta=10000.0), **common), dict(window=5)
    else:            # global layer: linear-scaled rope
        ours, mask = Attention(rope=Rope(theta=1_000_000.0, scaling="linear", factor=8.0), **common), {}
    return AttnCase(hf=hf_gemma3.Gemma3Attention(cfg, layer), rotary=lambda x, pos: rot(x, pos, kind),
                    cfg=ours, weights=ATTN_NAMES + ["q_norm.weight", "k_norm.weight"], mask=mask,
                    layer_kwargs=dict(gemma_norm=True, norm_eps=1e-6))


ATTENTION_CASES: dict[str, Callable[[], AttnCase]] = {
    "llama_full_bias": _llama,
    "mistral_sliding5": _mistral,
    "llama4_chunked_rope": lambda: _llama4(0),
    "llama4_nope_temperature": lambda: _llama4(1),
    "gemma2_softcap_sliding6": _gemma2,
    "gemma3_sliding_local_rope": lambda: _gemma3(0),
    "gemma3_global_linear_rope": lambda: _gemma3(1),
}


def build_attention(name: str, seed: int = 0) -> tuple[AttentionLayer, Callable, int]:
    """(our layer with HF's weights, HF full-sequence oracle x -> y, block size) for one case."""
    case = ATTENTION_CASES[name]()
    randomize(case.hf, seed)
    ours = AttentionLayer(H, case.cfg, cache_name="attn", **{"norm_eps": 1e-6, **case.layer_kwargs})
    load_exact(ours, same_names(case.hf, case.weights))

    def oracle(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        with torch.no_grad():
            pe = case.rotary(x[None], torch.arange(n)[None])
            mask = additive_mask(n, **case.mask)
            return case.hf(hidden_states=x[None], position_embeddings=pe, attention_mask=mask)[0][0]

    return ours, oracle, case.block_size


@pytest.mark.parametrize("sched", list(SCHEDULES))
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_hf(case: str, sched: str) -> None:
    ours, oracle, block_size = build_attention(case)
    x = hidden(SEQ, H, seed=1)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, block_size=block_size, seed=3).run(x, SCHEDULES[sched])
    assert torch.isfinite(out).all()
    assert_close(out, oracle(x))


# ----------------------------------------------------------------------------- Mamba2 / Mamba1 (Jamba)


def build_mamba2(seed: int = 0) -> tuple[Mamba2Layer, Callable[[torch.Tensor], torch.Tensor]]:
    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=2,
                       conv_kernel=4, chunk_size=8, num_hidden_layers=1, layer_norm_epsilon=1e-5,
                       time_step_limit=(0.0, 1.5))
    hf = hf_mamba2.Mamba2Mixer(cfg, 0)
    randomize(hf, seed, scale=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # A in [-4, -0.5], D around 1, dt_bias so that softplus spans ~0.1 .. 2
        hf.A_log.copy_(torch.log(0.5 + 3.5 * torch.rand(4, generator=gen)))
        hf.D.copy_(1.0 + 0.5 * torch.randn(4, generator=gen))
        hf.dt_bias.copy_(torch.randn(4, generator=gen))
    ours = Mamba2Layer(32, Mamba2(num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4,
                                  chunk_size=8, norm_eps=1e-5, time_step_limit=(0.0, 1.5)), cache_name="m2")
    load_exact(ours, same_names(hf, ["in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log",
                                     "D", "norm.weight", "out_proj.weight"]))
    return ours, lambda x: hf(x[None])[0]


def build_jamba_mamba(seed: int = 0) -> tuple[Mamba1Layer, nn.Module]:
    cfg = JambaConfig(hidden_size=32, mamba_expand=2, mamba_d_state=8, mamba_d_conv=4, mamba_dt_rank=4,
                      num_hidden_layers=1, rms_norm_eps=1e-6)
    hf = hf_jamba.JambaMambaMixer(cfg, 0)
    randomize(hf, seed, scale=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        hf.A_log.copy_(torch.log(0.5 + 3.5 * torch.rand(64, 8, generator=gen)))
        hf.dt_proj.bias.copy_(torch.randn(64, generator=gen))
        hf.D.copy_(1.0 + 0.5 * torch.randn(64, generator=gen))
    ours = Mamba1Layer(32, Mamba1(intermediate_size=64, state_size=8, dt_rank=4, conv_kernel=4, dt_norm=True,
                                  norm_eps=1e-6), cache_name="m1")
    load_exact(ours, same_names(hf, [
        "in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight", "dt_proj.bias",
        "A_log", "D", "out_proj.weight", "dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight"]))
    return ours, hf


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_mamba2_matches_hf(sched: str) -> None:
    ours, oracle = build_mamba2()
    x = hidden(SEQ, 32, seed=2)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4).run(x, SCHEDULES[sched])
    with torch.no_grad():
        assert_close(out, oracle(x))


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_jamba_mamba1_matches_hf(sched: str) -> None:
    ours, hf = build_jamba_mamba()
    x = hidden(SEQ, 32, seed=2)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4).run(x, SCHEDULES[sched])
    with torch.no_grad():   # HF's multi-token path starts from zero state: right for the whole sequence
        assert_close(out, hf(x[None])[0])


def test_jamba_mamba1_continuations_match_hf_decode_path() -> None:
    """Continuations against HF's own recurrent path: a prefill through HF's cache, then HF token-by-token
    decode steps (HF's multi-token continuation from a cache is not an oracle: it restarts from zero)."""
    ours, hf = build_jamba_mamba(seed=5)
    n_pre, x = 9, hidden(20, 32, seed=6)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(x[None, :n_pre], cache_params=cache)[0]]
        ref += [hf(x[None, t:t + 1], cache_params=cache)[0] for t in range(n_pre, 20)]
    out = LayerHarness(ours, max_len=20, max_reqs=1, seed=7).run(x, [4, 5] + [1] * 11)
    assert_close(out, torch.cat(ref))


# ----------------------------------------------------------------------------- batches


def _batch_layer(kind: str) -> tuple[nn.Module, int]:
    if kind == "mamba2":
        return build_mamba2(seed=8)[0], 4
    if kind == "mamba1":
        return build_jamba_mamba(seed=8)[0], 4
    case = {"sliding": "mistral_sliding5", "chunked": "llama4_chunked_rope", "full": "llama_full_bias"}[kind]
    layer, _, block_size = build_attention(case, seed=8)
    return layer, block_size


# Per step, request -> new tokens. Decodes, fresh prefills and chunked-prefill continuations mix freely;
# the harness orders each step decodes first. "a" finishes after step 3, so "d" gets its recycled ids.
BATCH_STEPS = [
    {"a": 6, "b": 3},
    {"a": 1, "b": 8, "c": 5},
    {"c": 1, "a": 1, "b": 4},
    {"b": 1, "a": 7, "c": 9},
    {"c": 1, "b": 1, "d": 6},
    {"d": 1, "b": 6, "c": 2},
    {"d": 2, "c": 1, "b": 1},
]


def assert_batched_equals_one_by_one(layer: torch.nn.Module, dim: int, *, block_size: int = 4) -> None:
    """``layer`` stepped through ``BATCH_STEPS`` (requests joining, leaving and chunking at different steps) gives
    each request what it gets alone."""
    lengths: dict[str, int] = {}
    last_step: dict[str, int] = {}
    for i, step in enumerate(BATCH_STEPS):
        for r, n in step.items():
            lengths[r] = lengths.get(r, 0) + n
            last_step[r] = i
    xs = {r: hidden(n, dim, seed=10 + i) for i, (r, n) in enumerate(sorted(lengths.items()))}
    harness = LayerHarness(layer, max_len=max(lengths.values()), max_reqs=3, block_size=block_size, seed=11)
    got: dict[str, list[torch.Tensor]] = {r: [] for r in lengths}
    done = dict.fromkeys(lengths, 0)
    for i, step in enumerate(BATCH_STEPS):
        out = harness.step({r: xs[r][done[r]:done[r] + n] for r, n in step.items()})
        for r, n in step.items():
            got[r].append(out[r])
            done[r] += n
            if last_step[r] == i:
                harness.finish(r)
    for r, n in lengths.items():
        alone = LayerHarness(layer, max_len=n, max_reqs=1, block_size=block_size, seed=12).run(xs[r], [n])
        assert_close(torch.cat(got[r]), alone)


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked", "mamba2", "mamba1"])
def test_batched_equals_one_by_one(kind: str) -> None:
    layer, block_size = _batch_layer(kind)
    assert_batched_equals_one_by_one(layer, 32, block_size=block_size)


# ----------------------------------------------------------------------------- feed-forward


def test_llama4_moe_matches_hf() -> None:
    cfg = Llama4TextConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=1,
                           num_hidden_layers=1, hidden_act="silu")
    hf = hf_llama4.Llama4TextMoe(cfg)
    randomize(hf, 0)
    ours = MoEFeedForward(32, MoE(num_experts=4, top_k=1, intermediate_size=24, router="sigmoid_input",
                                  shared_intermediate_size=24))
    gate_up, inter = hf.experts.gate_up_proj.detach(), 24       # (E, hidden, 2 * inter), x @ W layout
    load_exact(ours, {
        "router.weight": hf.router.weight.detach(),
        "gate_proj": gate_up[..., :inter].transpose(1, 2), "up_proj": gate_up[..., inter:].transpose(1, 2),
        "down_proj": hf.experts.down_proj.detach().transpose(1, 2),
        **{f"shared.{n}.weight": getattr(hf.shared_expert, n).weight.detach()
           for n in ("gate_proj", "up_proj", "down_proj")}})
    x = hidden(30, 32, seed=1)
    with torch.no_grad():
        assert_close(ours(x), hf(x)[0])


def _stacked_gated_experts(experts: nn.Module, inter: int) -> dict[str, torch.Tensor]:
    """HF (E, 2 * inter, hidden) gate|up and (E, hidden, inter) down -> our stacked (E, out, in)."""
    gate_up = experts.gate_up_proj.detach()
    return {"gate_proj": gate_up[:, :inter], "up_proj": gate_up[:, inter:],
            "down_proj": experts.down_proj.detach()}


@pytest.mark.parametrize("family", ["mixtral", "jamba", "granite"])
def test_softmax_topk_moe_matches_hf(family: str) -> None:
    common = dict(hidden_size=32, intermediate_size=16, num_experts_per_tok=2, num_hidden_layers=1)
    if family == "mixtral":
        hf = hf_mixtral.MixtralSparseMoeBlock(MixtralConfig(num_local_experts=6, **common))
        renorm, router = True, "gate.weight"
    elif family == "jamba":   # top-k of softmax, not renormalised
        hf = hf_jamba.JambaSparseMoeBlock(JambaConfig(num_experts=6, **common))
        renorm, router = False, "router.weight"
    else:                     # softmax over the top-k logits == renormalised top-k of softmax
        hf = hf_granite.GraniteMoeHybridMoE(GraniteMoeHybridConfig(num_local_experts=6, mamba_n_heads=4,
                                                                           mamba_d_head=16, **common))
        renorm, router = True, "router.weight"
    randomize(hf, 0, scale=0.3)
    ours = MoEFeedForward(32, MoE(num_experts=6, top_k=2, intermediate_size=16, renormalize=renorm))
    load_exact(ours, {"router.weight": dict(hf.named_parameters())[router].detach(),
                      **_stacked_gated_experts(hf.experts, 16)})
    x = hidden(30, 32, seed=1)
    with torch.no_grad():
        assert_close(ours(x), hf(x[None])[0])


@pytest.mark.parametrize("latent", [None, 16])
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_nemotron_h_moe_matches_hf(groups: tuple[int, int], latent: int | None) -> None:
    n_group, topk_group = groups
    cfg = NemotronHConfig(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=n_group,
                          topk_group=topk_group, moe_intermediate_size=16,
                          moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5,
                          norm_topk_prob=True, mlp_hidden_act="relu2", moe_latent_size=latent,
                          num_hidden_layers=1)
    hf = hf_nemotron_h.NemotronHMoE(cfg)
    randomize(hf, 0, scale=0.3)
    with torch.no_grad():   # a correction bias large enough to change which experts are chosen
        hf.gate.e_score_correction_bias.copy_(0.3 * hidden(1, 8, seed=2)[0])
    ours = MoEFeedForward(32, MoE(num_experts=8, top_k=2, intermediate_size=16, router="sigmoid_bias",
                                  shared_intermediate_size=24, routed_scaling_factor=2.5,
                                  activation="relu2", gated=False, num_groups=n_group,
                                  topk_groups=topk_group, latent_size=latent))
    tensors = {"router.weight": hf.gate.weight.detach(), "up_proj": hf.experts.up_proj.detach(),
               "down_proj": hf.experts.down_proj.detach(),
               "shared.up_proj.weight": hf.shared_experts.up_proj.weight.detach(),
               "shared.down_proj.weight": hf.shared_experts.down_proj.weight.detach()}
    if latent:
        tensors |= {f"{n}.weight": getattr(hf, n).weight.detach()
                    for n in ("fc1_latent_proj", "fc2_latent_proj")}
    load_exact(ours, tensors | {"correction_bias": hf.gate.e_score_correction_bias.clone()})
    x = hidden(40, 32, seed=1)
    with torch.no_grad():
        assert_close(ours(x), hf(x[None])[0])


def _mlp_case(kind: str) -> tuple[nn.Module, DenseMLP, list[str]]:
    if kind == "swiglu":
        hf = hf_llama.LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu"))
        return hf, DenseMLP(32, 48, activation="silu"), ["gate_proj", "up_proj", "down_proj"]
    if kind == "geglu_tanh":
        hf = hf_gemma2.Gemma2MLP(Gemma2Config(hidden_size=32, intermediate_size=48,
                                              hidden_activation="gelu_pytorch_tanh"))
        return hf, DenseMLP(32, 48, activation="gelu_tanh"), ["gate_proj", "up_proj", "down_proj"]
    hf = hf_nemotron_h.NemotronHMLP(NemotronHConfig(hidden_size=32, intermediate_size=48,
                                                    mlp_hidden_act="relu2", num_hidden_layers=1))
    return hf, DenseMLP(32, 48, activation="relu2", gated=False), ["up_proj", "down_proj"]


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "relu2"])
def test_dense_mlp_matches_hf(kind: str) -> None:
    hf, ours, names = _mlp_case(kind)
    randomize(hf, 0, scale=0.3)
    load_exact(ours, same_names(hf, [f"{n}.weight" for n in names]))
    x = hidden(20, 32, seed=1)
    with torch.no_grad():
        assert_close(ours(x), hf(x))


@pytest.mark.parametrize(("ours", "hf"), [("silu", "silu"), ("gelu", "gelu"),
                                          ("gelu_tanh", "gelu_pytorch_tanh"), ("relu2", "relu2")])
def test_activations_match_hf(ours: str, hf: str) -> None:
    x = torch.linspace(-6, 6, 1001)
    assert torch.equal(get_activation(ours)(x), ACT2FN[hf](x))


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "gemma2", "gemma3", "llama4_l2"])
def test_rms_norms_match_hf(kind: str, dtype: torch.dtype) -> None:
    """Same ops in the same order, so equal to the bit, in bf16 too (Llama casts before the weight, Gemma
    after it)."""
    x = (3 * hidden(12, 32, seed=1)).to(dtype)
    if kind == "llama4_l2":
        hf_out = hf_llama4.Llama4TextL2Norm(1e-5)(x)
        assert torch.equal(rms_normalize(x, 1e-5).to(dtype), hf_out)
        return
    hf = {"llama": lambda: hf_llama.LlamaRMSNorm(32, eps=1e-5), "gemma2": lambda: hf_gemma2.Gemma2RMSNorm(32),
          "gemma3": lambda: hf_gemma3.Gemma3RMSNorm(32)}[kind]()
    randomize(hf, 0)
    ours = RMSNorm(32, eps=1e-5 if kind == "llama" else 1e-6, gemma=kind != "llama")
    load_exact(ours, same_names(hf, ["weight"]))
    hf, ours = hf.to(dtype), ours.to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))


def test_gated_group_norm_matches_hf() -> None:
    hf = hf_mamba2.MambaRMSNormGated(64, group_size=16, eps=1e-5)
    randomize(hf, 0)
    ours = GatedGroupRMSNorm(64, n_groups=4, eps=1e-5)
    load_exact(ours, same_names(hf, ["weight"]))
    y, z = hidden(10, 64, seed=1), hidden(10, 64, seed=2)
    with torch.no_grad():
        assert_close(ours(y, z), hf(y, gate=z), atol=1e-6)


# ----------------------------------------------------------------------------- RoPE


ROPE_CASES = {
    # name: (HF rope_parameters, our Rope)
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, Rope(theta=10000.0)),
    "linear": ({"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
               Rope(theta=1e6, scaling="linear", factor=8.0)),
    "llama3": (LLAMA3, OUR_LLAMA3),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_inv_freq_matches_hf_init_functions(case: str) -> None:
    params, rope = ROPE_CASES[case]
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_parameters=params,
                      max_position_embeddings=131072)
    rope_type = params["rope_type"]
    init = (hf_llama.LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rope_type])
    assert torch.equal(rope_inv_freq(rope, 128), init(cfg)[0])   # bit-exact: fp32, HF's op order


def _positions() -> torch.Tensor:
    """Short and long positions: a frequency off by one ulp shows up as a phase error far out."""
    return torch.cat([torch.arange(20), torch.tensor([1000, 8191, 8192, 40_000, 131_071])])


def _qk(n: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = hidden(n * heads, dim, seed=1), hidden(n * kv_heads, dim, seed=2)
    return q.view(n, heads, dim), k.view(n, kv_heads, dim)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_rotate_half_matches_hf(case: str) -> None:
    params, rope = ROPE_CASES[case]
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=params,
                      max_position_embeddings=131072)
    pos = _positions()
    q, k = _qk(len(pos), 4, 2, 16)
    cos, sin = hf_llama.LlamaRotaryEmbedding(cfg)(q, pos[None])
    hq, hk = hf_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    oq, ok = RotaryEmbedding(16, rope)(pos, q, k)
    assert_close(oq, hq[0].transpose(0, 1), atol=2e-6)
    assert_close(ok, hk[0].transpose(0, 1), atol=2e-6)


def test_rope_partial_rotary_matches_hf() -> None:
    """Bamba: rotate-half over the first half of each head, the rest passed through."""
    cfg = BambaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5
    pos = _positions()
    q, k = _qk(len(pos), 4, 2, 16)
    cos, sin = hf_bamba.BambaRotaryEmbedding(cfg)(q, pos[None])
    hq, hk = hf_bamba.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    oq, ok = RotaryEmbedding(16, Rope(theta=10000.0, partial_rotary_factor=0.5))(pos, q, k)
    assert torch.equal(oq[..., 8:], q[..., 8:])
    assert_close(oq, hq[0].transpose(0, 1), atol=2e-6)
    assert_close(ok, hk[0].transpose(0, 1), atol=2e-6)


def test_rope_interleaved_matches_hf_llama4() -> None:
    cfg = Llama4TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rope_parameters=LLAMA3, max_position_embeddings=131072)
    pos = _positions()
    q, k = _qk(len(pos), 4, 2, 16)
    freqs_cis = hf_llama4.Llama4TextRotaryEmbedding(cfg)(q, pos[None])
    hq, hk = hf_llama4.apply_rotary_emb(q[None], k[None], freqs_cis)
    oq, ok = RotaryEmbedding(16, dataclasses.replace(OUR_LLAMA3, interleaved=True))(pos, q, k)
    assert_close(oq, hq[0], atol=2e-6)
    assert_close(ok, hk[0], atol=2e-6)


# ----------------------------------------------------------------------------- Falcon-H1 µP, Zamba2 sharing


FALCON_MULTIPLIERS = dict(attention_in_multiplier=0.8, key_multiplier=1.3, attention_out_multiplier=0.7,
                          ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                          ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], mlp_multipliers=[1.1, 0.8])


def _falcon_config(**kw) -> FalconH1Config:
    return eager(FalconH1Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, projectors_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, **FALCON_MULTIPLIERS, **kw))


FALCON_NORMS = {"no_norm": dict(mamba_rms_norm=False), "norm_then_gate": dict(mamba_rms_norm=True),
                "gate_then_norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=False)}


@pytest.mark.parametrize("sched", list(SCHEDULES))
@pytest.mark.parametrize("norm", list(FALCON_NORMS))
def test_falcon_h1_mamba_matches_hf(norm: str, sched: str) -> None:
    """µP input / per-section (z, x, B, C, dt) / output multipliers, out_proj bias without in_proj bias,
    and the three output-gate variants, through prefill, chunked prefill and decode steps."""
    cfg = _falcon_config(**FALCON_NORMS[norm])
    hf = hf_falcon_h1.FalconH1Mixer(cfg, 0)
    hf.register_buffer("mup_vector", hf_falcon_h1.compute_mup_vector(cfg), persistent=False)
    randomize(hf, 0, scale=0.2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf.A_log.copy_(torch.log(0.5 + 3.5 * torch.rand(4, generator=gen)))
        hf.D.copy_(1.0 + 0.5 * torch.randn(4, generator=gen))
        hf.dt_bias.copy_(torch.randn(4, generator=gen))
    spec = Mamba2(num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=8, norm_eps=cfg.rms_norm_eps,
                  out_proj_bias=True, gated_norm=cfg.mamba_rms_norm,
                  norm_before_gate=cfg.mamba_norm_before_gate, input_multiplier=1.2,
                  zxbcdt_multipliers=(1.1, 0.9, 1.2, 0.8, 1.05), output_multiplier=0.9)
    ours = Mamba2Layer(32, spec, cache_name="m2")
    names = ["in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "out_proj.weight",
             "out_proj.bias"] + (["norm.weight"] if cfg.mamba_rms_norm else [])
    load_exact(ours, same_names(hf, names))
    x = hidden(SEQ, 32, seed=2)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4).run(x, SCHEDULES[sched])
    with torch.no_grad():
        assert_close(out, hf(x[None])[0] * 0.9)


def test_falcon_h1_attention_multipliers_match_hf() -> None:
    cfg = _falcon_config()
    hf = hf_falcon_h1.FalconH1Attention(cfg, 0)
    randomize(hf, 0)
    ours = AttentionLayer(32, Attention(num_heads=4, num_kv_heads=2, head_dim=8, rope=Rope(theta=100.0),
                                       input_multiplier=0.8, key_multiplier=1.3, output_multiplier=0.7),
                          cache_name="attn", norm_eps=1e-5)
    load_exact(ours, same_names(hf, ATTN_NAMES))
    x = hidden(SEQ, 32, seed=1)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=3).run(x, SCHEDULES["chunks+decodes"])
    with torch.no_grad():   # HF's decoder layer applies the in / out multipliers around the module
        pe = hf_falcon_h1.FalconH1RotaryEmbedding(cfg)(x[None], torch.arange(SEQ)[None])
        ref = hf(hidden_states=x[None] * 0.8, position_embeddings=pe, attention_mask=additive_mask(SEQ))[0][0]
    assert_close(out, ref * 0.7)


def test_falcon_h1_mlp_multipliers_match_hf() -> None:
    hf = hf_falcon_h1.FalconH1MLP(_falcon_config())
    randomize(hf, 0, scale=0.3)
    ours = DenseMLP(32, 48, gate_multiplier=1.1, down_multiplier=0.8)
    load_exact(ours, same_names(hf, [f"{n}_proj.weight" for n in ("gate", "up", "down")]))
    x = hidden(20, 32, seed=1)
    with torch.no_grad():
        assert_close(ours(x), hf(x))


@pytest.mark.parametrize("before", [True, False])
def test_falcon_h1_gated_norm_matches_hf(before: bool) -> None:
    hf = hf_falcon_h1.FalconH1RMSNormGated(64, eps=1e-5, n_groups=4, norm_before_gate=before)
    randomize(hf, 0)
    ours = GatedGroupRMSNorm(64, n_groups=4, eps=1e-5, norm_before_gate=before)
    load_exact(ours, same_names(hf, ["weight"]))
    y, z = hidden(10, 64, seed=1), hidden(10, 64, seed=2)
    with torch.no_grad():
        assert_close(ours(y, z), hf(y, gate=z), atol=1e-6)


ZAMBA_TYPES = ["hybrid", "mamba", "hybrid", "hybrid"]       # uses 0 and 2 share block 0


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_zamba2_shared_block_use_matches_hf(sched: str) -> None:
    """One use of a shared block: concat(x, embeddings) -> norm -> attention (+ q/k/v adapters, RoPE,
    scale (head_dim / 2) ** -0.5) -> norm -> MLP (+ gate|up adapter) -> the layer's linear. Use 2 of
    block 0 (layer 3) picks adapter 2 out of the block's list."""
    cfg = eager(Zamba2Config(
        hidden_size=32, num_hidden_layers=4, layers_block_type=ZAMBA_TYPES, num_mem_blocks=2,
        num_attention_heads=4, num_key_value_heads=4, adapter_rank=4, intermediate_size=48,
        use_shared_attention_adapter=True, use_mem_rope=True, n_mamba_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}))
    block = hf_zamba2.Zamba2AttentionDecoderLayer(cfg, block_id=0)
    linear = nn.Linear(32, 32, bias=False)
    randomize(block, 0, scale=0.2)
    randomize(linear, 1, scale=0.2)
    attention = Attention(num_heads=4, num_kv_heads=4, head_dim=16, rope=Rope(theta=100.0), scale=8 ** -0.5,
                          shared_id=0)
    spec = SharedBlock(block_id=0, use_index=2, attention=attention, adapter_rank=4, attention_adapters=True,
                       mlp=MLP(intermediate_size=48, activation="gelu"))
    mamba = Mamba2(num_heads=4, head_dim=16, state_size=8)
    config = HybridConfig(vocab_size=8, hidden_size=32, layers=(Layer(mixer=mamba, shared_block=spec),))
    weights = SharedTransformerBlock(config, spec)
    ours = SharedBlockUse(config, spec, weights, cache_name="shared")
    hp = {k: v.detach() for k, v in block.named_parameters()}
    gate_up = hp["feed_forward.gate_up_proj.weight"]
    load_exact(weights, {
        "input_norm.weight": hp["input_layernorm.weight"], "ffn_norm.weight": hp["pre_ff_layernorm.weight"],
        **{f"attention.{p}_proj.weight": hp[f"self_attn.{p}_proj.weight"] for p in "qkvo"},
        "mlp.gate_proj.weight": gate_up[:48], "mlp.up_proj.weight": gate_up[48:],
        "mlp.down_proj.weight": hp["feed_forward.down_proj.weight"]})
    parts = {"0": "down", "1": "up"}
    load_exact(ours, {
        "linear.weight": linear.weight.detach(),
        **{f"attention.{p}_adapter.{ours_part}.weight": hp[f"self_attn.linear_{p}_adapter_list.2.{i}.weight"]
           for p in "qkv" for i, ours_part in parts.items()},
        **{f"mlp_adapter.{part}.weight": hp[f"feed_forward.gate_up_proj_adapter_list.2.{i}.weight"]
           for i, part in parts.items()}})

    class Packed(nn.Module):          # the harness feeds one tensor: (x | embeddings)
        def __init__(self) -> None:
            super().__init__()
            self.use = ours

        def forward(self, xe: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.use(xe[:, :32], xe[:, 32:], positions)

    x, e = hidden(SEQ, 32, seed=1), hidden(SEQ, 32, seed=2)
    out = LayerHarness(Packed(), max_len=SEQ, max_reqs=1, seed=3).run(torch.cat([x, e], -1), SCHEDULES[sched])
    with torch.no_grad():
        pe = hf_zamba2.Zamba2RotaryEmbedding(cfg)(x[None], torch.arange(SEQ)[None])
        t = block(x[None], original_hidden_states=e[None], layer_idx=3, attention_mask=additive_mask(SEQ),
                  position_embeddings=pe)
        assert_close(out, linear(t)[0], atol=3e-5)   # three sublayers deep, outputs ~3: a few ulps each
