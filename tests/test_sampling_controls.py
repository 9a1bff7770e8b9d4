"""vLLM's sampling controls (logit bias, min_tokens, repetition / frequency / presence penalties, stop-string
options, seeds of n samples) against brute-force references: the vectorised processing against a per-row
Python loop (hypothesis), and the engine's greedy tokens with penalties against a loop over the no-cache
reference forward, in mixed batches with preemption, prefix hits and asynchronous scheduling.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits
from hybridkv.engine.sampler import LogitsProcessing, process_logits
from hybridkv.engine.sampling_params import sample_seed
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model

VOCAB = 29
EOS = 1


def config() -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    mixers = (Mamba2(num_heads=2, head_dim=8, state_size=8, chunk_size=4), Attention(sliding_window=6, **attn),
              Attention(**attn))
    return HybridConfig(vocab_size=VOCAB, hidden_size=16, max_position_embeddings=96, dtype="float32",
                        eos_token_ids=(EOS,), layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=32))
                                                           for m in mixers))


@pytest.fixture(scope="module")
def model():
    return build_model(config(), seed=5)


@pytest.fixture(scope="module")
def ref_model():
    """The same weights for ``reference_logits``, which binds its own cache to the model it runs."""
    return build_model(config(), seed=5)


def make_llm(model, **kw) -> LLM:
    args = dict(device="cpu", block_size=4, max_num_seqs=6, max_num_batched_tokens=16, kv_cache_memory=1 << 20)
    return LLM(model, **(args | kw))


# -- the vectorised processing against a per-row loop -------------------------------------------------------
def reference_row(logits: torch.Tensor, history: list[int], num_prompt: int, bias: dict[int, float],
                  masked: list[int], mask_active: bool, presence: float, frequency: float,
                  repetition: float) -> torch.Tensor:
    """vLLM's definitions, one token at a time."""
    x = logits.clone()
    for token, value in bias.items():
        x[token] += value
    if mask_active:
        for token in masked:
            x[token] = float("-inf")
    outputs = history[num_prompt:]
    for token in set(history):
        x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
    for token in set(outputs):
        x[token] -= frequency * outputs.count(token) + presence
    return x


def _padded(rows: list[list], pad: object, dtype: torch.dtype, first: bool = False) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [(r[0] if first and r else pad)] * (width - len(r)) for r in rows], dtype=dtype)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 5), vocab=st.integers(2, 40))
def test_processing_matches_the_per_row_loop(data: st.DataObject, rows: int, vocab: int) -> None:
    token = st.integers(0, vocab - 1)
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-5, 5, width=32), min_size=vocab, max_size=vocab),
                                             min_size=rows, max_size=rows)), dtype=torch.float32)
    cases = []
    for _ in range(rows):
        history = data.draw(st.lists(token, min_size=1, max_size=12))
        cases.append(dict(
            history=history, num_prompt=data.draw(st.integers(1, len(history))),
            bias=data.draw(st.dictionaries(token, st.floats(-100, 100), max_size=4)),
            masked=data.draw(st.lists(token, max_size=3, unique=True)), mask_active=data.draw(st.booleans()),
            presence=data.draw(st.floats(-2, 2)), frequency=data.draw(st.floats(-2, 2)),
            repetition=data.draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            penalized=data.draw(st.booleans())))
    for c in cases:         # a row without penalties keeps neutral values and an empty history
        if not c["penalized"]:
            c.update(presence=0.0, frequency=0.0, repetition=1.0)
    bias_ids = [list(c["bias"]) for c in cases]
    proc = LogitsProcessing(
        bias_ids=_padded(bias_ids, 0, torch.int64, first=True),
        bias_values=_padded([list(c["bias"].values()) for c in cases], 0.0, torch.float32),
        masked_ids=_padded([c["masked"] or [0] for c in cases], 0, torch.int64, first=True),
        mask_active=torch.tensor([c["mask_active"] and bool(c["masked"]) for c in cases]),
        history=_padded([c["history"] for c in cases], vocab + 7, torch.int64),       # padding: never read
        num_prompt=torch.tensor([c["num_prompt"] for c in cases]),
        num_tokens=torch.tensor([len(c["history"]) if c["penalized"] else 0 for c in cases]),
        presence=torch.tensor([c["presence"] for c in cases], dtype=torch.float32),
        frequency=torch.tensor([c["frequency"] for c in cases], dtype=torch.float32),
        repetition=torch.tensor([c["repetition"] for c in cases], dtype=torch.float32))
    got = process_logits(logits, proc)
    for i, c in enumerate(cases):
        history = c["history"] if c["penalized"] else []
        want = reference_row(logits[i], history, min(c["num_prompt"], len(history)), c["bias"], c["masked"],
                             c["mask_active"], c["presence"], c["frequency"], c["repetition"])
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-4)


# -- the engine against a reference loop ---------------------------------------------------------------------
def reference_greedy(model, prompt: list[int], params: SamplingParams, eos: int = EOS) -> list[int]:
    """Greedy continuation of ``prompt`` with ``params``' processing applied to the no-cache reference logits
    at every step; a near-tie (top two within 1e-4) is marked None (either is right)."""
    seq, out = list(prompt), []
    masked = list(dict.fromkeys([*params.stop_token_ids, *([] if params.ignore_eos else [eos])]))
    while len(out) < params.max_tokens:
        logits = reference_logits(model, seq)[-1]
        x = reference_row(logits, seq if params.has_penalties else [], len(prompt), params.logit_bias, masked,
                          len(out) < params.min_tokens, params.presence_penalty, params.frequency_penalty,
                          params.repetition_penalty)
        top = torch.topk(x, 2)
        token = int(top.indices[0])
        out.append(token if float(top.values[0] - top.values[1]) > 1e-4 else None)
        seq.append(token)
        stops = token in params.stop_token_ids or (token == eos and not params.ignore_eos)
        if stops and len(out) >= params.min_tokens:
            break
    return out


def same(got: tuple[int, ...], want: list[int | None]) -> bool:
    """Equal up to the first near-tie (after which the continuations may differ)."""
    for g, w in zip(got, want, strict=False):
        if w is None:
            return True
        if g != w:
            return False
    return len(got) == len(want)


@st.composite
def processed_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, 7))
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=draw(st.integers(0, min(3, max_tokens))),
        presence_penalty=draw(st.sampled_from([0.0, 0.7, -1.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.4, 2.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.5, 0.7])),
        logit_bias=draw(st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -3.0, 2.5, 8.0]),
                                        max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(2, VOCAB - 1), max_size=2)), ignore_eos=draw(st.booleans()))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.lists(processed_params(), min_size=2, max_size=4), seed=st.integers(0, 2**16), tight=st.booleans(),
       asynchronous=st.booleans())
def test_engine_processing_matches_the_reference_loop(model, ref_model, params, seed: int, tight: bool,
                                                      asynchronous: bool) -> None:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, VOCAB, 5).tolist()
    prompts = [prefix + rng.integers(2, VOCAB, int(rng.integers(1, 14))).tolist() for _ in params]
    params = [*params, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]   # plain, same batch
    prompts.append(prefix + [3, 4])
    llm = make_llm(model, async_scheduling=asynchronous, kv_cache_memory=12_000 if tight else 1 << 20)
    want = [reference_greedy(ref_model, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    for _ in range(2):                       # the second time with prefix hits
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, out, w in zip(params, outs, want, strict=True):
            assert out.error is None
            assert same(out.outputs[0].token_ids, w), (p, out.outputs[0].token_ids, w)


def test_the_reference_loop_is_not_vacuous(ref_model) -> None:
    """The controls change the tokens (else the test above would pass with them ignored)."""
    prompt = [5, 6, 7, 5, 6]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = reference_greedy(ref_model, prompt, plain)
    for change in (dict(repetition_penalty=2.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                   dict(logit_bias={base[0]: -100.0})):
        p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **change)
        assert reference_greedy(ref_model, prompt, p) != base, change


@pytest.mark.parametrize("asynchronous", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(model, asynchronous: bool) -> None:
    llm = make_llm(model, async_scheduling=asynchronous)
    eos_first = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    assert llm.generate([[4, 5, 6]], eos_first, use_tqdm=False)[0].outputs[0].token_ids == (EOS,)
    out = llm.generate([[4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0},
                                                   min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason is None
    stop = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logit_bias={9: 100.0}, stop_token_ids=[9],
                          min_tokens=2)
    out = llm.generate([[4, 5, 6]], stop, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == 9 and out.stop_reason == 9


def test_logit_bias_steers_sampling(model) -> None:
    llm = make_llm(model)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logit_bias={"7": 100})
    out = llm.generate([[3, 4]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == (7,) * 6
    assert params.logit_bias == {7: 100.0}
    assert SamplingParams(logit_bias={2: 1e9}).logit_bias == {2: 100.0}       # clamped as OpenAI does


def test_penalties_keep_the_greedy_fast_path_for_the_others(model) -> None:
    """A greedy batch asks for no logits (its argmax is all it needs) unless a request processes them."""
    llm = make_llm(model)
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", [3, 4, 5], plain)
    batch = engine.scheduler.schedule()
    assert engine._step_batch(batch).needs_logits is False
    engine.abort("a")
    engine.add_request("b", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3, presence_penalty=0.5))
    batch = engine.scheduler.schedule()
    assert engine._step_batch(batch).needs_logits is True
    engine.abort("b")


# -- seeds of n samples, stop-string options ---------------------------------------------------------------
def test_n_samples_hash_their_seeds(model) -> None:
    llm = make_llm(model)
    prompt = [3, 9, 4]

    def sampled(n: int, seed: int) -> list[tuple[int, ...]]:
        p = SamplingParams(temperature=1.0, n=n, seed=seed, max_tokens=8, ignore_eos=True)
        return [c.token_ids for c in llm.generate([prompt], p, use_tqdm=False)[0].outputs]

    three = sampled(3, 7)
    assert three == sampled(3, 7)                      # reproducible
    assert three[0] == sampled(1, 7)[0]                # n=1 is the first of n=k
    assert three[1] != sampled(1, 8)[0]                # not seed + i
    assert sample_seed(7, 1) != 8 and 0 <= sample_seed(7, 1) < 2**63
    assert sample_seed(-5, 0) == sample_seed(-5, 0) and 0 <= sample_seed(2**70, 0) < 2**63


class SpecialWords:
    """Token t is the word "w<t>", token 2 is the special "<x>" (skipped unless asked for)."""

    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [2 if w == "<x>" else int(w[1:]) for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join("<x>" if t == 2 else f"w{t}" for t in ids if t != 2 or not skip_special_tokens)


def test_stop_strings_and_special_tokens_in_text(model) -> None:
    llm = make_llm(model, tokenizer=SpecialWords())
    forced = {2: 100.0}
    plain = llm.generate(["w3 w4"], SamplingParams(temperature=0.0, max_tokens=3, logit_bias=forced),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == (2, 2, 2) and plain.text == ""
    kept = llm.generate(["w3 w4"], SamplingParams(temperature=0.0, max_tokens=3, logit_bias=forced,
                                                  skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert kept.text == "<x> <x> <x>"
    ids = llm.generate(["w3 w4"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    word = next(f"w{t}" for t in ids[1:] if t != 2)
    first = SpecialWords().decode(list(ids)).index(word)
    for include, text in ((False, SpecialWords().decode(list(ids))[:first]),
                          (True, SpecialWords().decode(list(ids))[:first + len(word)])):
        out = llm.generate(["w3 w4"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[word],
                                                     include_stop_str_in_output=include), use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == word and c.text == text
