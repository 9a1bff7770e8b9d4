"""selective_scan_ref / selective_state_update_mamba1_ref (Mamba-1, Jamba) against a naive per-token loop,
chunked-prefill and decode equivalences, low-precision inputs, and a tiny HF JambaMambaMixer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref
from hybridkv.layers.ops.selective_scan_ref import selective_scan_ref, selective_state_update_mamba1_ref
from tests._ssm_helpers import Batch, packed_batches


@dataclass
class Params:
    u: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    delta_bias: torch.Tensor | None


def make_params(n, dim, dstate, seed, *, use_d=True, use_z=True, use_bias=True) -> Params:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    return Params(
        u=r(n, dim),
        delta=r(n, dim),
        A=-torch.exp(torch.rand(dim, dstate, generator=g) * 3 - 1),
        B=r(n, dstate),
        C=r(n, dstate),
        D=r(dim) if use_d else None,
        z=r(n, dim) if use_z else None,
        delta_bias=r(dim) - 1 if use_bias else None,
    )


def naive_scan(p: Params, pool, batch: Batch):
    """Per request, per token: h <- exp(delta A) h + delta u B; y = h C + D u; y *= silu(z) (float64)."""
    pool = pool.double().clone()
    ys, start = [], 0
    for n, slot, init in zip(batch.lens, batch.slots, batch.has_init, strict=True):
        h = pool[slot] if init else torch.zeros_like(pool[slot])  # (dim, dstate)
        for t in range(start, start + n):
            delta = p.delta[t].double() + (p.delta_bias.double() if p.delta_bias is not None else 0)
            delta = F.softplus(delta)
            u = p.u[t].double()
            h = torch.exp(delta[:, None] * p.A.double()) * h + (delta * u)[:, None] * p.B[t].double()[None, :]
            y = h @ p.C[t].double()
            if p.D is not None:
                y = y + p.D.double() * u
            if p.z is not None:
                y = y * F.silu(p.z[t].double())
            ys.append(y)
        pool[slot] = h
        start += n
    y = torch.stack(ys) if ys else p.u.new_zeros(p.u.shape).double()
    return y, pool


def run_scan(p: Params, pool, batch: Batch):
    return selective_scan_ref(
        p.u,
        p.delta,
        p.A,
        p.B,
        p.C,
        query_start_loc=batch.qsl,
        ssm_states=pool,
        state_indices=torch.tensor(batch.slots),
        has_initial_state=torch.tensor(batch.has_init),
        D=p.D,
        z=p.z,
        delta_bias=p.delta_bias,
    )


@settings(max_examples=60, deadline=None)
@given(
    batch=packed_batches(max_reqs=4, max_len=15),
    dim=st.integers(1, 6),
    dstate=st.integers(1, 5),
    use_d=st.booleans(),
    use_z=st.booleans(),
    use_bias=st.booleans(),
)
def test_matches_naive_recurrence(batch: Batch, dim: int, dstate: int, use_d, use_z, use_bias) -> None:
    p = make_params(sum(batch.lens), dim, dstate, batch.seed, use_d=use_d, use_z=use_z, use_bias=use_bias)
    pool = torch.randn(batch.num_slots, dim, dstate, generator=torch.Generator().manual_seed(2))
    for slot, init in zip(batch.slots, batch.has_init, strict=True):
        if not init:
            pool[slot] = float("nan")
    before = pool.clone()
    inputs = [t.clone() for t in (p.u, p.delta, p.B, p.C)]
    y = run_scan(p, pool, batch)
    y_ref, pool_ref = naive_scan(p, before, batch)
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)
    for slot in range(batch.num_slots):
        if slot in batch.slots:
            torch.testing.assert_close(pool[slot], pool_ref[slot].float(), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(pool[slot], before[slot])
    assert all(torch.equal(a, b) for a, b in zip(inputs, (p.u, p.delta, p.B, p.C), strict=True))


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 20), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_chunked_prefill_equals_whole(total: int, data, seed: int) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, total - 1), max_size=4)) if total > 1 else set())
    bounds = [0, *cuts, total]
    dim, dstate = 5, 4
    p = make_params(total, dim, dstate, seed)
    other = make_params(2, dim, dstate, seed + 1)
    pool_whole = torch.zeros(3, dim, dstate)
    y_whole = run_scan(p, pool_whole, Batch([total], [0], [False], 3, 0))
    pool = torch.full((3, dim, dstate), float("nan"))
    pool[1] = 0.25
    pieces = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        piece = Params(
            torch.cat([other.u, p.u[a:b]]),
            torch.cat([other.delta, p.delta[a:b]]),
            p.A,
            torch.cat([other.B, p.B[a:b]]),
            torch.cat([other.C, p.C[a:b]]),
            p.D,
            torch.cat([other.z, p.z[a:b]]),
            p.delta_bias,
        )
        y = run_scan(piece, pool, Batch([2, b - a], [1, 0], [True, i > 0], 3, 0))
        pieces.append(y[2:])
    torch.testing.assert_close(torch.cat(pieces), y_whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[0], pool_whole[0], rtol=1e-6, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(batch_size=st.integers(1, 5), spare=st.integers(0, 3), use_z=st.booleans(), data=st.data())
def test_state_update_equals_packed_one_token_requests(
    batch_size: int, spare: int, use_z: bool, data
) -> None:
    num_slots = batch_size + spare
    slots = data.draw(st.permutations(range(num_slots)))[:batch_size]
    p = make_params(batch_size, 4, 3, data.draw(st.integers(0, 2**31 - 1)), use_z=use_z)
    pool_a = torch.randn(num_slots, 4, 3)
    pool_b = pool_a.clone()
    y_a = selective_state_update_mamba1_ref(
        pool_a,
        p.u,
        p.delta,
        p.A,
        p.B,
        p.C,
        state_indices=torch.tensor(slots),
        D=p.D,
        z=p.z,
        dt_bias=p.delta_bias,
    )
    y_b = run_scan(p, pool_b, Batch([1] * batch_size, slots, [True] * batch_size, num_slots, 0))
    torch.testing.assert_close(y_a, y_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool_a, pool_b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_fp32_state(dtype: torch.dtype) -> None:
    batch = Batch([9, 1, 14], [2, 0, 3], [True, True, False], 4, seed=4)
    p = make_params(sum(batch.lens), 8, 6, batch.seed)
    pool32 = torch.randn(4, 8, 6)
    pool16 = pool32.clone()
    y32 = run_scan(p, pool32, batch)
    p16 = Params(*(t.to(dtype) if t is not p.A else t for t in vars(p).values()))
    y16 = run_scan(p16, pool16, batch)
    assert y16.dtype == dtype and pool16.dtype == torch.float32
    torch.testing.assert_close(y16.float(), y32, rtol=5e-2, atol=1e-1)
    torch.testing.assert_close(pool16, pool32, rtol=5e-2, atol=5e-2)


def test_shape_errors_name_the_argument() -> None:
    p = make_params(6, 4, 3, 0)
    ok = dict(
        query_start_loc=torch.tensor([0, 6]),
        ssm_states=torch.zeros(2, 4, 3),
        state_indices=torch.tensor([0]),
        has_initial_state=torch.tensor([False]),
    )
    for name, bad in [("delta", p.delta[:, :3]), ("A", p.A[:3]), ("B", p.B[:, :2]), ("C", p.C[:5])]:
        args = dict(u=p.u, delta=p.delta, A=p.A, B=p.B, C=p.C) | {name: bad}
        with pytest.raises(ValueError, match=name):
            selective_scan_ref(*args.values(), **ok)
    with pytest.raises(ValueError, match="ssm_states"):
        selective_scan_ref(p.u, p.delta, p.A, p.B, p.C, **(ok | dict(ssm_states=torch.zeros(2, 4, 2))))
    with pytest.raises(ValueError, match="z"):
        selective_scan_ref(p.u, p.delta, p.A, p.B, p.C, **ok, z=p.z[:, :2])
    with pytest.raises(ValueError, match="dt_bias"):
        selective_state_update_mamba1_ref(
            torch.zeros(2, 4, 3),
            p.u[:1],
            p.delta[:1],
            p.A,
            p.B[:1],
            p.C[:1],
            state_indices=torch.tensor([0]),
            dt_bias=torch.zeros(3),
        )


def test_matches_hf_jamba_mamba_mixer() -> None:
    """A tiny HF JambaMambaMixer (fp32, random A_log, D, dt bias): prefill then two decode steps.

    Our conv + selective scan (with HF's x_proj, dt/B/C RMSNorms, dt_proj and out_proj applied around them)
    reproduce its outputs and cached states. HF's multi-token path always starts from a zero state, so the
    prefill is a fresh request; continuation goes through its decode path.
    """
    from transformers import DynamicCache, JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    torch.manual_seed(0)
    cfg = JambaConfig(
        hidden_size=16,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=3,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=32,
        num_experts=1,
    )
    mixer = JambaMambaMixer(cfg, layer_idx=0).float().eval()
    dim, dstate = 32, 4
    with torch.no_grad():
        mixer.A_log.copy_(torch.randn(dim, dstate))
        mixer.D.copy_(torch.randn(dim))
        mixer.dt_proj.bias.copy_(torch.randn(dim) - 1)
    seq = 11
    hidden = torch.randn(1, seq + 2, 16)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        hf_prefill = mixer(hidden[:, :seq], cache_params=cache)[0]
        hf_prefill_state = cache.get_recurrent_state(0)[0].clone()
        hf_steps = [mixer(hidden[:, t : t + 1], cache_params=cache)[0, 0] for t in (seq, seq + 1)]

    A = -torch.exp(mixer.A_log.float())
    conv_pool = torch.zeros(2, dim, 3)
    ssm_pool = torch.zeros(2, dim, dstate)
    slot = torch.tensor([1])

    def mix(h: torch.Tensor, decode: bool) -> torch.Tensor:
        x, gate = mixer.in_proj(h).chunk(2, dim=-1)
        if decode:
            x = causal_conv1d_update_ref(
                x,
                conv_states=conv_pool,
                weight=mixer.conv1d.weight[:, 0],
                bias=mixer.conv1d.bias,
                state_indices=slot,
            )
        else:
            x = causal_conv1d_ref(
                x,
                mixer.conv1d.weight[:, 0],
                mixer.conv1d.bias,
                conv_states=conv_pool,
                query_start_loc=torch.tensor([0, len(h)]),
                state_indices=slot,
                has_initial_state=torch.tensor([False]),
            )
        dt, B, C = mixer.x_proj(x).split([cfg.mamba_dt_rank, dstate, dstate], dim=-1)
        dt = mixer.dt_layernorm(dt) @ mixer.dt_proj.weight.T  # bias goes in as delta_bias, as in HF
        B, C = mixer.b_layernorm(B), mixer.c_layernorm(C)
        if decode:
            y = selective_state_update_mamba1_ref(
                ssm_pool, x, dt, A, B, C, state_indices=slot, D=mixer.D, z=gate, dt_bias=mixer.dt_proj.bias
            )
        else:
            y = selective_scan_ref(
                x,
                dt,
                A,
                B,
                C,
                query_start_loc=torch.tensor([0, len(h)]),
                ssm_states=ssm_pool,
                state_indices=slot,
                has_initial_state=torch.tensor([False]),
                D=mixer.D,
                z=gate,
                delta_bias=mixer.dt_proj.bias,
            )
        return mixer.out_proj(y)

    with torch.no_grad():
        ours_prefill = mix(hidden[0, :seq], decode=False)
        torch.testing.assert_close(ssm_pool[1], hf_prefill_state, rtol=1e-5, atol=1e-5)
        ours_steps = [mix(hidden[0, t : t + 1], decode=True)[0] for t in (seq, seq + 1)]
    torch.testing.assert_close(ours_prefill, hf_prefill, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(ours_steps), torch.stack(hf_steps), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm_pool[1], cache.get_recurrent_state(0)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_pool[1], cache.get_conv_state(0)[0, :, 1:], rtol=0, atol=0)
