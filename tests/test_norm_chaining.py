"""Each layer's last residual add applies the next layer's input norm (and the last one the final norm) in the
same backend op (``DecoderLayer.forward``'s ``normed`` / ``next_norm``): the same numbers as one norm launch
per layer, with one ``rms_norm`` per forward (the first layer's) instead of one per layer.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from hybridkv.backends.registry import torch_backend
from hybridkv.forward_context import ForwardContext, current_ops, forward_context
from hybridkv.models import MLP, HybridConfig, Layer, MoE
from hybridkv.models.hybrid import build_model


def _config(*, sandwich: bool, fp32_residual: bool) -> HybridConfig:
    layers = (Layer(ffn=MLP(intermediate_size=24), sandwich_norm=sandwich),
              Layer(ffn=MoE(num_experts=4, top_k=2, intermediate_size=16), sandwich_norm=sandwich),
              Layer(ffn=MLP(intermediate_size=24, activation="gelu_tanh"), sandwich_norm=sandwich))
    return HybridConfig(vocab_size=37, hidden_size=16, layers=layers, max_position_embeddings=32, dtype="bfloat16",
                        norm="gemma_rms" if sandwich else "rms", residual_in_fp32=fp32_residual)


def _counting_backend(calls: Counter):
    base = torch_backend()

    def counted(name):
        fn = getattr(base, name)

        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run
    return dataclasses.replace(base, rms_norm=counted("rms_norm"), add_rms_norm=counted("add_rms_norm"))


def _unchained(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The forward with every layer normalising its own input and a separate final norm."""
    x = model.embed_tokens(ids)
    embeddings = x
    if model.config.residual_in_fp32:
        x = x.float()
    for layer in model.layers:
        x, normed = layer(x, positions, embeddings)
        assert normed is None
    norm = model.norm
    return current_ops().rms_norm(x, norm.weight, eps=norm.eps, gemma=norm.gemma)


@pytest.mark.parametrize("sandwich,fp32_residual", [(False, False), (True, False), (False, True)])
def test_chained_norms_equal_per_layer_norms(sandwich: bool, fp32_residual: bool) -> None:
    model = build_model(_config(sandwich=sandwich, fp32_residual=fp32_residual), dtype=torch.bfloat16, seed=1)
    ids = torch.randint(0, 37, (11,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)
    calls: Counter = Counter()
    with torch.no_grad(), forward_context(ForwardContext(inputs={}, backend=_counting_backend(calls))):
        chained = model(ids, positions)
        counted = dict(calls)
        unchained = _unchained(model, ids, positions)
    assert chained.dtype == unchained.dtype and torch.equal(chained, unchained)
    # One add per layer; a norm launch for the first layer only, plus the final norm of an fp32 stream
    # (HF's final norm reads it unrounded, so that one is not chained).
    assert counted == {"rms_norm": 1 + fp32_residual, "add_rms_norm": 3}
    assert calls["rms_norm"] - counted["rms_norm"] == 3 + 1      # the unchained forward: every layer + final
