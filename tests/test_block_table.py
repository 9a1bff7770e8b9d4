"""Block tables (host rows, device mirror, vectorised slot mapping) and the plan's cache tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.kv_groups.block_table import BlockTable, MultiGroupBlockTable, token_ranges
from hybridkv.kv_groups.cache_tensors import allocate_kv_cache, layer_pool_positions
from hybridkv.kv_groups.plan import plan_kv_cache
from hybridkv.kv_groups.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec


def naive_slots(table: np.ndarray, bs: int, rows: np.ndarray, positions: np.ndarray) -> list[int]:
    return [int(table[r, p // bs]) * bs + int(p) % bs for r, p in zip(rows.tolist(), positions.tolist(),
                                                                      strict=True)]


@settings(deadline=None, max_examples=60)
@given(data=st.data(), bs=st.integers(1, 8), groups=st.integers(1, 3), rows=st.integers(1, 6),
       cols=st.integers(1, 10))
def test_slot_mapping_matches_a_loop(data: st.DataObject, bs: int, groups: int, rows: int, cols: int) -> None:
    t = MultiGroupBlockTable(groups, rows, cols, block_size=bs)
    t.np[:] = np.array(data.draw(st.lists(st.integers(0, 1000), min_size=t.np.size,
                                          max_size=t.np.size))).reshape(t.np.shape)
    # A batch: per request a row, a start and a count of positions (chunked prefill / decode).
    reqs = data.draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, cols * bs - 1)),
                              min_size=1, max_size=5))
    req_rows = np.array([r for r, _ in reqs])
    starts = np.array([s for _, s in reqs])
    counts = np.array([data.draw(st.integers(0, cols * bs - s)) for s in starts])
    owner, positions = token_ranges(starts, counts)
    token_rows = req_rows[owner]
    assert positions.tolist() == [p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)]
    got = t.slot_mapping(token_rows, positions)
    assert got.dtype == np.int64 and got.shape == (groups, positions.size)
    for g in range(groups):
        want = naive_slots(t.np[g], bs, token_rows, positions)
        assert got[g].tolist() == want
        assert t[g].slot_mapping(token_rows, positions).tolist() == want


@settings(deadline=None, max_examples=60)
@given(data=st.data(), groups=st.integers(1, 3), rows=st.integers(1, 5), cols=st.integers(1, 8))
def test_row_windows_match_a_loop(data: st.DataObject, groups: int, rows: int, cols: int) -> None:
    """Each row from its own column, nulls past the row's end (the last row's too, and windows that cross
    into the next row), for any subset of the groups."""
    t = MultiGroupBlockTable(groups, rows, cols, block_size=4)
    t.np[:] = np.arange(1, t.np.size + 1, dtype=np.int32).reshape(t.np.shape)
    picked = np.array(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=6, unique=True)))
    start = np.array([data.draw(st.integers(0, cols)) for _ in picked], np.int32)
    width = data.draw(st.integers(1, cols))
    first = data.draw(st.integers(0, groups - 1))
    sel = slice(first, data.draw(st.integers(first + 1, groups)))
    got = t.row_windows(sel, picked, start, width)
    padded = np.concatenate([t.np, np.zeros((groups, rows, width), np.int32)], axis=2)
    want = np.stack([[padded[g, r, s:s + width] for r, s in zip(picked, start, strict=True)]
                     for g in range(groups)[sel]])
    assert got.dtype == np.int32 and got.tolist() == want.tolist()


def test_token_ranges_empty_and_zero_counts() -> None:
    owner, vals = token_ranges(np.array([5, 0, 7]), np.array([2, 0, 1]))
    assert owner.tolist() == [0, 0, 2] and vals.tolist() == [5, 6, 7]
    owner, vals = token_ranges(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert owner.size == vals.size == 0


def test_row_ops() -> None:
    t = BlockTable(4, 6, block_size=2)
    t.set_row(0, [3, 4, 5])
    t.append_blocks(0, np.array([6]))
    t.null_blocks(0, 0, 2)
    assert t.np[0].tolist() == [0, 0, 5, 6, 0, 0] and t.num_blocks[0] == 4
    t.set_row(1, [9])
    t.swap_rows(0, 1)
    assert t.np[0].tolist()[:4] == [9, 0, 0, 0] and t.np[1].tolist()[:4] == [0, 0, 5, 6]
    assert t.num_blocks[:2].tolist() == [1, 4]
    t.move_row(1, 3)
    assert t.np[3].tolist()[:4] == [0, 0, 5, 6] and (t.np[1] == 0).all() and t.num_blocks[1] == 0
    t.set_row(3, [1])                     # shrinking a row nulls the rest
    assert t.np[3].tolist() == [1, 0, 0, 0, 0, 0]
    t.clear_row(3)
    assert (t.np == np.array([[9] + [0] * 5] + [[0] * 6] * 3)).all()


def test_multi_group_rows_move_together() -> None:
    t = MultiGroupBlockTable(2, 3, 4, block_size=4)
    t.np[:, 0, :2] = [[1, 2], [3, 4]]
    t.num_blocks[0] = 2
    t.move_row(0, 2)
    assert t.np[:, 2, :2].tolist() == [[1, 2], [3, 4]] and (t.np[:, 0] == 0).all()
    assert t[1].num_blocks[2] == 2 and t[0].np is not None and t[1].np[2, 1] == 4
    t.swap_rows(1, 2)
    assert t.np[:, 1, :2].tolist() == [[1, 2], [3, 4]] and t.num_blocks.tolist() == [0, 2, 0]
    t.clear_row(1)
    assert (t.np == 0).all()


@pytest.mark.parametrize("share", [True, False])
def test_device_mirror_equals_host_after_commit(share: bool) -> None:
    t = MultiGroupBlockTable(2, 4, 5, block_size=2, share_host_memory=share)
    t.np[:, :3, :4] = np.arange(1, 2 * 3 * 4 + 1).reshape(2, 3, 4)
    t.num_blocks[:3] = [4, 2, 3]
    t.np[:, 3] = 77                                          # beyond num_rows: not copied
    t.commit(3)
    dev = t.tensor.numpy()
    assert (dev[:, :3] == t.np[:, :3]).all()
    assert (dev[:, 3] == (77 if share else 0)).all()
    t.clear_row(0)                                           # a shrunk row: stale ids must not survive
    t.commit(3)
    assert (t.tensor.numpy()[:, :3] == t.np[:, :3]).all() and (t.tensor.numpy()[:, 0] == 0).all()
    single = BlockTable(3, 4, block_size=2, share_host_memory=share)
    single.set_row(1, [5, 6])
    single.commit(2)
    assert (single.tensor.numpy()[:2] == single.np[:2]).all()
    single.clear_row(1)
    single.commit(2)
    assert (single.tensor.numpy() == 0).all()
    assert t[1].tensor.shape == (4, 5) and (t[1].tensor.numpy()[:3] == t.np[1, :3]).all()


def test_bad_table_sizes() -> None:
    with pytest.raises(ValueError, match="max_blocks_per_req"):
        BlockTable(2, 0, block_size=4)
    with pytest.raises(ValueError, match="num_groups"):
        MultiGroupBlockTable(0, 2, 2, block_size=4)


def test_cache_tensors_views_share_one_pool_each_group_sized_by_its_shape() -> None:
    """A 2x narrower spec's group holds 2x the layers: every group fills a page exactly (no padding), and each
    layer views its own byte range of the one pool."""
    wide = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    narrow = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32,
                               sliding_window=8)
    mam = MambaSpec(block_size=4, shapes=((3, 5), (2, 2, 2)), dtypes=(torch.bfloat16, torch.float32))
    layers = {"a0": wide, "a1": wide, "m0": mam, "s0": narrow, "s1": narrow, "m1": mam}
    plan = plan_kv_cache(layers, max_model_len=32, kv_memory=1 << 16, num_checkpoint_slots=1)
    caches = allocate_kv_cache(plan)
    assert [g.layer_names for g in plan.attention_groups] == [("a0",), ("a1",), ("s0", "s1")]
    assert plan.page_bytes == wide.bytes_per_block == 2 * narrow.bytes_per_block and plan.padding_bytes == 0
    assert plan.layers_per_block == 2 and layer_pool_positions(plan) == {"a0": 0, "a1": 0, "s0": 0, "s1": 1}
    (kv_a0,), (kv_s0,), (kv_s1,) = caches["a0"], caches["s0"], caches["s1"]
    assert kv_a0.shape == (plan.num_blocks, 2, 4, 2, 8) and kv_a0.dtype == torch.float32
    assert kv_s0.shape == kv_s1.shape == (plan.num_blocks, 2, 4, 1, 8)
    assert len({t.untyped_storage().data_ptr() for t in (kv_a0, kv_s0, kv_s1, caches["a1"][0])}) == 1
    kv_s0[3].fill_(1.0)                                     # block 3 of s0: the first half of page 3
    page = kv_a0[3].reshape(-1)
    assert page[:kv_s0[3].numel()].eq(1.0).all() and page[kv_s0[3].numel():].eq(0).all()
    kv_s1[3].fill_(2.0)                                     # s1: the second half of the same page
    assert page[kv_s0[3].numel():].eq(2.0).all() and kv_s0[3].eq(1.0).all()
    assert kv_a0[2].eq(0).all() and kv_a0[4].eq(0).all()
    conv, ssm = caches["m0"]
    assert conv.shape == (plan.num_state_slots, 3, 5) and conv.dtype == torch.bfloat16
    assert ssm.shape == (plan.num_state_slots, 2, 2, 2) and ssm.dtype == torch.float32
    assert conv.data_ptr() != caches["m1"][0].data_ptr()
