"""The Gated DeltaNet layer against HF's ``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet`` (unfused projections)
and ``OlmoHybridGatedDeltaNet`` (separate q/k/v projections, beta doubled) (CPU, fp32, copied weights).

Through ``LayerHarness`` (shuffled state slots, fresh slots NaN): one full prefill, several prefill chunks then
single-token decodes (every chunk continues from its request's conv and recurrent state), against HF over the
whole sequence; HF's own cached decode path; a mixed batch equal to each request alone; the tensor-parallel rule
as data (a clear error where the ranks do not divide the key heads); on a GPU, the same through the triton and fla
backends."""

from __future__ import annotations

import pytest
import torch
from _layer_harness import LayerHarness
from _triton import gpu
from test_layers_vs_hf import (
    SCHEDULES,
    SEQ,
    assert_batched_equals_one_by_one,
    assert_close,
    hidden,
    load_exact,
    randomize,
    same_names,
)

from hybridkv.layers.gated_deltanet import GatedDeltaNetLayer, qwen3_next_rows
from hybridkv.layers.parallel import TensorParallel
from hybridkv.models.config import GatedDeltaNet

hf_qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                    reason="transformers without Qwen3-Next")

H = 32
COMMON = ["conv1d.weight", "dt_bias", "A_log", "out_proj.weight"]
VARIANTS = ["qwen3_next", "qwen3_5", "olmo_hybrid"]


def _hf_layer(variant: str, k_heads: int, v_heads: int) -> tuple[torch.nn.Module, object, dict]:
    """HF's module of ``variant``, its config and our config's options for it."""
    heads = dict(linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=8,
                 linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    one = dict(num_hidden_layers=1, layer_types=["linear_attention"])
    if variant == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(hidden_size=H, **heads, **one)
        return hf_qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0), cfg, dict(norm_eps=1e-6)
    if variant == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        cfg = Qwen3_5TextConfig(hidden_size=H, **heads, **one)
        return Qwen3_5GatedDeltaNet(cfg, 0), cfg, dict(norm_eps=1e-6)
    from transformers import OlmoHybridConfig
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

    cfg = OlmoHybridConfig(hidden_size=H, num_attention_heads=4, pad_token_id=None, **heads, num_hidden_layers=2,
                           layer_types=["linear_attention", "full_attention"], linear_allow_neg_eigval=True)
    return OlmoHybridGatedDeltaNet(cfg, 0), cfg, dict(norm_eps=1e-5, beta_scale=2.0)


def _our_weights(variant: str, hf: torch.nn.Module, cfg: GatedDeltaNet) -> dict[str, torch.Tensor]:
    if variant == "qwen3_next":      # the loader's reordering of the per-key-head groups
        p = {n: t.detach().clone() for n, t in hf.named_parameters()}
        rows = {part: qwen3_next_rows(p[f"in_proj_{fused}.weight"], part, cfg)
                for fused, parts in (("qkvz", ("qkv", "z")), ("ba", ("b", "a"))) for part in parts}
        return {**{f"in_proj_{part}.weight": t for part, t in rows.items()},
                **same_names(hf, ["norm.weight", *COMMON])}
    if variant == "qwen3_5":
        return same_names(hf, [f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")] + ["norm.weight", *COMMON])
    p = {n: t.detach().clone() for n, t in hf.named_parameters()}
    return {"in_proj_qkv.weight": torch.cat([p[f"{x}_proj.weight"] for x in "qkv"]),
            "in_proj_z.weight": p["g_proj.weight"], "in_proj_b.weight": p["b_proj.weight"],
            "in_proj_a.weight": p["a_proj.weight"], "norm.weight": p["o_norm.weight"],
            "out_proj.weight": p["o_proj.weight"], **{n: p[n] for n in ("conv1d.weight", "dt_bias", "A_log")}}


def build(seed: int = 0, *, k_heads: int = 2, v_heads: int = 4, variant: str = "qwen3_next"
          ) -> tuple[GatedDeltaNetLayer, torch.nn.Module]:
    hf, cfg, options = _hf_layer(variant, k_heads, v_heads)
    hf = hf.eval()
    hf.config = cfg                                         # for a DynamicCache of this one layer
    randomize(hf, seed, scale=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # A in [0.5, 4] (decays from ~0.99 to ~0.3 per token), dt_bias around 0
        hf.A_log.copy_(torch.log(0.5 + 3.5 * torch.rand(v_heads, generator=gen)))
        hf.dt_bias.copy_(torch.randn(v_heads, generator=gen))
    ours_cfg = GatedDeltaNet(num_k_heads=k_heads, num_v_heads=v_heads, head_k_dim=8, head_v_dim=12, conv_kernel=4,
                             chunk_size=8, **options)
    ours = GatedDeltaNetLayer(H, ours_cfg, cache_name="gdn")
    load_exact(ours, _our_weights(variant, hf, ours_cfg))
    return ours, hf


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads", [(2, 4), (2, 2)])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_gated_deltanet_matches_hf(sched: str, heads: tuple[int, int], variant: str) -> None:
    ours, hf = build(k_heads=heads[0], v_heads=heads[1], variant=variant)
    x = hidden(SEQ, H, seed=2)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4).run(x, SCHEDULES[sched])
    assert torch.isfinite(out).all()
    with torch.no_grad():
        assert_close(out, hf(x[None])[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_gated_deltanet_matches_hf_cached_decode(variant: str) -> None:
    """A prefill through HF's cache, then HF's recurrent one-token path, against our chunks and decodes."""
    from transformers.cache_utils import DynamicCache

    ours, hf = build(seed=5, variant=variant)
    n_pre, n = 9, 20
    x = hidden(n, H, seed=6)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(x[None, :n_pre], cache=cache)[0]]
        ref += [hf(x[None, t:t + 1], cache=cache)[0] for t in range(n_pre, n)]
    out = LayerHarness(ours, max_len=n, max_reqs=1, seed=7).run(x, [4, 5] + [1] * (n - n_pre))
    assert_close(out, torch.cat(ref))


def test_gated_deltanet_batched_equals_one_by_one() -> None:
    layer, _ = build(seed=8)
    assert_batched_equals_one_by_one(layer, H)


def test_tensor_parallel_rule_and_state_shapes() -> None:
    cfg = GatedDeltaNet(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=12)
    assert cfg.state_shapes() == ((2 * 32 + 96, 3), (8, 8, 12))
    assert cfg.state_shapes(2) == ((2 * 16 + 48, 3), (4, 8, 12))       # two key heads and their four value heads
    with pytest.raises(ValueError, match="num_k_heads"):
        cfg.state_shapes(3)
    with pytest.raises(ValueError, match="must divide num_v_heads"):
        GatedDeltaNet(num_k_heads=3, num_v_heads=8, head_k_dim=8, head_v_dim=8)
    # One rank's shard: each of q, k, v, z, b, a cut by key heads.
    rank = GatedDeltaNetLayer(H, cfg, cache_name="gdn", tp=TensorParallel(rank=1, size=2))
    assert rank.in_proj_qkv.weight.shape[0] == cfg.state_shapes(2)[0][0] == 2 * 16 + 48
    assert rank.in_proj_z.weight.shape[0] == 48
    assert rank.in_proj_b.weight.shape[0] == rank.in_proj_a.weight.shape[0] == 4
    assert rank.conv1d.weight.shape[0] == cfg.state_shapes(2)[0][0]
    assert rank.A_log.shape == (4,) and rank.out_proj.weight.shape[1] == 48
    with pytest.raises(ValueError, match="num_k_heads"):
        GatedDeltaNetLayer(H, cfg, cache_name="gdn", tp=TensorParallel(rank=0, size=8))
    with pytest.raises(ValueError, match="beta_scale"):
        GatedDeltaNet(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=12, beta_scale=0.0)


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["triton", "fla"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_gated_deltanet_on_gpu_matches_hf(sched: str, backend: str, variant: str) -> None:
    """On CUDA through the backend's kernels (conv1d and gated delta rule: ours, or fla's when installed)."""
    if backend == "fla":
        pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    ours, hf = build(variant=variant)
    ours, hf = ours.cuda(), hf.cuda()
    x = hidden(SEQ, H, seed=2).cuda()
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4, backend=backend).run(x, SCHEDULES[sched])
    with torch.no_grad():
        assert_close(out, hf(x[None])[0], atol=1e-4)


def test_configs_saved_with_a_projection_layout() -> None:
    """Configs saved while GatedDeltaNet had two projection layouts: "flat" (today's) loads, "grouped" (whose
    in_proj_qkvz / in_proj_ba tensors no longer exist) is a clear error saying what to do."""
    import json

    from hybridkv.models import HybridConfig, Layer

    config = HybridConfig(vocab_size=32, hidden_size=H, max_position_embeddings=64, dtype="float32",
                          layers=(Layer(mixer=GatedDeltaNet(num_k_heads=2, num_v_heads=4, head_k_dim=8,
                                                            head_v_dim=8)),))
    saved = json.loads(json.dumps(config.to_dict()))
    mixer = saved["hybridkv_config"]["layers"][0]["mixer"]
    mixer["projections"] = "flat"
    assert HybridConfig.from_dict(saved) == config
    mixer["projections"] = "grouped"
    with pytest.raises(ValueError, match="Hugging Face checkpoint"):
        HybridConfig.from_dict(saved)
