"""causal_conv1d_ref / causal_conv1d_update_ref against a naive per-token loop, chunked-prefill and decode
equivalences, and HF's Mamba2 conv (whose cache keeps `width` columns where ours keeps width - 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref
from tests._ssm_helpers import Batch, packed_batches


def naive_conv(x, weight, bias, pool, batch: Batch, activation):
    """The simplest causal conv: per request, per token, a Python list of past inputs (float64)."""
    width = weight.shape[1]
    pool = pool.double().clone()
    x, weight = x.double(), weight.double()
    ys = []
    start = 0
    for n, slot, init in zip(batch.lens, batch.slots, batch.has_init, strict=True):
        hist = (
            [pool[slot, :, k] for k in range(width - 1)] if init else [x.new_zeros(x.shape[1])] * (width - 1)
        )
        for t in range(start, start + n):
            hist.append(x[t])
            window = hist[-width:]
            y = sum(weight[:, k] * window[k] for k in range(width))
            y = y + bias.double() if bias is not None else y
            ys.append(F.silu(y) if activation == "silu" else y)
        if width > 1:
            pool[slot] = torch.stack(hist[len(hist) - (width - 1) :], dim=1)
        start += n
    y = torch.stack(ys) if ys else x.new_zeros(0, x.shape[1])
    return y, pool


def make_inputs(batch: Batch, dim: int, width: int, use_bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(batch.seed)
    x = torch.randn(sum(batch.lens), dim, generator=g).to(dtype)
    weight = torch.randn(dim, width, generator=g).to(dtype)
    bias = torch.randn(dim, generator=g).to(dtype) if use_bias else None
    pool = torch.randn(batch.num_slots, dim, width - 1, generator=g)
    for slot, init in zip(batch.slots, batch.has_init, strict=True):
        if not init:
            pool[slot] = float("nan")  # a fresh slot may hold garbage: it must never be read
    return x, weight, bias, pool


@settings(max_examples=60, deadline=None)
@given(
    batch=packed_batches(max_reqs=5, max_len=11),
    dim=st.integers(1, 6),
    width=st.integers(1, 5),
    use_bias=st.booleans(),
    activation=st.sampled_from(["silu", None]),
)
def test_matches_naive_loop(batch: Batch, dim: int, width: int, use_bias: bool, activation) -> None:
    x, weight, bias, pool = make_inputs(batch, dim, width, use_bias)
    before = pool.clone()
    x_in, w_in = x.clone(), weight.clone()
    y = causal_conv1d_ref(
        x,
        weight,
        bias,
        conv_states=pool,
        query_start_loc=batch.qsl,
        state_indices=torch.tensor(batch.slots, dtype=torch.int32),
        has_initial_state=torch.tensor(batch.has_init),
        activation=activation,
    )
    y_ref, pool_ref = naive_conv(x, weight, bias, before, batch, activation)
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    for slot in range(batch.num_slots):
        if slot in batch.slots:
            torch.testing.assert_close(pool[slot], pool_ref[slot].float(), rtol=0, atol=0)
        else:  # unused slots untouched, bit for bit
            assert torch.equal(pool[slot], before[slot])
    assert torch.equal(x, x_in) and torch.equal(weight, w_in)  # inputs not mutated


@settings(max_examples=30, deadline=None)
@given(
    total=st.integers(1, 14),
    data=st.data(),
    width=st.integers(2, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_prefill_equals_whole(total: int, data: st.DataObject, width: int, seed: int) -> None:
    """Pieces carried through the slot (next to an unrelated request) == the whole sequence at once."""
    dim = 3
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=4)) if total > 1 else set())
    bounds = [0, *cuts, total]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, dim, generator=g)
    other = torch.randn(2, dim, generator=g)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)

    pool_whole = torch.zeros(3, dim, width - 1)
    y_whole = causal_conv1d_ref(
        x,
        weight,
        bias,
        conv_states=pool_whole,
        query_start_loc=torch.tensor([0, total]),
        state_indices=torch.tensor([2]),
        has_initial_state=torch.tensor([False]),
    )
    pool = torch.full((3, dim, width - 1), float("nan"))
    pool[0] = 0.0
    pieces = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        xs = torch.cat([other, x[a:b]])  # an unrelated 2-token request in slot 0 comes first
        y = causal_conv1d_ref(
            xs,
            weight,
            bias,
            conv_states=pool,
            query_start_loc=torch.tensor([0, 2, 2 + b - a]),
            state_indices=torch.tensor([0, 2]),
            has_initial_state=torch.tensor([True, i > 0]),
        )
        pieces.append(y[2:])
    torch.testing.assert_close(torch.cat(pieces), y_whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[2], pool_whole[2], rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(batch_size=st.integers(1, 5), spare=st.integers(0, 3), width=st.integers(1, 5), data=st.data())
def test_update_equals_packed_one_token_requests(batch_size: int, spare: int, width: int, data) -> None:
    dim = 4
    num_slots = batch_size + spare
    slots = torch.tensor(data.draw(st.permutations(range(num_slots)))[:batch_size])
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(batch_size, dim, generator=g)
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    pool_a = torch.randn(num_slots, dim, width - 1, generator=g)
    pool_b = pool_a.clone()
    y_a = causal_conv1d_update_ref(x, conv_states=pool_a, weight=weight, bias=bias, state_indices=slots)
    y_b = causal_conv1d_ref(
        x,
        weight,
        bias,
        conv_states=pool_b,
        query_start_loc=torch.arange(batch_size + 1),
        state_indices=slots,
        has_initial_state=torch.ones(batch_size, dtype=torch.bool),
    )
    torch.testing.assert_close(y_a, y_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool_a, pool_b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype: torch.dtype) -> None:
    batch = Batch([5, 1, 2, 9], [3, 0, 4, 1], [True, False, True, False], 5, seed=7)
    x, weight, bias, pool = make_inputs(batch, 8, 4, True)
    pool16 = pool.to(dtype)
    kw = dict(
        query_start_loc=batch.qsl,
        state_indices=torch.tensor(batch.slots),
        has_initial_state=torch.tensor(batch.has_init),
    )
    y16 = causal_conv1d_ref(x.to(dtype), weight.to(dtype), bias.to(dtype), conv_states=pool16, **kw)
    y32 = causal_conv1d_ref(x, weight, bias, conv_states=pool, **kw)
    assert y16.dtype == dtype and pool16.dtype == dtype
    torch.testing.assert_close(y16.float(), y32, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(pool16.float()[batch.slots], pool[batch.slots], rtol=1e-2, atol=1e-2)


def test_shape_errors_name_the_argument() -> None:
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    ok = dict(
        conv_states=torch.zeros(2, 4, 2),
        query_start_loc=torch.tensor([0, 5]),
        state_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([True]),
    )
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_ref(x, torch.randn(3, 3), None, **ok)
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d_ref(x, w, torch.randn(5), **ok)
    with pytest.raises(ValueError, match="conv_states"):
        causal_conv1d_ref(x, w, None, **(ok | dict(conv_states=torch.zeros(2, 4, 3))))
    with pytest.raises(ValueError, match="query_start_loc"):
        causal_conv1d_ref(x, w, None, **(ok | dict(query_start_loc=torch.tensor([0, 4]))))
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_ref(x, w, None, **(ok | dict(state_indices=torch.tensor([2]))))
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_ref(x, w, None, **(ok | dict(has_initial_state=torch.tensor([True, False]))))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_ref(x, w, None, **ok, activation="gelu")
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_update_ref(
            torch.randn(2, 4),
            conv_states=torch.zeros(2, 4, 2),
            weight=w,
            bias=None,
            state_indices=torch.tensor([1, 1]),
        )


def test_matches_hf_mamba2_conv_with_cache() -> None:
    """HF's torch conv path: prefill with a cache, then two decode steps; same outputs and states."""
    from transformers.models.mamba2.modeling_mamba2 import causal_conv1d_fn, causal_conv1d_update

    g = torch.Generator().manual_seed(0)
    dim, width, seq = 6, 4, 7
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    x = torch.randn(seq + 2, dim, generator=g)
    hf_y = causal_conv1d_fn(x[:seq].T[None], weight, bias, activation="silu")[0].T
    hf_state = (
        F.pad(x[:seq].T[None], (width - seq, 0)) if seq < width else x[seq - width : seq].T[None].clone()
    )
    hf_steps = [
        causal_conv1d_update(x[t].view(1, dim, 1), hf_state, weight, bias, "silu")[0, :, 0]
        for t in (seq, seq + 1)
    ]

    pool = torch.zeros(2, dim, width - 1)
    y = causal_conv1d_ref(
        x[:seq],
        weight,
        bias,
        conv_states=pool,
        query_start_loc=torch.tensor([0, seq]),
        state_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
    )
    torch.testing.assert_close(y, hf_y, rtol=1e-5, atol=1e-5)
    steps = [
        causal_conv1d_update_ref(
            x[t][None], conv_states=pool, weight=weight, bias=bias, state_indices=torch.tensor([1])
        )[0]
        for t in (seq, seq + 1)
    ]
    torch.testing.assert_close(torch.stack(steps), torch.stack(hf_steps), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[1], hf_state[0, :, 1:], rtol=0, atol=0)  # HF keeps width columns
