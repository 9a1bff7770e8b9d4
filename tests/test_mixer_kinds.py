"""The mixer-kind registry (``layers/kind.py``), table-driven over every registered kind: each has every hook, round
trips through ``HybridConfig.to_dict`` / ``from_dict``, builds its module as the model does, plans its cache, names
the dimension tensor parallelism cannot split, counts its matrices and declares registered ops. A new kind fails
here until it has an example below."""

from __future__ import annotations

import inspect
import json
import re
import sys

import pytest
import torch

from hybridkv.kv_groups.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec
from hybridkv.layers.kind import MIXER_HOOKS, MixerConfig, RecurrentMixerConfig, mixer_kinds, register_mixer
from hybridkv.layers.ops import reference_ops
from hybridkv.layers.parallel import SINGLE
from hybridkv.models.config import (
    MLP,
    Attention,
    GatedDeltaNet,
    HybridConfig,
    KimiDeltaAttention,
    Layer,
    Mamba1,
    Mamba2,
    MultiLatentAttention,
    ShortConv,
)
from hybridkv.models.hybrid import HybridModel, build_model

HIDDEN = 32

# kind -> a tiny config of it (every size splits over 2 ranks, none over 3)
EXAMPLES: dict[str, MixerConfig] = {
    "Attention": Attention(num_heads=4, num_kv_heads=2, head_dim=8),
    "Mamba2": Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=2),
    "Mamba1": Mamba1(intermediate_size=32, state_size=4, dt_rank=4),
    "ShortConv": ShortConv(channels=32),
    "GatedDeltaNet": GatedDeltaNet(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8),
    "KimiDeltaAttention": KimiDeltaAttention(num_heads=2, head_dim=8),
    "MultiLatentAttention": MultiLatentAttention(num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                                 qk_rope_head_dim=4, v_head_dim=8),
}
SPECS = {"Attention": FullAttentionSpec, "MultiLatentAttention": MLAAttentionSpec}      # the rest: MambaSpec
KINDS = sorted(EXAMPLES)


def _model(mixer: MixerConfig) -> HybridConfig:
    return HybridConfig(vocab_size=64, hidden_size=HIDDEN, max_position_embeddings=128,
                        layers=(Layer(mixer=mixer, ffn=MLP(intermediate_size=64)),))


def test_every_registered_kind_has_an_example() -> None:
    assert sorted(mixer_kinds()) == KINDS


@pytest.mark.parametrize("name", KINDS)
def test_kind_has_every_hook_and_round_trips(name: str) -> None:
    cls, mixer = mixer_kinds()[name], EXAMPLES[name]
    assert type(mixer) is cls and not cls.__abstractmethods__
    assert all(callable(getattr(cls, hook)) for hook in MIXER_HOOKS)
    config = _model(mixer)
    again = HybridConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and type(again.layers[0].mixer) is cls


@pytest.mark.parametrize("name", KINDS)
def test_kind_builds_its_module_as_the_model_does(name: str) -> None:
    mixer = EXAMPLES[name]
    config = _model(mixer)
    module = mixer.build(HIDDEN, cache_name="layers.0", tp=SINGLE, model_config=config)
    in_model = HybridModel(config).layers[0].mixer
    assert type(module) is type(in_model) and module.cache_name == "layers.0"
    assert {n: p.shape for n, p in module.named_parameters()} == {n: p.shape for n, p in in_model.named_parameters()}
    # the matrix count is a lower bound of the module's parameters that counts every weight matrix
    count = sum(p.numel() for p in module.parameters())
    matrices = sum(p.numel() for p in module.parameters() if p.ndim >= 2 and p.numel() >= HIDDEN)
    assert matrices <= mixer.matrix_elements(HIDDEN, HIDDEN) <= count
    model = build_model(config, seed=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for leaf, param in model.layers[0].mixer.named_parameters():          # the kind's own init, where it has one
        rule = mixer.init_parameter(leaf, tuple(param.shape), torch.Generator().manual_seed(0))
        if isinstance(rule, float):
            assert (param == rule).all(), leaf


@pytest.mark.parametrize("name", KINDS)
def test_kind_plans_its_cache_and_checks_tensor_parallel(name: str) -> None:
    mixer = EXAMPLES[name]
    config = _model(mixer)
    for tp in (1, 2):
        config.check_tensor_parallel(tp)
        spec = config.kv_specs(tensor_parallel_size=tp, kv_dtype=torch.bfloat16)["layers.0"]
        assert type(spec) is SPECS.get(name, MambaSpec)
        if isinstance(mixer, RecurrentMixerConfig):
            assert spec.shapes == mixer.state_shapes(tp) and spec.dtypes[0] == torch.bfloat16
            assert spec.dtypes[1:] == (torch.float32,) * (len(spec.shapes) - 1)
    with pytest.raises(ValueError, match=rf"^layers\.0 \({name}\): \w+=\d+ must be divisible by "
                                         rf"tensor_parallel_size=3"):
        config.check_tensor_parallel(3)


@pytest.mark.parametrize("name", KINDS)
def test_kind_declares_the_registered_ops_its_module_calls(name: str) -> None:
    cls = mixer_kinds()[name]
    assert cls.ops and set(cls.ops) <= set(reference_ops())
    source = inspect.getsource(sys.modules[cls.__module__])
    called = set(re.findall(r"\b(?:be|ops|backend|current_ops\(\))\.(\w+)\(", source)) & set(reference_ops())
    assert called <= set(cls.ops), f"{name} calls {sorted(called - set(cls.ops))} without declaring them"


def test_register_refuses_what_is_not_a_complete_kind() -> None:
    with pytest.raises(TypeError, match="not a MixerConfig subclass"):
        register_mixer(int)

    class Half(RecurrentMixerConfig):           # no state_shapes, TP rule, matrices or build
        pass

    with pytest.raises(TypeError, match=r"Half leaves hooks unimplemented: \['build', 'check_tensor_parallel'"):
        register_mixer(Half)

    class Mamba2(Half):                         # a second kind of a registered name  # noqa: N801
        def state_shapes(self, tensor_parallel_size: int = 1) -> tuple[tuple[int, ...], ...]:
            return ((1,),)

        check_tensor_parallel = matrix_elements = build = state_shapes

    with pytest.raises(ValueError, match="a mixer kind named Mamba2 is already registered"):
        register_mixer(Mamba2)
    assert mixer_kinds()["Mamba2"] is type(EXAMPLES["Mamba2"])
