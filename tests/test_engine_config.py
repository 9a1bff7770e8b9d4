"""``EngineConfig``: frozen, keyword-only, every field checked (one error naming each bad field), the rules that
turn settings into numbers, and ``LLM(model, **settings)`` == ``LLM(model, config=EngineConfig(**settings))``."""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch

from hybridkv import LLM, EngineConfig, SamplingParams
from hybridkv.kv_groups.plan import checkpoint_slots
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model


def config() -> HybridConfig:
    attn = Attention(num_heads=2, num_kv_heads=1, head_dim=8)
    return HybridConfig(vocab_size=64, hidden_size=16, max_position_embeddings=128, dtype="bfloat16",
                        eos_token_ids=(1,), layers=(Layer(mixer=attn, ffn=MLP(intermediate_size=32)),
                                                    Layer(mixer=Mamba2(num_heads=2, head_dim=8, state_size=8))))


def test_defaults_frozen_keyword_only() -> None:
    c = EngineConfig()
    assert (c.max_num_seqs, c.enable_prefix_caching, c.backend, c.max_logprobs) == (256, True, "auto", 20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineConfig("cpu")  # type: ignore[misc]
    with pytest.raises(TypeError, match="no_such_setting"):
        EngineConfig(no_such_setting=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("field, value", [
    ("max_num_seqs", 0), ("max_num_seqs", 2.0), ("max_num_seqs", True), ("block_size", -16),
    ("max_model_len", 0), ("max_num_batched_tokens", "2048"), ("tensor_parallel_size", 0),
    ("enable_prefix_caching", 1), ("cuda_graphs", "yes"), ("async_scheduling", 0), ("warmup", "on"),
    ("seed", 1.5), ("max_logprobs", -2), ("distributed_timeout", 0), ("distributed_timeout", float("inf")),
    ("dtype", "float33"), ("dtype", 16), ("device", "gpu"), ("device", 0), ("backend", "cudnn"),
    ("kv_cache_memory", "lots"), ("kv_cache_memory", 0), ("kv_cache_memory", 1.5), ("kv_cache_memory", True),
])
def test_every_bad_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"EngineConfig: .*{field}"):
        EngineConfig(**{field: value})


def test_errors_come_together_and_a_bad_tokenizer_is_a_type_error() -> None:
    with pytest.raises(ValueError, match=r"max_num_seqs.*; .*backend"):
        EngineConfig(max_num_seqs=0, backend="nope")
    with pytest.raises(TypeError, match="encode / decode"):
        EngineConfig(tokenizer=42)


def test_derived_settings() -> None:
    cfg = config()
    c = EngineConfig(device="cpu", kv_cache_memory="1MiB", max_num_seqs=4)
    assert c.resolved_device() == torch.device("cpu")
    assert c.resolved_dtype(cfg, torch.device("cpu")) == torch.float32          # fp32 on the CPU
    assert c.resolved_dtype(cfg, torch.device("cuda")) == torch.bfloat16        # the checkpoint's on CUDA
    assert EngineConfig(dtype="float16").resolved_dtype(cfg, torch.device("cpu")) == torch.float16
    assert c.kv_budget(torch.device("cpu")) == 1 << 20
    assert 0 < EngineConfig().kv_budget(torch.device("cpu")) <= 4 << 30
    assert c.resolved_max_model_len(cfg) == 128 and EngineConfig(max_model_len=64).resolved_max_model_len(cfg) == 64
    assert c.step_tokens(128) == 2048 and c.step_tokens(32768) == 8192
    assert EngineConfig(max_num_batched_tokens=96).step_tokens(128) == 96
    plan = c.plan(cfg, kv_dtype=torch.float32, budget=1 << 20)
    specs = cfg.kv_specs(block_size=cfg.default_block_size(), kv_dtype=torch.float32)
    assert plan.max_model_len == 128 and plan.num_checkpoint_slots == checkpoint_slots(
        specs, kv_memory=1 << 20, max_num_seqs=4) > 0                             # Mamba layers: checkpoints
    assert EngineConfig(enable_prefix_caching=False).plan(cfg, kv_dtype=torch.float32,
                                                          budget=1 << 20).num_checkpoint_slots == 0
    ranks = EngineConfig(tokenizer="/some/dir", max_num_seqs=8).for_ranks()
    assert ranks.tokenizer is None and ranks.max_num_seqs == 8
    buffer = io.BytesIO()
    torch.save(ranks, buffer)                                                    # how ranks receive it
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False) == ranks == pickle.loads(pickle.dumps(ranks))


def test_llm_takes_settings_or_a_config() -> None:
    model = build_model(config(), seed=0)
    settings = dict(device="cpu", block_size=4, max_num_seqs=4, kv_cache_memory="1MiB", seed=3)
    by_kwargs = LLM(model, **settings)
    by_config = LLM(model, config=EngineConfig(**settings))
    overridden = LLM(model, config=EngineConfig(**settings), max_num_seqs=2)
    assert by_kwargs.config == by_config.config and by_kwargs.plan == by_config.plan
    assert overridden.config.max_num_seqs == 2 and overridden.engine.scheduler.config.max_num_seqs == 2
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = [llm.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids for llm in (by_kwargs, by_config)]
    assert outs[0] == outs[1]
    with pytest.raises(TypeError, match="EngineConfig"):
        LLM(model, config={"device": "cpu"})  # type: ignore[arg-type]
