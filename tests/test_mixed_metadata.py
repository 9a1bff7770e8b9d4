"""The mixed graphs' static attention inputs (``engine/mixed_metadata.py``): widths, packing and padding, and the
Triton attention over a packed bucket against the reference over the step's own metadata (interpreted without
CUDA, compiled with it)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _cam_helpers import make_batch
from _triton import DEVICE, kernel_module

from hybridkv.engine.mixed_metadata import (
    HEAD_ROWS_UNIT,
    MixedStepBuffers,
    static_groups,
    static_state_groups,
    static_table_width,
)
from hybridkv.kv_groups.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.layers.ops.attention_ref import paged_attention_ref

BS, HEADS, KV_HEADS, D = 4, 4, 2, 16


def _plan(max_model_len: int = 64, window: int = 5) -> SimpleNamespace:
    """What the buffers read of a plan: groups (spec, cache names) and the model length."""
    full = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=D, dtype=torch.float32)
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=D, dtype=torch.float32,
                                sliding_window=window)
    mamba = MambaSpec(shapes=((4, 3), (2, 8, 8)), dtypes=(torch.float32, torch.float32), block_size=BS)
    return SimpleNamespace(max_model_len=max_model_len,
                           groups=[SimpleNamespace(spec=full, cache_names=("l0", "l2")),
                                   SimpleNamespace(spec=mamba, cache_names=("m3",)),
                                   SimpleNamespace(spec=sliding, cache_names=("l1",))])


@pytest.mark.parametrize(("spec", "max_model_len", "max_tokens", "want"), [
    (FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64), 32768, 4096, 2048),
    (FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64), 100, 4096, 16),          # 7 blocks, 16 columns
    (SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, sliding_window=512), 32768, 4096, 304),  # 290
    (SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, sliding_window=512), 1024, 4096, 64),    # the model
])
def test_static_table_width(spec, max_model_len: int, max_tokens: int, want: int) -> None:
    assert static_table_width(spec, max_model_len=max_model_len, max_tokens=max_tokens) == want


def test_static_groups_are_full_and_sliding_attention_only() -> None:
    kw = dict(block_size=16, num_kv_heads=1, head_size=64)
    specs = [FullAttentionSpec(**kw), MLAAttentionSpec(block_size=16, kv_lora_rank=32, qk_rope_head_dim=16),
             SlidingWindowSpec(**kw, sliding_window=8), ChunkedLocalAttentionSpec(**kw, attention_chunk_size=32),
             MambaSpec(shapes=((4, 8),), dtypes=(torch.float32,), block_size=16)]
    plan = SimpleNamespace(groups=[SimpleNamespace(spec=s) for s in specs])
    assert static_groups(plan) == (0, 2)


def test_static_state_groups_are_those_whose_layers_all_take_static_slots() -> None:
    plan = _plan()
    yes, no = SimpleNamespace(static_slots=True), SimpleNamespace()
    assert static_state_groups(plan, {"l0": no, "l1": no, "l2": no, "m3": yes}) == (1,)
    assert static_state_groups(plan, {"l0": no, "l1": no, "l2": no, "m3": no}) == ()
    assert static_state_groups(plan, {}) == ()


def test_pack_pads_requests_and_tokens_and_clears_stale_rows() -> None:
    buffers = MixedStepBuffers(_plan(), max_tokens=32, max_reqs=6, device="cpu", pin=False, state_groups=(1,))
    assert buffers.names == {"l0", "l1", "l2", "m3"} and buffers.widths == (16, 16) and buffers.covers_plan
    assert not MixedStepBuffers(_plan(), max_tokens=32, max_reqs=6, device="cpu", pin=False).covers_plan
    rng = np.random.default_rng(0)

    def step(q_lens: list[int]) -> np.ndarray:
        n, tokens = len(q_lens), sum(q_lens)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        groups = [(rng.integers(1, 40, n).astype(np.int32), rng.integers(1, 99, (n, 3 + g)).astype(np.int32),
                   rng.integers(0, 500, tokens)) for g in range(2)]
        states = [(rng.integers(1, 9, n).astype(np.int32), rng.random(n) < 0.5)]
        buffers.pack(qsl, groups, bucket=32, states=states)
        buffers.upload()
        slot, started = states[0]
        assert np.array_equal(buffers.d_idx[0, :n].numpy(), slot) and (buffers.d_idx[0, n:7] == -1).all()
        assert np.array_equal(buffers.d_init[0, :n].numpy(), started) and not buffers.d_init[0, n:7].any()
        scan = buffers.inputs(32)["m3"]
        assert scan.num_decodes == 0 and scan.num_reqs == 7 and scan.query_start_loc.data_ptr() == \
            buffers.d_qsl.data_ptr() and scan.has_initial_state.dtype == torch.bool
        for a, (seq, table, slots) in enumerate(groups):
            assert np.array_equal(buffers.d_seq[a, :n].numpy(), seq) and not buffers.d_seq[a, n:7].any()
            assert np.array_equal(buffers.d_tables[a][:n, :table.shape[1]].numpy(), table)
            assert np.array_equal(buffers.d_slots[a, :tokens].numpy(), slots)
            assert (buffers.d_slots[a, tokens:32] == -1).all()
        return qsl

    step([5, 1, 1, 9, 2, 1])                                 # every request row used
    qsl = step([3, 1])                                       # then fewer: rows 2.. are padding again
    assert buffers.d_qsl.tolist() == [*qsl.tolist(), *[32] * 5]    # request 2 owns tokens 4..32, with no keys
    buffers.pad(16)                                          # the capture's warm-up: request 0 owns the 16 tokens
    assert buffers.d_qsl.tolist() == [0, *[16] * 7] and not buffers.d_seq.any() and not buffers.d_init.any()
    assert (buffers.d_slots == -1).all() and (buffers.d_idx == -1).all()
    step([5, 1, 1, 9, 2, 1])
    step([2])
    with pytest.raises(ValueError, match="cannot replay"):
        buffers.pack(qsl, [], bucket=3)
    assert buffers.fits(6, [16, 16]) and not buffers.fits(7, [16, 16]) and not buffers.fits(2, [16, 17])


@pytest.mark.parametrize("groups", [(0, 2), ()])
def test_a_step_goes_to_the_device_in_one_copy(monkeypatch: pytest.MonkeyPatch, groups: tuple[int, ...]) -> None:
    """Every group's table rows are interleaved (row r of each, then r + 1), so the step's fields are one span; a
    plan with state groups only has no table columns at all."""
    plan = _plan()
    plan.groups = [plan.groups[g] for g in (*groups, 1)]
    buffers = MixedStepBuffers(plan, max_tokens=16, max_reqs=4, device="cpu", pin=False,
                               state_groups=(len(groups),))
    tables = [np.arange(9, dtype=np.int32).reshape(3, 3) + 10 * a for a in range(len(groups))]
    qsl = np.array([0, 2, 3, 4], np.int32)
    buffers.pack(qsl, [(np.ones(3, np.int32), t, np.arange(4)) for t in tables], bucket=16,
                 states=[(np.array([1, 2, 3]), np.ones(3, bool))])
    copies: list[int] = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: copies.append(t.numel()) or copy(t, *a, **k))
    buffers.upload()
    assert copies == [buffers._tables_at + 3 * 4 * sum(buffers.widths)]     # everything before the tables + 3 rows
    for a, table in enumerate(tables):
        view = buffers.d_tables[a]
        assert view.stride(0) == sum(buffers.widths) and view.data_ptr() % 16 == 0
        assert np.array_equal(view[:3, :3].numpy(), table)
    assert buffers.d_idx[0, :3].tolist() == [1, 2, 3]


def test_pending_ids_are_taken_from_the_step_in_flight_on_the_device() -> None:
    """The step's ids, positions and the sources of its pending ids ride in the one copy; what graph 0 computes
    (``MixedStepGraphs._step_inputs``) takes each pending id from the step in flight's tokens, and a later, smaller
    step's padded rows keep valid ids (>= 0, not a pending id's placeholder) with no source."""
    from hybridkv.engine.mixed_graphs import MixedStepGraphs

    buffers = MixedStepBuffers(_plan(), max_tokens=16, max_reqs=4, device="cpu", pin=False, state_groups=(1,))
    graph = SimpleNamespace(static=buffers)

    def step(ids: list[int], sources: list[int] | None, prev: list[int] | None) -> torch.Tensor:
        n = len(ids)
        buffers.pack_step(np.array(ids, np.int64), np.arange(n), None if sources is None else np.array(sources),
                          np.array([n - 1]))
        buffers.pack(np.array([0, n], np.int32), [(np.ones(1, np.int32), np.zeros((1, 1), np.int32), np.arange(n))] * 2,
                     bucket=16, states=[(np.array([1]), np.ones(1, bool))])
        buffers.upload()
        if prev is not None:
            buffers.take_prev(torch.tensor(prev))
        ids_in, positions = MixedStepGraphs._step_inputs(graph, 16)
        assert positions[:n].tolist() == list(range(n)) and buffers.head_rows(1).tolist() == [n - 1]
        return ids_in

    assert step([5, 6, -1, 7, -1], [-1, -1, 1, -1, 0], [40, 41])[:5].tolist() == [5, 6, 41, 7, 40]
    ids = step([9, 8], None, None)                               # fewer tokens, nothing pending
    assert ids[:2].tolist() == [9, 8] and (buffers.d_src[2:] == -1).all() and (ids >= 0).all()


def test_the_head_graphs_rows_and_flag_ride_in_the_copy() -> None:
    """Every bucket's graph gathers the first ``HEAD_ROWS_UNIT`` head rows for the head graph, so a step with fewer
    logits rows packs them padded with its last row (row 0 with none: never a stale row past the step's tokens), and
    the flag that says whether the head graph writes its logits."""
    buffers = MixedStepBuffers(_plan(), max_tokens=16, max_reqs=4, device="cpu", pin=False)
    ids = np.arange(12, dtype=np.int64)
    for rows, write, expected in (([3, 11], False, [3, 11] + [11] * (HEAD_ROWS_UNIT - 2)),
                                  ([], True, [0] * HEAD_ROWS_UNIT)):
        buffers.pack_step(ids, ids, None, np.array(rows, np.int64), write_logits=write)
        buffers.pack(np.array([0, 12], np.int32), [(np.ones(1, np.int32), np.zeros((1, 1), np.int32), ids)] * 2,
                     bucket=16)
        buffers.upload()
        assert buffers.head_rows(HEAD_ROWS_UNIT).tolist() == expected and buffers.d_flag.tolist() == [int(write)]
    assert buffers.d_flag.data_ptr() % 16 == 0 and buffers.d_slots.data_ptr() % 16 == 0


@pytest.mark.parametrize("budget", [100, 160, 192, 2048])
def test_a_steps_padded_head_rows_fit_the_static_buffers(budget: int) -> None:
    """Every row count a step of the largest bucket can want logits for, padded as the head pads it (``padded_rows``,
    ``max_num_seqs`` 256), fits the head rows region, whatever the budget (not only multiples of 64)."""
    from hybridkv.engine.mixed_graphs import HEAD_GRANULE, mixed_buckets, padded_rows

    assert HEAD_GRANULE == HEAD_ROWS_UNIT
    top = mixed_buckets(budget)[-1]
    buffers = MixedStepBuffers(_plan(), max_tokens=top, max_reqs=min(top, 256), device="cpu", pin=False)
    assert max(padded_rows(r, 256) for r in range(1, top + 1)) <= buffers.h_rows.shape[0]
    assert buffers.d_prev.shape[0] > min(top, 256)              # one sampled token per request of the step in flight


@pytest.mark.parametrize(("seed", "bucket"), [(0, 48), *(pytest.param(s, b, marks=pytest.mark.slow)    # (quick: seed 0)
                                               for s, b in ((1, 48), (2, 48), (3, 256)))])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_a_packed_bucket_matches_the_step(seed: int, bucket: int, window: int | None) -> None:
    """A mixed batch packed into a larger bucket (the padded tokens owned by a request with no keys, the requests
    after it with no queries): the kernel's rows for the real tokens equal the reference over the batch's own
    metadata, and its padded rows are zero, with and without split-KV. At 256 the padded request spans several
    q-blocks, and its key range ends far below zero (negative tile counts, the split's empty segments)."""
    ta = kernel_module("hybridkv.backends.triton_attention")
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    s_lens = rng.integers(2, 40, n).tolist()
    q_lens = [1 if rng.random() < 0.4 else int(rng.integers(1, s + 1)) for s in s_lens]
    b = make_batch(q_lens, s_lens, BS, seed, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D)
    cam, tokens = b.cam, sum(q_lens)
    buffers = MixedStepBuffers(_plan(window=window or 5), max_tokens=256, max_reqs=6, device=DEVICE, pin=False)
    table = cam.block_table_cpu.astype(np.int32)
    packed = (cam.seq_lens_cpu.astype(np.int32), table, cam.slot_mapping.numpy())
    buffers.pack(cam.query_start_loc_cpu.astype(np.int32), [packed, packed], bucket=bucket)
    buffers.upload()
    inputs = buffers.inputs(bucket)
    static = inputs["l1" if window else "l0"]
    assert static.cam.num_reqs == 7 and static.cam.num_actual_tokens == bucket and static.sliding_window == window
    q = torch.cat([b.q, torch.randn(bucket - tokens, HEADS, D)]).to(DEVICE)
    pool = torch.stack([b.k_cache, b.v_cache], dim=1).to(DEVICE)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, cam, scale=b.scale, sliding_window=window)
    for segs in (1, 4):         # (4: split-KV, as small captured buckets are)
        out = torch.full_like(q, float("nan"))
        ta.paged_attention_triton(q, pool[:, 0], pool[:, 1], static.cam, scale=b.scale, sliding_window=window,
                                  out=out, num_segments=segs)
        torch.testing.assert_close(out[:tokens].cpu(), ref, atol=2e-4, rtol=2e-4)
        assert (out[tokens:] == 0).all(), "padded rows: zero (finite), not stale memory"


def _key_slots(qsl: np.ndarray, seq: np.ndarray, table: np.ndarray, abs_seq: np.ndarray, bs: int,
               window: int | None) -> list[dict[int, int]]:
    """Per request: absolute key position -> KV slot, over the keys its queries can see (``seq`` and ``table``
    relative to the row's first key, ``abs_seq - seq``): the brute-force meaning of a group's metadata."""
    out = []
    for r in range(len(seq)):
        q_len, first = int(qsl[r + 1] - qsl[r]), int(abs_seq[r] - seq[r])
        lo = 0 if window is None else max(0, int(abs_seq[r]) - q_len - window + 1)
        assert first <= lo and -(-(int(abs_seq[r]) - first) // bs) <= table.shape[1], "a visible key off the row"
        out.append({p: int(table[r, (p - first) // bs]) * bs + (p - first) % bs for p in range(lo, int(abs_seq[r]))})
    return out


def test_model_runner_packs_what_the_eager_step_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving-shaped steps of a full + sliding-window + Mamba2 model (prompts past the window, so the engine's sliding
    rows start at their first live block): what ``ModelRunner`` packs into the static buffers means the same keys at
    the same slots, and the same query offsets and KV writes, as the eager step's built metadata (after the builders'
    transforms); the Mamba2 group's slots and initial-state flags are the eager step's. CPU: a stand-in for the mixed
    graphs answers the bucket; with ``HYBRIDKV_DEBUG`` the packing step validates the same arrays as CAMs too."""
    from hybridkv import LLM, SamplingParams

    monkeypatch.setenv("HYBRIDKV_DEBUG", "1")
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2

    window = 8
    mixers = [Attention(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=window if i % 2 else None)
              for i in range(4)]
    mixers.insert(2, Mamba2(num_heads=4, head_dim=8, state_size=8, chunk_size=8))
    layers = tuple(Layer(mixer=m, ffn=MLP(intermediate_size=48)) for m in mixers)
    config = HybridConfig(vocab_size=128, hidden_size=32, max_position_embeddings=256, dtype="float32", layers=layers)
    llm = LLM(config, device="cpu", max_num_seqs=6, kv_cache_memory=16 << 20, max_num_batched_tokens=32, seed=0)
    runner = llm.engine.runner
    state_groups = static_state_groups(runner.plan, runner.model.cache_layers())
    assert len(state_groups) == 1
    buffers = MixedStepBuffers(runner.plan, max_tokens=32, max_reqs=6, device="cpu", pin=False,
                               state_groups=state_groups)
    stand_in = SimpleNamespace(static=buffers, bucket_for=lambda n: 32 if n <= 32 else None)
    execute, checked = runner.execute, []

    def compare(batch):
        runner.mixed_graphs = None
        built = runner.group_inputs(batch, torch.device("cpu"))
        runner.mixed_graphs = stand_in
        static = runner._static_inputs(batch)
        assert static is buffers
        runner._group_inputs(batch, torch.device("cpu"), (), static)
        n, tokens = batch.num_reqs, int(batch.input_ids.shape[0])
        abs_seq = batch.seq_lens
        qsl = buffers.d_qsl.numpy()
        for a, g in enumerate(buffers.groups):
            cam, spec = built[g].cam, runner.plan.groups[g].spec
            win = getattr(spec, "sliding_window", None)
            assert np.array_equal(qsl[:n + 1], cam.query_start_loc_cpu) and (qsl[n + 1:] == 32).all()
            assert np.array_equal(buffers.d_slots[a, :tokens].numpy(), built[g].slot_mapping.numpy())
            assert (buffers.d_slots[a, tokens:32] == -1).all() and not buffers.d_seq[a, n:7].any()
            seq = buffers.d_seq[a, :n].numpy()
            static_keys = _key_slots(qsl, seq, buffers.d_tables[a][:n].numpy(), abs_seq, spec.block_size, win)
            built_keys = _key_slots(cam.query_start_loc_cpu, cam.seq_lens_cpu, cam.block_table_cpu, abs_seq,
                                    spec.block_size, win)
            assert static_keys == built_keys
        for m, g in enumerate(buffers.state_groups):       # the Mamba2 group: the eager step's slots and flags
            assert np.array_equal(buffers.d_idx[m, :n].numpy(), built[g].state_indices.numpy())
            assert np.array_equal(buffers.d_init[m, :n].numpy(), built[g].has_initial_state.numpy())
            assert (buffers.d_idx[m, n:7] == -1).all() and not buffers.d_init[m, n:7].any()
        checked.append(int((abs_seq - buffers.d_seq[:, :n].numpy().min(axis=0)).max()))   # the latest row start
        runner.mixed_graphs = None

    def checked_execute(batch):
        compare(batch)
        return execute(batch)

    runner.execute = checked_execute
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, int(n)).tolist() for n in rng.integers(10, 70, 8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(outs) == 8 and len(checked) > 10 and max(checked) > 0      # some sliding rows started past key 0


def test_a_step_wider_than_the_static_tables_runs_eagerly_at_its_bucket() -> None:
    """When a step's tables do not fit the static ones, the runner builds every group's inputs and runs the forward
    eagerly, padded to the bucket (whose GEMM shapes the capture met): same tokens and logprobs as a plain run."""
    from hybridkv import LLM, SamplingParams
    from hybridkv.engine.mixed_graphs import MixedStepGraphs
    from hybridkv.models import MLP, Attention, HybridConfig, Layer

    class Refusing:             # the mixed graphs' fallback alone: static inputs that never fit
        eager = ()
        run_eager = MixedStepGraphs.run_eager

        def __init__(self, model) -> None:
            self.model, self.sizes = model, []
            self.static = SimpleNamespace(groups=(0,), fits=lambda num_reqs, widths: False)

        def bucket_for(self, num_tokens: int) -> int:
            self.sizes.append(num_tokens)
            return 64

        def run(self, ids, positions):
            raise AssertionError("no replay: the tables do not fit")

    layers = tuple(Layer(mixer=Attention(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=8 if i else None),
                         ffn=MLP(intermediate_size=48)) for i in range(2))
    config = HybridConfig(vocab_size=128, hidden_size=32, max_position_embeddings=256, dtype="float32", layers=layers)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 128, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = []
    for refusing in (False, True):
        llm = LLM(config, device="cpu", max_num_seqs=8, kv_cache_memory=16 << 20, max_num_batched_tokens=64, seed=0)
        if refusing:
            stub = llm.engine.runner.mixed_graphs = Refusing(llm.engine.runner.model)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params)])
    assert min(stub.sizes) < 64                  # steps padded to the bucket among them
    for plain, padded in zip(*runs, strict=True):
        assert padded.token_ids == plain.token_ids
        np.testing.assert_allclose([lp.logprob for lp in padded.logprobs], [lp.logprob for lp in plain.logprobs],
                                   atol=1e-5, rtol=1e-5)


class _Replay:
    """The mixed graphs' replay without CUDA: a step's forward at its bucket over the static step inputs as the
    capture reads them (``MixedStepGraphs._step_inputs``: the pending ids taken, padded rows as packed), the static
    layers' ops over the packed buffers on every row (as captured), the others on the real tokens, padded with zero
    rows (as the breaks run)."""

    eager = ()
    head_rows = HEAD_ROWS_UNIT      # (``MixedStepGraphs.head_rows``: steps with at most this many logits rows)

    def __init__(self, model, static: MixedStepBuffers, bucket: int) -> None:
        self.model, self.static, self.bucket, self.replays, self.heads = model, static, bucket, 0, 0
        self._head_in = None            # (``MixedStepGraphs._gather_head_rows`` makes it)

    def bucket_for(self, num_tokens: int) -> int | None:
        return self.bucket if num_tokens <= self.bucket else None

    def replay_static(self, n: int, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        import dataclasses

        from hybridkv.engine.mixed_graphs import MixedStepGraphs, _Padded
        from hybridkv.forward_context import forward_context, get_forward_context

        if prev_tokens is not None:
            self.static.take_prev(prev_tokens)
        ids, positions = MixedStepGraphs._step_inputs(self, self.bucket)       # (bucket,) each
        eager, ctx = _Padded(n), get_forward_context()

        def ops(fn, tensors, shape, dtype, key=None):
            return fn(*tensors) if key in self.static.names else eager(fn, tensors, shape, dtype, key)

        step = dataclasses.replace(ctx, inputs={**ctx.inputs, **self.static.inputs(self.bucket)}, graph_breaks=ops)
        with forward_context(step):
            hidden = self.model(ids, positions)
            MixedStepGraphs._gather_head_rows(self, hidden)
        self.backend = ctx.backend
        self.replays += 1
        return hidden[:n]

    def run_head(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head graph's work on the gathered rows, eagerly (its flag read as the graph reads it)."""
        from hybridkv.forward_context import ForwardContext, forward_context

        tokens = torch.zeros(HEAD_ROWS_UNIT, dtype=torch.int64, device=self._head_in.device)
        report = torch.zeros_like(tokens)
        with forward_context(ForwardContext(inputs={}, backend=self.backend)):
            logits, _ = self.model.compute_logits_and_greedy(self._head_in, out=tokens, report=report,
                                                             write_logits=self.static.d_flag)
        self.heads += 1
        return logits, tokens, report


@pytest.mark.slow          # ~40 s: every Mamba2 and attention kernel interpreted, ~40 steps twice
def test_mamba2_scans_over_the_static_slots_match_the_eager_step() -> None:
    """Mamba2 beside full and sliding-window attention, requests arriving while others decode and chunked prefills:
    with every step replayed over the static buffers (``_Replay``: the Mamba2 layers take every request through the
    packed conv and scan, decodes as one-token requests, the padded request at slot -1), greedy tokens and logprobs
    equal a plain run's (fp32, Triton interpreted without CUDA)."""
    from test_mixed_graphs import _assert_same, _staggered

    from hybridkv import LLM, SamplingParams
    from hybridkv.backends.base import KernelBackend
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2

    conv, ssd, attention = (kernel_module(f"hybridkv.backends.triton_{m}") for m in ("conv1d", "ssd", "attention"))
    # the kernels the static inputs meet (interpreted without CUDA); the references for the rest
    backend = KernelBackend(name="triton-state", paged_attention=attention.paged_attention_triton,
                            write_kv=attention.write_kv_triton, causal_conv1d=conv.causal_conv1d_triton,
                            causal_conv1d_update=conv.causal_conv1d_update_triton,
                            ssd_chunk_scan=ssd.ssd_chunk_scan_triton, ssd_state_update=ssd.ssd_state_update_triton)
    attn = dict(num_heads=4, num_kv_heads=2, head_dim=8)
    mixers = (Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=1, chunk_size=8), Attention(**attn),
              Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8),
              Attention(sliding_window=6, **attn))
    config = HybridConfig(vocab_size=128, hidden_size=32, max_position_embeddings=256, dtype="float32",
                          layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=48)) for m in mixers))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 128, int(n)).tolist() for n in rng.integers(2, 24, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    runs = []
    for replay in (False, True):
        llm = LLM(config, device=DEVICE, backend=backend, max_num_seqs=4, kv_cache_memory=16 << 20,
                  max_num_batched_tokens=16, cuda_graphs=False, seed=0)
        runner = llm.engine.runner
        if replay:
            groups = static_state_groups(runner.plan, runner.model.cache_layers())
            assert len(groups) == 2           # (the two layers' state shapes differ)
            static = MixedStepBuffers(runner.plan, max_tokens=16, max_reqs=4, device=DEVICE, pin=False,
                                      state_groups=groups)
            runner.mixed_graphs = stand_in = _Replay(runner.model, static, 16)
        runs.append(_staggered(llm, prompts, params, every=2))
    assert stand_in.replays > 10 and stand_in.heads > 10
    _assert_same(*runs)


@pytest.mark.parametrize("refusal", ["vendor", "other"])
def test_a_backend_whose_scan_refuses_capture_keeps_mamba2_as_a_graph_break(
        refusal: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """mamba_ssm's scan refuses a capture of several requests (``UnsupportedConfig``): the runner captures again with
    the Mamba2 groups breaking the graph (attention still inside), rather than losing the mixed graphs. Any other
    failure (out of memory, say) is not retried: the mixed graphs are off."""
    from hybridkv import LLM
    from hybridkv.backends.registry import UnsupportedConfig
    from hybridkv.engine import model_runner
    from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2

    captures: list[tuple[int, ...]] = []

    class Graphs(model_runner.MixedStepGraphs):     # the capture alone: the packed scan refuses it
        def __init__(self, model, backend, *, buckets, eager, static) -> None:
            self.static = static

        def capture(self) -> None:
            captures.append(self.static.state_groups)
            if self.static.state_groups:
                raise (UnsupportedConfig("mamba_ssm", "ssd_chunk_scan", "several requests under CUDA-graph capture")
                       if refusal == "vendor" else RuntimeError("CUDA out of memory"))

        def touch_eager_sizes(self, head, head_rows) -> None:
            pass

    monkeypatch.setattr(model_runner, "MixedStepGraphs", Graphs)
    monkeypatch.setattr(model_runner, "MixedStepBuffers",
                        lambda plan, *, state_groups, **kw: SimpleNamespace(state_groups=tuple(state_groups)))
    layers = tuple(Layer(mixer=m, ffn=MLP(intermediate_size=48)) for m in (
        Attention(num_heads=4, num_kv_heads=2, head_dim=8), Mamba2(num_heads=4, head_dim=8, state_size=8)))
    config = HybridConfig(vocab_size=128, hidden_size=32, max_position_embeddings=256, dtype="float32", layers=layers)
    runner = LLM(config, device="cpu", max_num_seqs=4, kv_cache_memory=16 << 20, seed=0).engine.runner
    with caplog.at_level("INFO", logger="hybridkv.engine"):
        graphs = runner._capture_mixed(64)
    if refusal == "vendor":
        assert len(captures) == 2 and len(captures[0]) == 1 and captures[1] == ()
        assert graphs is not None and graphs.static.state_groups == ()
        assert "state groups as graph breaks" in caplog.text and "mixed steps off" not in caplog.text
    else:
        assert len(captures) == 1 and graphs is None and "mixed steps off" in caplog.text
