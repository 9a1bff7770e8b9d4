"""The router kernel (``backends/triton_moe.py``: ``moe_route``) against ``moe_route_ref``.

Without CUDA the kernel runs under Triton's interpreter; with CUDA compiled, on bf16 logits as the model
produces them. Expert ids must be equal (logits drawn without near-ties), weights close to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from _triton import DEVICE, HAS_CUDA, kernel_module
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.layers.ops.fused_ref import moe_route_ref

tm = kernel_module("hybridkv.backends.triton_moe")


def _logits(tokens: int, experts: int, *, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct values a clear margin apart in every row (a permutation of a spaced grid), so the top-k is
    unambiguous in any precision."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-4.0, 4.0, experts)
    rows = torch.stack([grid[torch.randperm(experts, generator=g)] for _ in range(tokens)]) if tokens else \
        torch.empty(0, experts)
    return rows.to(dtype).to(DEVICE)


def _check(logits: torch.Tensor, **kw) -> None:
    ids, w = tm.moe_route(logits, **kw)
    ref_ids, ref_w = moe_route_ref(logits, **kw)
    assert ids.dtype == ref_ids.dtype == torch.int64 and w.dtype == ref_w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)


# (router, experts, top_k, renormalize, scaling): Llama-4 (top-1 sigmoid of the logit), Mixtral / Jamba
# (softmax, renormalised or not), NemotronH without expert groups (sigmoid + bias, renormalised, scaled),
# a non-power-of-two expert count, 128 experts with top-8, gpt-oss (softmax over the top-k logits).
CASES = [
    ("sigmoid_input", 4, 1, False, 1.0),
    ("sigmoid_input", 16, 2, True, 1.0),
    ("softmax", 8, 2, True, 1.0),
    ("softmax", 16, 4, False, 1.0),
    ("softmax", 6, 3, True, 2.5),
    ("sigmoid_bias", 12, 3, True, 2.5),
    ("sigmoid_bias", 128, 8, False, 1.0),
    ("topk_softmax", 32, 4, False, 1.0),      # gpt-oss-20b's router shape
    ("topk_softmax", 12, 3, True, 2.0),
]


@pytest.mark.parametrize("router,experts,top_k,renormalize,scaling", CASES)
def test_route_matches_reference(router: str, experts: int, top_k: int, renormalize: bool, scaling: float) -> None:
    logits = _logits(5, experts, seed=experts + top_k)
    bias = (torch.linspace(-0.01, 0.01, experts).to(DEVICE) if router == "sigmoid_bias" else None)
    _check(logits, router=router, top_k=top_k, renormalize=renormalize, scaling=scaling, correction_bias=bias)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 9), experts=st.integers(1, 70), data=st.data())
def test_route_random_batches(tokens: int, experts: int, data: st.DataObject) -> None:
    router = data.draw(st.sampled_from(["softmax", "sigmoid_input", "sigmoid_bias", "topk_softmax"]))
    top_k = data.draw(st.integers(1, min(experts, 8)))
    bias = torch.linspace(-0.001, 0.001, experts).to(DEVICE) if router == "sigmoid_bias" else None
    _check(_logits(tokens, experts, seed=data.draw(st.integers(0, 999))), router=router, top_k=top_k,
           renormalize=data.draw(st.booleans()), scaling=data.draw(st.sampled_from([1.0, 0.5])),
           correction_bias=bias)


def test_bias_steers_choice_not_weights() -> None:
    """sigmoid_bias: a large bias on the worst expert selects it, with its own (small) sigmoid score."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], device=DEVICE)
    ids, w = tm.moe_route(logits, router="sigmoid_bias", top_k=2, correction_bias=bias)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(w.cpu(), torch.sigmoid(torch.tensor([[-3.0, 2.0]])))


def test_ties_go_to_the_lowest_expert() -> None:
    ids, _ = tm.moe_route(torch.tensor([[0.5, 1.0, 1.0, 1.0]], device=DEVICE), router="sigmoid_input", top_k=2)
    assert ids.tolist() == [[1, 2]]


def test_topk_softmax_is_softmax_over_the_chosen_logits() -> None:
    """gpt-oss: the k largest logits, then their softmax (HF ``GptOssTopKRouter``), weights summing to one."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]], device=DEVICE)
    ids, w = tm.moe_route(logits, router="topk_softmax", top_k=3)
    assert ids.tolist() == [[3, 0, 2]]
    torch.testing.assert_close(w.cpu(), torch.tensor([[3.0, 2.0, 0.5]]).softmax(-1))


def test_expert_groups_run_the_reference() -> None:
    logits = _logits(3, 16, seed=3)
    bias = torch.zeros(16, device=DEVICE)
    kw = dict(router="sigmoid_bias", top_k=2, renormalize=True, correction_bias=bias, num_groups=4, topk_groups=2)
    ids, w = tm.moe_route(logits, **kw)
    ref_ids, ref_w = moe_route_ref(logits, **kw)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


@pytest.mark.parametrize("kw,match", [
    (dict(router="top1", top_k=1), "router must be one of"),
    (dict(router="softmax", top_k=5), r"top_k=5 must be in \[1, num_experts=4\]"),
    (dict(router="sigmoid_bias", top_k=1), r"needs a \(4,\) correction_bias"),
])
def test_bad_input(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tm.moe_route_triton(torch.zeros(2, 4, device=DEVICE), **kw)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (bf16 logits, compiled kernel)")
def test_bf16_logits_on_gpu() -> None:
    for router, experts, top_k in (("sigmoid_input", 4, 1), ("softmax", 64, 6), ("sigmoid_bias", 128, 8),
                                   ("topk_softmax", 128, 4)):
        bias = torch.linspace(-0.01, 0.01, experts, device=DEVICE) if router == "sigmoid_bias" else None
        _check(_logits(33, experts, seed=experts, dtype=torch.bfloat16), router=router, top_k=top_k,
               renormalize=True, scaling=1.5, correction_bias=bias)


@pytest.mark.parametrize("tokens", [1, 3, 20])          # 20: past LINEAR_ROUTE_MAX_ROWS, the linear then the route
@pytest.mark.parametrize("router,experts,top_k,renormalize,scaling", CASES[1:8])
def test_linear_route_matches_reference(router: str, experts: int, top_k: int, renormalize: bool, scaling: float,
                                        tokens: int) -> None:
    """The router's projection and the routing in one kernel (``linear_moe_route``) against ``linear`` then
    ``moe_route``: one-hot inputs pick rows of a weight holding the spaced logits (exact in fp32), two extra rows
    past the experts (Qwen3-Next's shared-expert gate rides along), a router bias (gpt-oss), an input wider than one
    K step (2100 features); the arrival counters are zero again afterwards."""
    from hybridkv.backends.triton_linear import counters
    from hybridkv.layers.ops.fused_ref import linear_moe_route_ref

    n, k = experts + 2, 2100 if router == "topk_softmax" else max(tokens, 8) + 3
    want = torch.cat([_logits(tokens, experts, seed=experts), torch.randn(tokens, 2).to(DEVICE)], dim=1)
    x = torch.eye(tokens, k, device=DEVICE)
    weight = torch.zeros(n, k, device=DEVICE)
    weight[:, :tokens] = want.T
    bias = torch.linspace(-0.01, 0.01, n, device=DEVICE) if router == "topk_softmax" else None
    corr = torch.linspace(-0.01, 0.01, experts).to(DEVICE) if router == "sigmoid_bias" else None
    kw = dict(num_experts=experts, router=router, top_k=top_k, renormalize=renormalize, scaling=scaling,
              correction_bias=corr)
    ids, w, logits = tm.linear_moe_route(x, weight, bias, **kw)
    ref_ids, ref_w, ref_logits = linear_moe_route_ref(x, weight, bias, **kw)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)
    assert int(counters(x.device).count_nonzero()) == 0
