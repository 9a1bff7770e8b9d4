"""Greedy tokens on the device (``backends/triton_sampling.py``, and the logits head's fused argmax in
``backends/triton_linear.py``) against ``argmax_ref`` (``torch.argmax``): the first maximum, NaN above every
number. Without CUDA the kernels run under Triton's interpreter at tiny sizes, with the chunk sizes shrunk so
that a row spans several partials and the reduction several iterations.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _triton import DEVICE, kernel_module, tiles
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.fused_ref import NONFINITE, argmax_ref, linear_argmax_ref

ts = kernel_module("hybridkv.backends.triton_sampling")
tl_mod = kernel_module("hybridkv.backends.triton_linear")


def _tiles(block_n: int, split: int):
    """The logits head's tiles at tiny sizes: ``block_n`` columns per block, ``split`` K slices."""
    return tiles(tl_mod, "default_config", dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32, SPLIT_K=split,
                                                 num_warps=4, num_stages=2))


@pytest.fixture
def small_chunks(monkeypatch):
    """16 columns per partial and 2 partials per reduction step: a 40-column row takes 3 partials and the
    reduction 2 iterations."""
    monkeypatch.setattr(ts, "_BLOCK", 16)
    monkeypatch.setattr(ts, "_REDUCE_BLOCK", 2)


def _logits(rows: int, vocab: int, case: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if case == "ties":                  # the maximum repeated in several partials, and in the same one
        x[:, ::5] = x.max() + 1
    elif case == "nan":                 # a NaN wins over larger numbers, the first NaN over later ones
        x[0, vocab // 2] = x[0, -1] = float("nan")
        x[-1, 0] = float("nan")
    elif case == "-inf":                # a row of -inf: its first column
        x[0] = float("-inf")
    elif case == "bf16":                # rounded logits: ties between distinct fp32 values
        x = (x * 4).round().to(torch.bfloat16)
    return x.to(DEVICE)


# (rows, vocab, case): one partial; several partials, the last one partial; ties across partials; NaN; a row
# of -inf; bf16 input
CASES = [(1, 7, "plain"), (3, 40, "plain"), (2, 33, "ties"), (4, 50, "nan"), (2, 40, "-inf"), (5, 64, "bf16")]


@pytest.mark.parametrize("rows,vocab,case", CASES + [(3, 40, "+inf")])
def test_argmax_matches_reference(small_chunks, rows, vocab, case):
    x = _logits(rows, vocab, case, seed=rows * vocab)
    if case == "+inf":
        x[1, 7] = float("inf")
    got_report = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    want_report = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    got = ts.argmax_triton(x, report=got_report)
    assert got.dtype == torch.int64
    assert torch.equal(got, argmax_ref(x, report=want_report))
    assert torch.equal(got_report, want_report)             # NONFINITE where the chosen logit is NaN or +-inf
    nonfinite = {"nan": {0, rows - 1}, "-inf": {0}, "+inf": {1}}.get(case, set())
    assert set(torch.nonzero(want_report == NONFINITE).flatten().tolist()) == nonfinite


def test_argmax_writes_out_and_checks_it(small_chunks):
    x = _logits(3, 40, "ties", seed=0)
    out = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
    ts.argmax_triton(x, out=out[:3])
    assert torch.equal(out[:3], argmax_ref(x)) and out[3:].eq(-7).all()
    with pytest.raises(ValueError, match="out must be"):
        ts.argmax_triton(x, out=out[:2])
    with pytest.raises(ValueError, match="contiguous last dim"):
        ts.argmax_triton(x.t())


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 70), case=st.sampled_from(["plain", "ties", "bf16"]),
       seed=st.integers(0, 2**16))
def test_argmax_random(rows, vocab, case, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts, "_BLOCK", 16)
        mp.setattr(ts, "_REDUCE_BLOCK", 2)
        x = _logits(rows, vocab, case, seed)
        assert torch.equal(ts.argmax_triton(x), argmax_ref(x))


def _head(rows: int, vocab: int, k: int, *, ties: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(vocab, k, generator=g) / k ** 0.5
    if ties:                            # equal weight rows give equal logits, in different column blocks
        w[vocab // 3] = w[2 * vocab // 3] = w[-1] = w[1] * 3
    return x.to(DEVICE), w.to(DEVICE)


# (rows, vocab, in features, BLOCK_N, SPLIT_K, ties): one column block; partial last block; ties across
# blocks; split-K (the argmax in the last program's epilogue)
HEAD_CASES = [(1, 16, 32, 16, 1, False), (3, 45, 64, 16, 1, False), (2, 50, 64, 16, 1, True),
              (5, 40, 96, 16, 3, True)]


@pytest.mark.parametrize("rows,vocab,k,block_n,split,ties", HEAD_CASES)
def test_linear_argmax_matches_reference(small_chunks, rows, vocab, k, block_n, split, ties):
    x, w = _head(rows, vocab, k, ties=ties, seed=vocab + k)
    with _tiles(block_n, split):
        logits, tokens = tl_mod.linear_argmax_triton(x, w)
        assert torch.equal(logits, tl_mod.linear_triton(x, w, out_dtype=torch.float32))
    want_logits, _ = linear_argmax_ref(x, w)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, argmax_ref(logits))          # the argmax of the logits it returned


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("write", [0, 1])
def test_linear_argmax_write_flag(small_chunks, monkeypatch, split, write):
    """``write_logits`` (a device scalar) 0: the same tokens, the logits never stored (every buffer starts
    NaN, so an unwritten one stays NaN); 1: stored as without the flag."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    x, w = _head(5, 40, 96, ties=True, seed=4)
    flag = torch.tensor([write], dtype=torch.int64, device=DEVICE)
    with _tiles(16, split):
        logits, tokens = tl_mod.linear_argmax_triton(x, w, write_logits=flag)
        want_logits, want = tl_mod.linear_argmax_triton(x, w)
    assert torch.equal(tokens, want)
    assert torch.equal(logits, want_logits) if write else bool(logits.isnan().all())


def test_linear_argmax_nan_row():
    x, w = _head(2, 40, 32, ties=False, seed=1)
    x[1, 3] = float("nan")                                   # every logit of row 1 is NaN: its first column
    with _tiles(16, 1):
        logits, tokens = tl_mod.linear_argmax_triton(x, w)
    assert torch.equal(tokens, argmax_ref(logits)) and int(tokens[1]) == 0


def test_linear_argmax_dispatch_outside_the_kernel(small_chunks):
    """Rows the kernel does not take (here: a CPU tensor) get the reference logits and ``argmax_triton``."""
    x, w = _head(3, 40, 32, ties=True, seed=2)
    logits, tokens = tl_mod.linear_argmax(x, w)
    want_logits, want = linear_argmax_ref(x, w)
    assert torch.equal(logits, want_logits) and torch.equal(tokens, want)


@pytest.mark.parametrize("post_ops", [False, True])
def test_model_greedy_equals_argmax_of_its_logits(small_chunks, post_ops):
    """``compute_logits_and_greedy`` on the triton backend: the head's fused argmax (no post-ops) or the
    standalone one after the multiplier and softcap."""
    from _tp_helpers import sliding

    from hybridkv.backends.base import torch_backend
    from hybridkv.backends.triton_backend import triton_backend
    from hybridkv.forward_context import ForwardContext, forward_context
    from hybridkv.models.hybrid import build_model

    config = sliding()
    config = dataclasses.replace(config, **({"logits_multiplier": 0.5} if post_ops else {"final_softcap": None}))
    model = build_model(config, seed=3, device=DEVICE)
    hidden = torch.randn(4, config.hidden_size, device=DEVICE)
    for backend in (torch_backend(), triton_backend()):
        with forward_context(ForwardContext(inputs={}, backend=backend)):
            logits, tokens = model.compute_logits_and_greedy(hidden)
            torch.testing.assert_close(logits, model.compute_logits(hidden), rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, argmax_ref(logits))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 32])
def test_bf16_head_at_decode_size(rows):
    """A vocabulary-size bf16 head with its default tiles: the fused argmax is the argmax of the logits the
    kernel stored, which are ``linear_triton``'s; the standalone argmax agrees."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1152, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(50000, 1152, device="cuda", generator=g) / 34).to(torch.bfloat16)
    out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    logits, tokens = tl_mod.linear_argmax(x, w, out=out)
    assert tokens.data_ptr() == out.data_ptr()
    assert torch.equal(logits, tl_mod.linear(x, w, out_dtype=torch.float32))
    assert torch.equal(tokens, argmax_ref(logits)) and torch.equal(ts.argmax_triton(logits), tokens)
