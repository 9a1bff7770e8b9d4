"""The fused Mamba2 decode step (``backends/triton_mamba_decode.py``: conv update + SSD update + gated norm in
one launch) against ``mamba2_decode_ref`` (the three reference ops composed): output AND both state pools.

Without CUDA the kernel runs under Triton's interpreter in fp32 (tight: only fp32 sum orders differ) and fp16
(every rounding point shows; the interpreter rounds bf16 toward zero, so bf16 runs only compiled). In low
precision the kernel's error against an fp32 truth must stay within twice the reference's own error; the conv
states are pure copies and must match exactly. Inputs are the mixer's strided ``split`` views of one
projection; state slots are shuffled with spare ones, and every slot not used holds NaN and must stay so.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _triton import DEVICE, HAS_CUDA, gpu, kernel_module

from hybridkv.layers.ops.mamba2_decode_ref import mamba2_decode_ref

tm = kernel_module("hybridkv.backends.triton_mamba_decode")
DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]
NUM_SLOTS = 6
NAN = float("nan")


@dataclass(frozen=True, kw_only=True)
class Case:
    slots: tuple[int, ...]          # state index per token; -1 = padding row
    n_groups: int
    heads_per_group: int
    headdim: int                    # with BLOCK_P 16: 24 = two blocks, the second partial; 40 = three
    width: int = 4
    dstate: int = 16
    d_mode: int = 1                 # D: 0 None, 1 (heads,), 2 (heads, headdim)
    dt_bias: bool = True
    conv_bias: bool = True
    norm: str = "after"             # "after" the gate, "before" it, "none" (y * silu(z))
    norm_fp32: bool = False         # an fp32 norm weight: an fp32 output from low-precision y
    config: tuple[tuple[str, int], ...] = ()


CASES = {
    "one_token": Case(slots=(3,), n_groups=1, heads_per_group=1, headdim=24),
    "three_tokens_two_groups": Case(slots=(5, 0, 2), n_groups=2, heads_per_group=4, headdim=24, d_mode=2,
                                    config=(("BLOCK_P", 16),)),
    "padding_between": Case(slots=(2, -1, 4), n_groups=2, heads_per_group=1, headdim=40, width=2, d_mode=0,
                            dt_bias=False, conv_bias=False, norm="before", config=(("BLOCK_P", 16),)),
    "no_norm": Case(slots=(1, 4, 0), n_groups=1, heads_per_group=4, headdim=24, width=3, dstate=8, norm="none"),
    "width2_before_gate": Case(slots=(4,), n_groups=2, heads_per_group=4, headdim=16, width=2, d_mode=2,
                               norm="before"),
    "small_tiles_norm_passes": Case(slots=(0, -1, 3), n_groups=2, heads_per_group=2, headdim=24, conv_bias=False,
                                    config=(("BLOCK_P", 8), ("BLOCK_G", 16))),
    "fp32_norm_weight": Case(slots=(2, 5), n_groups=1, heads_per_group=2, headdim=24, norm_fp32=True),
    "all_padding": Case(slots=(-1, -1), n_groups=1, heads_per_group=2, headdim=8),
}


def _problem(case: Case, dtype: torch.dtype, seed: int = 0) -> dict:
    """Kernel arguments: z, xbc, dt as the mixer's split views of one projection (row stride > width), pools
    with random used slots and NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    heads = case.n_groups * case.heads_per_group
    d_inner, n = heads * case.headdim, case.dstate
    conv_dim = d_inner + 2 * case.n_groups * n
    t = len(case.slots)
    proj = torch.randn(t, d_inner + conv_dim + heads + 3, generator=g)
    z, xbc, dt = proj[:, :-3].to(DEVICE, dtype).split([d_inner, conv_dim, heads], dim=1)
    used = [s for s in case.slots if s >= 0]
    conv_states = torch.full((NUM_SLOTS, conv_dim, case.width - 1), NAN)
    ssm_states = torch.full((NUM_SLOTS, heads, case.headdim, n), NAN)
    conv_states[used] = torch.randn(len(used), conv_dim, case.width - 1, generator=g)
    ssm_states[used] = torch.randn(len(used), heads, case.headdim, n, generator=g)
    D = {0: None, 1: torch.randn(heads, generator=g), 2: torch.randn(heads, case.headdim, generator=g)}[case.d_mode]
    kw = dict(
        conv_states=conv_states.to(DEVICE, dtype), ssm_states=ssm_states.to(DEVICE),
        conv_weight=(torch.randn(conv_dim, case.width, generator=g) * 0.5).to(DEVICE, dtype),
        conv_bias=torch.randn(conv_dim, generator=g).to(DEVICE, dtype) if case.conv_bias else None,
        A=-torch.rand(heads, generator=g).add(0.5).to(DEVICE), D=D.to(DEVICE) if D is not None else None,
        dt_bias=(torch.randn(heads, generator=g) * 0.5).to(DEVICE) if case.dt_bias else None,
        norm_weight=(torch.randn(d_inner, generator=g) * 0.3 + 1).to(DEVICE, torch.float32 if case.norm_fp32 else dtype)
        if case.norm != "none" else None,
        norm_before_gate=case.norm == "before", norm_eps=1e-5, n_groups=case.n_groups,
        state_indices=torch.tensor(case.slots, device=DEVICE),
    )
    return dict(xbc=xbc, z=z, dt=dt, **kw)


def _cloned(p: dict) -> dict:
    """Fresh pools (updated in place by each call); every other argument shared."""
    return {**p, "conv_states": p["conv_states"].clone(), "ssm_states": p["ssm_states"].clone()}


def _upcast(p: dict) -> dict:
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in p.items()}


def _run_ref(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = _cloned(p)
    out = mamba2_decode_ref(q.pop("xbc"), q.pop("z"), q.pop("dt"), **q)
    return out, q["conv_states"], q["ssm_states"]


def _run_triton(p: dict, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = _cloned(p)
    out = tm.mamba2_decode_triton(q.pop("xbc"), q.pop("z"), q.pop("dt"), config=config, **q)
    return out, q["conv_states"], q["ssm_states"]


def _within_2x(ours: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    """Same NaN pattern as the reference (unused slots); elsewhere |ours - truth| <= 2 |ref - truth| + tiny."""
    ours, ref, truth = ours.float().cpu(), ref.float().cpu(), truth.float().cpu()
    assert torch.equal(ours.isnan(), ref.isnan()), f"{what}: NaN where the reference has none, or the reverse"
    ok = ~ref.isnan()
    if not ok.any():
        return
    err, ref_err = (ours - truth)[ok].abs().max(), (ref - truth)[ok].abs().max()
    assert err <= 2 * ref_err + 1e-3 * truth[ok].abs().max(), f"{what}: {err:.3e} vs reference {ref_err:.3e}"


def _agreement(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The fraction of the reference's finite values that ours equals to fp32 rounding (1e-5 relative)."""
    ours, ref = ours.float().cpu(), ref.float().cpu()
    ok = ~ref.isnan()
    if not ok.any():
        return 1.0
    return ((ours - ref)[ok].abs() <= 1e-6 + 1e-5 * ref[ok].abs()).float().mean().item()


def _check(p: dict, case_config: dict | None, dtype: torch.dtype) -> None:
    (out, conv, ssm), (r_out, r_conv, r_ssm) = _run_triton(p, case_config), _run_ref(p)
    assert out.dtype == r_out.dtype and out.shape == r_out.shape
    torch.testing.assert_close(conv.cpu(), r_conv.cpu(), rtol=0, atol=0, equal_nan=True)   # copies only
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), r_out.cpu(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(ssm.cpu(), r_ssm.cpu(), rtol=2e-5, atol=2e-5, equal_nan=True)
    else:
        t_out, _, t_ssm = _run_ref(_upcast(p))
        _within_2x(out, r_out, t_out, "output")
        _within_2x(ssm, r_ssm, t_ssm, "ssm_states")
        # the reference's rounding points: all but rare last-bit flips (where fp32 sum orders differ) agree
        for what, a, b in (("output", out, r_out), ("ssm_states", ssm, r_ssm)):
            assert _agreement(a, b) >= 0.9, f"{what}: {_agreement(a, b):.2f} agree with the reference's rounding"
    assert not tm._counters(out.device).any(), "an arrival counter was left non-zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str, dtype: torch.dtype) -> None:
    case = CASES[name]
    _check(_problem(case, dtype), dict(case.config) or None, dtype)


def test_repeat_calls_equal_reference_twice() -> None:
    """The second call finds the counters re-zeroed: two steps equal two reference steps (states chained)."""
    case = CASES["three_tokens_two_groups"]
    p, q = _problem(case, torch.float32, seed=1), _problem(case, torch.float32, seed=2)
    ours, ref = _cloned(p), _cloned(p)
    for step in (p, q):
        inputs = {k: step[k] for k in ("xbc", "z", "dt")}
        out = tm.mamba2_decode_triton(**inputs, **{k: v for k, v in ours.items() if k not in inputs},
                                      config=dict(case.config))
        r_out = mamba2_decode_ref(**inputs, **{k: v for k, v in ref.items() if k not in inputs})
        torch.testing.assert_close(out.cpu(), r_out.cpu(), rtol=2e-5, atol=2e-5)
    for pool in ("conv_states", "ssm_states"):
        torch.testing.assert_close(ours[pool].cpu(), ref[pool].cpu(), rtol=2e-5, atol=2e-5, equal_nan=True)


def test_padding_row_with_nan_inputs_leaves_other_rows_and_slots_alone() -> None:
    """A padding row's garbage stays in its own output row: it shares no counter, norm or slot with others."""
    case = CASES["padding_between"]
    p = _problem(case, torch.float32)
    for k in ("xbc", "z", "dt"):
        p[k][1] = NAN
    (out, conv, ssm), (r_out, r_conv, r_ssm) = _run_triton(p, dict(case.config)), _run_ref(p)
    torch.testing.assert_close(out[[0, 2]].cpu(), r_out[[0, 2]].cpu(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(conv.cpu(), r_conv.cpu(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ssm.cpu(), r_ssm.cpu(), rtol=2e-5, atol=2e-5, equal_nan=True)


def test_rejects_unsupported_shapes() -> None:
    p = _problem(CASES["three_tokens_two_groups"], torch.float32)
    with pytest.raises(ValueError, match="must divide nheads"):
        tm.mamba2_decode_triton(**{**p, "xbc": torch.zeros(3, 8 * 24 + 2 * 3 * 16, device=DEVICE),
                                   "n_groups": 3, "conv_weight": torch.zeros(8 * 24 + 96, 4, device=DEVICE),
                                   "conv_bias": None, "conv_states": torch.zeros(6, 8 * 24 + 96, 3, device=DEVICE)})
    with pytest.raises(ValueError, match=r"expected x \| B \| C"):
        tm.mamba2_decode_triton(**{**p, "n_groups": 1})
    conv_dim = p["xbc"].shape[1]
    with pytest.raises(ValueError, match="width must be >= 2"):
        tm.mamba2_decode_triton(**{**p, "conv_weight": torch.zeros(conv_dim, 1, device=DEVICE),
                                   "conv_states": torch.zeros(6, conv_dim, 0, device=DEVICE)})


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_replays() -> None:
    """Captured once, replayed twice with new inputs: equals two reference steps (counters reset per replay)."""
    case = CASES["three_tokens_two_groups"]
    p, q, r = (_problem(case, torch.float32, seed=s) for s in (3, 4, 5))
    live, ref = _cloned(p), _cloned(p)
    static = {k: p[k].clone() for k in ("xbc", "z", "dt")}
    run = {**{k: v for k, v in live.items() if k not in static}, "config": dict(case.config)}
    snapshot = (live["conv_states"].clone(), live["ssm_states"].clone())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tm.mamba2_decode_triton(**static, **run)                       # warm-up (compile) outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tm.mamba2_decode_triton(**static, **run)
    live["conv_states"].copy_(snapshot[0])
    live["ssm_states"].copy_(snapshot[1])
    for step in (q, r):
        for k, v in static.items():
            v.copy_(step[k])
        graph.replay()
        inputs = {k: step[k] for k in static}
        r_out = mamba2_decode_ref(**inputs, **{k: v for k, v in ref.items() if k not in inputs})
        torch.testing.assert_close(out, r_out, rtol=2e-5, atol=2e-5)
    for pool in ("conv_states", "ssm_states"):
        torch.testing.assert_close(live[pool], ref[pool], rtol=2e-5, atol=2e-5, equal_nan=True)
