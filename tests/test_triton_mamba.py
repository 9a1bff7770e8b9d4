"""Triton Mamba kernels (causal conv1d + update, Mamba2 SSD chunk scan + state update) against their
torch reference twins, outputs AND in-place state slots.

On a machine without CUDA the kernels run under Triton's interpreter (``tests/_triton.py``) at tiny sizes.
With CUDA the same checks run compiled, plus bf16 checks and a CUDA-graph capture check marked ``gpu``.

Every batch is hostile: several requests of mixed lengths (0, 1, chunk multiples and not), with and
without initial state, state slots shuffled with spare slots; unused slots and the slots of requests
without initial state hold NaN (the latter must never be read), outputs are NaN-poisoned before the call
(every element must be written), inputs are strided views like the real call sites' ``split`` outputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _triton import DEVICE, gpu, kernel_module, tiles

from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref
from hybridkv.layers.ops.ssd_ref import ssd_chunk_scan_ref, ssd_state_update_ref

tc = kernel_module("hybridkv.backends.triton_conv1d")
ts = kernel_module("hybridkv.backends.triton_ssd")
NAN = float("nan")


# ------------------------------------------------------------------------------------------ batches

def _batch(seed: int, lens: list[int] | None = None, max_reqs: int = 5, max_len: int = 40, spare: int = 3):
    """(lens, qsl, slots, has_init, num_slots): random mixed lengths (a 1-token request always; a 0-token
    one sometimes), shuffled distinct slots with spare ones, random has_initial_state."""
    rng = np.random.default_rng(seed)
    if lens is None:
        n = int(rng.integers(2, max_reqs + 1))
        lens = [int(v) for v in rng.integers(2, max_len + 1, n)]
        lens[int(rng.integers(0, n))] = 1
        if seed % 3 == 0:
            lens.insert(int(rng.integers(0, n + 1)), 0)
    num_slots = len(lens) + spare
    slots = [int(v) for v in rng.permutation(num_slots)[: len(lens)]]
    has_init = [bool(v) for v in rng.random(len(lens)) < 0.6]
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    return lens, qsl, torch.tensor(slots), torch.tensor(has_init), num_slots


def _pool(shape, slots, has_init, gen, dtype=torch.float32) -> torch.Tensor:
    """Random where a request continues from its slot, NaN everywhere else (fresh and unused slots)."""
    pool = torch.full(shape, NAN, dtype=dtype)
    for s, h in zip(slots.tolist(), has_init.tolist(), strict=True):
        if h:
            pool[s] = torch.randn(shape[1:], generator=gen).to(dtype)
    return pool


def _strided(t: torch.Tensor, extra: int = 3) -> torch.Tensor:
    """The same values as a non-contiguous view (rows of a wider tensor), like ``split`` outputs."""
    wide = torch.full((t.shape[0], t[0].numel() + extra), NAN, dtype=t.dtype, device=t.device)
    wide[:, : t[0].numel()] = t.reshape(t.shape[0], -1)
    return wide[:, : t[0].numel()].view(t.shape)


def _dev(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol, equal_nan=True)


def _check_states(pool: torch.Tensor, ref_pool: torch.Tensor, slots: torch.Tensor, tol: float = 1e-4) -> None:
    """Used slots finite and equal to the reference's; every other slot untouched (still NaN)."""
    pool = pool.cpu()
    used = torch.zeros(pool.shape[0], dtype=torch.bool)
    used[slots] = True
    assert torch.isfinite(pool[used]).all(), "a used slot holds NaN: a fresh slot was read or not written"
    assert torch.isnan(pool[~used]).all(), "an unused slot was written"
    _close(pool, ref_pool, tol)


# ------------------------------------------------------------------------------------------ conv1d

# (seed, dim, width, bias, activation, config)
CONV_CASES = [
    (0, 12, 4, True, "silu", None),
    (1, 20, 4, False, None, {"BLOCK_T": 4, "BLOCK_D": 8}),   # many token / channel blocks
    (2, 9, 2, True, "silu", {"BLOCK_T": 8, "BLOCK_D": 16}),
    (3, 7, 1, True, "silu", None),                           # width 1: no state at all
    (4, 16, 3, True, None, {"BLOCK_T": 2, "BLOCK_D": 16}),   # BLOCK_T == width - 1
]


@pytest.mark.parametrize(("seed", "dim", "width", "use_bias", "act", "config"), CONV_CASES)
def test_conv1d_matches_reference(seed, dim, width, use_bias, act, config):
    lens, qsl, slots, init, num_slots = _batch(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), dim, generator=g)
    w = torch.randn(dim, width, generator=g) * 0.5
    b = torch.randn(dim, generator=g) if use_bias else None
    pool = _pool((num_slots, dim, width - 1), slots, init, g)
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, w, b, conv_states=ref_pool, query_start_loc=qsl, state_indices=slots,
                            has_initial_state=init, activation=act)
    xd, wd, bd, dpool, dqsl, dslots, dinit = _dev(_strided(x), w, b, pool, qsl, slots, init)
    out = torch.full((sum(lens), dim), NAN, device=DEVICE)
    with tiles(tc, "conv1d_launch_config", config):
        y = tc.causal_conv1d_triton(xd, wd, bd, conv_states=dpool, query_start_loc=dqsl, state_indices=dslots,
                                    has_initial_state=dinit, activation=act, out=out)
    assert y is out and not torch.isnan(y).any()
    _close(y, ref)
    if width > 1:
        _check_states(dpool, ref_pool, slots)


@pytest.mark.parametrize(("seed", "width", "act", "config"),
                         [(5, 4, "silu", None), (6, 4, None, {"BLOCK_D": 8}), (7, 1, "silu", None),
                          (8, 2, "silu", {"BLOCK_D": 4})])
def test_conv1d_update_matches_reference(seed, width, act, config):
    g = torch.Generator().manual_seed(seed)
    batch, dim, num_slots = 4, 11, 7
    slots = torch.randperm(num_slots, generator=g)[:batch]
    x = torch.randn(batch, dim, generator=g)
    w = torch.randn(dim, width, generator=g) * 0.5
    b = torch.randn(dim, generator=g)
    pool = _pool((num_slots, dim, width - 1), slots, torch.ones(batch, dtype=torch.bool), g)
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, conv_states=ref_pool, weight=w, bias=b, state_indices=slots, activation=act)
    xd, wd, bd, dpool, dslots = _dev(_strided(x), w, b, pool, slots)
    with tiles(tc, "conv1d_launch_config", config):
        y = tc.causal_conv1d_update_triton(xd, conv_states=dpool, weight=wd, bias=bd, state_indices=dslots,
                                           activation=act)
    _close(y, ref)
    if width > 1:
        _check_states(dpool, ref_pool, slots)


def test_conv1d_chunked_prefill_then_decode_equals_one_pass():
    """A request fed as prefill chunks, then decode updates, equals one prefill of the whole sequence."""
    g = torch.Generator().manual_seed(9)
    dim, width, n = 6, 4, 13
    x, w, b = torch.randn(n, dim, generator=g), torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    one = torch.zeros(2, dim, width - 1, device=DEVICE)
    y_all = tc.causal_conv1d_triton(*_dev(x, w, b), conv_states=one, query_start_loc=torch.tensor([0, n]).to(DEVICE),
                                    state_indices=torch.tensor([1]).to(DEVICE),
                                    has_initial_state=torch.tensor([False]).to(DEVICE))
    pool = torch.full((2, dim, width - 1), NAN, device=DEVICE)
    ys, t = [], 0
    for k, first in ((2, True), (5, False)):
        ys.append(tc.causal_conv1d_triton(*_dev(x[t:t + k], w, b), conv_states=pool,
                                          query_start_loc=torch.tensor([0, k]).to(DEVICE),
                                          state_indices=torch.tensor([1]).to(DEVICE),
                                          has_initial_state=torch.tensor([not first]).to(DEVICE)))
        t += k
    while t < n:
        ys.append(tc.causal_conv1d_update_triton(x[t:t + 1].to(DEVICE), conv_states=pool, weight=w.to(DEVICE),
                                                 bias=b.to(DEVICE), state_indices=torch.tensor([1]).to(DEVICE)))
        t += 1
    _close(torch.cat(ys), y_all)
    _close(pool[1], one[1])


# ------------------------------------------------------------------------------------------ SSD

def _ssd_inputs(seed: int, n: int, nheads: int, headdim: int, ngroups: int, dstate: int, *, d_mode: int,
                use_z: bool, use_bias: bool):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    D = None if d_mode == 0 else (r(nheads) if d_mode == 1 else r(nheads, headdim))
    return dict(x=r(n, nheads, headdim), dt=r(n, nheads), A=-torch.exp(torch.rand(nheads, generator=g) * 3 - 1),
                B=r(n, ngroups, dstate), C=r(n, ngroups, dstate), D=D, z=r(n, nheads, headdim) if use_z else None,
                dt_bias=r(nheads) if use_bias else None)


def _strided_ssd(p: dict) -> dict:
    """x, B, C as views of one packed row (like ``_split_xbc``), dt a view of a wider tensor."""
    x, B, C = p["x"], p["B"], p["C"]
    n = x.shape[0]
    pad = torch.full((n, 2), NAN, dtype=x.dtype, device=x.device)
    xbc = torch.cat([x.reshape(n, -1), B.reshape(n, -1), C.reshape(n, -1), pad], 1)
    sx, sb = x[0].numel(), B[0].numel()
    out = dict(p, x=xbc[:, :sx].view(x.shape), B=xbc[:, sx:sx + sb].view(B.shape),
               C=xbc[:, sx + sb:sx + 2 * sb].view(C.shape), dt=_strided(p["dt"]))
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


# (seed, nheads, headdim, ngroups, dstate, d_mode, z, dt_bias, dt_limit, config)
SSD_CASES = [
    (0, 4, 8, 2, 12, 1, False, True, (0.0, math.inf), {"CHUNK": 16, "BLOCK_P": 16}),
    (1, 2, 16, 1, 16, 2, True, True, (0.05, 1.5), {"CHUNK": 16, "BLOCK_P": 16}),
    (2, 3, 20, 3, 8, 0, True, False, (0.0, math.inf), {"CHUNK": 32, "BLOCK_P": 16}),   # 2 P-blocks
    (3, 4, 4, 4, 16, 1, False, True, (0.0, 0.5), None),                                 # default config
]


@pytest.mark.parametrize(("seed", "nheads", "headdim", "ngroups", "dstate", "d_mode", "use_z", "use_bias",
                          "dt_limit", "config"), SSD_CASES)
def test_ssd_chunk_scan_matches_reference(seed, nheads, headdim, ngroups, dstate, d_mode, use_z, use_bias,
                                          dt_limit, config):
    lens, qsl, slots, init, num_slots = _batch(seed, max_len=45)
    p = _ssd_inputs(seed, sum(lens), nheads, headdim, ngroups, dstate, d_mode=d_mode, use_z=use_z,
                    use_bias=use_bias)
    g = torch.Generator().manual_seed(seed + 100)
    pool = _pool((num_slots, nheads, headdim, dstate), slots, init, g)
    ref_pool = pool.clone()
    ref = ssd_chunk_scan_ref(**p, chunk_size=8, query_start_loc=qsl, ssm_states=ref_pool, state_indices=slots,
                             has_initial_state=init, dt_limit=dt_limit)
    dpool, dqsl, dslots, dinit = _dev(pool, qsl, slots, init)
    out = torch.full(p["x"].shape, NAN, device=DEVICE)
    with tiles(ts, "ssd_launch_config", config):
        y = ts.ssd_chunk_scan_triton(**_strided_ssd(p), chunk_size=8, query_start_loc=dqsl, ssm_states=dpool,
                                     state_indices=dslots, has_initial_state=dinit, dt_limit=dt_limit, out=out)
    assert y is out and not torch.isnan(y).any()
    _close(y, ref, 2e-4)
    _check_states(dpool, ref_pool, slots, 2e-4)


@pytest.mark.parametrize(("seed", "d_mode", "use_z", "dt_limit", "config"),
                         [(10, 1, False, (0.0, math.inf), None), (11, 2, True, (0.1, 0.8), {"BLOCK_P": 4}),
                          (12, 0, True, (0.0, math.inf), {"BLOCK_P": 8})])
def test_ssd_state_update_matches_reference(seed, d_mode, use_z, dt_limit, config):
    batch, nheads, headdim, ngroups, dstate, num_slots = 3, 4, 10, 2, 12, 6
    p = _ssd_inputs(seed, batch, nheads, headdim, ngroups, dstate, d_mode=d_mode, use_z=use_z, use_bias=True)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:batch]
    pool = _pool((num_slots, nheads, headdim, dstate), slots, torch.ones(batch, dtype=torch.bool), g)
    ref_pool = pool.clone()
    ref = ssd_state_update_ref(ref_pool, **p, state_indices=slots, dt_limit=dt_limit)
    dpool = pool.to(DEVICE)
    with tiles(ts, "ssd_launch_config", config):
        y = ts.ssd_state_update_triton(dpool, **_strided_ssd(p), state_indices=slots.to(DEVICE), dt_limit=dt_limit)
    _close(y, ref)
    _check_states(dpool, ref_pool, slots)


def test_ssd_scan_of_one_token_equals_state_update():
    """A 1-token request with an initial state through the scan == the decode update."""
    p = _ssd_inputs(13, 2, 2, 16, 1, 16, d_mode=1, use_z=True, use_bias=True)
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(3, 2, 16, 16, generator=g).to(DEVICE)
    pool2 = pool.clone()
    idx = torch.tensor([2, 0], device=DEVICE)
    y1 = ts.ssd_chunk_scan_triton(**_strided_ssd(p), chunk_size=4, query_start_loc=torch.tensor([0, 1, 2]).to(DEVICE),
                                  ssm_states=pool, state_indices=idx,
                                  has_initial_state=torch.tensor([True, True]).to(DEVICE))
    y2 = ts.ssd_state_update_triton(pool2, **_strided_ssd(p), state_indices=idx)
    _close(y1, y2)
    _close(pool, pool2)


def test_conv_and_scan_over_a_padded_bucket():
    """The mixed graphs' packed layout (``engine/mixed_metadata.py``): the step's requests (a decode, one token
    continuing its slot; a fresh prompt; a continuing chunk), then the padded tokens' request at slot -1, then empty
    requests at slot -1. Conv and scan equal the reference over the real requests, the padded rows are finite, and
    no other slot is read or written (the unused ones stay NaN)."""
    g = torch.Generator().manual_seed(21)
    real_lens, padded_lens = [1, 7, 5], [4, 0, 0]
    slots, init = torch.tensor([3, 0, 5, -1, -1, -1]), torch.tensor([True, False, True, False, False, False])
    qsl = torch.tensor([0, *np.cumsum(real_lens + padded_lens).tolist()], dtype=torch.int32)
    n, total, num_slots = sum(real_lens), sum(real_lens + padded_lens), 7
    real = dict(query_start_loc=qsl[:4], state_indices=slots[:3], has_initial_state=init[:3])
    packed = dict(query_start_loc=qsl.to(DEVICE), state_indices=slots.to(DEVICE), has_initial_state=init.to(DEVICE))

    dim, width = 12, 4
    x, w, b = torch.randn(total, dim, generator=g), torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    pool = _pool((num_slots, dim, width - 1), slots[:3], init[:3], g)
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x[:n], w, b, conv_states=ref_pool, **real, activation="silu")
    dpool = pool.to(DEVICE)
    y = tc.causal_conv1d_triton(*_dev(x, w, b), conv_states=dpool, **packed, activation="silu")
    _close(y[:n], ref)
    assert torch.isfinite(y[n:]).all()
    _check_states(dpool, ref_pool, slots[:3])

    p = _ssd_inputs(21, total, 4, 8, 2, 8, d_mode=2, use_z=True, use_bias=True)
    pool = _pool((num_slots, 4, 8, 8), slots[:3], init[:3], g)
    ref_pool = pool.clone()
    tokens = ("x", "dt", "B", "C", "z")
    ref = ssd_chunk_scan_ref(**{k: v[:n] if k in tokens else v for k, v in p.items()}, chunk_size=4,
                             ssm_states=ref_pool, **real)
    dpool = pool.to(DEVICE)
    y = ts.ssd_chunk_scan_triton(**_strided_ssd(p), chunk_size=4, ssm_states=dpool, **packed)
    _close(y[:n], ref, 2e-4)
    assert torch.isfinite(y[n:]).all()
    _check_states(dpool, ref_pool, slots[:3], 2e-4)


# ------------------------------------------------------------------------------------------ contract

def _same_error(ref_call, our_call) -> None:
    with pytest.raises(ValueError) as ref_err:
        ref_call()
    with pytest.raises(ValueError) as our_err:
        our_call()
    assert str(our_err.value) == str(ref_err.value)


def test_shape_and_dtype_errors_match_reference():
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    st, qsl = torch.zeros(3, 4, 2), torch.tensor([0, 2, 5])
    idx, init = torch.tensor([0, 2]), torch.tensor([True, False])
    kw = dict(conv_states=st, query_start_loc=qsl, state_indices=idx, has_initial_state=init)
    bad = [
        dict(weight=torch.randn(3, 3)), dict(conv_states=torch.zeros(3, 4, 3)), dict(bias=torch.zeros(5)),
        dict(has_initial_state=torch.tensor([1, 0])), dict(state_indices=torch.tensor([0.0, 2.0])),
        dict(query_start_loc=torch.tensor([[0, 5]])), dict(activation="relu"), dict(state_indices=torch.tensor([0])),
    ]
    for change in bad:
        args = dict(x=x, weight=w, bias=None, **kw) | change
        _same_error(lambda a=args: causal_conv1d_ref(**a), lambda a=args: tc.causal_conv1d_triton(**a))
    ukw = dict(conv_states=st, weight=w, bias=None, state_indices=idx)
    for change in (dict(weight=torch.randn(4, 2)), dict(state_indices=torch.tensor([0, 1, 2])),
                   dict(x=torch.randn(2, 4, 1))):
        args = dict(x=torch.randn(2, 4), **ukw) | change
        _same_error(lambda a=args: causal_conv1d_update_ref(**a), lambda a=args: tc.causal_conv1d_update_triton(**a))

    p = _ssd_inputs(0, 5, 4, 8, 2, 6, d_mode=1, use_z=False, use_bias=True)
    ss = torch.zeros(3, 4, 8, 6)
    skw = dict(chunk_size=4, query_start_loc=qsl, ssm_states=ss, state_indices=idx, has_initial_state=init)
    for change in (dict(B=torch.randn(5, 3, 6)), dict(C=torch.randn(5, 2, 5)), dict(dt=torch.randn(5, 3)),
                   dict(D=torch.randn(4, 7)), dict(z=torch.randn(5, 4)), dict(dt_bias=torch.randn(3)),
                   dict(chunk_size=0), dict(ssm_states=torch.zeros(3, 4, 7, 6)), dict(A=torch.randn(4, 1))):
        args = p | skw | change
        _same_error(lambda a=args: ssd_chunk_scan_ref(**a), lambda a=args: ts.ssd_chunk_scan_triton(**a))
    p1 = {k: (v[:2] if k in ("x", "dt", "B", "C") else v) for k, v in p.items()}
    for change in (dict(state_indices=torch.tensor([1])), dict(x=torch.randn(2, 4, 7))):
        args = p1 | dict(ssm_states=ss, state_indices=idx) | change
        _same_error(lambda a=args: ssd_state_update_ref(**a), lambda a=args: ts.ssd_state_update_triton(**a))


def test_value_errors_match_reference_with_check_values():
    """Index range / duplicates / query_start_loc are the reference's errors with ``check_values=True``."""
    x, w, st = torch.randn(5, 4), torch.randn(4, 3), torch.zeros(3, 4, 2)
    init = torch.tensor([True, False])
    for qsl, idx in ((torch.tensor([0, 2, 5]), torch.tensor([0, 3])), (torch.tensor([0, 2, 5]), torch.tensor([1, 1])),
                     (torch.tensor([0, 3, 2]), torch.tensor([0, 1])), (torch.tensor([0, 2, 6]), torch.tensor([0, 1]))):
        kw = dict(conv_states=st, query_start_loc=qsl, state_indices=idx, has_initial_state=init)
        _same_error(lambda kw=kw: causal_conv1d_ref(x, w, None, **kw),
                    lambda kw=kw: tc.causal_conv1d_triton(x, w, None, check_values=True, **kw))
    _same_error(lambda: causal_conv1d_update_ref(x[:2], conv_states=st, weight=w, bias=None,
                                                 state_indices=torch.tensor([-1, 0])),
                lambda: tc.causal_conv1d_update_triton(x[:2], conv_states=st, weight=w, bias=None,
                                                       state_indices=torch.tensor([-1, 0]), check_values=True))
    p = _ssd_inputs(1, 2, 2, 4, 1, 4, d_mode=0, use_z=False, use_bias=False)
    ss = torch.zeros(2, 2, 4, 4)
    _same_error(lambda: ssd_state_update_ref(ss, **p, state_indices=torch.tensor([0, 2])),
                lambda: ts.ssd_state_update_triton(ss, **p, state_indices=torch.tensor([0, 2]), check_values=True))
    kw = dict(chunk_size=4, query_start_loc=torch.tensor([0, 1, 2]), ssm_states=ss,
              state_indices=torch.tensor([1, 1]), has_initial_state=torch.tensor([True, True]))
    _same_error(lambda: ssd_chunk_scan_ref(**p, **kw), lambda: ts.ssd_chunk_scan_triton(**p, **kw, check_values=True))


def test_out_of_range_index_is_never_dereferenced_without_checks():
    """Without value checks (the hot path), a negative or too-large slot reads and writes no state: the row
    computes from a zero state; the other rows and every slot are as if it were absent."""
    g = torch.Generator().manual_seed(3)
    dim, width = 5, 4
    x, w = torch.randn(3, dim, generator=g), torch.randn(dim, width, generator=g)
    pool = torch.randn(4, dim, width - 1, generator=g)
    ref_pool = pool.clone()
    idx = torch.tensor([2, -1, 9])
    ref = causal_conv1d_update_ref(x[:1], conv_states=ref_pool, weight=w, bias=None, state_indices=idx[:1])
    zero = causal_conv1d_update_ref(x[1:], conv_states=torch.zeros(2, dim, width - 1), weight=w, bias=None,
                                    state_indices=torch.tensor([0, 1]))
    dpool = pool.to(DEVICE)
    y = tc.causal_conv1d_update_triton(*_dev(x), conv_states=dpool, weight=w.to(DEVICE), bias=None,
                                       state_indices=idx.to(DEVICE))
    _close(y, torch.cat([ref, zero]))
    _close(dpool, ref_pool)

    p = _ssd_inputs(4, 2, 2, 4, 1, 4, d_mode=1, use_z=False, use_bias=True)
    ss = torch.randn(2, 2, 4, 4, generator=g)
    ref_ss = ss.clone()
    ref = ssd_state_update_ref(ref_ss, **{k: (v[1:] if k in ("x", "dt", "B", "C") else v) for k, v in p.items()},
                               state_indices=torch.tensor([0]))
    dss = ss.to(DEVICE)
    y = ts.ssd_state_update_triton(dss, **_strided_ssd(p), state_indices=torch.tensor([-1, 0]).to(DEVICE))
    _close(y[1:], ref)
    _close(dss, ref_ss)


def test_empty_batches():
    st = torch.full((2, 3, 2), NAN, device=DEVICE)
    y = tc.causal_conv1d_triton(torch.zeros(0, 3, device=DEVICE), torch.ones(3, 3, device=DEVICE), None,
                                conv_states=st, query_start_loc=torch.tensor([0]).to(DEVICE),
                                state_indices=torch.zeros(0, dtype=torch.long, device=DEVICE),
                                has_initial_state=torch.zeros(0, dtype=torch.bool, device=DEVICE))
    assert y.shape == (0, 3) and torch.isnan(st).all()
    # one zero-token request without initial state: its slot becomes zeros (as the reference)
    y = tc.causal_conv1d_triton(torch.zeros(0, 3, device=DEVICE), torch.ones(3, 3, device=DEVICE), None,
                                conv_states=st, query_start_loc=torch.tensor([0, 0]).to(DEVICE),
                                state_indices=torch.tensor([1]).to(DEVICE),
                                has_initial_state=torch.tensor([False]).to(DEVICE))
    assert torch.isnan(st[0]).all() and (st[1] == 0).all()


def test_backend_wires_the_kernels():
    from hybridkv.backends.triton_backend import triton_backend

    be = triton_backend()
    assert be.causal_conv1d.__name__ == "causal_conv1d_triton"
    assert be.causal_conv1d_update.__name__ == "causal_conv1d_update_triton"
    assert be.ssd_chunk_scan.__name__ == "ssd_chunk_scan_triton"
    assert be.ssd_state_update.__name__ == "ssd_state_update_triton"
    assert be.selective_scan.__name__ == "selective_scan_ref"    # Mamba-1 stays on the reference


def test_mamba2_layer_triton_equals_torch_backend():
    """The real call sites (``Mamba2Layer.forward``: strided splits, Parameter D / dt_bias, decodes first)
    on mixed steps of decodes, fresh prefills and chunked-prefill continuations, torch vs triton backend."""
    from _layer_harness import torch_and_triton_outputs

    from hybridkv.layers.mamba2 import Mamba2Layer
    from hybridkv.models.config import Mamba2

    torch.manual_seed(0)
    layer = Mamba2Layer(32, Mamba2(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4,
                                   chunk_size=8, norm_eps=1e-5, time_step_limit=(0.0, 1.5)), cache_name="m2")
    with torch.no_grad():
        for name, prm in layer.named_parameters():
            noise = torch.randn(prm.shape)
            prm.copy_(1.0 + 0.3 * noise if name.endswith("norm.weight") else 0.2 * noise)
        layer.A_log.copy_(torch.log(0.5 + 3.5 * torch.rand(4)))
    layer = layer.to(DEVICE)
    steps = [{"a": 6, "b": 3}, {"a": 1, "b": 19, "c": 5}, {"c": 1, "a": 1, "b": 4}, {"b": 1, "a": 1, "c": 9}]
    xs = {r: torch.randn(40, 32, generator=torch.Generator().manual_seed(i)) for i, r in enumerate("abc")}
    outs = torch_and_triton_outputs(layer, xs, steps, max_len=40, seed=5)
    assert torch.isfinite(outs[1]).all()
    _close(outs[1], outs[0], 1e-4)


# ------------------------------------------------------------------------------------------ GPU only
# bf16 inputs vs the fp32 reference on the same (bf16-rounded) values; the yardstick is the same math in
# eager torch with bf16 tensors: ours <= 2x its error + a small atol, and never NaN.

def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(a).any():
        return math.inf
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _assert_within(ours: float, base: float, what: str) -> None:
    assert ours <= 2 * base + 1e-4, f"{what}: ours {ours:.3e} vs bf16 eager {base:.3e}"


def _conv_eager_lowp(x, w, b, pool, qsl, slots, init, act="silu"):
    """Per request F.conv1d on bf16 tensors, the window primed from the slot (bf16 intermediates)."""
    outs = []
    for r in range(len(slots)):
        t0, t1 = int(qsl[r]), int(qsl[r + 1])
        pre = pool[slots[r]] if bool(init[r]) else torch.zeros_like(pool[0])
        seq = torch.cat([pre.to(x.dtype), x[t0:t1].T], 1)[None]                # (1, dim, hist + n)
        y = F.conv1d(seq, w[:, None, :].to(x.dtype), b.to(x.dtype), groups=w.shape[0])[0].T
        outs.append(F.silu(y) if act else y)
    return torch.cat(outs)


def _ssd_eager_lowp(p, qsl, pool, slots, init, dt_limit, chunk=64, dtype=torch.bfloat16):
    """The chunked SSD algorithm with bf16 tensors (dt, cumsum, decays, scores, dots); the state passed
    between chunks in fp32 (the pool's dtype). Returns (y, final states)."""
    x, B, C = p["x"].to(dtype), p["B"].to(dtype), p["C"].to(dtype)
    hpg = x.shape[1] // B.shape[1]
    dt = F.softplus((p["dt"] + p["dt_bias"]).to(dtype)).clamp(*dt_limit)
    a_all = dt * p["A"].to(dtype)
    ys, finals = [], []
    for r in range(len(slots)):
        t0, t1 = int(qsl[r]), int(qsl[r + 1])
        state = pool[slots[r]].float().clone() if bool(init[r]) else torch.zeros_like(pool[0]).float()
        for c0 in range(t0, t1, chunk):
            sl = slice(c0, min(c0 + chunk, t1))
            xs, d, a = x[sl], dt[sl], a_all[sl]
            Bh, Ch = B[sl].repeat_interleave(hpg, 1), C[sl].repeat_interleave(hpg, 1)
            cum = a.cumsum(0)                                                  # (L, H)
            L = xs.shape[0]
            causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[..., None]
            decay = torch.exp(cum[:, None] - cum[None, :]).masked_fill(~causal, 0)   # (L, L, H)
            scores = torch.einsum("lhn,shn->lsh", Ch, Bh) * decay * d[None]
            y = torch.einsum("lsh,shp->lhp", scores, xs)
            y = y + torch.einsum("lhn,hpn->lhp", Ch, state.to(dtype)) * torch.exp(cum)[..., None]
            wgt = torch.exp(cum[-1][None] - cum) * d
            state = state * torch.exp(cum[-1].float())[:, None, None] + \
                torch.einsum("lhn,lh,lhp->hpn", Bh, wgt, xs).float()
            ys.append(y + p["D"].to(dtype)[:, None] * xs)
        finals.append(state)
    return torch.cat(ys), torch.stack(finals)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_gpu_bf16_conv1d_within_2x_of_bf16_torch(seed):
    rng = np.random.default_rng(200 + seed)
    lens = [int(v) for v in rng.integers(1, 700, 6)] + [1]
    lens, qsl, slots, init, num_slots = _batch(seed, lens=lens)
    dim, width = 1024 + 2 * 128 + 7, 4
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), dim, generator=g).bfloat16().cuda()
    w = (torch.randn(dim, width, generator=g) * 0.5).bfloat16().cuda()
    b = torch.randn(dim, generator=g).bfloat16().cuda()
    pool = _pool((num_slots, dim, width - 1), slots, init, g, torch.bfloat16).cuda()
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x.float(), w.float(), b.float(), conv_states=ref_pool, query_start_loc=qsl.cuda(),
                            state_indices=slots.cuda(), has_initial_state=init.cuda())
    base = _conv_eager_lowp(x, w, b, pool, qsl, slots.tolist(), init)
    ours_pool = pool.clone()
    ours = tc.causal_conv1d_triton(_strided(x), w, b, conv_states=ours_pool, query_start_loc=qsl.cuda(),
                                   state_indices=slots.cuda(), has_initial_state=init.cuda())
    _assert_within(_rel(ours, ref), _rel(base, ref), "conv1d y")
    assert torch.equal(ours_pool.isnan(), ref_pool.isnan())
    assert torch.equal(ours_pool.nan_to_num(), ref_pool.nan_to_num())      # a state is a copy: exact
    # decode update on the same pool
    xd = torch.randn(len(lens), dim, generator=g).bfloat16().cuda()
    window = torch.cat([ref_pool[slots.cuda()].float(), xd.float()[:, :, None]], -1)
    base = F.silu((window.bfloat16() * w).sum(-1) + b)
    ref = causal_conv1d_update_ref(xd.float(), conv_states=ref_pool, weight=w.float(), bias=b.float(),
                                   state_indices=slots.cuda())
    ours = tc.causal_conv1d_update_triton(xd, conv_states=ours_pool, weight=w, bias=b, state_indices=slots.cuda())
    _assert_within(_rel(ours, ref), _rel(base, ref), "conv1d update y")
    assert torch.equal(ours_pool.nan_to_num(), ref_pool.nan_to_num())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("seed", "nheads", "ngroups"), [(0, 32, 1), (1, 16, 8), (2, 24, 4)])
def test_gpu_bf16_ssd_within_2x_of_bf16_torch(seed, nheads, ngroups):
    rng = np.random.default_rng(300 + seed)
    lens = [int(v) for v in rng.integers(1, 900, 5)] + [1, 64, 127]
    lens, qsl, slots, init, num_slots = _batch(seed, lens=lens)
    headdim, dstate, dt_limit = 64, 128, (0.0, math.inf)
    p = _ssd_inputs(seed, sum(lens), nheads, headdim, ngroups, dstate, d_mode=1, use_z=False, use_bias=True)
    p = {k: v.bfloat16().float().cuda() for k, v in p.items() if v is not None}   # the values bf16 can hold
    p["A"] = p["A"] / 4                                                         # decays over ~100 tokens
    g = torch.Generator().manual_seed(seed)
    pool = (_pool((num_slots, nheads, headdim, dstate), slots, init, g) * 0.1).cuda()
    ref_pool = pool.clone()
    cuda = dict(query_start_loc=qsl.cuda(), state_indices=slots.cuda(), has_initial_state=init.cuda())
    ref = ssd_chunk_scan_ref(**p, chunk_size=64, ssm_states=ref_pool, dt_limit=dt_limit, **cuda)
    base_y, base_states = _ssd_eager_lowp(p, qsl, pool, slots.tolist(), init, dt_limit)
    low = {k: (v.bfloat16() if k in ("x", "dt", "B", "C") else v) for k, v in p.items()}
    ours_pool = pool.clone()
    ours = ts.ssd_chunk_scan_triton(**_strided_ssd(low), chunk_size=256, ssm_states=ours_pool,
                                    dt_limit=dt_limit, **cuda)
    assert ours.dtype == torch.bfloat16
    _assert_within(_rel(ours, ref), _rel(base_y, ref), "ssd scan y")
    used = slots.cuda()
    _assert_within(_rel(ours_pool[used], ref_pool[used]), _rel(base_states, ref_pool[used]), "ssd scan states")
    assert torch.isnan(ours_pool[[s for s in range(num_slots) if s not in slots.tolist()]]).all()

    # decode step on the resulting states
    q = _ssd_inputs(seed + 1, len(lens), nheads, headdim, ngroups, dstate, d_mode=1, use_z=True, use_bias=True)
    q = {k: v.bfloat16().float().cuda() for k, v in q.items()}
    ref = ssd_state_update_ref(ref_pool, **q, state_indices=used)
    qd = {k: (v.bfloat16() if k in ("x", "dt", "B", "C", "z") else v) for k, v in q.items()}
    d = F.softplus((qd["dt"] + q["dt_bias"]).bfloat16())
    dA = torch.exp(d * q["A"].bfloat16())
    hpg = nheads // ngroups
    Bh, Ch = qd["B"].repeat_interleave(hpg, 1), qd["C"].repeat_interleave(hpg, 1)
    st = dA[..., None, None] * ours_pool[used].bfloat16() + (d[..., None] * qd["x"])[..., None] * Bh[:, :, None]
    base = (torch.einsum("bhpn,bhn->bhp", st, Ch) + q["D"].bfloat16()[:, None] * qd["x"]) * F.silu(qd["z"])
    ours = ts.ssd_state_update_triton(ours_pool, **_strided_ssd(qd), state_indices=used)
    _assert_within(_rel(ours, ref), _rel(base, ref), "ssd update y")
    _assert_within(_rel(ours_pool[used], ref_pool[used]), _rel(st.float(), ref_pool[used]), "ssd update states")


@gpu
@pytest.mark.gpu
def test_gpu_kernels_are_cuda_graph_capturable():
    """Capture conv update + SSD update + scan in one graph; replay with new values (indices included)."""
    dim, nheads, headdim, dstate, batch, num_slots = 64 + 2 * 32, 4, 16, 32, 3, 8
    g = torch.Generator().manual_seed(0)
    pool_c = torch.randn(num_slots, dim, 3, generator=g).cuda()
    pool_s = torch.randn(num_slots, nheads, headdim, dstate, generator=g).cuda()
    w, b = torch.randn(dim, 4, generator=g).cuda(), torch.randn(dim, generator=g).cuda()
    p = {k: v.cuda() for k, v in _ssd_inputs(0, batch, nheads, headdim, 2, dstate, d_mode=1, use_z=False,
                                             use_bias=True).items() if v is not None}
    xc = torch.randn(batch, dim, generator=g).cuda()
    idx = torch.tensor([5, 1, 3]).cuda()
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32).cuda()
    init = torch.tensor([True, False, True]).cuda()

    def step():
        yc = tc.causal_conv1d_update_triton(xc, conv_states=pool_c, weight=w, bias=b, state_indices=idx)
        ys = ts.ssd_state_update_triton(pool_s, **p, state_indices=idx)
        yp = ts.ssd_chunk_scan_triton(**p, chunk_size=8, query_start_loc=qsl, ssm_states=pool_s,
                                      state_indices=idx.flip(0), has_initial_state=init)
        return yc, ys, yp

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    saved = (pool_c.clone(), pool_s.clone())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    # new values in place, then replay == eager on the same inputs
    pool_c.copy_(saved[0])
    pool_s.copy_(saved[1])
    idx.copy_(torch.tensor([0, 7, 2]))
    xc.normal_()
    ref_c, ref_s = pool_c.clone(), pool_s.clone()
    graph.replay()
    torch.cuda.synchronize()
    yc = causal_conv1d_update_ref(xc, conv_states=ref_c, weight=w, bias=b, state_indices=idx)
    ys = ssd_state_update_ref(ref_s, **p, state_indices=idx)
    yp = ssd_chunk_scan_ref(**p, chunk_size=8, query_start_loc=qsl, ssm_states=ref_s, state_indices=idx.flip(0),
                            has_initial_state=init)
    for a, e in zip(outs, (yc, ys, yp), strict=True):
        _close(a, e)
    _close(pool_c, ref_c)
    _close(pool_s, ref_s)
