"""ssd_chunk_scan_ref / ssd_state_update_ref against a naive per-token recurrence, chunked-prefill and decode
equivalences, low-precision inputs, and a tiny HF Mamba2Mixer (conv + SSD + HF's gated norm)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref
from hybridkv.layers.ops.ssd_ref import ssd_chunk_scan_ref, ssd_state_update_ref
from tests._ssm_helpers import Batch, packed_batches


@dataclass
class Params:
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None


def make_params(
    n, nheads, headdim, ngroups, dstate, seed, *, use_d=True, use_z=False, use_bias=True
) -> Params:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    return Params(
        x=r(n, nheads, headdim),
        dt=r(n, nheads),
        A=-torch.exp(torch.rand(nheads, generator=g) * 3 - 1),  # -0.37 .. -7.4
        B=r(n, ngroups, dstate),
        C=r(n, ngroups, dstate),
        D=r(nheads) if use_d else None,
        z=r(n, nheads, headdim) if use_z else None,
        dt_bias=r(nheads) - 1 if use_bias else None,
    )


def naive_ssd(p: Params, pool, batch: Batch, dt_limit):
    """Per request, per token: h <- exp(dt A) h + dt x B^T; y = h C + D x (float64)."""
    pool = pool.double().clone()
    nheads = p.x.shape[1]
    rep = nheads // p.B.shape[1]
    ys, start = [], 0
    for n, slot, init in zip(batch.lens, batch.slots, batch.has_init, strict=True):
        h = pool[slot] if init else torch.zeros_like(pool[slot])
        for t in range(start, start + n):
            dt = p.dt[t].double() + (p.dt_bias.double() if p.dt_bias is not None else 0)
            dt = F.softplus(dt).clamp(*dt_limit)
            B = p.B[t].double().repeat_interleave(rep, 0)  # (nheads, dstate)
            C = p.C[t].double().repeat_interleave(rep, 0)
            x = p.x[t].double()  # (nheads, headdim)
            h = (
                torch.exp(dt * p.A.double())[:, None, None] * h
                + dt[:, None, None] * x[:, :, None] * B[:, None, :]
            )
            y = (h * C[:, None, :]).sum(-1)
            if p.D is not None:
                y = y + p.D.double()[:, None] * x
            if p.z is not None:
                y = y * F.silu(p.z[t].double())
            ys.append(y)
        pool[slot] = h
        start += n
    y = torch.stack(ys) if ys else p.x.new_zeros(p.x.shape).double()
    return y, pool


def run_scan(p: Params, pool, batch: Batch, chunk_size: int, dt_limit=(0.0, math.inf)):
    return ssd_chunk_scan_ref(
        p.x,
        p.dt,
        p.A,
        p.B,
        p.C,
        chunk_size=chunk_size,
        query_start_loc=batch.qsl,
        ssm_states=pool,
        state_indices=torch.tensor(batch.slots),
        has_initial_state=torch.tensor(batch.has_init),
        D=p.D,
        z=p.z,
        dt_bias=p.dt_bias,
        dt_limit=dt_limit,
    )


heads_groups = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (3, 3), (6, 2)])


@settings(max_examples=60, deadline=None)
@given(
    batch=packed_batches(),
    hg=heads_groups,
    headdim=st.integers(1, 4),
    dstate=st.integers(1, 5),
    chunk_size=st.sampled_from([1, 2, 3, 4, 8]),
    dt_limit=st.sampled_from([(0.0, math.inf), (0.05, 0.6)]),
    use_d=st.booleans(),
    use_z=st.booleans(),
    use_bias=st.booleans(),
)
def test_matches_naive_recurrence(batch, hg, headdim, dstate, chunk_size, dt_limit, use_d, use_z, use_bias):
    nheads, ngroups = hg
    p = make_params(
        sum(batch.lens),
        nheads,
        headdim,
        ngroups,
        dstate,
        batch.seed,
        use_d=use_d,
        use_z=use_z,
        use_bias=use_bias,
    )
    pool = torch.randn(batch.num_slots, nheads, headdim, dstate, generator=torch.Generator().manual_seed(1))
    for slot, init in zip(batch.slots, batch.has_init, strict=True):
        if not init:
            pool[slot] = float("nan")  # never read for a request without an initial state
    before = pool.clone()
    inputs = [t.clone() for t in (p.x, p.dt, p.B, p.C)]
    y = run_scan(p, pool, batch, chunk_size, dt_limit)
    y_ref, pool_ref = naive_ssd(p, before, batch, dt_limit)
    assert y.dtype == torch.float32 and y.shape == p.x.shape
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    for slot in range(batch.num_slots):
        if slot in batch.slots:
            torch.testing.assert_close(pool[slot], pool_ref[slot].float(), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(pool[slot], before[slot])
    assert all(torch.equal(a, b) for a, b in zip(inputs, (p.x, p.dt, p.B, p.C), strict=True))


def test_long_sequence_many_chunks() -> None:
    """Long requests (many chunks, strong decay) stay fp32-exact against the float64 recurrence."""
    batch = Batch([300, 77, 1, 129], [2, 0, 4, 1], [True, False, True, False], 5, seed=3)
    p = make_params(sum(batch.lens), 4, 8, 2, 16, batch.seed)
    pool = torch.randn(5, 4, 8, 16)
    before = pool.clone()
    y = run_scan(p, pool, batch, chunk_size=64)
    y_ref, pool_ref = naive_ssd(p, before, batch, (0.0, math.inf))
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref.float(), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    total=st.integers(1, 25),
    data=st.data(),
    chunk_size=st.sampled_from([2, 3, 4, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_prefill_equals_whole(total: int, data, chunk_size: int, seed: int) -> None:
    """Pieces carried through the slot (next to an unrelated request) == the whole sequence at once."""
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=4)) if total > 1 else set())
    bounds = [0, *cuts, total]
    nheads, headdim, ngroups, dstate = 4, 3, 2, 5
    p = make_params(total, nheads, headdim, ngroups, dstate, seed)
    other = make_params(3, nheads, headdim, ngroups, dstate, seed + 1)

    pool_whole = torch.zeros(3, nheads, headdim, dstate)
    y_whole = run_scan(p, pool_whole, Batch([total], [1], [False], 3, 0), chunk_size)
    pool = torch.full((3, nheads, headdim, dstate), float("nan"))
    pool[2] = 0.5
    pieces = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        piece = Params(
            torch.cat([other.x, p.x[a:b]]),
            torch.cat([other.dt, p.dt[a:b]]),
            p.A,
            torch.cat([other.B, p.B[a:b]]),
            torch.cat([other.C, p.C[a:b]]),
            p.D,
            None,
            p.dt_bias,
        )
        y = run_scan(piece, pool, Batch([3, b - a], [2, 1], [True, i > 0], 3, 0), chunk_size)
        pieces.append(y[3:])
    torch.testing.assert_close(torch.cat(pieces), y_whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[1], pool_whole[1], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    batch_size=st.integers(1, 5),
    spare=st.integers(0, 3),
    hg=heads_groups,
    use_z=st.booleans(),
    dt_limit=st.sampled_from([(0.0, math.inf), (0.05, 0.6)]),
    data=st.data(),
)
def test_state_update_equals_packed_one_token_requests(batch_size, spare, hg, use_z, dt_limit, data) -> None:
    nheads, ngroups = hg
    num_slots = batch_size + spare
    slots = data.draw(st.permutations(range(num_slots)))[:batch_size]
    p = make_params(batch_size, nheads, 3, ngroups, 4, data.draw(st.integers(0, 2**31 - 1)), use_z=use_z)
    pool_a = torch.randn(num_slots, nheads, 3, 4)
    pool_b = pool_a.clone()
    y_a = ssd_state_update_ref(
        pool_a,
        p.x,
        p.dt,
        p.A,
        p.B,
        p.C,
        state_indices=torch.tensor(slots),
        D=p.D,
        z=p.z,
        dt_bias=p.dt_bias,
        dt_limit=dt_limit,
    )
    y_b = run_scan(p, pool_b, Batch([1] * batch_size, slots, [True] * batch_size, num_slots, 0), 4, dt_limit)
    # fp32's default tolerances: the two paths sum in other orders (1.4e-6 apart on a 0.066 output was seen)
    torch.testing.assert_close(y_a, y_b)
    torch.testing.assert_close(pool_a, pool_b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_fp32_state(dtype: torch.dtype) -> None:
    batch = Batch([13, 1, 6, 20], [0, 3, 1, 4], [False, True, True, False], 5, seed=11)
    p = make_params(sum(batch.lens), 4, 8, 2, 8, batch.seed, use_z=True)
    pool32 = torch.randn(5, 4, 8, 8)
    pool16 = pool32.clone()
    y32 = run_scan(p, pool32, batch, 8)
    p16 = Params(*(t.to(dtype) if t is not None and t is not p.A else t for t in vars(p).values()))
    y16 = run_scan(p16, pool16, batch, 8)
    assert y16.dtype == dtype and pool16.dtype == torch.float32
    torch.testing.assert_close(y16.float(), y32, rtol=5e-2, atol=1e-1)
    torch.testing.assert_close(pool16, pool32, rtol=5e-2, atol=5e-2)
    y16_step = ssd_state_update_ref(
        pool16,
        p16.x[:2],
        p16.dt[:2],
        p.A,
        p16.B[:2],
        p16.C[:2],
        state_indices=torch.tensor([0, 1]),
        D=p16.D,
        dt_bias=p16.dt_bias,
    )
    assert y16_step.dtype == dtype and pool16.dtype == torch.float32


def test_shape_errors_name_the_argument() -> None:
    p = make_params(6, 4, 3, 2, 5, 0)
    ok = dict(
        chunk_size=4,
        query_start_loc=torch.tensor([0, 6]),
        ssm_states=torch.zeros(2, 4, 3, 5),
        state_indices=torch.tensor([0]),
        has_initial_state=torch.tensor([False]),
    )
    for name, bad in [("dt", p.dt[:, :3]), ("A", p.A[:3]), ("B", p.B[:, :, :4]), ("C", p.C[:5])]:
        args = dict(x=p.x, dt=p.dt, A=p.A, B=p.B, C=p.C) | {name: bad}
        with pytest.raises(ValueError, match=name):
            ssd_chunk_scan_ref(*args.values(), **ok)
    with pytest.raises(ValueError, match="divide"):
        ssd_chunk_scan_ref(p.x, p.dt, p.A, torch.randn(6, 3, 5), torch.randn(6, 3, 5), **ok)
    with pytest.raises(ValueError, match="ssm_states"):
        ssd_chunk_scan_ref(p.x, p.dt, p.A, p.B, p.C, **(ok | dict(ssm_states=torch.zeros(2, 4, 2, 5))))
    with pytest.raises(ValueError, match="D"):
        ssd_chunk_scan_ref(p.x, p.dt, p.A, p.B, p.C, **ok, D=torch.randn(3))
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunk_scan_ref(p.x, p.dt, p.A, p.B, p.C, **(ok | dict(chunk_size=0)))
    with pytest.raises(ValueError, match="state_indices"):
        ssd_state_update_ref(
            torch.zeros(2, 4, 3, 5),
            p.x[:2],
            p.dt[:2],
            p.A,
            p.B[:2],
            p.C[:2],
            state_indices=torch.tensor([0, 2]),
        )


def test_matches_hf_mamba2_mixer() -> None:
    """A tiny HF Mamba2Mixer (fp32, non-trivial A_log, D, dt_bias, dt clamp): prefill then two decode steps.

    Our conv + SSD + HF's own gated RMSNorm and projections reproduce its outputs and cached states.
    """
    from transformers import DynamicCache, Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    cfg = Mamba2Config(
        hidden_size=16,
        num_heads=4,
        head_dim=8,
        expand=2,
        n_groups=2,
        state_size=8,
        conv_kernel=4,
        chunk_size=8,
        num_hidden_layers=1,
        vocab_size=32,
        use_conv_bias=True,
    )
    mixer = Mamba2Mixer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        mixer.A_log.copy_(torch.randn(4))
        mixer.D.copy_(torch.randn(4))
        mixer.dt_bias.copy_(torch.randn(4) - 1)
        mixer.norm.weight.copy_(torch.rand(32) + 0.5)
    seq = 21  # not a multiple of chunk_size
    hidden = torch.randn(1, seq + 2, 16)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        hf_prefill = mixer(hidden[:, :seq], cache_params=cache)[0]
        hf_prefill_state = cache.get_recurrent_state(0)[0].clone()
        hf_steps = [mixer(hidden[:, t : t + 1], cache_params=cache)[0, 0] for t in (seq, seq + 1)]

    inter, conv_dim, nheads, headdim, dstate = 32, 32 + 2 * 2 * 8, 4, 8, 8
    A = -torch.exp(mixer.A_log.float())
    conv_pool = torch.zeros(3, conv_dim, 3)
    ssm_pool = torch.zeros(3, nheads, headdim, dstate)
    slot = torch.tensor([2])

    def mix(h: torch.Tensor, decode: bool) -> torch.Tensor:
        gate, xbc, dt = mixer.in_proj(h).split([inter, conv_dim, nheads], dim=-1)
        if decode:
            xbc = causal_conv1d_update_ref(
                xbc,
                conv_states=conv_pool,
                weight=mixer.conv1d.weight[:, 0],
                bias=mixer.conv1d.bias,
                state_indices=slot,
            )
        else:
            xbc = causal_conv1d_ref(
                xbc,
                mixer.conv1d.weight[:, 0],
                mixer.conv1d.bias,
                conv_states=conv_pool,
                query_start_loc=torch.tensor([0, len(h)]),
                state_indices=slot,
                has_initial_state=torch.tensor([False]),
            )
        x, B, C = xbc.split([inter, 16, 16], dim=-1)
        n = len(h)
        args = (x.view(n, nheads, headdim), dt, A, B.view(n, 2, dstate), C.view(n, 2, dstate))
        kw = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_limit=tuple(cfg.time_step_limit))
        if decode:
            y = ssd_state_update_ref(ssm_pool, *args, state_indices=slot, **kw)
        else:
            y = ssd_chunk_scan_ref(
                *args,
                chunk_size=cfg.chunk_size,
                query_start_loc=torch.tensor([0, n]),
                ssm_states=ssm_pool,
                state_indices=slot,
                has_initial_state=torch.tensor([False]),
                **kw,
            )
        return mixer.out_proj(mixer.norm(y.reshape(n, inter), gate))

    with torch.no_grad():
        ours_prefill = mix(hidden[0, :seq], decode=False)
        torch.testing.assert_close(ssm_pool[2], hf_prefill_state, rtol=1e-5, atol=1e-5)
        ours_steps = [mix(hidden[0, t : t + 1], decode=True)[0] for t in (seq, seq + 1)]
    torch.testing.assert_close(ours_prefill, hf_prefill, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(ours_steps), torch.stack(hf_steps), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm_pool[2], cache.get_recurrent_state(0)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_pool[2], cache.get_conv_state(0)[0, :, 1:], rtol=0, atol=0)


def test_hf_chunk_scan_clamps_dt() -> None:
    """HF's chunked path clamps dt to time_step_limit after softplus; so do we."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    p = make_params(11, 4, 3, 2, 5, seed=5)
    limit = (0.05, 0.3)
    hf_y, hf_state = mamba2_chunk_scan(
        p.x[None],
        p.dt[None],
        p.A,
        p.B[None],
        p.C[None],
        chunk_size=4,
        D=p.D,
        dt_bias=p.dt_bias,
        dt_softplus=True,
        dt_limit=limit,
        return_final_states=True,
    )
    pool = torch.zeros(1, 4, 3, 5)
    y = run_scan(p, pool, Batch([11], [0], [False], 1, 0), 4, limit)
    torch.testing.assert_close(y, hf_y[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[0], hf_state[0], rtol=1e-5, atol=1e-5)
