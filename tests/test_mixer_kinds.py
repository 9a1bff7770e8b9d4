"""The mixer-kind registry (``layers/kind.py``): what it accepts and refuses."""

from __future__ import annotations

import pytest

from hybridkv.layers.kind import MixerConfig, RecurrentMixerConfig, register_mixer


def test_register_refuses_what_is_not_a_complete_kind() -> None:
    with pytest.raises(TypeError, match="not a MixerConfig subclass"):
        register_mixer(int)

    class Half(RecurrentMixerConfig):           # no state_shapes, TP rule, matrices or build
        pass

    with pytest.raises(TypeError, match=r"Half leaves hooks unimplemented: \['build', 'check_tensor_parallel'"):
        register_mixer(Half)
    assert issubclass(Half, MixerConfig)
