"""LFM2's short convolution is the existing causal conv1d op with no activation: ``y = out_proj(C * conv(B * x))``
with a depthwise causal conv of width ``conv_L_cache`` (3) whose state holds the last width - 1 gated inputs. Checked
against HF's ``Lfm2ShortConv`` on a full sequence, through our packed prefill pieces and one-token decode updates
(reference and Triton twin)."""

from __future__ import annotations

import pytest
import torch
from _triton import DEVICE, kernel_module

from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref

lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2", reason="transformers without LFM2")


def _hf_module(bias: bool) -> torch.nn.Module:
    from transformers import Lfm2Config

    cfg = Lfm2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, conv_L_cache=3, conv_bias=bias, layer_types=["conv"])
    torch.manual_seed(0)
    return lfm2.Lfm2ShortConv(cfg, layer_idx=0).eval()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("triton", [False, True])
def test_short_conv_is_causal_conv1d_without_activation(bias, triton):
    conv, conv_update = causal_conv1d_ref, causal_conv1d_update_ref
    if triton:
        tc = kernel_module("hybridkv.backends.triton_conv1d")
        conv, conv_update = tc.causal_conv1d_triton, tc.causal_conv1d_update_triton
    m = _hf_module(bias).to(DEVICE)
    hidden, total, prefill = 16, 11, (1, 5)              # pieces of 1 and 4 tokens, then 6 decode steps
    h = torch.randn(1, total, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        y_hf = m(h)[0]                                    # (total, hidden)
        B, C, x = m.in_proj(h[0]).chunk(3, dim=-1)        # (total, hidden) each
        bx = B * x
        weight = m.conv.weight[:, 0]                      # (hidden, width)
        states = torch.full((2, hidden, weight.shape[1] - 1), float("nan"), device=DEVICE)
        ys, t = [], 0
        for i, end in enumerate(prefill):
            ys.append(conv(bx[t:end], weight, m.conv.bias, conv_states=states,
                           query_start_loc=torch.tensor([0, end - t], device=DEVICE),
                           state_indices=torch.tensor([1], device=DEVICE),
                           has_initial_state=torch.tensor([i > 0], device=DEVICE), activation=None))
            t = end
        for d in range(prefill[-1], total):
            ys.append(conv_update(bx[d:d + 1], conv_states=states, weight=weight, bias=m.conv.bias,
                                  state_indices=torch.tensor([1], device=DEVICE), activation=None))
        y = m.out_proj(C * torch.cat(ys))
    torch.testing.assert_close(y, y_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], bx[-2:].T)      # the state: the last width - 1 gated inputs
