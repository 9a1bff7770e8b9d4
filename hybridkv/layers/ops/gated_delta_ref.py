"""Reference gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid) and Kimi Delta Attention (KDA:
Kimi-Linear) over packed requests with per-request state slots.

The oracles for the recurrent half of those layers: our Triton kernels (``backends/triton_gated_delta.py``) and
flash-linear-attention's (``backends/vendor_fla.py``) must reproduce these outputs and final states.

Semantics (HF ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` and
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``; fla's ``chunk_gated_delta_rule`` /
``chunk_kda``), per value head h with state S (head_k_dim, head_v_dim) and token t:

    q, k <- q / sqrt(|q|^2 + 1e-6), k / sqrt(|k|^2 + 1e-6)      only with use_qk_l2norm (the models all set it)
    q <- q * scale                                               scale defaults to head_k_dim ** -0.5
    S <- exp(g_t) * S       gated delta rule: g_t one log decay per head; KDA: g_t (head_k_dim,), row i by exp(g_t[i])
    S <- S + k_t ⊗ beta_t (v_t - S^T k_t)                       the delta rule: write only what S does not predict
    o_t = S^T q_t

Query/key head j serves the value heads j * r .. j * r + r - 1, r = num_v_heads // num_k_heads (HF's
``repeat_interleave``, fla's GVA). g is a log decay (<= 0) and beta the write strength (sigmoid, or 2 * sigmoid with
OLMo-Hybrid's negative eigenvalues), both computed by the layer, as HF and fla take them; optionally the op computes
the decay itself from the raw gate input (fla's ``use_gate_in_kernel``, one launch fewer per layer):
``g = -exp(A_log[h]) * softplus(g_raw + dt_bias)``, dt_bias (num_v_heads,) for the gated delta rule and
(num_v_heads, head_k_dim) for KDA.

Math in fp32 (fp64 for fp64 inputs, so the tests can pin the algebra); the state pool is expected in fp32; outputs
in v's dtype. Packed-batch conventions (query_start_loc, state_indices, has_initial_state, in-place final states, a
zero-token request keeps its initial state) are those of ``conv1d_ref``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.layers.ops.conv1d_ref import _check_shape, _check_state_indices, _packed_layout
from hybridkv.layers.ops.registry import reference_op

__all__ = [
    "gated_delta_rule_naive_ref",
    "gated_delta_rule_ref",
    "gated_delta_rule_update_ref",
    "kda_naive_ref",
    "kda_ref",
    "kda_update_ref",
    "l2norm",
]

L2NORM_EPS = 1e-6       # HF's and fla's ``l2norm`` eps (inside the square root)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (HF's and fla's q/k normalisation)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_params(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    *,
    per_channel: bool,
) -> int:
    """Validate the shapes shared by every delta-rule op; return value heads per key head."""
    _check_shape("q", q, (None, None, None))
    n, num_k_heads, head_k_dim = q.shape
    _check_shape("k", k, (n, num_k_heads, head_k_dim))
    _check_shape("v", v, (n, None, None))
    num_v_heads, head_v_dim = v.shape[1:]
    if num_k_heads < 1 or num_v_heads % num_k_heads != 0:
        raise ValueError(f"q/k have {num_k_heads} heads, which must divide v's {num_v_heads} heads")
    _check_shape("g", g, (n, num_v_heads, head_k_dim) if per_channel else (n, num_v_heads))
    _check_shape("beta", beta, (n, num_v_heads))
    _check_shape("ssm_states", ssm_states, (None, num_v_heads, head_k_dim, head_v_dim))
    if A_log is not None:
        _check_shape("A_log", A_log, (num_v_heads,))
    if dt_bias is not None:
        if A_log is None:
            raise ValueError("dt_bias is only used with A_log (the decay computed in the op)")
        _check_shape("dt_bias", dt_bias, (num_v_heads, head_k_dim) if per_channel else (num_v_heads,))
    return num_v_heads // num_k_heads


def _decay(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    """The log decay: g as given, or -exp(A_log) * softplus(g + dt_bias) (per head, broadcast over channels)."""
    g = g.to(dtype)
    if A_log is None:
        return g
    if dt_bias is not None:
        g = g + dt_bias.to(dtype)
    a = torch.exp(A_log.to(dtype))
    return -(a[:, None] if g.dim() == 3 else a) * F.softplus(g)


def beta_from_logits(beta: torch.Tensor, beta_scale: float | None) -> torch.Tensor:
    """The write strength: ``beta`` as given (``beta_scale`` None), or ``sigmoid(beta) * beta_scale`` from logits,
    in beta's dtype, as the layers' torch ops round it."""
    if beta_scale is None:
        return beta
    return torch.sigmoid(beta) if beta_scale == 1.0 else torch.sigmoid(beta) * beta_scale


def _prepare(q, k, v, g, beta, A_log, dt_bias, *, rep: int, scale: float | None, use_qk_l2norm: bool,
             beta_scale: float | None = None):
    """Per value head, in the compute dtype: q (scaled), k, v, log decay, beta (``beta_from_logits``)."""
    beta = beta_from_logits(beta, beta_scale)
    dtype = _compute_dtype(v)
    qf, kf = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (q.shape[-1] ** -0.5 if scale is None else scale)
    qf, kf = qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)  # (n, num_v_heads, head_k_dim)
    return qf, kf, v.to(dtype), _decay(g, A_log, dt_bias, dtype), beta.to(dtype)


def _pair(a: torch.Tensor, b: torch.Tensor, gc: torch.Tensor, *, strict: bool) -> torch.Tensor:
    """out[..., i, j] = sum_c a[i, c] b[j, c] exp(gc[i(, c)] - gc[j(, c)]) for j <= i (j < i if strict), else 0.

    a, b (..., L, dk); gc (..., L) (one decay per head) or (..., L, dk) (per channel). The exponent is a decay over
    positions j+1..i (<= 0) formed as a difference, never exp(+gc): no overflow however fast the decay.
    """
    length = a.shape[-2]
    keep = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if gc.dim() == a.dim() - 1:
        diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~keep, -torch.inf)
        return (a @ b.transpose(-1, -2)) * torch.exp(diff)
    diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~keep[:, :, None], -torch.inf)  # (.., L, L, dk)
    return (a[..., :, None, :] * b[..., None, :, :] * torch.exp(diff)).sum(-1)


def _chunked(
    q, k, v, g, beta, *, query_start_loc, ssm_states, state_indices, has_initial_state, scale, use_qk_l2norm,
    A_log, dt_bias, chunk_size: int, per_channel: bool, beta_scale: float | None = None,
) -> torch.Tensor:
    rep = _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    num_tokens, num_v_heads, head_v_dim = v.shape
    device = v.device
    qsl, seq_lens, token_req, token_pos = _packed_layout(
        num_tokens, query_start_loc, state_indices, has_initial_state, ssm_states.shape[0], device
    )
    num_reqs = seq_lens.numel()
    slots = state_indices.to(device=ssm_states.device, dtype=torch.long)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, rep=rep, scale=scale,
                                  use_qk_l2norm=use_qk_l2norm, beta_scale=beta_scale)
    dtype = vf.dtype

    # 1. Tokens laid out in chunks aligned to each request's first token; padding rows are zero (k = v = beta = 0:
    #    no write; g = 0: no decay), which leaves the state exact.
    chunks_per_req = (seq_lens + chunk_size - 1) // chunk_size  # (num_reqs,)
    first_chunk = torch.cumsum(chunks_per_req, 0) - chunks_per_req  # (num_reqs,)
    num_chunks = int(chunks_per_req.sum())
    row = (first_chunk[token_req] + token_pos // chunk_size) * chunk_size + token_pos % chunk_size

    def to_chunks(t: torch.Tensor) -> torch.Tensor:  # (num_tokens, H, ...) -> (num_chunks, H, L, ...)
        out = t.new_zeros((num_chunks * chunk_size, *t.shape[1:]))
        out[row] = t
        return out.view(num_chunks, chunk_size, *t.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc_all, bc = (to_chunks(t) for t in (qf, kf, vf, gf, bf))
    gc_all = gc_all.cumsum(2)  # (num_chunks, H, L(, dk)): log decay from the chunk start through l

    # 2. Sequential over a request's chunks, parallel over requests and heads. Per chunk, with S its start state:
    #    A = strictly lower (beta_i k_i . k_j decayed j -> i); the chunk's corrections u solve (I + A) u = R with
    #    R = beta (v - (k decayed from the chunk start) S)  (the UT transform of the DeltaNet papers);
    #    o = (q decayed) S + (q_i . k_j decayed, j <= i) u;  S <- S decayed over the chunk + (k decayed to its end)^T u.
    init = ssm_states[slots].to(device=device, dtype=dtype)  # (num_reqs, H, dk, dv)
    state = torch.where(has_initial_state.to(device).view(-1, 1, 1, 1), init, torch.zeros_like(init))
    out = torch.zeros((num_chunks, num_v_heads, chunk_size, head_v_dim), dtype=dtype, device=device)
    eye = torch.eye(chunk_size, dtype=dtype, device=device)
    max_chunks = int(chunks_per_req.max()) if num_reqs else 0
    for c in range(max_chunks):
        reqs = torch.nonzero(chunks_per_req > c).squeeze(1)
        ids = first_chunk[reqs] + c
        qi, ki, vi, gc, bi = qc[ids], kc[ids], vc[ids], gc_all[ids], bc[ids]
        S = state[reqs]  # (n, H, dk, dv)
        decay_in = torch.exp(gc if per_channel else gc[..., None])  # (n, H, L, dk or 1): chunk start -> l
        glast = gc[:, :, -1]  # (n, H(, dk))
        decay_out = torch.exp((glast[:, :, None] - gc) if per_channel else (glast[:, :, None] - gc)[..., None])
        A = _pair(ki * bi[..., None], ki, gc, strict=True)  # (n, H, L, L)
        R = bi[..., None] * (vi - (ki * decay_in) @ S)  # (n, H, L, dv)
        u = torch.linalg.solve_triangular(eye + A, R, upper=False, unitriangular=True)
        out[ids] = (qi * decay_in) @ S + _pair(qi, ki, gc, strict=False) @ u
        total = torch.exp(glast)[..., None] if per_channel else torch.exp(glast)[..., None, None]
        state[reqs] = S * total + (ki * decay_out).transpose(-1, -2) @ u
    ssm_states[slots] = state.to(ssm_states)
    return out.transpose(1, 2).reshape(num_chunks * chunk_size, num_v_heads, head_v_dim)[row].to(v.dtype)


def _naive(
    q, k, v, g, beta, *, query_start_loc, ssm_states, state_indices, has_initial_state, scale, use_qk_l2norm,
    A_log, dt_bias, per_channel: bool, beta_scale: float | None = None,
) -> torch.Tensor:
    rep = _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
    num_tokens = v.shape[0]
    qsl, _, _, _ = _packed_layout(num_tokens, query_start_loc, state_indices, has_initial_state,
                                  ssm_states.shape[0], v.device)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, rep=rep, scale=scale,
                                  use_qk_l2norm=use_qk_l2norm, beta_scale=beta_scale)
    out = torch.zeros_like(vf)
    for r, (slot, init) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist(), strict=True)):
        S = ssm_states[slot].to(device=v.device, dtype=vf.dtype)
        S = S if init else torch.zeros_like(S)  # (H, dk, dv)
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            S, out[t] = _step(S, qf[t], kf[t], vf[t], gf[t], bf[t])
        ssm_states[slot] = S.to(ssm_states)
    return out.to(v.dtype)


def _step(S, q, k, v, g, beta):
    """One token for every head: S (H, dk, dv); q, k (H, dk); v (H, dv); g (H,) or (H, dk); beta (H,)."""
    S = S * torch.exp(g)[..., None] if g.dim() == 2 else S * torch.exp(g)[:, None, None]
    delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * delta[:, None, :]
    return S, torch.einsum("hkv,hk->hv", S, q)


def _update(
    ssm_states, q, k, v, g, beta, *, state_indices, scale, use_qk_l2norm, A_log, dt_bias, per_channel: bool,
    beta_scale: float | None = None,
) -> torch.Tensor:
    rep = _check_params(q, k, v, g, beta, ssm_states, A_log, dt_bias, per_channel=per_channel)
    _check_state_indices(state_indices, v.shape[0], ssm_states.shape[0])
    slots = state_indices.to(device=ssm_states.device, dtype=torch.long)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, A_log, dt_bias, rep=rep, scale=scale,
                                  use_qk_l2norm=use_qk_l2norm, beta_scale=beta_scale)
    S = ssm_states[slots].to(device=v.device, dtype=vf.dtype)  # (batch, H, dk, dv)
    S = S * (torch.exp(gf)[..., None] if per_channel else torch.exp(gf)[..., None, None])
    delta = bf[..., None] * (vf - torch.einsum("bhkv,bhk->bhv", S, kf))  # (batch, H, dv)
    S = S + kf[..., None] * delta[:, :, None, :]
    ssm_states[slots] = S.to(ssm_states)
    return torch.einsum("bhkv,bhk->bhv", S, qf).to(v.dtype)


# ----------------------------------------------------------------------------- public ops


@reference_op("gated_delta_rule")
def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    beta_scale: float | None = None,
) -> torch.Tensor:
    """Gated delta rule over packed requests in chunked (UT-transform) form, continuing from and updating slots.

    Shapes: q, k (num_tokens, num_k_heads, head_k_dim); v (num_tokens, num_v_heads, head_v_dim);
    g, beta (num_tokens, num_v_heads) (g: log decay, or the raw gate input with A_log; beta: the write strength, or
    its logits with ``beta_scale``, which makes it ``sigmoid(beta) * beta_scale``); A_log, dt_bias
    (num_v_heads,) or None; ssm_states (num_slots, num_v_heads, head_k_dim, head_v_dim) fp32, read where
    has_initial_state and overwritten at state_indices (num_reqs,) with each request's final state;
    query_start_loc (num_reqs + 1,). Returns o (num_tokens, num_v_heads, head_v_dim) in v's dtype.

    Why the chunked form: it is the algorithm the fast kernels implement (HF's ``torch_chunk_gated_delta_rule``,
    fla's ``chunk_gated_delta_rule``, chunk 64), with chunks aligned to each request's first token and every request
    continuing from its own slot; it equals the per-token recurrence (``gated_delta_rule_naive_ref``) to rounding.
    """
    return _chunked(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                    state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
                    per_channel=False, beta_scale=beta_scale)


def gated_delta_rule_naive_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_scale: float | None = None,
) -> torch.Tensor:
    """``gated_delta_rule_ref`` as the per-token recurrence (a Python loop over requests and tokens): the oracle."""
    return _naive(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                  state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                  use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, per_channel=False,
                  beta_scale=beta_scale)


@reference_op("gated_delta_rule_update")
def gated_delta_rule_update_ref(
    ssm_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_scale: float | None = None,
) -> torch.Tensor:
    """One decode token per request: q, k (batch, num_k_heads, head_k_dim); v (batch, num_v_heads, head_v_dim);
    g, beta (batch, num_v_heads); ssm_states updated in place at state_indices (batch,), distinct. Returns o like v.

    Equals ``gated_delta_rule_ref`` on one-token requests that all have an initial state (HF's
    ``torch_recurrent_gated_delta_rule`` on one token; fla's ``fused_recurrent_gated_delta_rule``)."""
    return _update(ssm_states, q, k, v, g, beta, state_indices=state_indices, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, per_channel=False,
                   beta_scale=beta_scale)


@reference_op("kda")
def kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Kimi Delta Attention: ``gated_delta_rule_ref`` with a per-channel decay, g (num_tokens, num_v_heads,
    head_k_dim) (and dt_bias (num_v_heads, head_k_dim) with A_log); everything else as there.

    Chunked like HF's ``chunk_kimi_delta_attention`` / fla's ``chunk_kda``; the pairwise decays are formed as
    differences inside each chunk (never exp(+cumulative)), so no gate magnitude overflows."""
    return _chunked(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                    state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
                    per_channel=True)


def kda_naive_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kda_ref`` as the per-token recurrence: the oracle."""
    return _naive(q, k, v, g, beta, query_start_loc=query_start_loc, ssm_states=ssm_states,
                  state_indices=state_indices, has_initial_state=has_initial_state, scale=scale,
                  use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, per_channel=True)


@reference_op("kda_update")
def kda_update_ref(
    ssm_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One KDA decode token per request (``gated_delta_rule_update_ref`` with g (batch, num_v_heads, head_k_dim)):
    HF's ``recurrent_kimi_delta_attention`` on one token; fla's ``fused_recurrent_kda``."""
    return _update(ssm_states, q, k, v, g, beta, state_indices=state_indices, scale=scale,
                   use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, per_channel=True)
