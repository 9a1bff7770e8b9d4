"""CommonAttentionMetadata: build, field declarations, validate() against corrupted metadata."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hybridkv.metadata import (
    PACK_ALIGN,
    SLICE_KINDS,
    CommonAttentionMetadata,
    field_rules,
    host_to_device_many,
    packed_offsets,
)
from hybridkv.transforms import split_microbatches


def small_cam(**kw) -> CommonAttentionMetadata:
    """2 requests, block 2: a chunked prefill (2 context + 3 new) and a decode (3 context + 1 new)."""
    args = {
        "query_lens": [3, 1],
        "seq_lens": [5, 4],
        "block_table": [[7, 3, 9], [4, 8, 0]],
        "block_size": 2,
    }
    args.update(kw)
    return CommonAttentionMetadata.build(**args)


def test_build_fills_everything():
    cam = small_cam()
    cam.validate()
    assert cam.query_start_loc_cpu.tolist() == [0, 3, 4]
    assert cam.query_lens_cpu.tolist() == [3, 1]
    assert cam.num_computed_tokens_cpu.tolist() == [2, 3]
    assert cam.key_start_cpu.tolist() == [0, 0]
    # request 0 writes positions 2,3,4 -> blocks 3,3,9; request 1 writes position 3 -> block 8 offset 1
    assert cam.slot_mapping.tolist() == [3 * 2 + 0, 3 * 2 + 1, 9 * 2 + 0, 8 * 2 + 1]
    assert (cam.num_reqs, cam.num_actual_tokens, cam.max_query_len, cam.max_seq_len) == (2, 4, 3, 5)
    for name in (
        "query_start_loc_cpu",
        "seq_lens_cpu",
        "num_computed_tokens_cpu",
        "key_start_cpu",
        "block_table_cpu",
    ):
        assert getattr(cam, name).dtype == np.int32, name
    assert cam.slot_mapping.dtype == torch.int64
    assert cam.block_table_tensor.dtype == torch.int32
    assert cam.device == torch.device("cpu")


def test_build_with_key_start_uses_relative_positions():
    cam = small_cam(key_start=[4, 0])
    assert cam.key_start.tolist() == [4, 0]
    assert cam.slot_mapping.tolist()[:3] == [6, 7, 18]  # relative positions 2,3,4 as before


def test_frozen_and_keyword_only():
    cam = small_cam()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cam.num_reqs = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CommonAttentionMetadata(cam.query_start_loc)  # type: ignore[misc]


def test_every_field_declares_how_it_slices():
    """Adding a field without a slicing rule must fail here (silently dropped fields are a real bug class)."""
    for f in dataclasses.fields(CommonAttentionMetadata):
        assert f.metadata.get("slice") in SLICE_KINDS, f"{f.name} has no valid 'slice' declaration"
        assert f.metadata.get("on_cut") in (None, "sub_tail", "add_head"), f.name


def test_twins_name_host_fields_of_the_same_kind():
    fields = {f.name: f for f in dataclasses.fields(CommonAttentionMetadata)}
    rules = field_rules(CommonAttentionMetadata)
    assert {r.name for r in rules} == set(fields)
    for r in rules:
        if r.twin is not None:
            assert isinstance(r.twin, str) and fields[r.twin].metadata["slice"] == r.kind, r.name
            assert fields[r.twin].metadata.get("on_cut") == r.on_cut, r.name


def test_undeclared_field_fails_and_declared_field_is_sliced():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Undeclared(CommonAttentionMetadata):
        extra: int = 0

    with pytest.raises(TypeError, match="extra"):
        field_rules(Undeclared)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class WithTokenField(CommonAttentionMetadata):
        token_ids: np.ndarray = dataclasses.field(default=None, metadata={"slice": "token"})

    cam = small_cam()
    values = {f.name: getattr(cam, f.name) for f in dataclasses.fields(cam)}
    ext = WithTokenField(**values, token_ids=np.array([10, 11, 12, 13]))
    first, second = split_microbatches(ext, [2])
    assert type(first) is WithTokenField
    assert first.token_ids.tolist() == [10, 11] and second.token_ids.tolist() == [12, 13]


def test_empty_batch():
    cam = CommonAttentionMetadata.build(query_lens=[], seq_lens=[], block_table=[], block_size=4)
    cam.validate()
    assert cam.num_reqs == 0 and cam.num_actual_tokens == 0 and cam.block_table_cpu.shape == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"query_lens": [-1, 1]}, "query_lens"),
        ({"seq_lens": [5, -4]}, "seq_lens"),
        ({"query_lens": [6, 1]}, "query_lens"),  # query_len > seq_len
        ({"seq_lens": [5, 4, 1]}, "seq_lens"),  # length mismatch
        ({"query_lens": [[3, 1]]}, "query_lens"),  # not 1-D
        ({"query_lens": [3.0, 1.0]}, "query_lens"),  # not integers
        ({"block_table": [[7, 3], [4, 8]]}, "block_table"),  # too narrow for seq_len 5
        ({"block_table": [[7, 3, 9]]}, "block_table"),  # too few rows
        ({"block_table": [7, 3, 9]}, "block_table"),  # not 2-D
        ({"block_table": [[7, 3, -1], [4, 8, 0]]}, "block_table"),  # -1 is not the null block
        ({"block_table": [[7, 3], [4, 8, 0]]}, "block_table"),  # ragged
        ({"block_size": 0}, "block_size"),
        ({"key_start": [1, 0]}, "key_start"),  # not a multiple of block_size
        ({"key_start": [-2, 0]}, "key_start"),
        ({"key_start": [0]}, "key_start"),
    ],
)
def test_build_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        small_cam(**kwargs)


# (field named in the error, corrupting change)
CORRUPTIONS = [
    ("query_start_loc_cpu", lambda c: {"query_start_loc_cpu": np.array([0, 4, 3], np.int32)}),
    ("query_start_loc_cpu", lambda c: {"query_start_loc_cpu": np.array([0, 3, 4], np.int64)}),
    ("seq_lens_cpu", lambda c: {"seq_lens_cpu": np.array([5, 4, 1], np.int32)}),
    ("seq_lens_cpu", lambda c: {"seq_lens_cpu": np.array([2, 4], np.int32)}),
    ("num_computed_tokens_cpu", lambda c: {"num_computed_tokens_cpu": np.array([1, 3], np.int32)}),
    ("key_start_cpu", lambda c: {"key_start_cpu": np.array([1, 0], np.int32)}),
    ("block_table_cpu", lambda c: {"block_table_cpu": c.block_table_cpu[:, :2].copy()}),
    ("block_table_tensor", lambda c: {"block_table_tensor": c.block_table_tensor.long()}),
    ("slot_mapping", lambda c: {"slot_mapping": c.slot_mapping[:3]}),
    ("slot_mapping", lambda c: {"slot_mapping": c.slot_mapping + 1}),
    ("seq_lens", lambda c: {"seq_lens": c.seq_lens + 1}),
    ("key_start", lambda c: {"key_start": c.key_start.float()}),
    ("num_actual_tokens", lambda c: {"num_actual_tokens": 5}),
    ("max_seq_len", lambda c: {"max_seq_len": 4}),
    ("max_query_len", lambda c: {"max_query_len": 1}),
    ("num_reqs", lambda c: {"num_reqs": 3}),
    ("block_size", lambda c: {"block_size": 0}),
]


@pytest.mark.parametrize(("field", "change"), CORRUPTIONS)
def test_validate_catches_corruption(field, change):
    cam = small_cam()
    bad = dataclasses.replace(cam, **change(cam))
    with pytest.raises(ValueError, match=f"^{field}:"):
        bad.validate()


def test_validate_catches_host_device_disagreement():
    cam = small_cam()
    table = cam.block_table_cpu.copy()
    table[1, 0] = 5
    bad = dataclasses.replace(cam, block_table_cpu=table)
    with pytest.raises(ValueError, match="block_table_tensor"):
        bad.validate()
    bad.validate(check_device=False)  # the cheap checks alone cannot see it


def test_debug_env_validates_on_replace(monkeypatch):
    cam = small_cam()
    monkeypatch.setenv("HYBRIDKV_DEBUG", "1")
    with pytest.raises(ValueError, match="max_seq_len"):
        cam.replace(max_seq_len=99)
    monkeypatch.setenv("HYBRIDKV_DEBUG", "0")
    assert cam.replace(max_seq_len=99).max_seq_len == 99


_ARRAYS = [np.arange(5, dtype=np.int32), np.arange(12, dtype=np.int64).reshape(3, 4) * 7, np.zeros(0, np.int32),
           np.array([True, False, True]), np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2],   # not contiguous
           np.array([-1, 2**40], np.int64)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_host_to_device_many_equals_each_array(device: str) -> None:
    """One packed copy gives every array's twin: same values, dtype and shape (odd sizes, bools, an empty and a
    non-contiguous array among them); on the CPU the twins share memory with the arrays."""
    twins = host_to_device_many(_ARRAYS, device)
    assert len(twins) == len(_ARRAYS)
    for a, t in zip(_ARRAYS, twins, strict=True):
        assert t.device.type == device and tuple(t.shape) == a.shape
        assert t.dtype == torch.from_numpy(np.empty(0, a.dtype)).dtype
        np.testing.assert_array_equal(t.cpu().numpy(), a)
        if device == "cuda":        # Triton specializes on it: a twin's alignment must not depend on its neighbours
            assert t.data_ptr() % PACK_ALIGN == 0
    if device == "cpu":
        assert np.shares_memory(twins[0].numpy(), _ARRAYS[0])


@pytest.mark.parametrize(("nbytes", "expected"), [
    ((), [0]), ((20,), [0, 32]), ((4, 8, 16, 0, 17), [0, 16, 32, 48, 48, 80]), ((0, 0), [0, 0, 0])])
def test_packed_offsets_start_each_array_on_a_16_byte_boundary(nbytes, expected) -> None:
    assert PACK_ALIGN == 16
    assert packed_offsets(nbytes).tolist() == expected
