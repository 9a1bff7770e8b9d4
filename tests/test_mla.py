"""Multi-head latent attention against HF's ``KimiLinearAttention`` (CPU, fp32, copied weights), and its latent
cache spec.

Through ``LayerHarness`` (4-token blocks handed out shuffled, unused blocks NaN): one full prefill, prefill chunks
then single-token decodes, against HF over the whole sequence with a causal mask; with q_proj or the low-rank
q_a / q_b path, with and without biases; a mixed batch equal to each request alone; HF's cached decode path. The
spec: one latent row per token (its page bytes), grouped apart from ordinary full attention; the tensor-parallel
rule as data."""

from __future__ import annotations

import pytest
import torch
from _layer_harness import LayerHarness, torch_and_triton_outputs
from test_layers_vs_hf import (
    SCHEDULES,
    SEQ,
    additive_mask,
    assert_batched_equals_one_by_one,
    assert_close,
    hidden,
    randomize,
)

from hybridkv.kv_groups.plan import group_layers
from hybridkv.kv_groups.specs import FullAttentionSpec, MLAAttentionSpec
from hybridkv.layers.mla import MLALayer
from hybridkv.layers.parallel import TensorParallel
from hybridkv.models.config import MultiLatentAttention

hf_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                              reason="transformers without Kimi-Linear")

H = 32


def build(seed: int = 0, *, q_lora_rank: int | None = None, bias: bool = False
          ) -> tuple[MLALayer, torch.nn.Module]:
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12,
                           q_lora_rank=q_lora_rank, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                           attention_bias=bias, num_hidden_layers=1, layer_types=["full_attention"])
    cfg._attn_implementation = "eager"
    hf = hf_kimi.KimiLinearAttention(cfg, 0).eval()
    hf.config = cfg
    randomize(hf, seed, scale=0.3)
    ours = MLALayer(H, MultiLatentAttention(num_heads=4, kv_lora_rank=12, q_lora_rank=q_lora_rank,
                                            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, bias=bias),
                    cache_name="mla")
    hf_params = {n: t.detach().clone() for n, t in hf.named_parameters()}
    own = dict(ours.named_parameters())
    assert set(own) == set(hf_params), (sorted(own), sorted(hf_params))      # the hub's names, one to one
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(hf_params[name])
    return ours, hf


def hf_forward(hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x[None], attention_mask=additive_mask(x.shape[0]))[0][0]


@pytest.mark.parametrize("variant", [dict(), dict(q_lora_rank=10, bias=True)], ids=["q_proj", "q_lora+bias"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_mla_matches_hf(sched: str, variant: dict) -> None:
    ours, hf = build(**variant)
    x = hidden(SEQ, H, seed=2)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4).run(x, SCHEDULES[sched])
    assert torch.isfinite(out).all()
    assert_close(out, hf_forward(hf, x))


def test_mla_matches_hf_cached_decode() -> None:
    """HF's own cache (it stores the latent and the rope key) through a prefill and one-token steps."""
    from transformers.cache_utils import DynamicCache

    ours, hf = build(seed=5)
    n_pre, n = 9, 20
    x = hidden(n, H, seed=6)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(x[None, :n_pre], attention_mask=additive_mask(n_pre), cache=cache)[0]]
        ref += [hf(x[None, t:t + 1], attention_mask=None, cache=cache)[0] for t in range(n_pre, n)]
    out = LayerHarness(ours, max_len=n, max_reqs=1, seed=7).run(x, [4, 5] + [1] * (n - n_pre))
    assert_close(out, torch.cat(ref, dim=1)[0])


def test_mla_batched_equals_one_by_one() -> None:
    layer, _ = build(seed=8, q_lora_rank=10)
    assert_batched_equals_one_by_one(layer, H)


def test_latent_spec_page_bytes_and_grouping() -> None:
    """Kimi-Linear-48B's MLA in bf16: one 576-wide row per token (1152 bytes), where per-head K and V would be
    32 heads x (192 + 128) x 2 bytes = 20480 bytes; equal specs group together, apart from plain full attention."""
    spec = MLAAttentionSpec(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
    assert (spec.num_kv_heads, spec.head_size, spec.kv_planes) == (1, 576, 1)
    assert spec.bytes_per_token == 1152 and spec.bytes_per_block == 16 * 1152
    assert spec.as_full_attention() is spec and spec.describe() == "mla(512+64)"
    assert spec.skipped_tokens(100) == 0 and spec.max_blocks_per_request(num_tokens=33, step_tokens=8) == 3
    plain = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert plain.bytes_per_token == 2 * spec.bytes_per_token and plain != spec
    twin = MLAAttentionSpec(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
    groups = group_layers({"a": spec, "b": plain, "c": twin, "d": plain})
    # (groups fill a page exactly: two latent layers take the bytes of one K/V layer)
    assert sorted(sorted(g.layer_names) for g in groups) == [["a", "c"], ["b"], ["d"]]
    with pytest.raises(ValueError, match="one row of kv_lora_rank"):
        MLAAttentionSpec(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64, head_size=512)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
        MLAAttentionSpec(block_size=16, kv_lora_rank=0, qk_rope_head_dim=64)


def test_tensor_parallel_rule() -> None:
    cfg = MultiLatentAttention(num_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    full = MLALayer(H, cfg, cache_name="mla")
    rank = MLALayer(H, cfg, cache_name="mla", tp=TensorParallel(rank=1, size=2))
    assert rank.num_heads == 2 and rank.q_proj.weight.shape[0] * 2 == full.q_proj.weight.shape[0]
    assert rank.kv_b_proj.weight.shape == (2 * (8 + 6), 12) and rank.o_proj.weight.shape == (H, 2 * 6)
    assert rank.kv_a_proj_with_mqa.weight.shape == full.kv_a_proj_with_mqa.weight.shape     # the latent: whole
    with pytest.raises(ValueError, match="num_heads"):
        MLALayer(H, cfg, cache_name="mla", tp=TensorParallel(rank=0, size=3))


def test_mla_triton_backend_equals_torch() -> None:
    """The latent cache through the triton backend's KV write and paged attention (interpreted without a GPU): one
    KV head of width kv_lora_rank + qk_rope_head_dim read as keys and values, on mixed decode / prefill steps."""
    layer, _ = build(seed=13, q_lora_rank=10)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = layer.to(device)
    steps = [{"a": 6, "b": 3}, {"a": 1, "b": 11, "c": 5}, {"c": 1, "a": 1, "b": 4}]
    xs = {r: hidden(24, H, seed=20 + i).to(device) for i, r in enumerate("abc")}
    outs = torch_and_triton_outputs(layer, xs, steps, max_len=24, seed=14)
    assert_close(outs[1], outs[0], atol=1e-4)
