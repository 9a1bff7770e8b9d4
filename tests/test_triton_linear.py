"""The decode-size linear kernel (``backends/triton_linear.py``) against ``linear_ref`` / ``linear_act_mul_ref``.

Without CUDA the kernel runs under Triton's interpreter in fp32 (only the order of fp32 sums differs from the
reference) at tiny sizes, with the tile rule replaced (``_triton.tiles``) so that split-K, partial column blocks,
partial K tiles and every epilogue run. With CUDA the same tables run compiled, plus a bf16 test (error within twice a
bf16 cuBLAS baseline's against fp32) and a CUDA-graph replay test (split-K counters re-armed, bit-identical).
"""

from __future__ import annotations

import pytest
import torch
from _triton import DEVICE, HAS_CUDA, gpu, kernel_module, tiles
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.fused_ref import linear_act_mul_ref, linear_ref

tl_mod = kernel_module("hybridkv.backends.triton_linear")


def _cfg(rows: int, *, block_n: int = 16, block_k: int = 32, split: int = 1) -> dict:
    return dict(BLOCK_M=max(16, 1 << max(0, rows - 1).bit_length()), BLOCK_N=block_n, BLOCK_K=block_k,
                SPLIT_K=split, num_warps=4, num_stages=2)


def _tiles(cfg: dict):
    return tiles(tl_mod, "default_config", cfg)


def _inputs(rows: int, n_out: int, k: int, *, bias: bool, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n_out, k, generator=g) / k ** 0.5
    b = torch.randn(n_out, generator=g) if bias else None
    return x.to(DEVICE), w.to(DEVICE), (b.to(DEVICE) if b is not None else None)


def _counters_clear() -> bool:
    return all(int(c.abs().sum()) == 0 for c in tl_mod._COUNTERS.values())


# (rows, out channels, in features, BLOCK_N, BLOCK_K, SPLIT_K, bias): one column block and K tile; partial
# column block; partial last K tile; split-K over 2, 3 (uneven slices) and 8 (some slices empty) programs.
LINEAR_CASES = [
    (1, 16, 32, 16, 32, 1, False),
    (3, 40, 96, 16, 32, 1, True),
    (5, 40, 100, 16, 32, 2, False),
    (17, 33, 96, 16, 32, 3, True),
    (2, 24, 64, 16, 32, 8, False),
]


@pytest.mark.parametrize("rows,n,k,block_n,block_k,split,bias", LINEAR_CASES)
def test_linear_matches_reference(rows, n, k, block_n, block_k, split, bias):
    x, w, b = _inputs(rows, n, k, bias=bias, seed=rows + n + k)
    with _tiles(_cfg(rows, block_n=block_n, block_k=block_k, split=split)):
        got = tl_mod.linear_triton(x, w, b)
    torch.testing.assert_close(got, linear_ref(x, w, b), rtol=1e-5, atol=1e-5)
    assert _counters_clear()


# (rows, inter, in features, activation, gated, gate multiplier, bias, SPLIT_K)
ACT_CASES = [
    (1, 16, 32, "silu", True, 1.0, False, 1),
    (4, 24, 64, "gelu_tanh", True, 1.0, True, 2),
    (7, 20, 96, "gelu", True, 2.5, False, 3),
    (2, 40, 64, "relu2", False, 1.0, True, 2),
    (3, 16, 32, "silu", False, 1.0, False, 1),
]


@pytest.mark.parametrize("rows,inter,k,activation,gated,mult,bias,split", ACT_CASES)
def test_linear_act_mul_matches_reference(rows, inter, k, activation, gated, mult, bias, split):
    x, w, b = _inputs(rows, 2 * inter if gated else inter, k, bias=bias, seed=inter + k)
    with _tiles(_cfg(rows, split=split)):
        got = tl_mod.linear_act_mul_triton(x, w, b, activation=activation, gated=gated, gate_multiplier=mult)
    want = linear_act_mul_ref(x, w, b, activation=activation, gated=gated, gate_multiplier=mult)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _counters_clear()


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 20), n=st.integers(1, 40), k=st.integers(1, 130), split=st.sampled_from([1, 2, 3, 4]),
       gated=st.booleans(), bias=st.booleans(), seed=st.integers(0, 1000))
def test_random_shapes_and_splits(rows, n, k, split, gated, bias, seed):
    x, w, b = _inputs(rows, 2 * n if gated else n, k, bias=bias, seed=seed)
    with _tiles(_cfg(rows, split=split)):
        if gated:
            got = tl_mod.linear_act_mul_triton(x, w, b, activation="silu")
            want = linear_act_mul_ref(x, w, b, activation="silu")
        else:
            got = tl_mod.linear_triton(x, w, b)
            want = linear_ref(x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _counters_clear()


# (rows, n, k, gated) -> (BLOCK_M, BLOCK_N, SPLIT_K): the benchmark models' shapes (docs/performance.md)
CONFIG_CASES = [
    ((1, 1536, 1152, False), (16, 32, 2)),        # Gemma-3-like qkv: 48 column blocks, K too short for 4
    ((32, 1152, 6912, False), (32, 32, 8)),       # its down projection: 36 blocks, a long K
    ((32, 6912, 1152, True), (32, 64, 1)),        # its gate|up: 108 blocks of two 64-channel tiles each
    ((8, 2048, 2048, True), (16, 32, 2)),         # Llama-4-like shared expert gate|up
    ((1, 262144, 1152, False), (16, 64, 1)),      # a 262k vocabulary head
]


@pytest.mark.parametrize("shape,want", CONFIG_CASES)
def test_default_config(shape, want):
    rows, n, k, gated = shape
    cfg = tl_mod.default_config(rows, n, k, gated=gated)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]) == want


def test_default_config_fits_shared_memory():
    cfg = tl_mod.default_config(128, 4096, 4096, gated=True, itemsize=4)
    stage = (cfg["BLOCK_M"] + 2 * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 4
    assert cfg["num_stages"] * stage <= tl_mod._SMEM_BUDGET


def test_bad_input_is_a_clear_error():
    x, w, _ = _inputs(2, 8, 16, bias=False, seed=0)
    with pytest.raises(ValueError, match="input features"):
        tl_mod.linear_triton(x, w[:, :8].contiguous())
    with pytest.raises(ValueError, match="at most 128 rows"):
        tl_mod.linear_triton(torch.zeros(129, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="even row count"):
        tl_mod.linear_act_mul_triton(x, w[:7], activation="silu")
    with pytest.raises(ValueError, match="unknown activation"):
        tl_mod.linear_act_mul_triton(x, w, activation="tanh")
    assert tl_mod.linear_triton(x[:0], w).shape == (0, 8)


@pytest.mark.parametrize("split", [1, 2])
def test_fp32_output_is_the_rounded_output_widened(split):
    """``out_dtype=float32`` (the LM head's logits): the same values as the model-dtype output, widened in the
    store instead of by a copy kernel."""
    x, w, b = _inputs(3, 40, 64, bias=True, seed=5)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    with _tiles(_cfg(3, block_n=16, block_k=32, split=split)):
        wide = tl_mod.linear_triton(x, w, b, out_dtype=torch.float32)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, tl_mod.linear_triton(x, w, b).float())
    torch.testing.assert_close(wide, linear_ref(x, w, b, out_dtype=torch.float32), rtol=2e-2, atol=2e-2)


# (rows, out channels, in features, gated) -> the kernel takes it
TAKES_CASES = [
    ((1, 1536, 1152, False), True),     # decode-size rows: every projection
    ((16, 2048, 2048, False), True),
    ((32, 2048, 2048, False), False),   # 17-32 rows: square-ish o / q|k|v stay on cuBLAS
    ((32, 6912, 1152, True), True),     # ... gate|up with the activation fused
    ((32, 1152, 6912, False), True),    # ... down projections (K >= 2 N)
    ((32, 262144, 1152, False), True),  # ... vocabulary-size heads
    ((32, 1536, 1152, False), True),    # up to 64 rows: small weights (Gemma's q|k|v, o), launch-bound on cuBLAS
    ((64, 1152, 1024, False), True),
    ((64, 262144, 1152, False), True),  # ... and vocabulary-size heads
    ((64, 3072, 2048, False), False),   # ... but not a 12.6 MB q|k|v
    ((64, 6912, 1152, True), False),    # ... nor gate|up above 32 rows
    ((128, 1536, 1152, False), False),  # above 64 rows: cuBLAS
    ((0, 64, 64, False), False),
]


@pytest.mark.parametrize("shape,want", TAKES_CASES)
def test_dispatch_rule(shape, want):
    rows, n, k, gated = shape
    assert tl_mod.takes(rows, n, k, gated=gated) == want


def test_dispatch_keeps_cublas_for_what_the_kernel_does_not_take():
    """fp32, CPU tensors and prefill-size batches go to F.linear unchanged (bit-identical to the reference)."""
    x, w, b = _inputs(3, 8, 16, bias=True, seed=1)
    assert torch.equal(tl_mod.linear(x, w, b), linear_ref(x, w, b))
    big = torch.randn(tl_mod.MAX_ROWS + 1, 16, device=DEVICE)
    assert torch.equal(tl_mod.linear(big, w), linear_ref(big, w))


@gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 128])
@pytest.mark.parametrize("gated", [False, True])
def test_bf16_error_within_twice_cublas(rows, gated):
    """bf16 at a benchmark-model shape (default configuration): error against the fp32 reference at most twice
    that of bf16 cuBLAS (+ the activation kernel), never NaN."""
    n, k = (1152, 6912) if not gated else (2 * 6912, 1152)
    x, w, b = _inputs(rows, n, k, bias=False, seed=rows)
    xb, wb = x.bfloat16(), w.bfloat16()
    if gated:
        truth = linear_act_mul_ref(xb.float(), wb.float(), activation="gelu_tanh")
        base = linear_act_mul_ref(xb, wb, activation="gelu_tanh").float()
        got = tl_mod.linear_act_mul_triton(xb, wb, activation="gelu_tanh").float()
    else:
        truth, base = linear_ref(xb.float(), wb.float()), linear_ref(xb, wb).float()
        got = tl_mod.linear_triton(xb, wb).float()
    assert not torch.isnan(got).any()
    assert (got - truth).norm() <= 2 * (base - truth).norm() + 1e-6 * truth.norm()


@gpu
def test_split_k_graph_replays_are_identical():
    """A captured split-K launch replays with new inputs and gives the eager result bit for bit (the last
    program of each column block re-arms its counter)."""
    x, w, _ = _inputs(16, 1152, 6912, bias=False, seed=3)
    x, w = x.bfloat16(), w.bfloat16()
    assert tl_mod.default_config(16, 1152, 6912, gated=False)["SPLIT_K"] > 1
    static_x = x.clone()
    out = tl_mod.linear_triton(static_x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tl_mod.linear_triton(static_x, w)
    for seed in range(3):
        new = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x)
        static_x.copy_(new)
        graph.replay()
        assert torch.equal(out, tl_mod.linear_triton(new, w))
    assert _counters_clear()


@pytest.mark.skipif(HAS_CUDA, reason="checks the interpreter's launch keywords")
def test_no_programmatic_launch_under_the_interpreter():
    from hybridkv.backends.pdl import pdl_kwargs

    assert pdl_kwargs(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
