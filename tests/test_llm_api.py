"""The offline API's vLLM surface: ``LLM.chat`` with the checkpoint's chat template (BOS exactly once),
``tokenizer=`` a directory or an object (transformers' included), prompt dicts, ``RequestOutput.metrics`` and
``num_cached_tokens``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.loaders.tokenizer import load_tokenizer
from hybridkv.models import MLP, Attention, HybridConfig, Layer
from hybridkv.models.hybrid import build_model
from tests.test_tokenizers import MESSAGES, _bpe_dir

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BOS = 0


def config() -> HybridConfig:
    attn = Attention(num_heads=2, num_kv_heads=1, head_dim=8)
    return HybridConfig(vocab_size=300, hidden_size=16, max_position_embeddings=128, dtype="float32",
                        eos_token_ids=(1,), layers=(Layer(mixer=attn, ffn=MLP(intermediate_size=32)),) * 2)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return _bpe_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model():
    return build_model(config(), seed=0)


def make_llm(model, **kw) -> LLM:
    args = dict(device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=1 << 20)
    return LLM(model, **(args | kw))


def test_tokenizer_from_a_directory_or_an_object(model, tok_dir: Path, tmp_path: Path) -> None:
    by_path = make_llm(model, tokenizer=str(tok_dir))
    by_object = make_llm(model, tokenizer=load_tokenizer(tok_dir))
    outs = [llm.generate(["The lazy fox"], PARAMS, use_tqdm=False)[0] for llm in (by_path, by_object)]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids and outs[0].outputs == outs[1].outputs
    assert outs[0].outputs[0].text == by_path.tokenizer.decode(outs[0].outputs[0].token_ids)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        make_llm(model, tokenizer=tmp_path)
    with pytest.raises(TypeError, match="encode / decode"):
        make_llm(model, tokenizer=42)


def test_prompt_dicts(model, tok_dir: Path) -> None:
    llm = make_llm(model, tokenizer=tok_dir)
    ids = llm.tokenizer.encode("The lazy fox")
    outs = llm.generate(["The lazy fox", {"prompt": "The lazy fox"}, {"prompt_token_ids": ids},
                         {"prompt_token_ids": ids, "prompt": "shown"}], PARAMS, use_tqdm=False)
    assert len({o.outputs[0].token_ids for o in outs}) == 1
    assert [o.prompt for o in outs] == ["The lazy fox", "The lazy fox", None, "shown"]
    assert all(o.prompt_token_ids == tuple(ids) for o in outs)


def test_chat_renders_the_template_with_one_bos(model, tok_dir: Path) -> None:
    llm = make_llm(model, tokenizer=tok_dir)
    rendered = llm.tokenizer.apply_chat_template(MESSAGES)
    assert rendered.startswith("<s>")
    out = llm.chat(MESSAGES, PARAMS, use_tqdm=False)[0]
    assert out.prompt == rendered and out.prompt_token_ids.count(BOS) == 1 and out.prompt_token_ids[0] == BOS
    assert out.prompt_token_ids == tuple(llm.tokenizer.apply_chat_template(MESSAGES, tokenize=True))
    # the rendered text as a plain prompt, or encoded by hand, gets the BOS once too
    assert llm.generate([rendered], PARAMS, use_tqdm=False)[0].prompt_token_ids == out.prompt_token_ids
    assert llm.tokenizer.encode(rendered) == list(out.prompt_token_ids)
    assert llm.tokenizer.encode("Hi")[0] == BOS and llm.tokenizer.encode("Hi").count(BOS) == 1


def test_chat_with_transformers_tokenizer_matches_ours(model, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = make_llm(model, tokenizer=tok_dir).chat(MESSAGES, PARAMS, use_tqdm=False)[0]
    theirs = make_llm(model, tokenizer=AutoTokenizer.from_pretrained(str(tok_dir))).chat(MESSAGES, PARAMS,
                                                                                          use_tqdm=False)[0]
    assert theirs.prompt == ours.prompt and theirs.prompt_token_ids == ours.prompt_token_ids
    assert theirs.outputs[0].token_ids == ours.outputs[0].token_ids


def test_chat_options_and_a_refused_conversation(model, tok_dir: Path) -> None:
    llm = make_llm(model, tokenizer=tok_dir)
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
              "{% endif %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}"
              "[assistant]{% endif %}")
    user_only = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    outs = llm.chat([MESSAGES, user_only], PARAMS, use_tqdm=False, chat_template=strict)
    assert "no system turns" in outs[0].error and outs[0].outputs == ()
    assert outs[1].error is None and outs[1].prompt == "[user] Hi\nthere [assistant]"
    assert outs[1].prompt_token_ids[0] == BOS                 # not in the text: the tokenizer adds it
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    cont = llm.chat(prefill, PARAMS, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("<|assistant|>Sure")
    plain = make_llm(model)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        plain.chat(MESSAGES, PARAMS)


def test_metrics_and_cached_tokens(model) -> None:
    llm = make_llm(model)
    prompt = list(range(2, 22))                 # 20 tokens: 4 full blocks of 4 can be reused
    first, again = (llm.generate([prompt], PARAMS, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    for out in (first, again):
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
            <= m.finished_time
        assert m.time_in_queue >= 0
    n = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, seed=0, max_tokens=3), use_tqdm=False)[0]
    assert len(n.outputs) == 3 and n.num_cached_tokens == 16 and n.metrics.finished_time >= n.metrics.arrival_time
