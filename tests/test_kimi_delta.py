"""The Kimi Delta Attention layer against HF's ``KimiLinearDeltaAttention`` (CPU, fp32, copied weights).

Through ``LayerHarness`` (shuffled state slots, fresh slots NaN): one full prefill, several prefill chunks then
single-token decodes (every chunk continues from its request's conv and recurrent state), against HF over the
whole sequence; HF's own cached decode path; a mixed batch equal to each request alone; the tensor-parallel rule
as data (a clear error where the ranks do not divide the heads); on a GPU, the same through the triton and fla
backends."""

from __future__ import annotations

import pytest
import torch
from _layer_harness import LayerHarness, torch_and_triton_outputs
from _triton import gpu
from test_layers_vs_hf import SCHEDULES, SEQ, assert_batched_equals_one_by_one, assert_close, hidden, randomize

from hybridkv.layers.kimi_delta import KimiDeltaAttentionLayer
from hybridkv.layers.parallel import TensorParallel
from hybridkv.models.config import KimiDeltaAttention

hf_kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                              reason="transformers without Kimi-Linear")

H = 32
_SAME = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight",
         "o_norm.weight", "o_proj.weight"]


def hf_weights(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our parameter names <- HF's in-memory module (forget gate moved up, the stacked conv split q/k/v)."""
    p = {n: t.detach().clone() for n, t in hf.named_parameters()}
    out = {n: p[n] for n in _SAME}
    out.update({n: p[f"forget_gate.{n}"] for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")})
    out["conv1d.weight"] = p["conv1d.weight"].view(3, -1, *p["conv1d.weight"].shape[1:])
    return out


def build(seed: int = 0, *, heads: int = 2, head_dim: int = 8) -> tuple[KimiDeltaAttentionLayer, torch.nn.Module]:
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(hidden_size=H, linear_num_heads=heads, linear_head_dim=head_dim, linear_conv_kernel_dim=4,
                           num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    hf = hf_kimi.KimiLinearDeltaAttention(cfg, 0).eval()
    hf.config = cfg                                         # for a DynamicCache of this one layer
    randomize(hf, seed, scale=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # A in [0.5, 4], dt_bias around 0 per channel: decays that differ by head and channel
        hf.forget_gate.A_log.copy_(torch.log(0.5 + 3.5 * torch.rand(1, 1, heads, 1, generator=gen)))
        hf.forget_gate.dt_bias.copy_(torch.randn(heads * head_dim, generator=gen))
    ours = KimiDeltaAttentionLayer(H, KimiDeltaAttention(num_heads=heads, head_dim=head_dim, conv_kernel=4,
                                                         norm_eps=1e-6, chunk_size=8), cache_name="kda")
    weights = hf_weights(hf)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(weights.pop(name))
    assert not weights, f"unused HF weights {sorted(weights)}"
    return ours, hf


@pytest.mark.parametrize("heads", [2, 1])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_kda_layer_matches_hf(sched: str, heads: int) -> None:
    ours, hf = build(heads=heads)
    x = hidden(SEQ, H, seed=2)
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4).run(x, SCHEDULES[sched])
    assert torch.isfinite(out).all()
    with torch.no_grad():
        assert_close(out, hf(x[None])[0])


def test_kda_layer_matches_hf_cached_decode() -> None:
    """A prefill through HF's cache, then HF's recurrent one-token path, against our chunks and decodes."""
    from transformers.cache_utils import DynamicCache

    ours, hf = build(seed=5)
    n_pre, n = 9, 20
    x = hidden(n, H, seed=6)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(x[None, :n_pre], cache=cache)]
        ref += [hf(x[None, t:t + 1], cache=cache) for t in range(n_pre, n)]
    out = LayerHarness(ours, max_len=n, max_reqs=1, seed=7).run(x, [4, 5] + [1] * (n - n_pre))
    assert_close(out, torch.cat(ref, dim=1)[0])


def test_kda_layer_batched_equals_one_by_one() -> None:
    layer, _ = build(seed=8)
    assert_batched_equals_one_by_one(layer, H)


def test_tensor_parallel_rule_and_state_shapes() -> None:
    cfg = KimiDeltaAttention(num_heads=4, head_dim=8)
    assert cfg.state_shapes() == ((3 * 32, 3), (4, 8, 8))
    assert cfg.state_shapes(2) == ((3 * 16, 3), (2, 8, 8))
    with pytest.raises(ValueError, match="num_heads"):
        cfg.state_shapes(3)
    with pytest.raises(ValueError, match="conv_kernel must be at least 2"):
        KimiDeltaAttention(num_heads=4, head_dim=8, conv_kernel=1)
    full = KimiDeltaAttentionLayer(H, cfg, cache_name="kda")
    rank = KimiDeltaAttentionLayer(H, cfg, cache_name="kda", tp=TensorParallel(rank=1, size=2))
    assert rank.q_proj.weight.shape[0] * 2 == full.q_proj.weight.shape[0]
    assert rank.conv1d.weight.view(-1, 4).shape[0] == cfg.state_shapes(2)[0][0]
    assert rank.A_log.shape == (1, 1, 2, 1) and rank.dt_bias.shape == (16,) and rank.o_proj.weight.shape[1] == 16
    assert rank.f_a_proj.weight.shape == full.f_a_proj.weight.shape          # the low-rank halves: replicated
    # A rank's shard of the stacked conv is its heads' channels of each of q, k and v.
    conv = torch.arange(3 * 32 * 4, dtype=torch.float32).view(3, 32, 1, 4)
    shard = rank.tp_shards["conv1d.weight"].take(conv, TensorParallel(rank=1, size=2))
    assert torch.equal(shard, conv[:, 16:])
    with pytest.raises(ValueError, match="num_heads"):
        KimiDeltaAttentionLayer(H, cfg, cache_name="kda", tp=TensorParallel(rank=0, size=8))


@gpu
@pytest.mark.parametrize("backend", ["triton", "fla"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_kda_layer_on_gpu_matches_hf(sched: str, backend: str) -> None:
    """On CUDA through the backend's kernels (conv1d and KDA: ours, or fla's when installed)."""
    if backend == "fla":
        pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    ours, hf = build()
    ours, hf = ours.cuda(), hf.cuda()
    x = hidden(SEQ, H, seed=2).cuda()
    out = LayerHarness(ours, max_len=SEQ, max_reqs=1, seed=4, backend=backend).run(x, SCHEDULES[sched])
    with torch.no_grad():
        assert_close(out, hf(x[None])[0], atol=1e-4)


def test_kda_layer_triton_backend_equals_torch() -> None:
    """The real call sites (strided q/k/v views of the conv output, A_log / dt_bias views, the raw per-channel gate,
    decodes first) through the triton backend's conv1d and KDA kernels (interpreted without a GPU) on mixed steps of
    decodes, fresh prefills and chunked-prefill continuations, against the torch backend."""
    layer, _ = build(seed=13)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = layer.to(device)
    steps = [{"a": 6, "b": 3}, {"a": 1, "b": 11, "c": 5}, {"c": 1, "a": 1, "b": 4}]
    xs = {r: hidden(24, H, seed=20 + i).to(device) for i, r in enumerate("abc")}
    outs = torch_and_triton_outputs(layer, xs, steps, max_len=24, seed=14)
    assert_close(outs[1], outs[0], atol=1e-4)
