"""The fused elementwise Triton kernels (``backends/triton_fused.py``) against their torch references
(``layers/ops/fused_ref.py``): table-driven over every variant a layer uses.

On a machine without CUDA the kernels run under Triton's interpreter in fp32 (tight tolerances: only the
order of the fp32 sums differs) and fp16 (where every rounding point shows). With CUDA the same tables run
compiled, plus bf16. In low precision the kernel's error against an fp32 truth must stay within twice the
reference's own error (flash-attention's test rule).
Inputs are strided views like the real call sites' ``split`` outputs; caches are NaN outside the slots
written, padding rows (slot -1) must not be written.
"""

from __future__ import annotations

import pytest
import torch
from _triton import DEVICE, HAS_CUDA, kernel_module

from hybridkv.layers.ops.fused_ref import (
    QKPrep,
    act_mul_ref,
    add_rms_norm_ref,
    gated_rms_norm_ref,
    qk_rope_write_kv_ref,
    rms_norm_ref,
)
from hybridkv.layers.rotary import rope_inv_freq
from hybridkv.models.config import Rope

tf = kernel_module("hybridkv.backends.triton_fused")
ta = kernel_module("hybridkv.backends.triton_attention")
# fp16 on the CPU checks the rounding points (the interpreter rounds fp16 as torch does, but not bf16).
DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]


def _strided(t: torch.Tensor, extra: int = 5) -> torch.Tensor:
    """The same values as rows of a wider tensor (last dim contiguous, row stride larger)."""
    wide = torch.full((t.shape[0], t[0].numel() + extra), float("nan"), dtype=t.dtype, device=t.device)
    wide[:, : t[0].numel()] = t.reshape(t.shape[0], -1)
    return wide[:, : t[0].numel()].view(t.shape)


def _close(out: torch.Tensor, ref_fn, args: tuple, kwargs: dict, dtype: torch.dtype) -> None:
    """fp32: out == ref(args) to ~1e-5. Low precision: |out - truth| <= 2 |ref_lowp - truth| + tiny, truth =
    the reference on the same (rounded) inputs upcast to fp32."""
    ref = ref_fn(*args, **kwargs)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    up = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    upk = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
    truth = ref_fn(*up, **upk).float()
    err, ref_err = (out.float() - truth).abs().max(), (ref.float() - truth).abs().max()
    assert not torch.isnan(out).any()
    assert err <= 2 * ref_err + 1e-3 * truth.abs().max(), (err, ref_err)


NORM_CASES = [  # (residual in fp32, post-norm on the branch, scale, next norm, gemma, centered)
    (False, False, 1.0, True, False, False),
    (False, False, 1.0, False, False, False),
    (True, False, 1.0, True, False, False),
    (False, True, 1.0, True, True, False),
    (False, True, 0.5, False, True, False),
    (False, False, 2.0, True, False, False),
    (False, False, 1.0, True, False, True),
    (False, True, 1.0, True, False, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("res_fp32", "post", "scale", "has_norm", "gemma", "centered"), NORM_CASES)
def test_add_rms_norm(dtype, res_fp32, post, scale, has_norm, gemma, centered) -> None:
    g = torch.Generator().manual_seed(0)
    rows, n = 5, 48
    delta = _strided((torch.randn(rows, n, generator=g) + 1.5).to(DEVICE, dtype))    # off-centre: the mean matters
    residual = torch.randn(rows, n, generator=g).to(DEVICE, torch.float32 if res_fp32 else dtype)
    w = (torch.randn(n, generator=g) * 0.3 + (0 if gemma else 1)).to(DEVICE, dtype) if has_norm else None
    dw = (torch.randn(n, generator=g) * 0.3).to(DEVICE, dtype) if post else None
    kw = dict(weight=w, eps=1e-6, gemma=gemma, delta_weight=dw, scale=scale, centered=centered)
    normed, res = tf.add_rms_norm_triton(delta, residual, **kw)
    ref_normed, ref_res = add_rms_norm_ref(delta, residual, **kw)
    assert res.dtype == ref_res.dtype
    _close(res, lambda *a, **k: add_rms_norm_ref(*a, **k)[1], (delta, residual), kw, dtype)
    if has_norm:
        assert normed.dtype == ref_normed.dtype
        _close(normed, lambda *a, **k: add_rms_norm_ref(*a, **k)[0], (delta, residual), kw, dtype)
    else:
        assert normed is None and ref_normed is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("gemma", "centered"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("n", [16, 100])
def test_rms_norm(dtype, gemma, centered, n) -> None:
    g = torch.Generator().manual_seed(1)
    x = _strided((torch.randn(7, n, generator=g) + 2.0).to(DEVICE, dtype))
    w = (torch.randn(n, generator=g) * 0.3 + 1).to(DEVICE, dtype)
    out = tf.rms_norm_triton(x, w, eps=1e-5, gemma=gemma, centered=centered)
    assert out.dtype == rms_norm_ref(x, w, eps=1e-5, gemma=gemma, centered=centered).dtype
    _close(out, rms_norm_ref, (x, w), dict(eps=1e-5, gemma=gemma, centered=centered), dtype)


def test_centered_norm_is_layer_norm_without_bias() -> None:
    """The reference's centered flavour is torch's LayerNorm with no bias (HF ``CohereLayerNorm``)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 40, generator=g) * 3 + 1, torch.randn(40, generator=g)
    want = torch.nn.functional.layer_norm(x, (40,), w, None, eps=1e-5)
    torch.testing.assert_close(rms_norm_ref(x, w, eps=1e-5, centered=True), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu2", "sigmoid"])
@pytest.mark.parametrize(("gated", "mult"), [(True, 1.0), (True, 0.25), (False, 1.0)])
def test_act_mul(dtype, activation, gated, mult) -> None:
    g = torch.Generator().manual_seed(2)
    inter = 40
    x = _strided(torch.randn(6, 2 * inter if gated else inter, generator=g).mul(3).to(DEVICE, dtype))
    kw = dict(activation=activation, gated=gated, gate_multiplier=mult)
    out = tf.act_mul_triton(x, **kw)
    assert out.shape == (6, inter)
    _close(out, act_mul_ref, (x,), kw, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_mul_with_a_separate_up(dtype) -> None:
    """Qwen3-Next's attention output gate: ``out * sigmoid(gate)`` with the gate a strided view (its head's half of
    q_proj's rows) and out the attention's rows, one launch."""
    g = torch.Generator().manual_seed(3)
    heads, d = 3, 16
    q_and_gate = torch.randn(5, heads, 2 * d, generator=g).mul(3).to(DEVICE, dtype)
    gate = q_and_gate.chunk(2, dim=-1)[1].reshape(-1, d)                   # (5 * heads, d), row stride 2 * d
    up = torch.randn(5 * heads, d, generator=g).to(DEVICE, dtype)
    kw = dict(activation="sigmoid", up=up)
    _close(tf.act_mul_triton(gate, **kw), act_mul_ref, (gate,), kw, dtype)
    torch.testing.assert_close(act_mul_ref(gate, **kw), up * torch.sigmoid(gate), atol=0, rtol=0)


def test_act_mul_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown activation"):
        tf.act_mul_triton(torch.zeros(2, 4, device=DEVICE), activation="tanh")
    with pytest.raises(ValueError, match="even width"):
        tf.act_mul_triton(torch.zeros(2, 5, device=DEVICE), activation="silu")
    with pytest.raises(ValueError, match="up must be"):
        tf.act_mul_triton(torch.zeros(2, 4, device=DEVICE), activation="sigmoid", up=torch.zeros(2, 5, device=DEVICE))


PREPS = {  # name -> (QKPrep kwargs, rope)
    "neox": (dict(rot_dim=16), Rope(theta=10000.0)),
    "neox_partial": (dict(rot_dim=8), Rope(theta=10000.0, partial_rotary_factor=0.5)),
    "interleaved": (dict(rot_dim=16, interleaved=True), Rope(theta=500000.0, interleaved=True)),
    "qk_norm": (dict(rot_dim=16, qk_norm="rms"), Rope(theta=10000.0)),
    "qk_norm_gemma": (dict(rot_dim=16, qk_norm="rms", gemma_norm=True), Rope(theta=10000.0)),
    "llama4_rope": (dict(rot_dim=16, interleaved=True, qk_norm="rms_weightless"), Rope(theta=500000.0,
                                                                                        interleaved=True)),
    "llama4_nope": (dict(temperature_tuning=(0.1, 8.0)), None),
    "nope": ({}, None),
}


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 2, 16), (5, 1, 128)])   # 1 / 3 programs of q heads
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PREPS))
def test_qk_rope_write_kv(dtype, name, heads, kv_heads, d) -> None:
    prep_kw, rope = PREPS[name]
    g = torch.Generator().manual_seed(3)
    n, blocks, bs = 6, 5, 4
    prep = QKPrep(head_dim=d, eps=1e-6, **prep_kw)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q, k, v = (t.view(n, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    positions = torch.tensor([0, 5, 9, 17, 3000, 987654], device=DEVICE)     # RoPE angles up to ~1e6 rad
    slots = torch.tensor([1, 6, -1, 13, 19, 2], device=DEVICE)   # one padding row
    inv_freq = rope_inv_freq(rope, prep.rot_dim).to(DEVICE) if rope is not None else None
    qw = (torch.randn(d, generator=g) * 0.3 + 1).to(DEVICE, dtype)
    kw_ = (torch.randn(d, generator=g) * 0.3 + 1).to(DEVICE, dtype)
    kw = dict(prep=prep, inv_freq=inv_freq, q_norm_weight=qw, k_norm_weight=kw_)

    def pool() -> torch.Tensor:
        return torch.full((blocks, 2, bs, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)

    pool_tri, pool_ref = pool(), pool()
    q_tri = tf.qk_rope_write_kv_triton(q, k, v, positions, k_cache=pool_tri[:, 0], v_cache=pool_tri[:, 1],
                                       slot_mapping=slots, **kw)      # strided cache views, as bound
    # The reference writes every row: q from all rows into a scratch cache, K/V from the non-padding rows.
    keep = slots >= 0
    scratch = pool()
    q_ref = qk_rope_write_kv_ref(q, k, v, positions, k_cache=scratch[:, 0], v_cache=scratch[:, 1],
                                 slot_mapping=slots.clamp(min=0), **kw)
    qk_rope_write_kv_ref(q[keep], k[keep], v[keep], positions[keep], k_cache=pool_ref[:, 0],
                         v_cache=pool_ref[:, 1], slot_mapping=slots[keep], **kw)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q_tri, q_ref, **tol)
    torch.testing.assert_close(pool_tri, pool_ref, equal_nan=True, **tol)   # same slots written, NaN elsewhere


@pytest.mark.parametrize("name", ["qk_norm", "neox", "proportional"])
def test_qk_rope_q_only_writes_nothing(name) -> None:
    """k = v = None (a KV-sharing layer): q prepared as the reference does, the cache left as it was."""
    prep_kw, rope = PREPS[name] if name in PREPS else (dict(rot_dim=16, qk_norm="rms"),
                                                       Rope(theta=10000.0, scaling="proportional",
                                                            partial_rotary_factor=0.25))
    g = torch.Generator().manual_seed(5)
    n, heads, d = 6, 4, 16
    prep = QKPrep(head_dim=d, eps=1e-6, **prep_kw)
    q = torch.randn(n, heads, d, generator=g).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 17, 3000, 987654], device=DEVICE)
    inv_freq = rope_inv_freq(rope, prep.rot_dim).to(DEVICE)
    qw = (torch.randn(d, generator=g) * 0.3 + 1).to(DEVICE)
    kw = dict(prep=prep, inv_freq=inv_freq, q_norm_weight=qw, k_norm_weight=None,
              slot_mapping=torch.arange(n, device=DEVICE))
    pool = torch.full((3, 2, 4, 2, d), float("nan"), device=DEVICE)
    q_tri = tf.qk_rope_write_kv_triton(q, None, None, positions, k_cache=pool[:, 0], v_cache=pool[:, 1], **kw)
    q_ref = qk_rope_write_kv_ref(q, None, None, positions, k_cache=pool[:, 0], v_cache=pool[:, 1], **kw)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    assert pool.isnan().all()
    with pytest.raises(ValueError, match="both"):
        tf.qk_rope_write_kv_triton(q, q[:, :2], None, positions, k_cache=pool[:, 0], v_cache=pool[:, 1], **kw)


def test_qk_rope_write_kv_rejects_bad_input() -> None:
    prep = QKPrep(head_dim=8, qk_norm="rms")
    q = torch.zeros(2, 2, 8, device=DEVICE)
    k = torch.zeros(2, 1, 8, device=DEVICE)
    cache = torch.zeros(3, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="q_norm_weight"):
        tf.qk_rope_write_kv_triton(q, k, k, torch.zeros(2, dtype=torch.long, device=DEVICE), prep=prep,
                                   inv_freq=None, q_norm_weight=None, k_norm_weight=None, k_cache=cache,
                                   v_cache=cache, slot_mapping=torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="rot_dim"):
        QKPrep(head_dim=8, rot_dim=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_groups", "before", "has_weight", "rows"),
                         [(1, False, True, 5), (4, False, True, 5), (2, True, True, 5), (1, False, False, 5),
                          (2, True, True, 2100), (1, False, True, 4097)])     # many rows: several a program
def test_gated_rms_norm(dtype, n_groups, before, has_weight, rows) -> None:
    g = torch.Generator().manual_seed(4)
    dim = 32
    yz = torch.randn(rows, 2 * dim, generator=g).to(DEVICE, dtype)
    y, z = yz[:, :dim], yz[:, dim:]                            # strided views of one projection
    w = (torch.randn(dim, generator=g) * 0.3 + 1).to(DEVICE, dtype) if has_weight else None
    kw = dict(n_groups=n_groups, eps=1e-5, norm_before_gate=before)
    out = tf.gated_rms_norm_triton(y, z, w, **kw)
    _close(out, gated_rms_norm_ref, (y, z, w), kw, dtype)


# ------------------------------------------------------------------ a whole model on the fused ops

def _fused_backend():
    """The torch references with the fused elementwise ops (and decode's fused RoPE attention) replaced by the
    Triton kernels under test."""
    import dataclasses

    from hybridkv.backends.registry import torch_backend

    return dataclasses.replace(torch_backend(), name="torch+triton_fused", rms_norm=tf.rms_norm_triton,
                               add_rms_norm=tf.add_rms_norm_triton, act_mul=tf.act_mul_triton,
                               qk_rope_write_kv=tf.qk_rope_write_kv_triton, gated_rms_norm=tf.gated_rms_norm_triton,
                               rope_attention=ta.rope_attention_triton)   # decode: the fused attention kernel


def _every_variant(residual_in_fp32: bool, norm: str):
    """One small model with every variant the fused ops take: sandwich norms, a residual multiplier, q/k
    norms, rotate-half / interleaved / partial RoPE, Llama-4 post-RoPE norm and NoPE temperature, gated and
    plain MLPs with a gate multiplier, Mamba2 with and without norm-before-gate."""
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, Rope

    attn = dict(num_heads=4, num_kv_heads=2, head_dim=8)
    layers = (
        Layer(mixer=Attention(qk_norm="rms", rope=Rope(partial_rotary_factor=0.5), **attn),
              ffn=MLP(intermediate_size=24, gate_multiplier=0.5), sandwich_norm=True),
        Layer(mixer=Mamba2(num_heads=4, head_dim=8, state_size=4, n_groups=2, chunk_size=4),
              ffn=MLP(intermediate_size=24, activation="relu2", gated=False)),
        Layer(mixer=Attention(rope=Rope(interleaved=True), qk_norm="rms_weightless", attention_chunk_size=8, **attn),
              ffn=MLP(intermediate_size=24, activation="gelu_tanh")),
        Layer(mixer=Attention(rope=None, temperature_tuning=(0.1, 4.0), **attn), ffn=None),
        Layer(mixer=Mamba2(num_heads=4, head_dim=8, state_size=4, n_groups=1, chunk_size=4, norm_before_gate=True),
              ffn=MLP(intermediate_size=24, activation="gelu")),
    )
    return HybridConfig(vocab_size=61, hidden_size=32, layers=layers, max_position_embeddings=64, dtype="float32",
                        norm=norm, residual_multiplier=0.7, residual_in_fp32=residual_in_fp32)


def _sliding_hybrid(norm: str):
    """The sliding-window hybrids' layer shapes: with ``norm="layer"`` Cohere2's (a bias-free LayerNorm feeding
    attention and MLP side by side, interleaved RoPE on the sliding layer, the global one NoPE), else Exaone-4's
    (post-norms only, q/k norms, the global layer NoPE) and a Granite-SWA layer (sinks, residual multiplier)."""
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Rope

    attn = dict(num_heads=4, num_kv_heads=2, head_dim=8)
    mlp = MLP(intermediate_size=24)
    if norm == "layer":
        layers = (Layer(mixer=Attention(sliding_window=4, rope=Rope(interleaved=True), qkv_bias=True, o_bias=True,
                                        **attn), ffn=mlp, parallel_ffn=True),
                  Layer(mixer=Attention(rope=None, **attn), ffn=mlp, parallel_ffn=True))
    else:
        layers = (Layer(mixer=Attention(sliding_window=4, qk_norm="rms", **attn), ffn=mlp, sandwich_norm=True,
                        pre_norm=False),
                  Layer(mixer=Attention(rope=None, qk_norm="rms", **attn), ffn=mlp, sandwich_norm=True, pre_norm=False),
                  Layer(mixer=Attention(sliding_window=4, sinks=True, **attn), ffn=mlp))
    return HybridConfig(vocab_size=61, hidden_size=32, layers=layers, max_position_embeddings=64, dtype="float32",
                        norm=norm, residual_multiplier=0.7 if norm == "rms" else 1.0)


@pytest.mark.parametrize(("residual_in_fp32", "norm", "variant"), [
    (False, "gemma_rms", "every"), (True, "rms", "every"), (False, "layer", "sliding"),
    pytest.param(False, "rms", "sliding", marks=pytest.mark.slow)])
def test_model_on_fused_ops_matches_torch(residual_in_fp32, norm, variant) -> None:
    """Prefill logits (reference_logits) and greedy decode through the engine on the fused ops == the torch
    references, with the projections packed (the runner packs them)."""
    from hybridkv import LLM, SamplingParams
    from hybridkv.engine.model_runner import reference_logits
    from hybridkv.models.hybrid import build_model

    config = _every_variant(residual_in_fp32, norm) if variant == "every" else _sliding_hybrid(norm)
    model = build_model(config, seed=5).to(DEVICE)
    ids = torch.randint(0, 61, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = reference_logits(model, ids, backend="torch")
    fused = reference_logits(model, ids, backend=_fused_backend())
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for name, backend in (("torch", "torch"), ("fused", _fused_backend())):
        llm = LLM(build_model(config, seed=5), device=DEVICE, backend=backend, kv_cache_memory=4 << 20,
                  cuda_graphs=False)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate([ids, ids[:5]], params, use_tqdm=False)]
    assert outs["fused"] == outs["torch"]


def _gemma4_like():
    """Gemma-4's layer kinds: sliding and global layers of different KV shapes (the global ones k = v, proportional
    RoPE), value norms, softmax scale 1, KV-sharing layers of both kinds, per-layer inputs and layer scalars."""
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Rope

    local = dict(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=4, qk_norm="rms", scale=1.0)
    glob = dict(num_heads=4, num_kv_heads=1, head_dim=16, qk_norm="rms", scale=1.0,
                rope=Rope(theta=1000.0, scaling="proportional", partial_rotary_factor=0.25))
    mixers = (Attention(value_norm=True, **local), Attention(value_norm=True, k_eq_v=True, **glob),
              Attention(value_norm=True, **local), Attention(kv_source=1, **glob), Attention(kv_source=2, **local))
    layers = tuple(Layer(mixer=m, ffn=MLP(intermediate_size=24, activation="gelu_tanh"), sandwich_norm=True)
                   for m in mixers)
    return HybridConfig(vocab_size=61, hidden_size=32, layers=layers, max_position_embeddings=64, dtype="float32",
                        per_layer_input_size=4, layer_scalar=True, embedding_multiplier=32 ** 0.5,
                        final_softcap=30.0)


@pytest.mark.slow        # ~40 s under the Triton interpreter on 2 cores
def test_kv_sharing_model_on_triton_ops_matches_torch() -> None:
    """The Gemma-4-like model with the fused ops and Triton paged attention (KV-sharing layers: q-only prep, then
    the donor's blocks, in prefill and decode) == the torch references."""
    import dataclasses

    from hybridkv import LLM, SamplingParams
    from hybridkv.engine.model_runner import reference_logits
    from hybridkv.models.hybrid import build_model

    backend = dataclasses.replace(_fused_backend(), paged_attention=ta.paged_attention_triton)
    model = build_model(_gemma4_like(), seed=5).to(DEVICE)
    ids = torch.randint(0, 61, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.testing.assert_close(reference_logits(model, ids, backend=backend), reference_logits(model, ids),
                               rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name, b in (("torch", "torch"), ("triton", backend)):
        llm = LLM(build_model(_gemma4_like(), seed=5), device=DEVICE, backend=b, kv_cache_memory=4 << 20,
                  cuda_graphs=False, block_size=4, max_num_batched_tokens=8)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate([ids, ids[:5]], params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]


def test_norms_with_a_wider_weight_round_like_the_reference() -> None:
    """An fp16 input with an fp32 weight: the reference rounds the normalised value to fp16, then scales in
    the promoted dtype (fp32); the kernels do the same (fp16 rounds correctly under the interpreter too)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 40, generator=g).to(DEVICE, torch.float16)
    w = (torch.randn(40, generator=g) * 0.3 + 1).to(DEVICE)
    out = tf.rms_norm_triton(x, w, eps=1e-6)
    ref = rms_norm_ref(x, w, eps=1e-6)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    z = torch.randn(4, 40, generator=g).to(DEVICE, torch.float16)
    out = tf.gated_rms_norm_triton(x, z, w, n_groups=2)
    ref = gated_rms_norm_ref(x, z, w, n_groups=2)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="post-norm weight"):
        tf.add_rms_norm_triton(x, x, weight=None, eps=1e-6, delta_weight=w)
