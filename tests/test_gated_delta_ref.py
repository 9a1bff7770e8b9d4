"""Gated delta rule and KDA references: the chunked form against the per-token loop in fp64 on packed batches,
decode updates against one step of the loop, chunked prefill + decode == one pass, stability under fast decays,
HF transformers' own torch functions (Qwen3-Next's gated delta rule, Kimi-Linear's KDA and its forget gate) on
single sequences, and clear errors for bad input."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.gated_delta_ref import (
    gated_delta_rule_naive_ref,
    gated_delta_rule_ref,
    gated_delta_rule_update_ref,
    kda_naive_ref,
    kda_ref,
    kda_update_ref,
)
from tests._ssm_helpers import Batch, packed_batches

NAN = float("nan")
CHUNKED = {"gdn": gated_delta_rule_ref, "kda": kda_ref}
NAIVE = {"gdn": gated_delta_rule_naive_ref, "kda": kda_naive_ref}
UPDATE = {"gdn": gated_delta_rule_update_ref, "kda": kda_update_ref}


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta

    def rows(self, a: int, b: int) -> Inputs:
        return Inputs(self.q[a:b], self.k[a:b], self.v[a:b], self.g[a:b], self.beta[a:b], self.A_log, self.dt_bias)


def make_inputs(n: int, kind: str, num_k_heads: int, num_v_heads: int, dk: int, dv: int, seed: int, *,
                gate: bool = False, dtype: torch.dtype = torch.float64, beta_max: float = 1.0) -> Inputs:
    """Random q/k/v; g a log decay in (-1, 0] (or a raw gate input with A_log / dt_bias); beta in [0, beta_max]
    (2: OLMo-Hybrid's negative eigenvalues)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    g_shape = (n, num_v_heads, dk) if kind == "kda" else (n, num_v_heads)
    g = r(*g_shape) if gate else -torch.rand(*g_shape, generator=gen, dtype=dtype)
    return Inputs(
        q=r(n, num_k_heads, dk), k=r(n, num_k_heads, dk), v=r(n, num_v_heads, dv), g=g,
        beta=torch.rand(n, num_v_heads, generator=gen, dtype=dtype) * beta_max,
        A_log=r(num_v_heads) if gate else None,
        dt_bias=r(*g_shape[1:]) if gate else None,
    )


def run(fn, p: Inputs, pool: torch.Tensor, batch: Batch, **kw) -> torch.Tensor:
    return fn(*p.args(), query_start_loc=batch.qsl, ssm_states=pool, state_indices=torch.tensor(batch.slots),
              has_initial_state=torch.tensor(batch.has_init), A_log=p.A_log, dt_bias=p.dt_bias, **kw)


def fresh_pool(batch: Batch, shape: tuple[int, ...], seed: int, dtype=torch.float64) -> torch.Tensor:
    """Random slots; NaN in the slots of requests without an initial state (they must never be read)."""
    pool = torch.randn(batch.num_slots, *shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    for slot, init in zip(batch.slots, batch.has_init, strict=True):
        if not init:
            pool[slot] = NAN
    return pool


heads = st.sampled_from([(1, 1), (2, 2), (1, 2), (2, 4), (1, 3)])       # (q/k heads, value heads)


@settings(max_examples=40, deadline=None)
@given(batch=packed_batches(max_len=21), kind=st.sampled_from(["gdn", "kda"]), hv=heads, dk=st.integers(1, 5),
       dv=st.integers(1, 4), chunk_size=st.sampled_from([1, 3, 4, 8, 64]), l2=st.booleans(), gate=st.booleans(),
       scale=st.sampled_from([None, 0.7]), beta_max=st.sampled_from([1.0, 2.0]))
def test_chunked_matches_naive_loop_fp64(batch, kind, hv, dk, dv, chunk_size, l2, gate, scale, beta_max):
    """Packed requests of mixed lengths (0, 1, chunk multiples and not), shuffled and spare slots, some fresh."""
    num_k_heads, num_v_heads = hv
    p = make_inputs(sum(batch.lens), kind, num_k_heads, num_v_heads, dk, dv, batch.seed, gate=gate,
                    beta_max=beta_max)
    pool = fresh_pool(batch, (num_v_heads, dk, dv), batch.seed + 1)
    before = pool.clone()
    inputs = [t.clone() for t in p.args()]
    pool_naive = pool.clone()
    y = run(CHUNKED[kind], p, pool, batch, chunk_size=chunk_size, use_qk_l2norm=l2, scale=scale)
    y_naive = run(NAIVE[kind], p, pool_naive, batch, use_qk_l2norm=l2, scale=scale)
    assert y.dtype == torch.float64 and y.shape == p.v.shape
    torch.testing.assert_close(y, y_naive, rtol=1e-9, atol=1e-9)
    for slot in range(batch.num_slots):
        if slot in batch.slots:
            assert torch.isfinite(pool[slot]).all()
            torch.testing.assert_close(pool[slot], pool_naive[slot], rtol=1e-9, atol=1e-9)
        else:
            torch.testing.assert_close(pool[slot], before[slot], rtol=0, atol=0, equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(inputs, p.args(), strict=True))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_long_requests_fp32_against_fp64_loop(kind):
    """Several chunks of 64 per request (130, 64, 1 tokens), fp32 math against the fp64 loop."""
    batch = Batch([130, 64, 1], [2, 0, 3], [True, False, True], 4, seed=3)
    p = make_inputs(sum(batch.lens), kind, 2, 4, 16, 8, batch.seed)
    pool = fresh_pool(batch, (4, 16, 8), 5)
    pool_naive = pool.clone()
    p32 = Inputs(*(t.float() for t in p.args()), None, None)
    pool32 = pool.float()
    y = run(CHUNKED[kind], p32, pool32, batch, use_qk_l2norm=True)
    y_naive = run(NAIVE[kind], p, pool_naive, batch, use_qk_l2norm=True)
    assert y.dtype == torch.float32 and pool32.dtype == torch.float32
    torch.testing.assert_close(y, y_naive.float(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool32[batch.slots], pool_naive[batch.slots].float(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fast_decay_stays_finite(kind):
    """Log decays of -30 per token (exp(+cumulative) would overflow fp32 within a chunk): the pairwise decays are
    differences, so the chunked form stays finite and equal to the loop."""
    batch = Batch([70, 5], [0, 1], [True, True], 2, seed=4)
    p = make_inputs(75, kind, 1, 2, 4, 3, 4, dtype=torch.float32)
    p.g = p.g * 30.0
    pool = torch.randn(2, 2, 4, 3)
    pool_naive = pool.clone()
    y = run(CHUNKED[kind], p, pool, batch, use_qk_l2norm=True)
    y_naive = run(NAIVE[kind], p, pool_naive, batch, use_qk_l2norm=True)
    assert torch.isfinite(y).all() and torch.isfinite(pool).all()
    torch.testing.assert_close(y, y_naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_naive, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["gdn", "kda"]), batch_size=st.integers(1, 5), spare=st.integers(0, 3), hv=heads,
       gate=st.booleans(), l2=st.booleans(), data=st.data())
def test_update_is_one_step_of_the_loop(kind, batch_size, spare, hv, gate, l2, data):
    num_k_heads, num_v_heads = hv
    num_slots = batch_size + spare
    slots = data.draw(st.permutations(range(num_slots)))[:batch_size]
    seed = data.draw(st.integers(0, 2**31 - 1))
    p = make_inputs(batch_size, kind, num_k_heads, num_v_heads, 3, 2, seed, gate=gate)
    pool = torch.randn(num_slots, num_v_heads, 3, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pool_naive = pool.clone()
    y = UPDATE[kind](pool, *p.args(), state_indices=torch.tensor(slots), use_qk_l2norm=l2, A_log=p.A_log,
                     dt_bias=p.dt_bias)
    batch = Batch([1] * batch_size, slots, [True] * batch_size, num_slots, 0)
    y_naive = run(NAIVE[kind], p, pool_naive, batch, use_qk_l2norm=l2)
    torch.testing.assert_close(y, y_naive, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pool, pool_naive, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("cuts", [(1,), (5, 6, 20), (64,), (3, 67)])
def test_chunked_prefill_then_decode_equals_one_pass(kind, cuts):
    """A request fed as prefill pieces (next to an unrelated request) and then decode steps, its state carried in
    its slot, equals one pass over the whole sequence."""
    total, decode = 80, 4
    p = make_inputs(total + decode, kind, 1, 2, 4, 3, 11, gate=True)
    other = make_inputs(3, kind, 1, 2, 4, 3, 12, gate=True)
    other.A_log, other.dt_bias = p.A_log, p.dt_bias
    pool_whole = torch.zeros(3, 2, 4, 3, dtype=torch.float64)
    y_whole = run(CHUNKED[kind], p, pool_whole, Batch([total + decode], [1], [False], 3, 0), chunk_size=16)
    pool = torch.full_like(pool_whole, NAN)
    pool[2] = 0.5
    bounds = [0, *cuts, total]
    pieces = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        both = Inputs(*(torch.cat([o, t]) for o, t in zip(other.args(), p.rows(a, b).args(), strict=True)),
                      p.A_log, p.dt_bias)
        y = run(CHUNKED[kind], both, pool, Batch([3, b - a], [2, 1], [True, i > 0], 3, 0), chunk_size=16)
        pieces.append(y[3:])
    for t in range(total, total + decode):
        tok = p.rows(t, t + 1)
        pieces.append(UPDATE[kind](pool, *tok.args(), state_indices=torch.tensor([1]), A_log=p.A_log,
                                   dt_bias=p.dt_bias))
    torch.testing.assert_close(torch.cat(pieces), y_whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pool[1], pool_whole[1], rtol=1e-10, atol=1e-10)


def test_low_precision_inputs_keep_fp32_state():
    batch = Batch([9, 1], [1, 0], [True, False], 2, seed=0)
    p = make_inputs(10, "gdn", 1, 2, 8, 4, 0, dtype=torch.float32)
    pb = Inputs(*(t.bfloat16() for t in p.args()), None, None)
    pool = torch.randn(2, 2, 8, 4)
    ref_pool = pool.clone()
    y = run(gated_delta_rule_ref, pb, pool, batch, use_qk_l2norm=True)
    y_ref = run(gated_delta_rule_ref, Inputs(*(t.float() for t in pb.args()), None, None), ref_pool, batch,
                use_qk_l2norm=True)
    assert y.dtype == torch.bfloat16 and pool.dtype == torch.float32
    torch.testing.assert_close(y.float(), y_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(pool, ref_pool)                  # the math is fp32 from the bf16 values


# ------------------------------------------------------------------------------------------ HF transformers


def _hf(module: str):
    return pytest.importorskip(f"transformers.models.{module}", reason="transformers without this model")


@pytest.mark.parametrize(("length", "num_k_heads", "num_v_heads", "l2"),
                         [(1, 2, 2, True), (70, 2, 4, True), (64, 1, 3, False), (129, 2, 2, True)])
def test_gated_delta_rule_matches_hf(length, num_k_heads, num_v_heads, l2):
    """HF's torch_chunk_gated_delta_rule (prefill, chunk 64) and torch_recurrent_gated_delta_rule (decode) on one
    sequence with an initial state, value heads sharing q/k heads: same outputs and final states."""
    hf = _hf("qwen3_next.modeling_qwen3_next")
    p = make_inputs(length + 1, "gdn", num_k_heads, num_v_heads, 16, 8, length, dtype=torch.float32)
    if not l2:                  # unit keys from the caller (the delta rule diverges for |k| > sqrt(2 / beta))
        p.k = F.normalize(p.k, dim=-1)
    s0 = torch.randn(1, num_v_heads, 16, 8, generator=torch.Generator().manual_seed(1))
    pre = p.rows(0, length)
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(*(t[None] for t in pre.args()), initial_state=s0.clone(),
                                                 output_final_state=True, use_qk_l2norm_in_kernel=l2)
    pool = torch.full((3, num_v_heads, 16, 8), NAN)
    pool[2] = s0[0]
    o = run(gated_delta_rule_ref, pre, pool, Batch([length], [2], [True], 3, 0), use_qk_l2norm=l2)
    torch.testing.assert_close(o, o_hf[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool[2], s_hf[0], rtol=2e-5, atol=2e-5)
    tok = p.rows(length, length + 1)
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(*(t[None] for t in tok.args()), initial_state=s_hf,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o = gated_delta_rule_update_ref(pool, *tok.args(), state_indices=torch.tensor([2]), use_qk_l2norm=l2)
    torch.testing.assert_close(o, o_hf[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool[2], s_hf[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("length", [1, 70])
def test_kda_matches_hf(length):
    """HF's chunk_kimi_delta_attention / recurrent_kimi_delta_attention, with the decay from HF's
    KimiLinearForgetGate (our in-op gate from the same raw projection, A_log and dt_bias)."""
    hf = _hf("kimi_linear.modeling_kimi_linear")
    heads, dk, hidden = 2, 16, 24
    config = type("Cfg", (), {"linear_head_dim": dk, "linear_num_heads": heads, "hidden_size": hidden})()
    torch.manual_seed(0)
    gate = hf.KimiLinearForgetGate(config)
    with torch.no_grad():
        gate.dt_bias.normal_()
        gate.A_log.normal_()
        h = torch.randn(1, length + 1, hidden)
        g_hf = gate(h)[0]                                                      # (length + 1, heads, dk)
        raw = gate.f_b_proj(gate.f_a_proj(h))[0].view(length + 1, heads, dk)
    p = make_inputs(length + 1, "kda", heads, heads, dk, 8, length, dtype=torch.float32)
    p.g = g_hf
    s0 = torch.randn(1, heads, dk, 8)
    pre = p.rows(0, length)
    o_hf, s_hf = hf.chunk_kimi_delta_attention(*(t[None] for t in pre.args()), initial_state=s0.clone(),
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    for in_op in (False, True):
        pool = torch.full((2, heads, dk, 8), NAN)
        pool[1] = s0[0]
        args = (pre.q, pre.k, pre.v, raw[:length], pre.beta) if in_op else pre.args()
        gate_kw = dict(A_log=gate.A_log.detach().view(heads), dt_bias=gate.dt_bias.detach().view(heads, dk)) \
            if in_op else {}
        o = kda_ref(*args, query_start_loc=torch.tensor([0, length]), ssm_states=pool,
                    state_indices=torch.tensor([1]), has_initial_state=torch.tensor([True]), use_qk_l2norm=True,
                    **gate_kw)
        torch.testing.assert_close(o, o_hf[0], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(pool[1], s_hf[0], rtol=2e-5, atol=2e-5)
    tok = p.rows(length, length + 1)
    o_hf, s_next = hf.recurrent_kimi_delta_attention(*(t[None] for t in tok.args()), initial_state=s_hf,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o = kda_update_ref(pool, tok.q, tok.k, tok.v, raw[length:], tok.beta, state_indices=torch.tensor([1]),
                       use_qk_l2norm=True, **gate_kw)
    torch.testing.assert_close(o, o_hf[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(pool[1], s_next[0], rtol=2e-5, atol=2e-5)


def test_in_op_gate_is_qwen3_next_decay():
    """The gated delta rule's in-op gate is Qwen3-Next's ``-exp(A_log) * softplus(a + dt_bias)``."""
    p = make_inputs(7, "gdn", 1, 2, 4, 3, 0, gate=True, dtype=torch.float32)
    g = -p.A_log.exp() * F.softplus(p.g + p.dt_bias)
    batch = Batch([7], [0], [False], 1, 0)
    y1 = run(gated_delta_rule_ref, p, torch.zeros(1, 2, 4, 3), batch)
    y2 = run(gated_delta_rule_ref, Inputs(p.q, p.k, p.v, g, p.beta, None, None), torch.zeros(1, 2, 4, 3), batch)
    torch.testing.assert_close(y1, y2)


# ------------------------------------------------------------------------------------------ errors


def test_bad_inputs_are_clear_errors():
    p = make_inputs(5, "gdn", 2, 4, 3, 2, 0)
    pk = make_inputs(5, "kda", 2, 4, 3, 2, 0)
    pool = torch.zeros(3, 4, 3, 2, dtype=torch.float64)
    kw = dict(query_start_loc=torch.tensor([0, 2, 5]), ssm_states=pool, state_indices=torch.tensor([0, 2]),
              has_initial_state=torch.tensor([True, False]))
    cases = [
        (gated_delta_rule_ref, dict(k=p.k[:, :1]), "k has shape"),
        (gated_delta_rule_ref, dict(v=torch.zeros(5, 3, 2)), "must divide v's 3 heads"),
        (gated_delta_rule_ref, dict(g=pk.g), r"g has shape \(5, 4, 3\), expected \(5, 4\)"),
        (kda_ref, dict(g=p.g), r"g has shape \(5, 4\), expected \(5, 4, 3\)"),
        (gated_delta_rule_ref, dict(beta=p.beta[:, :1]), "beta has shape"),
        (gated_delta_rule_ref, dict(ssm_states=torch.zeros(3, 4, 2, 3)), "ssm_states has shape"),
        (gated_delta_rule_ref, dict(dt_bias=torch.zeros(4)), "dt_bias is only used with A_log"),
        (kda_ref, dict(A_log=torch.zeros(4), dt_bias=torch.zeros(4)), "dt_bias has shape"),
        (gated_delta_rule_ref, dict(state_indices=torch.tensor([0, 0])), "distinct"),
        (gated_delta_rule_ref, dict(state_indices=torch.tensor([0, 3])), "lie in"),
        (gated_delta_rule_ref, dict(query_start_loc=torch.tensor([0, 2, 4])), "rise from 0 to num_tokens=5"),
        (gated_delta_rule_ref, dict(has_initial_state=torch.tensor([1, 0])), "bool tensor"),
        (gated_delta_rule_ref, dict(chunk_size=0), "chunk_size must be >= 1"),
    ]
    for fn, change, message in cases:
        src = pk if fn is kda_ref else p
        args = dict(q=src.q, k=src.k, v=src.v, g=src.g, beta=src.beta, **kw) | change
        with pytest.raises(ValueError, match=message):
            fn(**args)
    with pytest.raises(ValueError, match="state_indices must be distinct"):
        gated_delta_rule_update_ref(pool, *p.rows(0, 2).args(), state_indices=torch.tensor([1, 1]))
