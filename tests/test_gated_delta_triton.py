"""Triton gated delta rule / KDA kernels (chunked prefill, recurrent prefill, decode update) against their torch
reference twins, outputs AND in-place state slots.

On a machine without CUDA the kernels run under Triton's interpreter (``tests/_triton.py``) at tiny sizes. With CUDA
the same checks run compiled, plus bf16 checks and a CUDA-graph capture check marked ``gpu``.

Every batch is hostile: several requests of mixed lengths (0, 1, tile multiples and not), with and without initial
state, state slots shuffled with spare slots; unused slots and the slots of requests without an initial state hold
NaN (the latter must never be read), outputs are NaN-poisoned before the call (every element must be written),
q / k / v are strided views of one packed row as the layer's split makes them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _triton import DEVICE, build_for_hopper, gpu, kernel_module, tiles

from hybridkv.layers.ops.gated_delta_ref import (
    gated_delta_rule_ref,
    gated_delta_rule_update_ref,
    kda_ref,
    kda_update_ref,
)

tg = kernel_module("hybridkv.backends.triton_gated_delta")
NAN = float("nan")
REF = {"gdn": gated_delta_rule_ref, "kda": kda_ref}
REF_UPDATE = {"gdn": gated_delta_rule_update_ref, "kda": kda_update_ref}


def _ours(kind: str, method: str):
    name = {"gdn": "gated_delta_rule", "kda": "kda"}[kind]
    return getattr(tg, f"{name}_triton" if method == "chunk" else f"{name}_{method}_triton")


# ------------------------------------------------------------------------------------------ batches

def _batch(seed: int, max_reqs: int = 4, max_len: int = 40, spare: int = 2):
    """(lens, qsl, slots, has_init, num_slots): mixed lengths with a 1-token request always, a 0-token one for
    seeds divisible by 3; shuffled distinct slots with spare ones; random has_initial_state."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_reqs + 1))
    lens = [int(v) for v in rng.integers(2, max_len + 1, n)]
    lens[int(rng.integers(0, n))] = 1
    if seed % 3 == 0:
        lens.insert(int(rng.integers(0, n + 1)), 0)
    num_slots = len(lens) + spare
    slots = torch.tensor([int(v) for v in rng.permutation(num_slots)[: len(lens)]])
    has_init = torch.tensor([bool(v) for v in rng.random(len(lens)) < 0.6])
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    return lens, qsl, slots, has_init, num_slots


def _pool(shape, slots, has_init, gen) -> torch.Tensor:
    """Random where a request continues from its slot, NaN everywhere else (fresh and unused slots)."""
    pool = torch.full(shape, NAN)
    for s, h in zip(slots.tolist(), has_init.tolist(), strict=True):
        if h:
            pool[s] = torch.randn(shape[1:], generator=gen)
    return pool


def _inputs(seed: int, n: int, kind: str, hk: int, hv: int, dk: int, dv: int, *, gate: bool):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    g_shape = (n, hv, dk) if kind == "kda" else (n, hv)
    return dict(q=r(n, hk, dk), k=r(n, hk, dk), v=r(n, hv, dv),
                g=r(*g_shape) if gate else -torch.rand(*g_shape, generator=g),
                beta=torch.rand(n, hv, generator=g) * 1.5,
                A_log=r(hv) if gate else None, dt_bias=r(*g_shape[1:]) if gate else None)


def _strided(p: dict) -> dict:
    """q, k, v as views of one packed row (the layer's conv output split), g and beta views of a wider tensor; on
    the test device."""
    q, k, v = p["q"], p["k"], p["v"]
    n = q.shape[0]
    row = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), torch.full((n, 3), NAN)], 1)
    sq, sv = q[0].numel(), v[0].numel()
    gw = torch.cat([p["g"].reshape(n, -1), torch.full((n, 1), NAN)], 1)[:, : p["g"][0].numel()].view(p["g"].shape)
    bw = torch.cat([p["beta"], torch.full((n, 2), NAN)], 1)[:, : p["beta"].shape[1]]
    out = dict(p, q=row[:, :sq].view(q.shape), k=row[:, sq:2 * sq].view(k.shape),
               v=row[:, 2 * sq:2 * sq + sv].view(v.shape), g=gw, beta=bw)
    return {key: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for key, t in out.items()}


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


# ------------------------------------------------------------------------------------------ prefill

# (seed, kind, q/k heads, value heads, head_k_dim, head_v_dim, l2 norm, in-op gate, tile overrides)
PREFILL_CASES = [
    (0, "gdn", 2, 4, 8, 12, True, False, None),                              # default tiles
    pytest.param(1, "gdn", 1, 3, 16, 20, True, True, {"BT": 16, "BV": 16},   # 2 value blocks, 3 heads per q/k head
                 marks=pytest.mark.slow),
    pytest.param(2, "gdn", 2, 2, 5, 7, False, True, {"BT": 16}, marks=pytest.mark.slow),  # dims below one tile
    (3, "kda", 2, 4, 8, 12, True, False, None),
    pytest.param(4, "kda", 1, 2, 20, 16, True, True, {"BT": 16, "BK": 16, "BV": 16},     # 2 channel blocks
                 marks=pytest.mark.slow),
    pytest.param(5, "kda", 2, 2, 6, 5, False, True, None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize(("seed", "kind", "hk", "hv", "dk", "dv", "l2", "gate", "config"), PREFILL_CASES)
def test_prefill_matches_reference(method, seed, kind, hk, hv, dk, dv, l2, gate, config):
    lens, qsl, slots, init, num_slots = _batch(seed)
    p = _inputs(seed, sum(lens), kind, hk, hv, dk, dv, gate=gate)
    if not l2:                                   # unit keys from the caller: the recurrence stays bounded
        p["k"] = torch.nn.functional.normalize(p["k"], dim=-1)
    pool = _pool((num_slots, hv, dk, dv), slots, init, torch.Generator().manual_seed(seed + 100))
    ref_pool = pool.clone()
    kw = dict(query_start_loc=qsl, state_indices=slots, has_initial_state=init, use_qk_l2norm=l2)
    ref = REF[kind](**p, ssm_states=ref_pool, chunk_size=16, **kw)
    dpool = pool.to(DEVICE)
    out = torch.full(p["v"].shape, NAN, device=DEVICE)
    dkw = {key: t.to(DEVICE) for key, t in kw.items() if isinstance(t, torch.Tensor)} | {"use_qk_l2norm": l2}
    with tiles(tg, "delta_launch_config", config):
        y = _ours(kind, method)(**_strided(p), ssm_states=dpool, out=out, **dkw)
    assert y is out and not torch.isnan(y).any()
    _close(y, ref, 2e-4)
    _check_states(dpool, ref_pool, slots, 2e-4)


@pytest.mark.parametrize(("lens", "bt"), [
    ([3, 1, 2, 4, 1, 5, 2, 1, 3, 2, 6, 1, 2, 3, 1, 4, 2, 0, 3, 1], 16),   # more request starts than rows
    ([70, 3, 0, 45, 17], 32),                                              # requests over several chunks
    pytest.param([130, 2, 61], 64, marks=pytest.mark.slow),                # 4 diagonal blocks per chunk
])
def test_gated_delta_chunks_cross_request_bounds(lens, bt):
    """The chunked gated delta rule blocks the packed tokens, not each request: a chunk holds the ends and starts
    of several requests, and each request's rows of it are a segment of their own."""
    rng = np.random.default_rng(len(lens))
    num_slots = len(lens) + 1
    slots = torch.tensor(rng.permutation(num_slots)[: len(lens)].tolist())
    init = torch.tensor([bool(v) for v in rng.random(len(lens)) < 0.5])
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    p = _inputs(9, sum(lens), "gdn", 1, 2, 8, 8, gate=True)
    pool = _pool((num_slots, 2, 8, 8), slots, init, torch.Generator().manual_seed(9))
    ref_pool = pool.clone()
    kw = dict(query_start_loc=qsl, state_indices=slots, has_initial_state=init, use_qk_l2norm=True)
    ref = REF["gdn"](**p, ssm_states=ref_pool, **kw)
    dpool = pool.to(DEVICE)
    with tiles(tg, "delta_launch_config", {"BT": bt}):
        y = _ours("gdn", "chunk")(**_strided(p), ssm_states=dpool,
                                  **{key: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for key, t in kw.items()})
    _close(y, ref, 2e-4)
    _check_states(dpool, ref_pool, slots, 2e-4)


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_gated_delta_beta_from_logits(beta_scale):
    """``beta_scale``: beta holds logits and every op takes ``sigmoid(beta) * beta_scale`` itself (the layer's
    sigmoid launch folded in), equal to passing that beta."""
    lens, qsl, slots, init, num_slots = _batch(11, max_len=20)
    p = _inputs(11, sum(lens), "gdn", 1, 2, 8, 8, gate=True)
    logits = torch.randn(p["beta"].shape, generator=torch.Generator().manual_seed(2)) * 2
    pool = _pool((num_slots, 2, 8, 8), slots, init, torch.Generator().manual_seed(3))
    kw = dict(query_start_loc=qsl, state_indices=slots, has_initial_state=init, use_qk_l2norm=True)
    ref_pool = pool.clone()
    ref = REF["gdn"](**(p | {"beta": torch.sigmoid(logits) * beta_scale}), ssm_states=ref_pool, **kw)
    dkw = {key: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for key, t in kw.items()}
    for method in ("chunk", "recurrent"):
        dpool = pool.clone().to(DEVICE)
        y = _ours("gdn", method)(**_strided(p | {"beta": logits}), ssm_states=dpool, beta_scale=beta_scale, **dkw)
        _close(y, ref, 2e-4)
        _check_states(dpool, ref_pool, slots, 2e-4)
    q = _inputs(12, len(lens), "gdn", 1, 2, 8, 8, gate=True)
    upd_logits = torch.randn(q["beta"].shape, generator=torch.Generator().manual_seed(4))
    upd_ref_pool = ref_pool.clone()
    want = REF_UPDATE["gdn"](upd_ref_pool, **(q | {"beta": torch.sigmoid(upd_logits) * beta_scale}),
                             state_indices=slots, use_qk_l2norm=True)
    dpool = ref_pool.clone().to(DEVICE)
    got = tg.gated_delta_rule_update_triton(dpool, **_strided(q | {"beta": upd_logits}), state_indices=slots.to(DEVICE),
                                            use_qk_l2norm=True, beta_scale=beta_scale)
    _close(got, want, 2e-4)
    _close(dpool[slots], upd_ref_pool[slots], 2e-4)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_prefill_scale_and_check_values(kind):
    """An explicit q scale, and ``check_values`` running the reference's value checks."""
    lens, qsl, slots, init, num_slots = _batch(7, max_len=20)
    p = _inputs(7, sum(lens), kind, 1, 2, 8, 4, gate=False)
    pool = _pool((num_slots, 2, 8, 4), slots, init, torch.Generator().manual_seed(0))
    ref_pool = pool.clone()
    kw = dict(query_start_loc=qsl, state_indices=slots, has_initial_state=init, use_qk_l2norm=True, scale=0.3)
    ref = REF[kind](**p, ssm_states=ref_pool, **kw)
    dpool = pool.to(DEVICE)
    dkw = {key: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for key, t in kw.items()}
    _close(_ours(kind, "chunk")(**_strided(p), ssm_states=dpool, check_values=True, **dkw), ref, 2e-4)
    _check_states(dpool, ref_pool, slots, 2e-4)
    with pytest.raises(ValueError, match="distinct"):
        bad = dkw | {"state_indices": torch.zeros_like(dkw["state_indices"])}
        _ours(kind, "chunk")(**_strided(p), ssm_states=dpool, check_values=True, **bad)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_prefill_16bit_inputs_use_16bit_dot_operands(kind):
    """fp16 inputs: the chunked kernel's dots take 16-bit operands (fp32 accumulation) and o comes back in fp16;
    within 16-bit rounding of the fp32 reference on the same values. (bf16 takes the same path; the interpreter's
    bf16 dot is wrong, so bf16 runs only in the GPU test.)"""
    lens, qsl, slots, init, num_slots = _batch(8, max_len=30)
    p = _inputs(8, sum(lens), kind, 1, 2, 16, 16, gate=True)
    p = {key: (t.half().float() if key in ("q", "k", "v") else t) for key, t in p.items()}
    pool = _pool((num_slots, 2, 16, 16), slots, init, torch.Generator().manual_seed(1)) * 0.1
    ref_pool = pool.clone()
    kw = dict(query_start_loc=qsl, state_indices=slots, has_initial_state=init, use_qk_l2norm=True)
    ref = REF[kind](**p, ssm_states=ref_pool, **kw)
    half = {key: (t.half() if key in ("q", "k", "v") else t) for key, t in _strided(p).items()}
    dpool = pool.to(DEVICE)
    y = _ours(kind, "chunk")(**half, ssm_states=dpool, **{key: t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                                           for key, t in kw.items()})
    assert y.dtype == torch.float16
    rel = lambda a, b: float((a.float().cpu() - b.float()).norm() / b.float().norm())
    assert rel(y, ref) < 3e-3
    assert rel(dpool[slots], ref_pool[slots]) < 3e-3
    assert torch.isnan(dpool.cpu()[[s for s in range(num_slots) if s not in slots.tolist()]]).all()


# ------------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize(("seed", "kind", "hk", "hv", "l2", "gate", "config"),
                         [(10, "gdn", 1, 2, True, False, None), (11, "gdn", 2, 4, True, True, {"BV": 16}),
                          (12, "kda", 2, 2, True, True, None), (13, "kda", 1, 3, False, False, {"BV": 16})])
def test_update_matches_reference(seed, kind, hk, hv, l2, gate, config):
    batch, dk, dv, num_slots = 3, 12, 20, 6
    p = _inputs(seed, batch, kind, hk, hv, dk, dv, gate=gate)
    if not l2:
        p["k"] = torch.nn.functional.normalize(p["k"], dim=-1)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:batch]
    pool = _pool((num_slots, hv, dk, dv), slots, torch.ones(batch, dtype=torch.bool), g)
    ref_pool = pool.clone()
    ref = REF_UPDATE[kind](ref_pool, **p, state_indices=slots, use_qk_l2norm=l2)
    dpool = pool.to(DEVICE)
    fn = tg.kda_update_triton if kind == "kda" else tg.gated_delta_rule_update_triton
    with tiles(tg, "delta_launch_config", config):
        y = fn(dpool, **_strided(p), state_indices=slots.to(DEVICE), use_qk_l2norm=l2)
    _close(y, ref)
    _check_states(dpool, ref_pool, slots)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_prefill_of_one_token_requests_equals_update(kind):
    p = _inputs(14, 2, kind, 1, 2, 16, 16, gate=True)
    pool = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    pool2 = pool.clone()
    idx = torch.tensor([2, 0], device=DEVICE)
    update = tg.kda_update_triton if kind == "kda" else tg.gated_delta_rule_update_triton
    y1 = _ours(kind, "chunk")(**_strided(p), query_start_loc=torch.tensor([0, 1, 2]).to(DEVICE), ssm_states=pool,
                              state_indices=idx, has_initial_state=torch.tensor([True, True]).to(DEVICE),
                              use_qk_l2norm=True)
    y2 = update(pool2, **_strided(p), state_indices=idx, use_qk_l2norm=True)
    _close(y1, y2)
    _close(pool, pool2)


# ------------------------------------------------------------------------------------------ contract


def _same_error(ref_call, our_call) -> None:
    with pytest.raises(ValueError) as ref_err:
        ref_call()
    with pytest.raises(ValueError) as our_err:
        our_call()
    assert str(our_err.value) == str(ref_err.value)


def test_shape_and_dtype_errors_match_reference():
    p = _inputs(0, 5, "gdn", 2, 4, 3, 2, gate=False)
    pk = _inputs(0, 5, "kda", 2, 4, 3, 2, gate=False)
    kw = dict(query_start_loc=torch.tensor([0, 2, 5]), ssm_states=torch.zeros(3, 4, 3, 2),
              state_indices=torch.tensor([0, 2]), has_initial_state=torch.tensor([True, False]))
    bad = [dict(k=p["k"][:, :1]), dict(v=torch.zeros(5, 3, 2)), dict(beta=p["beta"][:, :1]),
           dict(ssm_states=torch.zeros(3, 4, 2, 3)), dict(dt_bias=torch.zeros(4)),
           dict(has_initial_state=torch.tensor([1, 0])), dict(state_indices=torch.tensor([0.0, 2.0])),
           dict(query_start_loc=torch.tensor([[0, 5]])), dict(chunk_size=0)]
    for kind, src in (("gdn", p), ("kda", pk)):
        for change in [*bad, dict(g=(pk if kind == "gdn" else p)["g"])]:
            args = {key: src[key] for key in ("q", "k", "v", "g", "beta")} | kw | change
            _same_error(lambda a=args, k=kind: REF[k](**a), lambda a=args, k=kind: _ours(k, "chunk")(**a))
    upd = dict(ssm_states=torch.zeros(3, 4, 3, 2), state_indices=torch.tensor([0, 1]))
    for change in (dict(state_indices=torch.tensor([0, 1, 2])), dict(q=torch.zeros(2, 2, 4))):
        args = {key: p[key][:2] for key in ("q", "k", "v", "g", "beta")} | upd | change
        _same_error(lambda a=args: gated_delta_rule_update_ref(**a),
                    lambda a=args: tg.gated_delta_rule_update_triton(**a))


# ------------------------------------------------------------------------------------------ GPU


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_gpu_bf16_prefill_and_update(kind, method):
    """Qwen3-Next-like heads (16 value heads sharing 8 q/k heads, 128 x 128) in bf16 against the fp32 reference
    of the same bf16 values: relative error of outputs and states within bf16's."""
    rng = np.random.default_rng(5)
    lens = [int(v) for v in rng.integers(1, 600, 4)] + [1, 64, 127]
    num_slots = len(lens) + 2
    slots = torch.tensor(rng.permutation(num_slots)[: len(lens)].tolist())
    init = torch.tensor([bool(v) for v in rng.random(len(lens)) < 0.6])
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    hk, hv, d = (8, 16, 128) if kind == "gdn" else (16, 16, 128)
    p = _inputs(0, sum(lens), kind, hk, hv, d, d, gate=True)
    p = {key: t.bfloat16().float().cuda() for key, t in p.items()}
    pool = _pool((num_slots, hv, d, d), slots, init, torch.Generator().manual_seed(1)).cuda() * 0.1
    ref_pool = pool.clone()
    cuda = dict(query_start_loc=qsl.cuda(), state_indices=slots.cuda(), has_initial_state=init.cuda(),
                use_qk_l2norm=True)
    ref = REF[kind](**p, ssm_states=ref_pool, **cuda)
    low = {key: (t.bfloat16() if key in ("q", "k", "v") else t) for key, t in p.items()}
    ours_pool = pool.clone()
    y = _ours(kind, method)(**low, ssm_states=ours_pool, **cuda)
    assert y.dtype == torch.bfloat16
    assert _rel(y, ref) < 2e-2
    used = slots.cuda()
    assert _rel(ours_pool[used], ref_pool[used]) < 2e-2
    upd = REF_UPDATE[kind]
    q = {key: t.bfloat16().float().cuda() for key, t in _inputs(1, len(lens), kind, hk, hv, d, d, gate=True).items()}
    ref = upd(ref_pool, **q, state_indices=used, use_qk_l2norm=True)
    fn = tg.kda_update_triton if kind == "kda" else tg.gated_delta_rule_update_triton
    y = fn(ours_pool, **{key: (t.bfloat16() if key in ("q", "k", "v") else t) for key, t in q.items()},
           state_indices=used, use_qk_l2norm=True)
    assert _rel(y, ref) < 2e-2
    assert _rel(ours_pool[used], ref_pool[used]) < 2e-2


@gpu
@pytest.mark.gpu
def test_gpu_updates_are_cuda_graph_capturable():
    """Both decode updates and a chunked prefill in one graph; replay with new values (indices included)."""
    batch, hv, d, num_slots = 3, 4, 64, 8
    pool_g = torch.randn(num_slots, hv, d, d).cuda()
    pool_k = torch.randn(num_slots, hv, d, d).cuda()
    pg = {key: t.cuda() for key, t in _inputs(0, batch, "gdn", 2, hv, d, d, gate=True).items()}
    pk = {key: t.cuda() for key, t in _inputs(1, batch, "kda", hv, hv, d, d, gate=True).items()}
    idx = torch.tensor([5, 1, 3]).cuda()
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32).cuda()
    init = torch.tensor([True, False, True]).cuda()

    def step():
        a = tg.gated_delta_rule_update_triton(pool_g, **pg, state_indices=idx, use_qk_l2norm=True)
        b = tg.kda_update_triton(pool_k, **pk, state_indices=idx, use_qk_l2norm=True)
        c = tg.gated_delta_rule_triton(**pg, query_start_loc=qsl, ssm_states=pool_g, state_indices=idx.flip(0),
                                       has_initial_state=init, use_qk_l2norm=True)
        return a, b, c

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    saved = (pool_g.clone(), pool_k.clone())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    pool_g.copy_(saved[0])
    pool_k.copy_(saved[1])
    idx.copy_(torch.tensor([0, 7, 2]))
    pg["v"].normal_()
    ref_g, ref_k = pool_g.clone(), pool_k.clone()
    graph.replay()
    torch.cuda.synchronize()
    a = gated_delta_rule_update_ref(ref_g, **pg, state_indices=idx, use_qk_l2norm=True)
    b = kda_update_ref(ref_k, **pk, state_indices=idx, use_qk_l2norm=True)
    c = gated_delta_rule_ref(**pg, query_start_loc=qsl, ssm_states=ref_g, state_indices=idx.flip(0),
                             has_initial_state=init, use_qk_l2norm=True)
    for x, e in zip(outs, (a, b, c), strict=True):
        _close(x, e, 1e-3)
    _close(pool_g, ref_g, 1e-3)
    _close(pool_k, ref_k, 1e-3)


def test_backends_carry_the_ops():
    """The torch backend's delta-rule ops are the references; the triton backend's are these kernels."""
    from hybridkv.backends.base import torch_backend
    from hybridkv.backends.triton_backend import triton_backend

    ref, be = torch_backend(), triton_backend()
    for op in ("gated_delta_rule", "gated_delta_rule_update", "kda", "kda_update"):
        assert getattr(ref, op).__name__ == f"{op}_ref"
        assert getattr(be, op).__name__ == f"{op}_triton"



_COMPILE_FOR_HOPPER = """
from hybridkv.backends import triton_gated_delta as mod

ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "qsl_ptr": "*i32", "idx_ptr": "*i64",
        "init_ptr": "*u8"}
for per_channel in (False, True):
    for kind, fn in (("chunk", mod._delta_chunk_kernel), ("recurrent", mod._delta_recurrent_kernel),
                     ("update", mod._delta_update_kernel.graph)):
        if kind == "chunk" and not per_channel:     # the gated delta rule's chunked prefill: the WY pair below
            continue
        cfg = mod.delta_launch_config(head_k_dim=128, head_v_dim=128, per_channel=per_channel, kind=kind)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages", None)
        consts = dict(cfg, K_P=128, PER_CHANNEL=per_channel, HAS_GATE=True, HAS_DT_BIAS=True, L2NORM=True, EPS=1e-6,
                      PDL=False, PRECISION="tf32")
        build(fn, consts, ptrs, num_warps=warps)
        print("compiled", kind, per_channel)
WY_ROWS = dict(w_ptr="*bf16", qk_ptr="*bf16", qg_ptr="*bf16", kg_ptr="*bf16")
cfg = mod.delta_launch_config(head_k_dim=128, head_v_dim=128, per_channel=False, kind="chunk")
build(mod._wy_kernel, dict(BT=cfg["BT"], SB=mod._WY_BLOCK, K_P=128, V_P=128, HAS_GATE=True, HAS_DT_BIAS=True,
                           L2NORM=True, EPS=1e-6, PRECISION="tf32", PDL=False),
      dict(ptrs, u_ptr="*fp32", gc_ptr="*fp32", **WY_ROWS), num_warps=cfg["wy_warps"])
print("compiled wy")
build(mod._wy_state_kernel, dict(BT=cfg["BT"], K_P=128, V_P=128, BV=cfg["BV"], PRECISION="tf32", PDL=False),
      dict(ptrs, u_ptr="*fp32", gc_ptr="*fp32", state_ptr="*fp32", **WY_ROWS), num_warps=cfg["num_warps"])
print("compiled wy state")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels are compiled by the tests above")
def test_kernels_compile_for_hopper():
    """The interpreter never lowers the kernels: build all seven (recurrent and decode for the gated delta rule and
    KDA, KDA's chunked prefill, the gated delta rule's two-launch one)
    for sm_90 at head dims 128, bf16 and default tiles, as a GPU would, so a kernel that cannot be compiled fails here
    too."""
    assert build_for_hopper(_COMPILE_FOR_HOPPER).count("compiled") == 7
