"""Requests fail alone: bad parameters and prompts are rejected at submission with their own error output;
a failure while a request runs (non-finite logits, a sampling error, a failed forward) finishes the requests
it can be pinned on with ``error`` set while the others go on; every ``LLM`` call releases its requests
however it ends. The conftest fixture checks after every test that each engine it built holds nothing.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import hybridkv.engine.engine as engine_module
from hybridkv import LLM, SamplingParams
from hybridkv.engine.engine import NONFINITE_ERROR
from hybridkv.engine.sampler import NONFINITE, chosen_finite, report
from hybridkv.layers.ops.fused_ref import linear_argmax_ref
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model
from tests._triton import DEVICE, gpu, kernel_module

VOCAB = 31
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def config() -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    mixers = (Mamba2(num_heads=2, head_dim=8, state_size=8, chunk_size=4), Attention(sliding_window=6, **attn),
              Attention(**attn))
    return HybridConfig(vocab_size=VOCAB, hidden_size=16, max_position_embeddings=64, dtype="float32",
                        eos_token_ids=(1,), layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=32))
                                                         for m in mixers))


@pytest.fixture(scope="module")
def model():
    return build_model(config(), seed=2)


def make_llm(model, **kw) -> LLM:
    args = dict(device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory=1 << 20)
    return LLM(model, **(args | kw))


PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [15, 16]]


@pytest.fixture(scope="module")
def baseline(model) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in make_llm(model).generate(PROMPTS, GREEDY, use_tqdm=False)]


def tokens(outs) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids if o.outputs else () for o in outs]


# -- rejected at submission ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("bad", "message"), [
    (dict(logprobs=10**6), "max_logprobs"),
    (dict(prompt_logprobs=10**6), "max_logprobs"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(logit_bias={VOCAB + 3: 1.0}), "logit_bias"),
    (dict(stop=["w3"]), "need a tokenizer"),
])
def test_bad_params_fail_alone_and_leave_nothing(model, baseline, bad: dict, message: str) -> None:
    llm = make_llm(model)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=6, **bad), GREEDY, GREEDY]
    for _ in range(2):                              # every later call works the same
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.error is None for o in outs] == [True, False, True, True]
        assert message in outs[1].error and outs[1].outputs == ()
        assert [tokens(outs)[i] for i in (0, 2, 3)] == [baseline[i] for i in (0, 2, 3)]
        llm.engine.check_idle()


@pytest.mark.parametrize("bad", [
    dict(max_tokens=2.5), dict(max_tokens=True), dict(n=2.0), dict(top_k=1.5), dict(logprobs=2.0), dict(seed=1.5),
    dict(seed=False), dict(temperature=float("nan")), dict(temperature=True), dict(temperature=-1),
    dict(presence_penalty=3.0), dict(frequency_penalty=float("inf")), dict(repetition_penalty=0.0),
    dict(stop_token_ids=[-1]), dict(stop_token_ids=[True]), dict(logit_bias={-1: 1.0}),
    dict(logit_bias={1: float("nan")}), dict(logit_bias=[1, 2]), dict(min_tokens=5, max_tokens=4),
    dict(min_tokens=-1), dict(skip_special_tokens="yes"), dict(stop=[3]), dict(stop=[""]), dict(top_p=0),
])
def test_sampling_params_check_types_and_ranges(bad: dict) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**bad)


def test_sampling_params_accept_what_vllm_users_pass() -> None:
    p = SamplingParams(max_tokens=None, seed=np.int64(3), top_k=-1, stop="END", stop_token_ids=[np.int32(5)],
                       logit_bias={"4": 2, 5: -1e6})
    assert p.max_tokens is None and p.seed == 3 and type(p.seed) is int and p.stop == ("END",)
    assert p.stop_token_ids == (5,) and p.logit_bias == {4: 2.0, 5: -100.0}


@pytest.mark.parametrize("seed", [2**63, 2**63 - 1, 2**100, -3])
def test_any_int_seed_samples_reproducibly(model, seed: int) -> None:
    llm = make_llm(model)
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=5, ignore_eos=True)
    first, again = (llm.generate([PROMPTS[0]], params, use_tqdm=False)[0] for _ in range(2))
    assert first.error is None and first.outputs[0].token_ids == again.outputs[0].token_ids


def test_max_tokens_none_runs_to_the_model_length(model) -> None:
    out = make_llm(model).generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                                   use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64 - len(PROMPTS[3]) and out.outputs[0].finish_reason == "length"


def test_malformed_prompts_get_their_own_error(model, baseline) -> None:
    llm = make_llm(model)
    batch = [PROMPTS[0], [1, None], ["a"], {"prompt_token_ids": PROMPTS[1]}, {"bad": 1}, 3.5, [True, 2],
             np.array(PROMPTS[2]), "text", {"prompt": "text"}, PROMPTS[3]]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    errors = [o.error for o in outs]
    assert [e is None for e in errors] == [True, False, False, True, False, False, False, True, False, False, True]
    assert "None at position 1" in errors[1] and "'a' at position 0" in errors[2]
    assert "unsupported prompt keys" in errors[4] and "got float" in errors[5] and "True at position 0" in errors[6]
    assert "needs a tokenizer" in errors[8] and "needs a tokenizer" in errors[9]
    assert [tokens(outs)[i] for i in (0, 3, 7, 10)] == baseline


def test_one_prompt_forms(model, baseline) -> None:
    llm = make_llm(model)
    assert tokens(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)) == [baseline[0]]
    assert tokens(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)) == [baseline[0]]
    assert llm.generate([], GREEDY, use_tqdm=False) == []


# -- every call releases its requests ---------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("how", ["break", "close", "raise", "never_started"])
def test_a_stream_left_early_releases_its_requests(model, baseline, asynchronous: bool, how: str) -> None:
    llm = make_llm(model, async_scheduling=asynchronous)
    stream = llm.generate_stream(PROMPTS, GREEDY)
    if how == "break":
        for _ in stream:
            break
        del stream
    elif how == "close":
        next(stream)
        stream.close()
    elif how == "raise":
        with pytest.raises(RuntimeError, match="consumer"):
            for _ in stream:
                raise RuntimeError("the consumer failed")
        del stream                  # (an exception in the loop body leaves the generator open until dropped)
    else:
        del stream
    gc.collect()
    llm.engine.check_idle()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline


def test_a_paused_stream_keeps_its_outputs_while_generate_runs(model, baseline) -> None:
    llm = make_llm(model)
    stream = llm.generate_stream(PROMPTS[:2], GREEDY)
    first = next(stream)
    assert tokens(llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False)) == baseline[2:]
    last = {first.request_id: first}
    for out in stream:
        last[out.request_id] = out
    assert [last["0.0"].outputs[0].token_ids, last["1.0"].outputs[0].token_ids] == baseline[:2]


class Interrupt:
    """Wraps a runner's ``execute``: raises ``error`` on call number ``at``."""

    def __init__(self, execute, at: int, error: BaseException) -> None:
        self.execute, self.at, self.error, self.calls = execute, at, error, 0

    def __call__(self, batch):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.execute(batch)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_keyboard_interrupt_in_generate_leaves_the_engine_clean(model, baseline, asynchronous: bool,
                                                                monkeypatch) -> None:
    llm = make_llm(model, async_scheduling=asynchronous)
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "execute", Interrupt(runner.execute, 3, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.engine.check_idle()
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_forward_fails_its_step_only(model, baseline, asynchronous: bool, monkeypatch) -> None:
    """Two requests fit a step; the first step's forward fails: its two requests end with the error, the
    next two run as if nothing happened."""
    llm = make_llm(model, async_scheduling=asynchronous, max_num_seqs=2)
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "execute", Interrupt(runner.execute, 1, RuntimeError("device fault")))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outs[:2]:
        assert "the model step failed (RuntimeError: device fault)" in out.error
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == ()
    assert [o.error for o in outs[2:]] == [None, None] and tokens(outs[2:]) == baseline[2:]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_sampling_failure_is_pinned_on_its_row(model, baseline, asynchronous: bool, monkeypatch) -> None:
    """Sampling the batch fails; retried row by row, only the row that fails alone fails."""
    original = engine_module.logprobs_of

    def fragile(logits, token_ids, top):
        if top == 3:
            raise ValueError("cannot take 3")
        return original(logits, token_ids, top)

    monkeypatch.setattr(engine_module, "logprobs_of", fragile)
    llm = make_llm(model, async_scheduling=asynchronous)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k) for k in (1, 3, None, 2)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert "sampling failed: ValueError: cannot take 3" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert [outs[i].error for i in (0, 2, 3)] == [None] * 3
    assert [tokens(outs)[i] for i in (0, 2, 3)] == [baseline[i] for i in (0, 2, 3)]
    assert [len(lp.top) for lp in outs[3].outputs[0].logprobs] == [2] * 6


# -- non-finite logits at run time ---------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True),
                                    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
                                    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   presence_penalty=0.5)])
def test_nonfinite_logits_fail_their_request(model, asynchronous: bool, params) -> None:
    """A copy of the model whose embedding row of one token is NaN: only requests that hold that token see
    NaN (rows never mix across requests). The token is one the clean requests never produce."""
    clean = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    reference = tokens(make_llm(model).generate(clean, params, use_tqdm=False))
    used = {t for seq in (*clean, *reference) for t in seq}
    poison = next(t for t in range(2, VOCAB) if t not in used)
    poisoned = build_model(config(), seed=2)
    with torch.no_grad():
        poisoned.embed_tokens.weight[poison] = float("nan")
    llm = make_llm(poisoned, async_scheduling=asynchronous)
    outs = llm.generate([clean[0], [3, 4, poison], clean[1], PROMPTS[2] + [poison], clean[2]], params,
                        use_tqdm=False)
    for out in (outs[1], outs[3]):
        assert out.error == NONFINITE_ERROR and out.outputs[0].finish_reason == "error"
        assert out.outputs[0].token_ids == ()
    assert [o.error for o in (outs[0], outs[2], outs[4])] == [None] * 3
    assert tokens([outs[0], outs[2], outs[4]]) == reference


def test_a_nan_in_the_logits_head_fails_every_request(model) -> None:
    m = build_model(config(), seed=2)
    with torch.no_grad():
        m.lm_head.weight[7, 3] = float("nan")
    outs = make_llm(m).generate([PROMPTS[1], PROMPTS[3]], GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [NONFINITE_ERROR] * 2


@pytest.mark.parametrize("where", ["hidden", "head_row", "bias", "overflow", "none"])
def test_the_graph_check_matches_the_logits(where: str) -> None:
    """What a captured greedy step reports without writing the logits (the argmax's reduction checks the row's
    maximum, the chosen logit) says what the logits say, for the reference head and the Triton one."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(11, 8, generator=gen)
    bias = torch.randn(11, generator=gen)
    if where == "hidden":
        hidden[2, 4] = float("nan")
    elif where == "head_row":
        weight[6, 1] = float("inf")
    elif where == "bias":
        bias[3] = float("nan")
    elif where == "overflow":
        hidden[1] = 1e30
        weight[:] = 1e30
    logits = torch.nn.functional.linear(hidden, weight, bias)
    tokens = logits.argmax(-1)
    want = report(tokens, chosen_finite(logits, tokens))
    got = torch.full_like(tokens, -7)
    linear_argmax_ref(hidden, weight, bias, report=got)
    assert torch.equal(got, want)
    assert bool((want != NONFINITE).all()) is (where == "none")
    linear = kernel_module("hybridkv.backends.triton_linear")
    got = torch.full_like(tokens, -7, device=DEVICE)
    linear.linear_argmax_triton(hidden.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), report=got)
    assert torch.equal(got.cpu(), want)


@gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_nonfinite_logits_under_cuda_graphs(graphs: bool) -> None:
    """On the GPU a greedy decode step takes its tokens from the captured graph's argmax with the logits left
    unwritten: the report the graph writes beside them fails the NaN request alone. The NaN embedding row is
    that of a token request 1 generates itself a few steps in, so the NaN first shows in a decode step."""
    def build():
        return build_model(config(), seed=2, device=torch.device("cuda"))

    def make(m) -> LLM:
        return LLM(m, device="cuda", backend="triton", block_size=4, max_num_seqs=4, kv_cache_memory=1 << 22,
                   cuda_graphs=graphs)

    candidates = [PROMPTS[1], PROMPTS[2], PROMPTS[3], [5, 9, 2, 17], [11, 3, 28], [19, 6]]
    batch = [PROMPTS[0], *candidates]
    # (the poisoned run has the same batch: on a GPU, greedy tokens may depend on what else is batched)
    first, *continuations = tokens(make(build()).generate(batch, GREEDY, use_tqdm=False))
    other = {*PROMPTS[0], *first}
    for j, (prompt, cont) in enumerate(zip(candidates, continuations, strict=True)):  # noqa: B007 (read after)
        k, poison = next(((k, t) for k, t in enumerate(cont) if 1 <= k < len(cont) - 1 and t not in other
                          and t not in (*prompt, *cont[:k])), (None, None))
        if poison is not None:
            break
    assert poison is not None, f"no continuation of {candidates} has a token free of {sorted(other)}"
    m = build()
    with torch.no_grad():
        m.embed_tokens.weight[poison] = float("nan")
    outs = make(m).generate(batch, GREEDY, use_tqdm=False)
    assert outs[0].error is None and tokens(outs)[0] == first
    assert outs[1 + j].error == NONFINITE_ERROR and tokens(outs)[1 + j] == cont[:k + 1]


# -- the idle check itself -------------------------------------------------------------------------------------
@pytest.mark.engine_busy
def test_check_idle_sees_what_is_held(model) -> None:
    llm = make_llm(model)
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(AssertionError, match="engine not idle: 1 requests"):
        engine.check_idle()
    engine.abort("r")
    engine.check_idle()
    engine.add_request("r", PROMPTS[0], GREEDY)      # left for the fixture, which this marker turns off


@pytest.mark.parametrize("asynchronous", [False, True])
def test_aborting_everything_in_flight_leaves_nothing(model, asynchronous: bool) -> None:
    llm = make_llm(model, async_scheduling=asynchronous)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    for i in range(len(PROMPTS)):
        assert engine.abort(f"r{i}")
    assert not engine.has_unfinished
    engine.check_idle()
