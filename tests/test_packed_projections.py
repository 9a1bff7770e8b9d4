"""Packed projections (``HybridModel.fuse_projections``): q|k|v and gate|up as one GEMM each, with the
parameters turned into views of the packed tensor. The model's outputs, ``state_dict`` and saved files must
not change; a module moved after packing must notice the broken views and run unpacked."""

from __future__ import annotations

import torch

from hybridkv.engine.model_runner import reference_logits
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model, load_model, save_model


def _config() -> HybridConfig:
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    layers = (Layer(mixer=attn, ffn=MLP(intermediate_size=24)),
              Layer(mixer=Mamba2(num_heads=4, head_dim=8, state_size=4, chunk_size=4), ffn=MLP(intermediate_size=24)))
    return HybridConfig(vocab_size=40, hidden_size=32, layers=layers, max_position_embeddings=32, dtype="float32")


def test_packing_changes_nothing_observable(tmp_path) -> None:
    model = build_model(_config(), seed=2)
    ids = list(range(3, 15))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = reference_logits(model, ids)            # the runner packs: compare with an unpacked twin
    twin = build_model(_config(), seed=2)
    attention = model.layers[0].mixer
    assert attention.packed is not None and attention.packed.valid()
    assert attention.q_proj.weight.data_ptr() == attention.packed.weight.data_ptr()
    assert model.layers[0].ffn.packed is not None
    assert twin.layers[0].mixer.packed is None
    torch.testing.assert_close(reference_logits(twin, ids), ref, rtol=1e-6, atol=1e-6)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    save_model(model, tmp_path)                   # views are saved as tensors of their own
    loaded = load_model(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)


def test_a_moved_module_runs_unpacked() -> None:
    model = build_model(_config(), seed=2)
    model.fuse_projections()
    model.to(torch.float64)                       # replaces every parameter: the views are gone
    assert not model.layers[0].mixer.packed.valid()
    assert not model.layers[0].ffn.packed.valid()
    twin = build_model(_config(), seed=2).to(torch.float64)
    ids = list(range(5, 12))
    torch.testing.assert_close(reference_logits(model, ids), reference_logits(twin, ids))


def test_mixed_biases_are_not_packed_and_modules_run_outside_a_step() -> None:
    """Linears with and without a bias cannot share one GEMM: they stay unpacked. A module called on its
    own (no step, no forward context) runs on the torch references (``current_ops``)."""
    from torch import nn

    from hybridkv.forward_context import current_ops
    from hybridkv.layers.linear import PackedLinears
    from hybridkv.layers.mlp import DenseMLP

    assert not PackedLinears.can_pack(nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False))
    assert not PackedLinears.can_pack(nn.Linear(8, 4), nn.Linear(6, 4))
    assert current_ops().name == "torch"
    torch.manual_seed(0)
    mlp = DenseMLP(8, 12)
    x = torch.randn(3, 8)
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    mlp.fuse_projections()
    assert mlp.packed is not None and mlp.packed.valid()
    torch.testing.assert_close(mlp(x), want)


def test_a_replaced_parameter_unpacks_and_packing_twice_changes_nothing() -> None:
    model = build_model(_config(), seed=2)
    model.fuse_projections()
    attention = model.layers[0].mixer
    packed = attention.packed
    model.fuse_projections()                      # idempotent: the same packed tensors stay
    assert attention.packed is packed and packed.valid()
    with torch.no_grad():
        attention.v_proj.weight = torch.nn.Parameter(attention.v_proj.weight * 2)
    assert not attention.packed.valid()           # any replaced parameter, not only the first one
    twin = build_model(_config(), seed=2)
    with torch.no_grad():
        twin.layers[0].mixer.v_proj.weight.mul_(2)
    ids = list(range(4, 11))
    torch.testing.assert_close(reference_logits(model, ids), reference_logits(twin, ids))


def test_a_mamba2_model_built_under_inference_mode_runs() -> None:
    """Parameters made under ``torch.inference_mode`` have no version counter: Mamba2's cached -exp(A_log)
    must not need one."""
    with torch.inference_mode():
        model = build_model(_config(), seed=3)
        logits = reference_logits(model, list(range(3, 12)))
    assert torch.isfinite(logits).all()
