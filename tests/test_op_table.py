"""The open op table (``layers/ops/registry.py``) and the backends made from it (``backends/base.py``): every op
defaults to its reference twin, a backend overrides only the ops it has kernels for."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from hybridkv.backends.base import KernelBackend, torch_backend
from hybridkv.layers import ops as ref
from hybridkv.layers.ops import fused_ref, reference_op, reference_ops
from hybridkv.layers.ops import registry as op_registry

# op -> the reference twin it must default to (the signatures every backend implements)
REFERENCES = {
    "paged_attention": ref.paged_attention_ref, "write_kv": ref.write_kv_ref,
    "causal_conv1d": ref.causal_conv1d_ref, "causal_conv1d_update": ref.causal_conv1d_update_ref,
    "ssd_chunk_scan": ref.ssd_chunk_scan_ref, "ssd_state_update": ref.ssd_state_update_ref,
    "selective_scan": ref.selective_scan_ref, "selective_state_update": ref.selective_state_update_mamba1_ref,
    "gated_delta_rule": ref.gated_delta_rule_ref, "gated_delta_rule_update": ref.gated_delta_rule_update_ref,
    "kda": ref.kda_ref, "kda_update": ref.kda_update_ref,
    "rms_norm": fused_ref.rms_norm_ref, "add_rms_norm": fused_ref.add_rms_norm_ref, "act_mul": fused_ref.act_mul_ref,
    "linear": fused_ref.linear_ref, "linear_act_mul": fused_ref.linear_act_mul_ref, "argmax": fused_ref.argmax_ref,
    "linear_argmax": fused_ref.linear_argmax_ref, "qk_rope_write_kv": fused_ref.qk_rope_write_kv_ref,
    "rope_attention": fused_ref.rope_attention_ref, "gated_rms_norm": fused_ref.gated_rms_norm_ref,
    "moe_route": fused_ref.moe_route_ref, "linear_moe_route": fused_ref.linear_moe_route_ref,
}


def _kernel(*args: object, **kwargs: object) -> str:
    return "kernel"


def test_every_op_defaults_to_its_reference() -> None:
    assert dict(reference_ops()) == REFERENCES
    backend = torch_backend()
    assert backend.overrides == {} and backend.ops() == REFERENCES
    assert all(getattr(backend, op) is fn for op, fn in REFERENCES.items())


def test_a_backend_overrides_only_its_ops() -> None:
    backend = KernelBackend(name="k", act_mul=_kernel, cuda_graph_safe=True)
    assert backend.act_mul is _kernel and dict(backend.overrides) == {"act_mul": _kernel}
    assert backend.paged_attention is ref.paged_attention_ref and backend.cuda_graph_safe
    # ``dataclasses.replace`` composes (the registry's vendor overrides and fallbacks are made so)
    more = dataclasses.replace(backend, name="k+v", write_kv=_kernel)
    assert (more.name, set(more.overrides), more.act_mul, more.cuda_graph_safe) == (
        "k+v", {"act_mul", "write_kv"}, _kernel, True)
    back = dataclasses.replace(more, act_mul=fused_ref.act_mul_ref)       # the reference again: not an override
    assert set(back.overrides) == {"write_kv"} and back.act_mul is fused_ref.act_mul_ref
    assert back == KernelBackend(name="k+v", write_kv=_kernel, cuda_graph_safe=True) != more
    assert hash(back) == hash(KernelBackend(name="k+v", write_kv=_kernel, cuda_graph_safe=True))
    assert pickle.loads(pickle.dumps(back)) == back
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.act_mul = fused_ref.act_mul_ref


def test_unknown_ops_are_errors() -> None:
    with pytest.raises(TypeError, match="kernel backend 'k': unknown op.s. pagd_attention"):
        KernelBackend(name="k", pagd_attention=_kernel)
    with pytest.raises(AttributeError, match="kernel backend 'torch' has no op 'nope'"):
        torch_backend().nope  # noqa: B018


def test_an_op_registered_later_is_its_reference_in_every_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    made_before = torch_backend()

    def late_op_ref() -> str:
        return "reference"

    monkeypatch.setitem(op_registry._REFERENCES, "late_op", late_op_ref)
    assert made_before.late_op is late_op_ref
    assert KernelBackend(name="k", late_op=_kernel).late_op is _kernel


def test_an_op_has_one_reference() -> None:
    with pytest.raises(ValueError, match="backend op 'act_mul' already has the reference .*fused_ref.act_mul_ref"):
        reference_op("act_mul")(_kernel)
    assert reference_op("act_mul")(fused_ref.act_mul_ref) is fused_ref.act_mul_ref      # itself again: a reload
    assert reference_ops()["act_mul"] is fused_ref.act_mul_ref


def test_triton_overrides_all_but_mamba1() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    from hybridkv.backends.triton_backend import triton_backend

    backend = triton_backend()
    assert set(reference_ops()) - set(backend.overrides) == {"selective_scan", "selective_state_update"}
    assert backend.selective_scan is ref.selective_scan_ref and backend.cuda_graph_safe
