"""Cross-layer KV sharing (``KVSharingSpec``) in the plan, the cache allocator, the block allocator and the
config; and groups sized by their own KV shape (no padding) when a model mixes head dims and kv-head counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.kv_groups.cache_tensors import allocate_kv_cache
from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.plan import group_layers, plan_kv_cache
from hybridkv.kv_groups.specs import KVSharingSpec
from hybridkv.models.config import MLP, Attention, HybridConfig, Layer
from tests._kv_helpers import full, sliding


def _layers(*, with_readers: bool) -> dict:
    """Gemma-4's shape in miniature: sliding layers (1 KV head of 4), global ones twice as wide (2 heads of 4);
    with readers, two more layers read the last global / sliding owner's cache."""
    s, g = sliding(8), full(heads=2)
    layers = {"l0": s, "l1": s, "l2": g, "l3": s, "l4": s, "l5": g}
    if with_readers:
        layers["l6"] = KVSharingSpec(block_size=4, donor="l5", target=g)
        layers["l7"] = KVSharingSpec(block_size=4, donor="l4", target=s)
    return layers


def test_readers_join_their_donors_group_and_own_no_pages() -> None:
    plain = plan_kv_cache(_layers(with_readers=False), max_model_len=64, kv_memory=1 << 16, step_tokens=8)
    shared = plan_kv_cache(_layers(with_readers=True), max_model_len=64, kv_memory=1 << 16, step_tokens=8)
    # the plan is the plan without the readers: same groups, pages, pool and per-request bytes
    assert [g.layer_names for g in shared.groups] == [g.layer_names for g in plain.groups]
    for name in ("page_bytes", "num_blocks", "bytes_per_request_max", "max_concurrent_requests", "padding_bytes"):
        assert getattr(shared, name) == getattr(plain, name), name
    readers = {r: (g.group_id, d) for g in shared.groups for r, d in g.readers}
    donor_group = {n: g.group_id for g in shared.groups for n in g.layer_names}
    assert readers == {"l6": (donor_group["l5"], "l5"), "l7": (donor_group["l4"], "l4")}
    assert all("l6" not in g.layer_names and "l7" not in g.layer_names for g in shared.groups)
    g, s = full(heads=2), sliding(8)
    saved = 16 * g.bytes_per_block + s.max_blocks_per_request(num_tokens=64, step_tokens=1) * s.bytes_per_block
    assert shared.kv_shared_bytes_per_request == saved and plain.kv_shared_bytes_per_request == 0
    report = shared.to_dict()
    assert report["kv_shared_layers"] == 2 and report["kv_shared_bytes_per_request"] == saved
    assert report["groups"][donor_group["l5"]]["kv_shared_layers"] == {"l6": "l5"}
    assert "2 KV-sharing layers save" in shared.summary()


def test_allocator_gives_readers_their_donors_tensor() -> None:
    plan = plan_kv_cache(_layers(with_readers=True), max_model_len=64, kv_memory=1 << 16, step_tokens=8)
    caches = allocate_kv_cache(plan)
    assert caches["l6"][0] is caches["l5"][0] and caches["l7"][0] is caches["l4"][0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for (t,) in caches.values()}
    assert storages == {caches["l0"][0].untyped_storage().data_ptr(): plan.num_blocks * plan.page_bytes}


def test_block_allocator_keeps_no_table_for_readers() -> None:
    """The coordinator allocates per plan group: a request's blocks are those of the model without readers."""
    blocks = {}
    for with_readers in (False, True):
        plan = plan_kv_cache(_layers(with_readers=with_readers), max_model_len=64, kv_memory=1 << 16, step_tokens=8)
        coordinator = KVCacheCoordinator(plan, max_num_reqs=2)
        coordinator.add_waiting("r", list(range(40)))
        assert coordinator.allocate("r", num_computed_tokens=0, num_new_tokens=40)
        blocks[with_readers] = [coordinator.block_ids("r", g.group_id).tolist() for g in plan.groups]
        free = coordinator.num_free_blocks
        blocks[with_readers].append(free)
    assert blocks[True] == blocks[False]


def test_groups_sized_by_their_own_shape() -> None:
    """20 sliding layers of one width and 4 global ones of twice it (Gemma-4 E4B's owners): 5 groups of 4 and 2
    groups of 2, every page full; counts no exact split divides fall back to gcd groups padded to the widest."""
    s, g = sliding(8), full(heads=2)
    layers = {f"s{i}": s for i in range(20)} | {f"g{i}": g for i in range(4)}
    plan = plan_kv_cache(layers, max_model_len=64, kv_memory=1 << 18, step_tokens=8)
    assert sorted(len(x.layer_names) for x in plan.attention_groups) == [2, 2, 4, 4, 4, 4, 4]
    assert plan.page_bytes == 4 * s.bytes_per_block == 2 * g.bytes_per_block and plan.padding_bytes == 0
    odd = plan_kv_cache({"s0": s, "g0": g, "g1": g}, max_model_len=64, kv_memory=1 << 18, step_tokens=8)
    assert [len(x.layer_names) for x in odd.attention_groups] == [1, 1, 1] and odd.padding_bytes > 0


def test_reader_errors() -> None:
    s, g = sliding(8), full(heads=2)
    with pytest.raises(ValueError, match="not a planned layer"):
        group_layers({"a": s, "b": KVSharingSpec(block_size=4, donor="x", target=s)})
    with pytest.raises(ValueError, match="keeps none"):
        group_layers({"a": s, "b": KVSharingSpec(block_size=4, donor="a", target=s),
                      "c": KVSharingSpec(block_size=4, donor="b", target=s)})
    with pytest.raises(ValueError, match="expects"):
        group_layers({"a": s, "b": KVSharingSpec(block_size=4, donor="a", target=g)})
    with pytest.raises(ValueError, match="block_size"):
        KVSharingSpec(block_size=8, donor="a", target=s)


def _config(*mixers: Attention) -> HybridConfig:
    return HybridConfig(vocab_size=32, hidden_size=16, layers=tuple(
        Layer(mixer=m, ffn=MLP(intermediate_size=16)) for m in mixers))


def test_config_kv_source_specs_and_checks() -> None:
    own = Attention(num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4)
    wide = Attention(num_heads=2, num_kv_heads=2, head_dim=16)
    cfg = _config(own, wide, Attention(num_heads=4, num_kv_heads=1, head_dim=8, sliding_window=4, kv_source=0),
                  Attention(num_heads=2, num_kv_heads=2, head_dim=16, kv_source=1))
    specs = cfg.kv_specs(block_size=4, kv_dtype=torch.float32)
    assert specs["layers.2"] == KVSharingSpec(block_size=4, donor="layers.0", target=specs["layers.0"])
    assert specs["layers.3"].donor == "layers.1" and specs["layers.1"].head_size == 16
    with pytest.raises(ValueError, match="earlier attention layer"):
        _config(Attention(num_heads=2, num_kv_heads=1, head_dim=8, kv_source=1), own)
    with pytest.raises(ValueError, match="differ from the donor"):
        _config(own, Attention(num_heads=2, num_kv_heads=1, head_dim=8, kv_source=0))     # no window
    with pytest.raises(ValueError, match="keeps its own"):
        _config(own, Attention(num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4, kv_source=0),
                Attention(num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4, kv_source=1))


def test_reader_layer_has_no_kv_weights_and_matches_the_reference() -> None:
    """A random model with readers: no k/v parameters on them, and the engine's chunked, cached generation gives
    the no-cache reference forward's greedy tokens."""
    from hybridkv import LLM, SamplingParams
    from hybridkv.engine.model_runner import reference_logits
    from hybridkv.models.hybrid import build_model

    own = Attention(num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4, qk_norm="rms", value_norm=True)
    glob = Attention(num_heads=2, num_kv_heads=2, head_dim=16, k_eq_v=True)
    cfg = _config(own, glob, own, Attention(num_heads=2, num_kv_heads=2, head_dim=16, kv_source=1),
                  Attention(num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4, qk_norm="rms", kv_source=2))
    model = build_model(cfg, seed=3)
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.startswith(("layers.3.mixer.k", "layers.3.mixer.v", "layers.4.mixer.k", "layers.4.mixer.v",
                                 "layers.1.mixer.v")) for n in names)
    llm = LLM(model, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu", kv_cache_memory="1MiB",
              max_model_len=64)
    prompt = np.random.default_rng(0).integers(0, 32, 21).tolist()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    ref = reference_logits(llm.model, prompt + tokens)
    assert ref[len(prompt) - 1:-1].argmax(-1).tolist() == tokens
