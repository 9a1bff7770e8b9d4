"""The CUDA-graph decode packing straight from the engine's ``StepTables`` against the CAM-based packing.

``DecodeGraphs.run`` packs a decode batch into flat host buffers (``pack_host``, numpy only). The engine's
``StepTables`` are packed directly (``DecodeTables``: no CAM, no builder); the oracle is the CAM path: the
eager runner's per-group CAMs and builders (sliding-window trim, local-attention virtual batch, Mamba state
indices) packed field by field. On random workloads run by a real engine on the CPU (sliding windows and
chunks of several sizes, block sizes 2 to 8, prefix caching on and off, tight caches that preempt,
asynchronous scheduling on and off), every decode step must give the same buffers, byte for byte, carried
from step to step like the real ones; so must the same step with its rows' starts lagging (stale leading
entries), which the engine never produces but the builders handle: the trim and the chunk shift.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import LLM
from hybridkv.engine.cuda_graphs import DecodeBuffers, DecodeTables, _Layout, fill_padding, pack_host
from hybridkv.engine.model_runner import StepBatch, StepOutput, StepTables
from hybridkv.kv_groups.plan import plan_kv_cache
from hybridkv.kv_groups.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model
from tests._kv_helpers import add_random_requests

VOCAB = 23
CPU = torch.device("cpu")


def config(windows: tuple[int, int], chunk: int) -> HybridConfig:
    """Two sliding windows (one over two layers: groups that share their rows' starts), chunked-local over
    two layers, full attention and Mamba2."""
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    small, large = (Attention(sliding_window=w, **attn) for w in windows)
    chunked = Attention(attention_chunk_size=chunk, **attn)
    mixers = (small, Mamba2(num_heads=2, head_dim=8, state_size=8), chunked, Attention(**attn), small, large,
              chunked)
    return HybridConfig(vocab_size=VOCAB, hidden_size=16, max_position_embeddings=128, dtype="float32",
                        layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=16)) for m in mixers))


def is_decode(step: StepBatch) -> bool:
    """The batch shape ``ModelRunner._graph_eligible`` sends to the graphs (given a bucket that fits)."""
    n = step.num_reqs
    return (n > 0 and step.input_ids.shape[0] == n and step.logits_indices.shape[0] == n
            and int(step.query_lens.max()) == 1 and bool((step.seq_lens > 1).all()))


def buffers(lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(lay.i64_size, np.int64), np.zeros(lay.i32_size, np.int32)


def assert_same_buffers(lay: _Layout, got: Sequence[np.ndarray], want: Sequence[np.ndarray], n: int) -> None:
    """Field by field over the first n rows (a readable failure), then the whole buffers (padding, and every
    column both packings ever wrote)."""
    (g64, g32), (w64, w32) = got, want
    for name, buf64, ref64 in (("ids", g64, w64), ("positions", g64, w64), ("sources", g64, w64)):
        assert np.array_equal(getattr(lay, name)(buf64, n), getattr(lay, name)(ref64, n)), name
    for a, gi in enumerate(lay.attention):
        for name, got_f, want_f in (("slots", lay.slots(g64, a, n), lay.slots(w64, a, n)),
                                    ("seq_lens", lay.seq_lens(g32, a, n), lay.seq_lens(w32, a, n)),
                                    ("table", lay.table(g32, a, n), lay.table(w32, a, n))):
            assert np.array_equal(got_f, want_f), \
                f"group {gi} ({lay.specs[a].describe()}) {name}:\n{got_f}\n!=\n{want_f}"
    for m, gi in enumerate(lay.mamba):
        assert np.array_equal(lay.state_slots(g64, m, n), lay.state_slots(w64, m, n)), f"group {gi} state slots"
    assert np.array_equal(g64, w64) and np.array_equal(g32, w32), "whole buffers"


def lagging(tables: StepTables, rng: np.random.Generator) -> StepTables:
    """``tables`` with early-freeing rows starting up to their start earlier, the extra leading entries
    stale ids (nonzero): the engine's starts keep up with the transforms, so this is how the builders' trim
    and chunk shift get exercised. Groups that shared a starts array still share one."""
    moved: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out_tables, out_starts = list(tables.tables), list(tables.starts)
    for g, (table, start) in enumerate(zip(tables.tables, tables.starts, strict=True)):
        if start is None:
            continue
        if id(start) not in moved:
            lag = rng.integers(0, start + 1).astype(np.int32)
            moved[id(start)] = (start - lag, lag)
        out_starts[g], lag = moved[id(start)]
        n, width = table.shape
        wide = np.zeros((n, width + int(lag.max(initial=0))), np.int32)
        cols = np.arange(wide.shape[1])
        wide[np.arange(n)[:, None], np.arange(width) + lag[:, None]] = table
        stale = cols < lag[:, None]
        wide[stale] = 1000 + np.broadcast_to(cols, wide.shape)[stale]
        out_tables[g] = wide
    return dataclasses.replace(tables, tables=out_tables, starts=out_starts)


PACKING_CASES = dict(data=st.data(), bs=st.sampled_from([2, 4, 8]),
                     windows=st.tuples(st.integers(2, 13), st.integers(2, 40)), chunks=st.integers(1, 4),
                     budget=st.integers(1, 40), seqs=st.integers(1, 8), caching=st.booleans(), tight=st.booleans(),
                     asynchronous=st.booleans())


@settings(max_examples=10, deadline=None)   # the quick tier's runs; the slow tier's below
@given(**PACKING_CASES)
def test_step_table_packing_equals_the_cam_packing(data: st.DataObject, bs: int, windows: tuple[int, int],
                                                   chunks: int, budget: int, seqs: int, caching: bool,
                                                   tight: bool, asynchronous: bool) -> None:
    """The engine's own step loop, its runner's ``execute`` replaced by the comparison (random logits:
    sampling picks arbitrary tokens)."""
    model = build_model(config(windows, chunks * bs), seed=0)
    llm = LLM(model, device="cpu", block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget,
              enable_prefix_caching=caching, kv_cache_memory=(40 << 10) if tight else (1 << 20),
              async_scheduling=asynchronous)
    engine, runner = llm.engine, llm.engine.runner
    lay = _Layout.make(llm.plan, seqs)
    current, lagged = (buffers(lay), buffers(lay)), (buffers(lay), buffers(lay))     # (fast, oracle) each
    for fast, _ in (current, lagged):             # as after capture: every row padding (the oracle's are
        fill_padding(lay, *fast, 0, seqs)         # padded in full each step)
    rows = 0                                      # what the fast buffers' last packing filled
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))

    def execute(step: StepBatch) -> StepOutput:
        nonlocal rows
        if is_decode(step):
            assert isinstance(step.block_tables, StepTables)
            lag = dataclasses.replace(step, block_tables=lagging(step.block_tables, rng))
            for variant, (fast, oracle) in ((step, current), (lag, lagged)):
                packed = runner.graph_inputs(variant)
                assert isinstance(packed, DecodeTables)
                ids, positions = np.asarray(step.input_ids, np.int64), step.seq_lens - 1
                pack_host(lay, *fast, ids, positions, packed, sources=step.input_sources, stale=rows)
                pack_host(lay, *oracle, ids, positions, runner.group_inputs(variant, CPU), sources=step.input_sources)
                assert_same_buffers(lay, fast, oracle, step.num_reqs)
            rows = step.num_reqs
        logits = rng.standard_normal((len(step.logits_indices), VOCAB)).astype(np.float32)
        return StepOutput(logits=torch.from_numpy(logits))

    runner.execute = execute
    add_random_requests(engine, rng, vocab=VOCAB, count=data.draw(st.integers(1, 9)), max_tokens=100)
    while engine.has_unfinished:
        engine.step(only_finished=True)
    assert engine.coordinator.num_requests == 0


# all 40 (under a derandomized profile the first 10 repeat the quick tier's)
test_step_table_packing_equals_the_cam_packing_more_runs = pytest.mark.slow(settings(max_examples=40, deadline=None)(
    given(**PACKING_CASES)(test_step_table_packing_equals_the_cam_packing.hypothesis.inner_test)))


def test_packing_example() -> None:
    """Three decoding requests, block_size 2, window W = 3, chunk C = 4 (q = the query, k = a key it reads,
    x = a key it does not read, [..] = one block, | = a chunk boundary; ``start`` = the first block the
    coordinator still holds, where the step's row begins)::

        position        0 1   2 3   4 5   6 7   8
        full     r0    [k k] [k k] [k q]                        seq_len 6
                 r1    [k k] [k k] [k k] [k k] [q]              seq_len 9
                 r2    [k q]                                    seq_len 2
        sliding  r0          [x k] [k q]              start 1: nothing more to trim, seq_len 6 - 2 = 4
                 r1                [x x] [k k] [q]    start 2 lags: trim 1 more block, seq_len 9 - 6 = 3
                 r2    [k q]                          start 0: seq_len 2
        chunked  r0                | [k q]            start 2 = its chunk's first block: seq_len 2
                 r1                | [x x] [x x] | [q]   start 2 lags a chunk: from block 4, seq_len 1
                 r2    [k q]                          start 0: seq_len 2

    Block ids: full 1 + block (r1 + 5, r2 + 10), sliding + 20, chunked + 40; Mamba slots 3, 4, 5. The trimmed
    sliding table is as wide as its widest kept row (2), the chunked one as its widest chunk prefix (1)."""
    attn = dict(block_size=2, num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = {"full": FullAttentionSpec(**attn), "sliding": SlidingWindowSpec(sliding_window=3, **attn),
             "chunked": ChunkedLocalAttentionSpec(attention_chunk_size=4, **attn),
             "mamba": MambaSpec(shapes=((4,),), dtypes=(torch.float32,))}
    plan = plan_kv_cache(specs, max_model_len=16, kv_memory=1 << 20, max_num_seqs=4, step_tokens=4)
    seq_lens = np.array([6, 9, 2])
    # kind: (starts, the step's rows from their start, query slots, packed seq_lens, packed table)
    cases = {
        "full": (None, [[1, 2, 3, 0, 0], [6, 7, 8, 9, 10], [11, 0, 0, 0, 0]], [7, 20, 23],
                 [6, 9, 2], [[1, 2, 3, 0, 0], [6, 7, 8, 9, 10], [11, 0, 0, 0, 0]]),
        "sliding_window": ([1, 2, 0], [[22, 23, 0], [28, 29, 30], [31, 0, 0]], [47, 60, 63],
                           [4, 3, 2], [[22, 23], [29, 30], [31, 0]]),
        "chunked_local": ([2, 2, 0], [[43, 0, 0], [48, 49, 50], [51, 0, 0]], [87, 100, 103],
                          [2, 1, 2], [[43], [50], [51]]),
    }
    kinds = [g.spec.kind for g in plan.groups]
    tables: list[np.ndarray] = []
    starts: list[np.ndarray | None] = []
    slots: list[np.ndarray | None] = []
    for kind in kinds:
        start, table, slot = cases[kind][:3] if kind in cases else (None, [[3], [4], [5]], None)
        tables.append(np.array(table, np.int32))
        starts.append(None if start is None else np.array(start, np.int32))
        slots.append(None if slot is None else np.array(slot, np.int64))
    lay = _Layout.make(plan, 4)
    h64, h32 = np.full(lay.i64_size, 77, np.int64), np.full(lay.i32_size, 77, np.int32)    # stale contents
    pack_host(lay, h64, h32, np.array([7, 8, 9]), seq_lens - 1,
              DecodeTables(seq_lens=seq_lens, tables=tables, starts=starts, slots=slots))
    for a, gi in enumerate(lay.attention):
        *_, slot, want_seq, want_table = cases[kinds[gi]]
        assert lay.slots(h64, a, 4).tolist() == [*slot, -1], kinds[gi]                 # row 3: padding
        assert lay.seq_lens(h32, a, 4).tolist() == [*want_seq, 1], kinds[gi]
        table = lay.table(h32, a, 4)
        assert table[:3, :len(want_table[0])].tolist() == want_table and table[3, 0] == 0, kinds[gi]
    assert lay.state_slots(h64, 0, 4).tolist() == [3, 4, 5, 0]
    assert lay.ids(h64, 4).tolist() == [7, 8, 9, 0] and lay.positions(h64, 4).tolist() == [5, 8, 1, 0]


def _example_plan(max_num_seqs: int):
    attn = dict(block_size=2, num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = {"full": FullAttentionSpec(**attn), "sliding": SlidingWindowSpec(sliding_window=3, **attn),
             "chunked": ChunkedLocalAttentionSpec(attention_chunk_size=4, **attn),
             "mamba": MambaSpec(shapes=((4,),), dtypes=(torch.float32,))}
    return plan_kv_cache(specs, max_model_len=16, kv_memory=1 << 20, max_num_seqs=max_num_seqs, step_tokens=4)


def read_fields(lay: _Layout, h64: np.ndarray, h32: np.ndarray, b: int) -> dict[str, list[int]]:
    """What a bucket-``b`` replay's kernels read: every row's scalar fields, and each row's table up to its
    last key's block (a padding row: column 0)."""
    out = {"ids": lay.ids(h64, b).tolist(), "positions": lay.positions(h64, b).tolist(),
           "sources": lay.sources(h64, b).tolist()}
    for a in range(len(lay.attention)):
        seq = lay.seq_lens(h32, a, b)
        table = lay.table(h32, a, b)
        bs = lay.specs[a].block_size
        out[f"slots{a}"] = lay.slots(h64, a, b).tolist()
        out[f"seq{a}"] = seq.tolist()
        out[f"table{a}"] = [table[r, :-(-int(seq[r]) // bs)].tolist() for r in range(b)]
    for m in range(len(lay.mamba)):
        out[f"state{m}"] = lay.state_slots(h64, m, b).tolist()
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_buckets_share_one_buffer(data: st.DataObject) -> None:
    """Random decode batches (sizes 1..8 over buckets 1, 2, 4, 8, so the bucket switches up and down) packed
    in turn into one ``DecodeBuffers``: each time, the fields the kernels read equal a fresh packing's, and
    only the bucket's bytes (a prefix of the buffer) are meant to be copied."""
    plan = _example_plan(8)
    buckets = (1, 2, 4, 8)
    shared = DecodeBuffers(plan, buckets, device=CPU, pin=False)
    for b in reversed(buckets):                     # as capture leaves it
        shared.pad(b)
    kinds = [g.spec.kind for g in plan.groups]
    for _ in range(data.draw(st.integers(1, 6))):
        n = data.draw(st.integers(1, 8))
        b = next(x for x in buckets if x >= n)
        seq = np.array(data.draw(st.lists(st.integers(2, 16), min_size=n, max_size=n)), np.int64)
        width = -(-int(seq.max()) // 2)
        tables = [np.full((n, 1), 5, np.int32) if kind == "mamba"
                  else np.arange(n * width, dtype=np.int32).reshape(n, width) + 100 * g + 1
                  for g, kind in enumerate(kinds)]
        slots = [None if kind == "mamba" else (seq - 1) + 20 * g for g, kind in enumerate(kinds)]
        step = DecodeTables(seq_lens=seq, tables=tables, starts=[None] * len(kinds), slots=slots)
        ids, positions = np.arange(n, dtype=np.int64) + 3, seq - 1
        sources = np.where(np.arange(n) % 2 == 0, np.arange(n), -1)
        size = shared.pack(b, ids, positions, step, sources=sources)
        fresh = DecodeBuffers(plan, (b,), device=CPU, pin=False)
        assert fresh.pack(b, ids, positions, step, sources=sources) == size == fresh.host.numel()
        assert size <= shared.host.numel()
        got, want = shared.views[b], fresh.views[b]
        assert read_fields(got.layout, got.host64, got.host32, b) == \
            read_fields(want.layout, want.host64, want.host32, b)
