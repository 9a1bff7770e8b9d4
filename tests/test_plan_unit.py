"""Grouping and pool sizing on hand-made layer mixes (real model configs live in test_plan_real_configs)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kv_groups.plan import group_layers, plan_kv_cache
from hybridkv.kv_groups.specs import FullAttentionSpec, MambaSpec
from tests._kv_helpers import chunked, full, mamba, sliding


def mix(*parts: tuple[object, int]) -> dict:
    out = {}
    for spec, n in parts:
        for _ in range(n):
            out[f"layers.{len(out)}"] = spec
    return out


@pytest.mark.parametrize(("parts", "sizes", "kinds"), [
    (((full(), 12), (chunked(8), 36)), [12] * 4, ["full"] + ["chunked_local"] * 3),
    (((full(), 10), (sliding(8), 52)), [2] * 31, ["full"] * 5 + ["sliding_window"] * 26),
    (((full(), 3), (sliding(8), 2)), [1] * 5, ["full"] * 3 + ["sliding_window"] * 2),
    (((mamba(), 7), (full(), 2), (sliding(8), 4)), [7, 2, 2, 2], ["mamba", "full"] + ["sliding_window"] * 2),
    (((sliding(8), 2), (sliding(16), 2)), [2, 2], ["sliding_window"] * 2),
])
def test_grouping_splits_by_gcd(parts: tuple, sizes: list[int], kinds: list[str]) -> None:
    groups = group_layers(mix(*parts))
    assert [len(g.layer_names) for g in groups] == sizes
    assert [g.kind for g in groups] == kinds
    assert [g.group_id for g in groups] == list(range(len(groups)))
    names = [n for g in groups for n in g.layer_names]
    assert sorted(names) == sorted(mix(*parts)) and len(set(names)) == len(names)


def test_grouping_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        group_layers({})
    with pytest.raises(ValueError, match="block_size"):
        group_layers({"a": full(4), "b": full(8)})
    with pytest.raises(TypeError, match="KVCacheSpec"):
        group_layers({"a": "full"})  # type: ignore[dict-item]


def test_pool_sizing_fits_budget_and_counts_requests() -> None:
    layers = mix((full(16, heads=2, head_size=8), 2), (sliding(64, 16, heads=2, head_size=8), 6))
    budget = 10 << 20
    p = plan_kv_cache(layers, max_model_len=4096, kv_memory=budget, step_tokens=256)
    token = 2 * 2 * 8 * 4                                     # K+V x heads x head_size x fp32
    assert p.layers_per_block == 2 and p.page_bytes == 2 * 16 * token and len(p.groups) == 4
    assert p.allocated_bytes <= budget and budget - p.allocated_bytes < p.page_bytes
    per_req = p.bytes_per_request_max
    assert per_req == (256 + 3 * (4 + 1)) * p.page_bytes         # full: 4096/16; sliding: cdiv(64,16)+1
    assert p.reserved_step_blocks == 3 * 16                      # 3 groups x (cdiv(63+256,16)+1 - 5)
    fixed = (1 + p.reserved_step_blocks) * p.page_bytes
    assert p.max_concurrent_requests == (budget - fixed) // per_req
    assert p.max_concurrent_requests_if_all_full == (budget - p.page_bytes) // (4 * 256 * p.page_bytes)
    assert p.num_blocks * p.page_bytes >= fixed + p.max_concurrent_requests * per_req


def test_max_num_seqs_caps_concurrency_and_slots() -> None:
    p = plan_kv_cache(mix((mamba(16), 4), (full(16), 2)), max_model_len=256, kv_memory=64 << 20,
                      max_num_seqs=3, num_checkpoint_slots=5)
    assert p.max_concurrent_requests == 3 and p.num_state_slots == 1 + 5 + 3


def test_budget_too_small_names_the_bytes_needed() -> None:
    layers = mix((full(16, heads=4, head_size=64), 4))
    with pytest.raises(ValueError, match=r"too small for one request of max_model_len=8192: it needs "
                                         r"[0-9.]+ MiB"):
        plan_kv_cache(layers, max_model_len=8192, kv_memory=1 << 20)


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(max_model_len=0, kv_memory=1 << 20), "max_model_len"),
    (dict(max_model_len=16, kv_memory=0), "kv_memory"),
    (dict(max_model_len=16, kv_memory=1 << 20, max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=16, kv_memory=1 << 20, num_checkpoint_slots=-1), "num_checkpoint_slots"),
])
def test_bad_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plan_kv_cache(mix((full(), 1)), **kwargs)


def test_mamba_hybrid_default_block_size_has_no_padding() -> None:
    m = MambaSpec(shapes=((4, 8192 + 2 * 128), (128, 64, 128)), dtypes=(torch.bfloat16, torch.float32))
    attn = FullAttentionSpec(num_kv_heads=8, head_size=128)
    p = plan_kv_cache(mix((m, 28), (attn, 4)), max_model_len=32768, kv_memory=40 << 30,
                      num_checkpoint_slots=8)
    assert p.block_size == 16 and p.padding_bytes == 0
    assert p.allocated_bytes / p.budget_bytes <= 1.0
    needed = p.max_concurrent_requests * p.bytes_per_request_max
    assert p.allocated_bytes >= needed and p.num_checkpoint_slots == 8
    assert p.num_state_slots >= 1 + 8 + p.max_concurrent_requests      # working slots never go to checkpoints


def test_padding_when_attention_specs_differ_in_width() -> None:
    p = plan_kv_cache(mix((full(16, heads=2, head_size=8), 1), (sliding(32, 16, heads=1, head_size=8), 1)),
                      max_model_len=256, kv_memory=1 << 20)
    narrow = sliding(32, 16, heads=1, head_size=8)
    per_req_blocks = narrow.steady_blocks_per_request(256)
    assert p.padding_bytes == p.max_concurrent_requests * per_req_blocks * narrow.bytes_per_block


def test_to_dict_keys() -> None:
    p = plan_kv_cache(mix((mamba(16), 2), (full(16), 1), (sliding(32, 16), 1)), max_model_len=256,
                      kv_memory=1 << 20, num_checkpoint_slots=2)
    d = p.to_dict()
    assert set(d) == {
        "max_model_len", "step_tokens", "budget_bytes", "allocated_bytes", "block_size", "layers_per_block",
        "page_bytes", "num_blocks", "num_state_slots", "num_checkpoint_slots", "checkpoint_bytes",
        "num_host_checkpoint_slots", "host_checkpoint_bytes", "num_staging_slots", "reserved_step_blocks", "groups",
        "bytes_per_request_max", "bytes_per_request_if_all_full_attention", "padding_bytes",
        "kv_shared_layers", "kv_shared_bytes_per_request", "max_concurrent_requests",
        "max_concurrent_requests_if_all_full_attention", "concurrency_vs_all_full_attention"}
    common = {"group_id", "kind", "spec", "layers", "block_size", "bytes_per_block", "blocks_per_request_max",
              "bytes_per_request_max"}
    kinds = {g["kind"]: g for g in d["groups"]}
    assert set(kinds["mamba"]) == common | {"num_slots"}
    assert set(kinds["full"]) == set(kinds["sliding_window"]) == common | {"num_blocks"}
    assert kinds["mamba"]["num_slots"] == p.num_state_slots and kinds["full"]["num_blocks"] == p.num_blocks
