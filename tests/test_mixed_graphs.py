"""Mixed-step CUDA graphs (``engine/mixed_graphs.py``): the forward captured in pieces, broken at ``metadata_op``.

On the CPU: the buckets; every layer kind keeps its step inputs inside ``metadata_op`` (a forward with no step
inputs at all, each op answered by the recorder, completes, with the breaks each kind declares); outside a
capture ``metadata_op`` is a plain call. On a GPU: generation whose steps mix prefills and decodes equals
eager for every layer kind (fp32), with the mixed graphs replaying those steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.backends.registry import torch_backend
from hybridkv.engine.mixed_graphs import (
    HEAD_GRAPH_ROWS,
    HEAD_MIN_ROWS,
    MAX_GRAPHED_TOKENS,
    MixedStepGraphs,
    _Recorder,
    eager_sizes,
    mixed_buckets,
    padded_rows,
    unsupported_for_mixed_graphs,
)
from hybridkv.engine.mixed_metadata import HEAD_ROWS_UNIT
from hybridkv.forward_context import ForwardContext, forward_context, metadata_op
from hybridkv.models import (
    MLP,
    Attention,
    GatedDeltaNet,
    HybridConfig,
    KimiDeltaAttention,
    Layer,
    Mamba1,
    Mamba2,
    MoE,
    MultiLatentAttention,
    ShortConv,
)
from hybridkv.models.hybrid import HybridModel

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(("budget", "expected"), [
    (8, (8,)),
    (16, (16,)),
    (100, (16, 32, 64, 96, 100)),
    (640, (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640)),
    (1100, (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1100)),
    (8192, (16, 32, 64, *range(96, 257, 32), *range(320, 513, 64), *range(640, 1025, 128), *range(1280, 2049, 256),
            *range(2560, 4097, 512))),
])
def test_mixed_buckets(budget: int, expected: tuple[int, ...]) -> None:
    assert mixed_buckets(budget) == expected
    assert mixed_buckets(budget)[-1] == min(budget, MAX_GRAPHED_TOKENS)


@pytest.mark.parametrize(("budget", "expected"), [
    (4096, ()),
    (4200, (4200,)),
    (8192, tuple(range(4352, 8193, 256))),
    (9000, (*range(4352, 8961, 256), 9000)),
    (20000, (*range(4352, 8193, 256), *range(8448, 16384, 256), *range(16384, 20000, 512), 20000)),
])
def test_eager_sizes(budget: int, expected: tuple[int, ...]) -> None:
    """Past the graphs, steps run at few padded sizes: <= ~3% padding (the granule a power of two at most 1/32 of
    the size, at least EAGER_GRANULE), the budget itself last."""
    sizes = eager_sizes(budget)
    assert sizes == expected
    assert all(b - a <= max(256, a // 32) for a, b in zip((MAX_GRAPHED_TOKENS, *sizes), sizes, strict=False))


@pytest.mark.parametrize(("rows", "expected"), [(1, 1), (HEAD_MIN_ROWS, HEAD_MIN_ROWS), (65, 128), (129, 192),
                                                (192, 192), (193, 250), (250, 250), (251, 251), (4000, 4000)])
def test_head_rows_are_padded_to_few_counts(rows: int, expected: int) -> None:
    assert padded_rows(rows, 250) == expected


def test_head_rows_past_the_triton_gemv_are_cublas_ones() -> None:
    """Padding starts where a vocabulary-wide head leaves the Triton GEMV for cuBLAS."""
    from hybridkv.backends import triton_linear

    assert HEAD_MIN_ROWS == triton_linear.SMALL_MAX_ROWS
    assert HEAD_GRAPH_ROWS <= HEAD_ROWS_UNIT        # (the rows every step packs valid for the head graph's gather)
    for vocab, hidden in ((151936, 2048), (32000, 4096), (262144, 1152)):
        assert triton_linear.takes(HEAD_MIN_ROWS, vocab, hidden, gated=False)
        assert not triton_linear.takes(HEAD_MIN_ROWS + 1, vocab, hidden, gated=False)


def test_start_up_meets_every_eager_size_and_head_rows() -> None:
    """``touch_eager_sizes`` runs the forward (metadata ops skipped) at each eager size and the head at each row
    count: the GEMM shapes the padded steps will run, met once before serving."""
    mixer = _KINDS["mamba2"][0]
    config = HybridConfig(vocab_size=64, hidden_size=32, max_position_embeddings=64, dtype="float32",
                          layers=(Layer(mixer=_KINDS["full"][0], ffn=MLP(intermediate_size=48)),
                                  Layer(mixer=mixer, ffn=MLP(intermediate_size=48))))
    model = HybridModel(config).requires_grad_(False)
    sizes: list[int] = []
    forward = model.forward
    model.forward = lambda ids, positions: (sizes.append(int(ids.shape[0])), forward(ids, positions))[1]

    class Graphs:
        eager, backend, device = (8, 24), torch_backend(), torch.device("cpu")

    Graphs.model = model
    heads: list[int] = []
    MixedStepGraphs.touch_eager_sizes(Graphs, lambda h: heads.append(h.shape[0]), [80, 128])   # type: ignore[arg-type]
    assert sizes == [8, 24] and heads == [80, 128]


_ATTN = dict(num_heads=4, num_kv_heads=2, head_dim=8)
# mixer, breaks per layer (metadata_op calls)
_KINDS = {
    "full": (Attention(**_ATTN), 1),
    "sliding": (Attention(sliding_window=8, **_ATTN), 1),
    "chunked": (Attention(attention_chunk_size=8, **_ATTN), 1),
    "mamba2": (Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=1, chunk_size=8), 1),
    "mamba1": (Mamba1(intermediate_size=32, state_size=8, dt_rank=4, dt_norm=True), 2),
    "short_conv": (ShortConv(channels=32, bias=True), 1),
    "gated_deltanet": (GatedDeltaNet(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8), 1),
    "kimi_delta": (KimiDeltaAttention(num_heads=4, head_dim=8), 1),
    "mla": (MultiLatentAttention(num_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                 v_head_dim=6), 1),
}


class _Buffers:
    static_names: frozenset[str] = frozenset()

    def break_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, *, turn: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_layer_kind_reads_step_inputs_only_inside_metadata_op(kind: str) -> None:
    """A forward under a context with no step inputs (what a capture gives) completes when each metadata_op is
    answered by the recorder: nothing else in the layer reads the step. MoE FFN beside it, two layers."""
    mixer, breaks = _KINDS[kind]
    moe = MoE(num_experts=4, top_k=2, intermediate_size=32, router="softmax")
    config = HybridConfig(vocab_size=64, hidden_size=32, max_position_embeddings=64, dtype="float32",
                          layers=(Layer(mixer=mixer, ffn=MLP(intermediate_size=48)), Layer(mixer=mixer, ffn=moe)))
    model = HybridModel(config)
    assert unsupported_for_mixed_graphs(model) is None
    recorder = _Recorder(_Buffers(), None)          # type: ignore[arg-type]
    ids = torch.arange(10) % 64
    with torch.inference_mode(), forward_context(ForwardContext(inputs={}, backend=torch_backend(),
                                                                graph_breaks=recorder)):
        hidden = model(ids, torch.arange(10))
    assert hidden.shape == (10, 32) and bool(torch.isfinite(hidden).all())
    assert len(recorder.breaks) == 2 * breaks
    assert all(t.shape[0] == 10 for b in recorder.breaks for t in b.tensors)


def test_metadata_op_outside_a_capture_is_a_plain_call() -> None:
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(metadata_op(lambda t: t * 2, x, shape=(3, 2), dtype=x.dtype), x * 2)
    with forward_context(ForwardContext(inputs={}, backend=torch_backend())):
        assert torch.equal(metadata_op(lambda t: t + 1, x, shape=(3, 2), dtype=x.dtype), x + 1)


def _all_kinds_config() -> HybridConfig:
    moe = MoE(num_experts=4, top_k=2, intermediate_size=64, router="softmax")
    layers = tuple(Layer(mixer=mixer, ffn=MLP(intermediate_size=96) if i % 2 else moe)
                   for i, (mixer, _) in enumerate(_KINDS.values()))
    return HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=512, dtype="float32", layers=layers)


def _staggered(llm, prompts: list[list[int]], params, *, every: int) -> dict:
    """Request i arrives at step ``every * i`` while the earlier ones run (steps that mix prefills and decodes);
    each request's completion by id."""
    eng, done = llm.engine, {}
    for step in range(400):
        if step % every == 0 and step // every < len(prompts):
            eng.add_request(str(step // every), prompts[step // every], params)
        for out in eng.step(only_finished=True):
            done[out.request_id] = out.outputs[0]
        if len(done) == len(prompts):
            break
    assert len(done) == len(prompts)
    return done


def _assert_same(eager: dict, graphed: dict) -> None:
    """Greedy tokens equal, logprobs within fp32 reassociation."""
    for rid, out in eager.items():
        assert graphed[rid].token_ids == out.token_ids, rid
        np.testing.assert_allclose([lp.logprob for lp in graphed[rid].logprobs], [lp.logprob for lp in out.logprobs],
                                   atol=1e-4, rtol=1e-4)


@gpu
@pytest.mark.parametrize(("budget", "graphed_tokens"), [(24, MAX_GRAPHED_TOKENS), (160, MAX_GRAPHED_TOKENS), (160, 64)])
def test_mixed_graphs_match_eager(budget: int, graphed_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests arriving while others decode, chunked prefills (a step budget of ``budget`` tokens): the mixed
    steps replay the captured pieces (counted; with Mamba-1 every step does, decodes too), and the greedy tokens
    and their logprobs equal an eager run's, every layer kind in one model (fp32). With graphs up to 64 tokens,
    the larger steps run eagerly at padded sizes (granule 16)."""
    from hybridkv import LLM, SamplingParams
    from hybridkv.engine import mixed_graphs

    monkeypatch.setattr(mixed_graphs, "MAX_GRAPHED_TOKENS", graphed_tokens)
    monkeypatch.setattr(mixed_graphs, "EAGER_GRANULE", 16)

    rng = np.random.default_rng(budget)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 120, 10)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    runs = []
    for graphs in (False, True):
        # (None, not True: the decode graphs refuse Mamba-1's reference state update, the mixed ones run it eagerly)
        llm = LLM(_all_kinds_config(), device="cuda", backend="triton", max_num_seqs=8, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=budget, cuda_graphs=None if graphs else False, seed=0)
        runner = llm.engine.runner
        assert (runner.mixed_graphs is not None) == graphs and runner.graphs is None
        # the scheduler rounds a spread step's prompt cap up to the sizes the graphs pad steps to
        assert llm.engine.scheduler.step_sizes.tolist() == (list(runner.mixed_graphs.buckets) if graphs else [])
        replays = []
        if graphs:
            def counted(n, prev, replay=runner.mixed_graphs.replay_static, replays=replays):
                replays.append(n)
                return replay(n, prev)

            runner.mixed_graphs.replay_static = counted
        runs.append(_staggered(llm, prompts, params, every=3))
        if graphs:
            assert len(replays) > 5 and max(replays) > 8
    _assert_same(*runs)


@gpu
@pytest.mark.parametrize("other", ["sliding", "mamba2"])
def test_attention_and_mamba2_run_inside_the_mixed_graphs(other: str) -> None:
    """Full attention beside sliding-window attention (Gemma-3's mix) or beside Mamba2 (NemotronH's): every bucket is
    one graph, no break. The attention and the Mamba2 scans read the static inputs (``mixed_metadata.py``), and
    generation whose steps mix prefills and decodes equals an eager run's (fp32), the mixed steps replaying those
    graphs."""
    from hybridkv import LLM, SamplingParams

    layers = tuple(Layer(mixer=_KINDS[other if i % 3 else "full"][0], ffn=MLP(intermediate_size=96))
                   for i in range(6))
    config = HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=512, dtype="float32", layers=layers)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 150, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    runs = []
    for graphs in (False, True):
        llm = LLM(config, device="cuda", backend="triton", max_num_seqs=8, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=96, cuda_graphs=graphs, seed=0)
        mixed = llm.engine.runner.mixed_graphs
        if graphs:
            assert mixed is not None and mixed.static is not None
            assert all(len(pieces) == 1 and not brks for pieces, brks, _ in mixed._captured.values())
        runs.append(_staggered(llm, prompts, params, every=2))
    _assert_same(*runs)


@gpu
@pytest.mark.parametrize("sampling", ["greedy", "greedy_logprobs", "seeded"])
def test_the_logits_head_of_a_mixed_step_runs_as_a_graph(sampling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step over the static inputs that wants logits for at most ``HEAD_GRAPH_ROWS`` rows (4 here) replays the
    head's graph, counted; the others run the head eagerly. Greedy steps whose caller reads only the tokens (the graph
    leaves the logits unwritten), greedy steps with logprobs and seeded sampling (the logits written) give an eager
    run's tokens, and logprobs within fp32 reassociation (fp32)."""
    from hybridkv import LLM, SamplingParams
    from hybridkv.engine import mixed_graphs

    monkeypatch.setattr(mixed_graphs, "HEAD_GRAPH_ROWS", 4)
    layers = tuple(Layer(mixer=_KINDS["sliding" if i % 3 else "full"][0], ffn=MLP(intermediate_size=96))
                   for i in range(4))
    config = HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=512, dtype="float32", layers=layers)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 90, 12)]
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              "greedy_logprobs": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
              "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=16, ignore_eos=True)}[sampling]
    runs, heads = [], []
    for graphs in (False, True):
        llm = LLM(config, device="cuda", backend="triton", max_num_seqs=8, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=64, cuda_graphs=graphs, seed=0)
        mixed = llm.engine.runner.mixed_graphs
        if graphs:
            assert mixed is not None and mixed.head_rows == 4

            def counted(run=mixed.run_head):
                heads.append(1)
                return run()

            mixed.run_head = counted
        runs.append(_staggered(llm, prompts, params, every=2))
    assert heads
    if sampling == "greedy_logprobs":
        _assert_same(*runs)
    else:
        assert {r: o.token_ids for r, o in runs[1].items()} == {r: o.token_ids for r, o in runs[0].items()}


@gpu
def test_the_head_graph_takes_an_fp32_residual_streams_hidden_states() -> None:
    """A half-precision model whose residual stream is fp32 (``residual_in_fp32``, Mamba2's HF default) hands the head
    fp32 hidden states: the head graph's input takes the forward's dtype, so the capture keeps its static inputs and
    the head graph, and generation runs through them."""
    from hybridkv import LLM, SamplingParams

    layers = tuple(Layer(mixer=_KINDS["sliding" if i % 2 else "full"][0], ffn=MLP(intermediate_size=96))
                   for i in range(2))
    config = HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=512, dtype="bfloat16",
                          residual_in_fp32=True, layers=layers)
    llm = LLM(config, device="cuda", backend="triton", max_num_seqs=8, kv_cache_memory=64 << 20,
              max_num_batched_tokens=64, seed=0)
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.static is not None and mixed.head_rows > 0
    assert mixed._head_in is not None and mixed._head_in.dtype == torch.float32
    outs = llm.generate([[1, 2, 3, 4, 5]] * 3, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_padded_eager_steps_equal_exact_ones() -> None:
    """Steps past the graphs run at a padded size (the metadata ops on the real tokens, zero rows after them) and the
    head at padded row counts: greedy tokens and logprobs equal a plain run's, every layer kind (CPU, fp32; the
    padded path driven through ``MixedStepGraphs.run_eager`` without graphs)."""
    from hybridkv import LLM, SamplingParams

    class Eager:                 # the mixed graphs' padded eager path alone: every step past the (absent) buckets
        eager = (16, 48, 96, 160, 300)
        static = None
        run_eager = MixedStepGraphs.run_eager

        def __init__(self, model: HybridModel) -> None:
            self.model, self.sizes = model, []

        def bucket_for(self, num_tokens: int) -> None:
            self.sizes.append(num_tokens)

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(2, 6, 140)]   # then 140 decode at once
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = []
    for padded in (False, True):
        llm = LLM(_all_kinds_config(), device="cpu", backend="torch", max_num_seqs=150, kv_cache_memory=64 << 20,
                  max_num_batched_tokens=300, seed=0)
        if padded:
            stub = llm.engine.runner.mixed_graphs = Eager(llm.engine.runner.model)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params)])
    assert any(n not in Eager.eager for n in stub.sizes) and max(stub.sizes) > HEAD_MIN_ROWS    # padded steps, rows
    for exact, padded in zip(*runs, strict=True):
        assert padded.token_ids == exact.token_ids
        np.testing.assert_allclose([lp.logprob for lp in padded.logprobs], [lp.logprob for lp in exact.logprobs],
                                   atol=1e-5, rtol=1e-5)
