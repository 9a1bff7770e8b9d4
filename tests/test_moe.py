"""The sync-free MoE paths (sorted grouped GEMM, padded bmm, the Triton GEMVs and per-expert tiles) against the
per-expert reference loop.

Every router (softmax with and without renormalisation, Llama-4's input-scaling sigmoid, NemotronH's grouped
sigmoid with a correction bias and a latent space, gpt-oss's softmax over the top-k logits of a biased router
with biased experts and the clamped SwiGLU), gated and not, top-1 to top-3, fp32 and bf16, batches from
one token to many, experts that get no token and one expert that gets every token. ``torch._grouped_mm`` runs
on the CPU through torch's fallback and the Triton kernels under the interpreter, so every fast path is checked
here; on the GPU the grouped path is torch's CUTLASS kernel (benchmarks/tp_decode.py checks it there, with no
host sync and under a CUDA graph) and the Triton kernels run compiled.
That the fast paths have no data-dependent shapes is checked here by tracing them whole with dynamo
(``fullgraph=True`` fails on the reference loop's ``nonzero``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybridkv.layers import moe as moe_module
from hybridkv.layers.moe import (
    MoEFeedForward,
    choose_impl,
    moe_experts_grouped,
    moe_experts_padded,
    moe_experts_ref,
    run_experts,
)
from hybridkv.models.config import MoE

HIDDEN = 32
CONFIGS = {
    "llama4": MoE(num_experts=4, top_k=1, intermediate_size=24, router="sigmoid_input", shared_intermediate_size=24),
    "mixtral": MoE(num_experts=6, top_k=2, intermediate_size=16, router="softmax", renormalize=True),
    "jamba": MoE(num_experts=6, top_k=2, intermediate_size=16, router="softmax", renormalize=False),
    "nemotron": MoE(num_experts=8, top_k=3, intermediate_size=16, router="sigmoid_bias", num_groups=4,
                    topk_groups=2, latent_size=16, shared_intermediate_size=24, routed_scaling_factor=2.0,
                    activation="relu2", gated=False),
    "qwen3_next": MoE(num_experts=8, top_k=4, intermediate_size=16, router="softmax", renormalize=True,
                      shared_intermediate_size=16, shared_gate=True),
    # a limit of 1.5 (gpt-oss: 7) so the clamps bite at these scales
    "gpt_oss": MoE(num_experts=6, top_k=3, intermediate_size=16, router="topk_softmax", router_bias=True,
                   bias=True, activation="swiglu_oai", swiglu_limit=1.5),
}
FAST = ("grouped", "padded", "gemv", "tiled")     # gemv, tiled: Triton kernels (the interpreter on the CPU)
TRITON = ("gemv", "tiled")
# The interpreted Triton paths take seconds per layer on 2 cores: their whole-layer grids are slow-tier, and the
# quick tier keeps them in ``test_addend_is_added_to_the_rounded_sum`` (both kernels, one and two slots).
FAST_TIERED = [pytest.param(impl, marks=pytest.mark.slow) if impl in TRITON else impl for impl in FAST]


def _layer(name: str, dtype: torch.dtype, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(HIDDEN, CONFIGS[name])
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)             # large enough that routing and experts matter in fp32 and bf16
    return layer.to(dtype).eval()


def _device(impl: str) -> str:
    """The Triton kernels run compiled on a GPU when there is one (the interpreter only without CUDA)."""
    return "cuda" if impl in TRITON and torch.cuda.is_available() else "cpu"


def _skip_interpreted_bf16(impl: str, dtype: torch.dtype) -> None:
    if impl in TRITON and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's CPU interpreter does not round to bf16 as the GPU does; checked on the GPU")


def _tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype != torch.float32:
        return dict(atol=2e-2, rtol=2e-2)
    # every fast path sums in another order than the per-expert loop (Triton's blocks, the padded bmm and
    # grouped GEMM's own CPU kernels, which vary with the machine's BLAS: 1.2e-5 on outputs up to ~54 seen)
    return dict(atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("impl", FAST_TIERED)
def test_fast_paths_match_the_reference_loop(impl: str, name: str, dtype: torch.dtype, packed: bool) -> None:
    """The whole layer (router, latent projections, shared expert) with each expert implementation; packed:
    gate|up as one tensor (``fuse_projections``), which the fast paths project with once."""
    _skip_interpreted_bf16(impl, dtype)
    if name == "qwen3_next" and impl in TRITON and not packed and not torch.cuda.is_available():
        pytest.skip("interpreted: the gated shared expert runs packed only (its router | gate view is the new path)")
    dev = _device(impl)
    layer = _layer(name, dtype).to(dev)
    if packed:
        layer.fuse_projections()
    # interpreted, the GEMVs' 2-channel programs cost ~1 ms each: 64 tokens (~4k programs a call) add minutes and no
    # case (a GEMV takes <= 8 assignments when chosen; more than 16 rows of one expert is the tiles' case)
    interpreted_gemv = impl == "gemv" and dev == "cpu"
    for num_tokens in (1, 3, 17) if interpreted_gemv else (1, 3, 17, 64):
        x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens)).to(dev, dtype)
        with torch.no_grad():
            layer.impl = "ref"
            want = layer(x)
            layer.impl = impl
            got = layer(x)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, **_tol(dtype), msg=f"{impl} {name} T={num_tokens}")


@pytest.mark.parametrize("impl", FAST_TIERED)
def test_skewed_and_empty_routing(impl: str) -> None:
    """Every token to one expert (the others empty; 19 rows: more than one of the tiled kernels' 16-row tiles; 9
    for the interpreted GEMVs, which have no tiles), every expert empty but one, and a permutation of a batch
    permutes the output (no mixing between tokens)."""
    dev = _device(impl)
    layer = _layer("mixtral", torch.float32, seed=3).to(dev)
    experts = layer.experts()
    n = 9 if impl == "gemv" and dev == "cpu" else 19
    x = torch.randn(n, HIDDEN).to(dev)
    weights = torch.rand(n, 2).to(dev)
    for ids in (torch.tensor([[5, 2]] * n), torch.tensor([[0, 1]] * n),
                torch.stack([torch.randperm(6)[:2] for _ in range(n)])):
        ids = ids.to(dev)
        want = moe_experts_ref(x, ids, weights, experts)
        got = run_experts(x, ids, weights, experts, impl=impl)
        torch.testing.assert_close(got, want, **_tol(torch.float32))
        assert run_experts(x[:0], ids[:0], weights[:0], experts, impl=impl).shape == (0, HIDDEN)
        perm = torch.randperm(n).to(dev)
        torch.testing.assert_close(run_experts(x[perm], ids[perm], weights[perm], experts, impl=impl), want[perm],
                                   **_tol(torch.float32))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("top_k", [1, pytest.param(2, marks=pytest.mark.slow)])       # (quick: one expert a token)
@pytest.mark.parametrize("impl", ("ref",) + FAST)
def test_addend_is_added_to_the_rounded_sum(impl: str, top_k: int, gated: bool) -> None:
    """``run_experts(..., addend=a)`` == ``run_experts(...) + a`` and with a gate logit g, ``+ a * sigmoid(g)``
    (the shared expert's output: in-kernel for the Triton paths, by the down kernel's last slot with several;
    after the slot sum otherwise). The GEMV's arrival counters are left zero: a second call gives the same."""
    dev = _device(impl)
    layer = _layer("mixtral", torch.float32, seed=4).to(dev)
    x = torch.randn(7, HIDDEN).to(dev)
    ids = torch.stack([torch.randperm(6)[:top_k] for _ in range(7)]).to(dev)
    weights = torch.rand(7, top_k).to(dev)
    addend = torch.randn(7, HIDDEN).to(dev)
    gate = torch.randn(7, 1).to(dev) if gated else None
    plain = run_experts(x, ids, weights, layer.experts(), impl=impl)
    got = run_experts(x, ids, weights, layer.experts(), impl=impl, addend=addend, addend_gate=gate)
    torch.testing.assert_close(got, plain + (addend * torch.sigmoid(gate) if gated else addend), atol=1e-6,
                               rtol=1e-6)
    if impl == "gemv":
        from hybridkv.backends import triton_moe
        from hybridkv.backends.triton_linear import counters

        assert int(counters(x.device).count_nonzero()) == 0
        again = run_experts(x, ids, weights, layer.experts(), impl=impl, addend=addend, addend_gate=gate)
        assert torch.equal(again, got)
        with pytest.MonkeyPatch.context() as mp:     # a forced batch past the counters: the slots summed after
            mp.setattr(triton_moe, "MAX_COUNTERS", 0)
            past = run_experts(x, ids, weights, layer.experts(), impl=impl, addend=addend, addend_gate=gate)
        torch.testing.assert_close(past, got, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("k", "weighted", "gated"), [(1, False, False), (3, True, True), (2, True, False)])
def test_combine_kernel_matches_its_reference(k: int, weighted: bool, gated: bool) -> None:
    """``moe_combine`` (the grouped path's last launch on CUDA): each token's slots read out of permuted rows,
    weighted, summed and joined by the (gated) addend, as ``moe_combine_ref``; in bf16 on a GPU, fp32 here."""
    from hybridkv.backends.triton_moe import moe_combine
    from hybridkv.layers.ops.fused_ref import moe_combine_ref

    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    tokens, dim = 5, 1100                                      # two output blocks, the second partial
    g = torch.Generator().manual_seed(k)
    y = torch.randn(tokens * k, dim, generator=g).to(dev, dtype)
    kw = dict(k=k, out_dtype=dtype, positions=torch.randperm(tokens * k, generator=g).to(dev),
              weights=torch.rand(tokens, k, generator=g).to(dev) if weighted else None,
              addend=torch.randn(tokens, dim, generator=g).to(dev, dtype) if gated else None,
              addend_gate=torch.randn(tokens, 1, generator=g).to(dev, dtype) if gated else None)
    got, want = moe_combine(y, **kw), moe_combine_ref(y, **kw)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **_tol(dtype))
    kw.pop("positions")                                        # rows already in (token, slot) order
    torch.testing.assert_close(moe_combine(y, **kw), moe_combine_ref(y, **kw), **_tol(dtype))


@pytest.mark.parametrize("inter", [64, pytest.param(1024, marks=pytest.mark.slow)])
def test_gemv_launch_shapes_by_expert_width(inter: int) -> None:
    """Both GEMV launch configurations (``_gemv_width``: narrow experts, and wide ones from 1024 channels: 2 output
    rows per program, 512-wide K steps) against the reference, biases and several slots per token included."""
    from hybridkv.backends import triton_moe

    dev = _device("gemv")
    gen = torch.Generator().manual_seed(5)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.1).to(dev)

    E, dim = 3, 48
    ex = moe_module.Experts(gate=w(E, inter, dim), up=w(E, inter, dim), down=w(E, dim, inter), activation="swiglu_oai",
                     scale_input=False, gate_bias=w(E, inter), up_bias=w(E, inter), down_bias=w(E, dim))
    x, ids, weights = w(2, dim), torch.tensor([[0, 2], [1, 0]]).to(dev), torch.rand(2, 2, generator=gen).to(dev)
    got = triton_moe.moe_experts_gemv(x, ids, weights, gate=ex.gate, up=ex.up, down=ex.down, activation=ex.activation,
                                      scale_input=False, gate_bias=ex.gate_bias, up_bias=ex.up_bias,
                                      down_bias=ex.down_bias)
    assert triton_moe._gemv_width(inter) == ("wide" if inter >= 1024 else "narrow")
    torch.testing.assert_close(got, moe_experts_ref(x, ids, weights, ex), atol=1e-5, rtol=1e-5)


def test_router_and_shared_gate_pack_into_one_projection() -> None:
    """``fuse_projections`` makes the router and the shared expert's gate views of one weight (same
    ``state_dict``) and the layer's output does not change; a moved layer projects them one by one."""
    layer = _layer("qwen3_next", torch.float32)
    x = torch.randn(5, HIDDEN)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.no_grad():
        want = layer(x)
        layer.fuse_projections()
        assert layer.router_gate is not None and layer.router_gate.weight.shape == (9, HIDDEN)
        assert layer.router.weight.data_ptr() == layer.router_gate.weight.data_ptr()
        torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=1e-6)
        after = layer.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        layer.to(torch.float64)
        assert not layer.router_gate.valid()
        torch.testing.assert_close(layer(x.double()).float(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("tokens", "k", "counts"), [
    (48, 1, "one expert, 3 tiles"), (50, 1, "37 interleaved on one expert"), (171, 3, "513: two launches"),
    (257, 2, "514: 2 rows in the second launch")])
def test_tiled_kernels_pick_each_experts_rows(tokens: int, k: int, counts: str) -> None:
    """The tiled kernels' row pick (``_expert_rows``: 128-id slices, 16-row tiles, 512-assignment launches) against
    the reference loop on tiny experts: busy experts over several tiles, interleaved rows, launch boundaries,
    the shared expert's addend with one slot, gpt-oss's biases and clamped SwiGLU with two."""
    if not torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (compiled on a GPU, else the interpreter)")
    from hybridkv.backends.triton_moe import moe_experts_tiled as tiled
    from hybridkv.layers.moe import Experts

    dev = _device("tiled")
    gen = torch.Generator().manual_seed(tokens)
    E, dim, inter = 5, 8, 16

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dev)

    oai = k == 2
    ex = Experts(gate=w(E, inter, dim), up=w(E, inter, dim), down=w(E, dim, inter),
                 activation="swiglu_oai" if oai else "silu", scale_input=False,
                 **(dict(gate_bias=w(E, inter), up_bias=w(E, inter), down_bias=w(E, dim)) if oai else {}))
    if tokens == 48:
        ids = torch.zeros(tokens, 1, dtype=torch.long)
    elif tokens == 50:
        ids = torch.randint(0, E, (tokens, 1), generator=gen)
        ids[torch.randperm(tokens, generator=gen)[:37]] = 2
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    ids = ids.to(dev)
    x, weights = w(tokens, dim), torch.rand(tokens, k, generator=gen).to(dev)
    addend = w(tokens, dim) if k == 1 else None
    want = moe_experts_ref(x, ids, weights, ex) + (addend if addend is not None else 0)
    got = tiled(x, ids, weights, gate=ex.gate, up=ex.up, down=ex.down, activation=ex.activation, scale_input=False,
                addend=addend, gate_bias=ex.gate_bias, up_bias=ex.up_bias, down_bias=ex.down_bias)
    torch.testing.assert_close(got, want, **_tol(torch.float32), msg=counts)


def test_input_scaling_is_rounded_like_hf() -> None:
    """Llama-4 scales the expert input in fp32 and rounds it to the model dtype before the expert: in bf16 the
    fast paths must round at the same place (equal to the reference exactly on the CPU)."""
    layer = _layer("llama4", torch.bfloat16, seed=5)
    x = torch.randn(33, HIDDEN).to(torch.bfloat16)
    ids, weights = layer.route(x)
    want = moe_experts_ref(x, ids, weights, layer.experts())
    for fn in (moe_experts_grouped, moe_experts_padded):    # (grouped: in bf16, exactly the reference's values)
        torch.testing.assert_close(fn(x, ids, weights, layer.experts()).float(), want, atol=0, rtol=0)
    if torch.cuda.is_available():     # the Triton kernels sum in another order: equal up to bf16 roundings
        for impl in TRITON:
            got = run_experts(x.cuda(), ids.cuda(), weights.cuda(), layer.cuda().experts(), impl=impl)
            torch.testing.assert_close(got.cpu(), want.to(got.dtype), **_tol(torch.bfloat16))


@pytest.mark.parametrize(("fn", "dtype"), [(moe_experts_grouped, torch.bfloat16), (moe_experts_padded, torch.float32),
                                           (moe_experts_padded, torch.bfloat16)])
def test_fast_paths_have_static_shapes(fn, dtype: torch.dtype) -> None:
    """Traced as one graph (no data-dependent shapes, no host reads: what a CUDA graph needs); the reference
    loop cannot be. (``_grouped_mm``'s shape function accepts bf16 only, its only dtype on sm90.)"""
    torch._dynamo.reset()
    layer = _layer("mixtral", dtype)
    x = torch.randn(8, HIDDEN).to(dtype)
    ids, weights = layer.route(x)
    with torch.no_grad():
        traced = torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)
        torch.testing.assert_close(traced(x, ids, weights, layer.experts()).float(),
                                   moe_experts_ref(x, ids, weights, layer.experts()), **_tol(dtype))
        with pytest.raises(Exception):  # noqa: B017  (dynamo's error type for data-dependent shapes varies)
            torch.compile(moe_experts_ref, fullgraph=True, backend="eager", dynamic=False)(
                x, ids, weights, layer.experts())
    torch._dynamo.reset()


def test_impl_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer("llama4", torch.bfloat16)
    x = torch.randn(4, HIDDEN).to(torch.bfloat16)

    def ids(tokens: int, k: int = 1) -> torch.Tensor:
        return torch.zeros(tokens, k, dtype=torch.long)

    assert choose_impl("auto", x, ids(4), layer.experts()) == "ref"              # CPU: the exact loop
    assert choose_impl("padded", x, ids(4), layer.experts()) == "padded"
    with pytest.raises(ValueError, match="not one of"):
        MoEFeedForward(HIDDEN, CONFIGS["llama4"], impl="fast")
    assert MoEFeedForward(HIDDEN, CONFIGS["llama4"]).impl == "auto"

    class FakeCuda:                      # the GPU rules without a GPU: decide from device, dtype and sizes
        type = "cuda"

    class Fake:
        def __init__(self, dtype: torch.dtype, tokens: int) -> None:
            self.device, self.dtype, self.shape = FakeCuda(), dtype, (tokens, HIDDEN)

    monkeypatch.setattr(moe_module, "grouped_mm_is_fast", lambda device: True)
    experts = layer.experts()
    assert choose_impl("auto", Fake(torch.bfloat16, 4096), ids(4096), experts) == "grouped"
    assert choose_impl("auto", Fake(torch.float16, 513), ids(513), experts) == "padded"
    assert choose_impl("auto", Fake(torch.float16, moe_module.PADDED_MAX_ROWS), ids(8192), experts) == "ref"
    if importlib.util.find_spec("triton") is not None:       # decode- and mid-size batches: the Triton kernels
        assert choose_impl("auto", Fake(torch.bfloat16, 4), ids(4, 2), experts) == "gemv"
        assert choose_impl("auto", Fake(torch.bfloat16, 8), ids(8, 2), experts) == "tiled"
        assert choose_impl("auto", Fake(torch.float16, 64), ids(64, 2), experts) == "tiled"
        assert choose_impl("auto", Fake(torch.bfloat16, 256), ids(256, 2), experts) == "tiled"
        assert choose_impl("auto", Fake(torch.bfloat16, 257), ids(257, 2), experts) == "grouped"
    monkeypatch.setattr(moe_module, "_triton_available", lambda: False)
    assert choose_impl("auto", Fake(torch.float16, 16), ids(16), experts) == "padded"
    monkeypatch.setattr(moe_module, "grouped_mm_is_fast", lambda device: False)      # e.g. an A100
    assert choose_impl("auto", Fake(torch.bfloat16, 16), ids(16), experts) == "padded"


def test_packed_gate_up_keeps_the_parameters() -> None:
    """Packing makes gate and up views of one tensor (same values, same ``state_dict``), twice is once, and a
    moved layer runs unpacked."""
    layer = _layer("mixtral", torch.float32)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.fuse_projections()
    packed = layer.experts().gate_up
    assert packed is not None and packed.shape == (6, 32, HIDDEN)
    assert layer.gate_proj.data_ptr() == packed.data_ptr()
    layer.fuse_projections()
    assert layer.experts().gate_up is packed
    after = layer.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    layer.to(torch.float64)
    assert layer.experts().gate_up is None
    ungated = _layer("nemotron", torch.float32)
    ungated.fuse_projections()
    assert ungated.experts().gate_up is None                                  # not gated: nothing to pack


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_packed_experts_run_on_the_backend_act_mul(impl: str) -> None:
    """With gate|up packed, act x up is the step backend's op; the Triton kernel takes rows, so the padded
    path's (E, T, 2 * inter) is flattened for it (the torch reference would take any shape)."""
    import dataclasses

    from hybridkv.backends.base import torch_backend
    from hybridkv.forward_context import ForwardContext, forward_context
    from tests._triton import DEVICE, kernel_module

    tf = kernel_module("hybridkv.backends.triton_fused")
    layer = _layer("llama4", torch.float32).to(DEVICE)
    layer.fuse_projections()
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    backend = dataclasses.replace(torch_backend(), act_mul=tf.act_mul_triton)
    with torch.no_grad():
        layer.impl = "ref"
        want = layer(x)
        layer.impl = impl
        with forward_context(ForwardContext(inputs={}, backend=backend)):
            got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


_MOE_FOR_HOPPER = """
from hybridkv.backends import triton_moe as mod

for name, fn, cfg, extra in (
        ("gate_up", mod._gate_up_kernel, mod._GATE_UP["wide"], dict(ACT=4, GATED=True)),
        ("gate_up narrow", mod._gate_up_kernel, mod._GATE_UP["narrow"], dict(ACT=0, GATED=True)),
        ("down", mod._down_kernel, mod._DOWN["wide"], dict(HAS_ADD=True, HAS_GATE=True, FINISH=False)),
        ("down slots", mod._down_kernel, mod._DOWN["wide"], dict(HAS_ADD=True, HAS_GATE=True, FINISH=True)),
        ("down slots narrow", mod._down_kernel, mod._DOWN["narrow"], dict(HAS_ADD=True, HAS_GATE=True, FINISH=True)),
        ("gate_up tiled", mod._gate_up_tiled_kernel.graph, mod._TILED_GATE_UP, dict(ACT=4, GATED=True)),
        ("down tiled", mod._down_tiled_kernel.graph, mod._TILED_DOWN, dict(HAS_ADD=True, HAS_GATE=True))):
    consts = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    consts.update(extra, SCALE_INPUT=False, HAS_BIAS=True, PDL=False, SLICE=128, BLOCK_M=16)
    ptrs = {"ids_ptr": "*i64", "w_ptr": "*fp32", "cnt_ptr": "*i32",
            "y_ptr": "*fp32" if extra.get("FINISH") else "*bf16"}
    build(fn, consts, ptrs, num_warps=cfg["num_warps"], default_ptr="*bf16", floats=("alpha", "limit"))
    print("compiled", name)
consts = dict(mod._LINEAR_ROUTE, HAS_BIAS=True, SCORING=3, TOP_K=4, RENORM=False, HAS_SCALE=True, BLOCK_E=32,
              BLOCK_K=4, PDL=False)
warps = consts.pop("num_warps")
build(mod._linear_route_kernel, consts, {"cnt_ptr": "*i32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32"},
      num_warps=warps, default_ptr="*bf16", floats=("scaling",))
print("compiled router")
build(mod._combine_kernel, dict(HAS_POS=True, WEIGHTED=True, HAS_ADD=True, HAS_GATE=True, BLOCK_N=1024, PDL=False),
      {"pos_ptr": "*i64", "w_ptr": "*fp32"}, num_warps=4, default_ptr="*bf16")
print("compiled combine")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels are compiled by the tests above")
def test_kernels_compile_for_hopper() -> None:
    """The interpreter runs fp32 only here and never lowers a kernel (a branch that changes a value's dtype compiles
    only for real): build the bf16 expert kernels for sm_90, biases, the shared expert's gated addend and the
    GEMV's slot sum included, the router's projection with the routing, and the grouped path's combine."""
    from _triton import build_for_hopper

    assert build_for_hopper(_MOE_FOR_HOPPER).count("compiled") == 9
