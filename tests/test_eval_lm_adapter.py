"""The lm-eval adapter: ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` on a tiny model
agree with log-probabilities from a plain full forward (``reference_logits``), every call is one batched
engine call, and, when lm-eval is installed, the registered ``hybridkv`` model runs real lm-eval tasks
(local YAML tasks over a local JSON file: nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridkv import LLM
from hybridkv.engine.model_runner import reference_logits
from hybridkv.eval.lm_eval_adapter import HybridKVEvaluator, rolling_windows
from hybridkv.models.hybrid import load_model

HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-eval is not installed (pip install lm-eval)")
MAX_LEN = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from tests.data.tiny_eval_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def evaluator(checkpoint) -> HybridKVEvaluator:
    return HybridKVEvaluator(LLM(checkpoint, kv_cache_memory="64MiB", max_model_len=MAX_LEN, max_num_seqs=8))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """A separate copy of the weights: ``reference_logits`` binds its own cache to the model it runs."""
    model = load_model(checkpoint)

    def logprobs(tokens: list[int]) -> torch.Tensor:        # (len, vocab): row i predicts token i + 1
        return reference_logits(model, tokens).log_softmax(-1)

    return logprobs


def _expected(reference, tokens: list[int], n: int) -> tuple[float, bool]:
    lp = reference(tokens)
    rows = range(len(tokens) - n - 1, len(tokens) - 1)
    total = sum(lp[r, tokens[r + 1]].item() for r in rows)
    return total, all(int(lp[r].argmax()) == tokens[r + 1] for r in rows)


@pytest.fixture
def generate_calls(evaluator, monkeypatch) -> list[int]:
    calls: list[int] = []
    original = evaluator.llm.generate

    def counting(prompts, params=None, use_tqdm=True):
        calls.append(len(prompts))
        return original(prompts, params, use_tqdm=use_tqdm)

    monkeypatch.setattr(evaluator.llm, "generate", counting)
    return calls


# -- loglikelihood -----------------------------------------------------------------------------------------
PAIRS = [("The cat", " sat on the mat"), ("", "hello"), ("Question: 2+2?\nAnswer: ", "4"),
         ("The cat", " sat on the mat"), ("x" * 70, "yz"), ("a", "b" * 60)]


def test_loglikelihood_matches_a_full_forward(evaluator, reference, generate_calls) -> None:
    results = evaluator.loglikelihood(PAIRS)
    assert generate_calls == [5]                 # one call; the repeated pair is computed once
    for (context, continuation), (logprob, greedy) in zip(PAIRS, results, strict=True):
        ctx, cont = evaluator.encode_pair(context, continuation)
        tokens = (ctx + cont)[-MAX_LEN:]
        expected, expected_greedy = _expected(reference, tokens, min(len(cont), len(tokens) - 1))
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy


def test_encode_pair_follows_lm_eval(evaluator) -> None:
    ctx, cont = evaluator.encode_pair("Answer: ", "4")
    assert evaluator.tokenizer.decode(ctx) == "Answer:" and evaluator.tokenizer.decode(cont) == " 4"
    ctx, cont = evaluator.encode_pair("", "hi")
    assert ctx == [evaluator.prefix_token_id] and evaluator.tokenizer.decode(cont) == "hi"


def test_is_greedy_when_the_continuation_is_the_argmax(evaluator, reference) -> None:
    context = evaluator.tokenizer.encode("Once upon a time")
    greedy_tokens = list(context)
    for _ in range(3):
        greedy_tokens.append(int(reference(greedy_tokens)[-1].argmax()))
    continuation = greedy_tokens[len(context):]
    (lp_greedy, is_greedy), (lp_other, not_greedy) = evaluator.loglikelihood_tokens(
        [(context, continuation), (context, [*continuation[:-1], (continuation[-1] + 1) % 256])])
    assert is_greedy and not not_greedy
    assert lp_greedy == pytest.approx(_expected(reference, greedy_tokens, 3)[0], abs=1e-4)
    assert lp_other < lp_greedy


# -- loglikelihood_rolling ---------------------------------------------------------------------------------
def test_rolling_windows_predict_every_token_once() -> None:
    for length in range(0, 30):
        for max_len in (1, 2, 3, 7, 16):
            tokens = list(range(100, 100 + length))
            windows = rolling_windows(tokens, -1, max_len)
            predicted = [t for _, targets in windows for t in targets]
            assert predicted == tokens
            for context, targets in windows:
                assert len(context) + len(targets) <= max_len + 1 and context
                seq = context + targets                     # targets follow their context contiguously
                assert seq[0] == -1 or seq == tokens[tokens.index(seq[0]):tokens.index(seq[0]) + len(seq)]


@needs_lm_eval
def test_rolling_windows_equal_lm_evals() -> None:
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for length in range(0, 40):
        for max_len in (1, 2, 3, 5, 8, 16):
            tokens = list(range(length))
            theirs = [tuple(map(list, make_disjoint_window(w)))
                      for w in get_rolling_token_windows(tokens, -1, max_len, 1)]
            assert theirs == [tuple(w) for w in rolling_windows(tokens, -1, max_len)]


def test_loglikelihood_rolling_matches_a_full_forward(evaluator, reference, generate_calls) -> None:
    texts = ["short text", "hello world " * 12]          # one window; several windows (144 tokens, max 48)
    results = evaluator.loglikelihood_rolling(texts)
    assert len(generate_calls) == 1
    # Single window: one forward over [BOS] + tokens scores every token.
    tokens = evaluator.encode_plain(texts[0])
    assert results[0] == pytest.approx(_expected(reference, [evaluator.prefix_token_id, *tokens], len(tokens))[0],
                                       abs=1e-4)
    # Several windows: each window is a separate full forward.
    expected = 0.0
    for context, targets in rolling_windows(evaluator.encode_plain(texts[1]), evaluator.prefix_token_id, MAX_LEN - 1):
        expected += _expected(reference, context + targets, len(targets))[0]
    assert results[1] == pytest.approx(expected, abs=1e-3)
    assert len(evaluator.encode_plain(texts[1])) > 2 * MAX_LEN


# -- generate_until ----------------------------------------------------------------------------------------
def _greedy_tokens(evaluator, reference, context: str, n: int) -> list[int]:
    tokens = evaluator.tokenizer.encode(context)
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference(tokens + out)[-1].argmax()))
    return out


def test_generate_until_matches_greedy_decoding(evaluator, reference, generate_calls) -> None:
    contexts = ["def f(x):", "Q: what is 2+2?\nA:", "abc"]
    greedy = [_greedy_tokens(evaluator, reference, c, 6) for c in contexts]
    full = [evaluator.tokenizer.decode(g) for g in greedy]
    # Stop request 1 at the first printable-ASCII byte it generates after the first token (byte-level
    # tokens: that character can only come from that token, so the expected text is exact).
    cut = next(i for i, t in enumerate(greedy[1]) if i > 0 and 32 < t < 127 and t not in greedy[1][:i])
    stop = chr(greedy[1][cut])
    requests = [(contexts[0], {"until": ["\u2603never"], "max_gen_toks": 6}),
                (contexts[1], {"until": [stop], "max_gen_toks": 6, "do_sample": False}),
                (contexts[2], {"until": "\u2603never", "max_gen_toks": 4, "temperature": 0.0})]
    results = evaluator.generate_until(requests)
    assert generate_calls == [3]
    assert results[0] == full[0]
    assert results[1] == evaluator.tokenizer.decode(greedy[1][:cut])     # stops there, stop string excluded
    assert results[2] == evaluator.tokenizer.decode(greedy[2][:4])


def test_sampling_params_from_lm_eval_kwargs(evaluator) -> None:
    p = evaluator.sampling_params({"until": ["\n", ""], "max_gen_toks": 7})
    assert p.stop == ("\n",) and p.max_tokens == 7 and p.temperature == 0.0
    p = evaluator.sampling_params({"do_sample": True, "temperature": 0.7, "top_p": 0.9})
    assert p.temperature == 0.7 and p.top_p == 0.9 and p.max_tokens == 256


def test_importing_the_adapter_does_not_import_lm_eval() -> None:
    code = "import sys, hybridkv.eval.lm_eval_adapter as a; assert 'lm_eval' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


# -- through lm-eval ---------------------------------------------------------------------------------------
@needs_lm_eval
def test_registered_model_answers_lm_eval_instances(checkpoint, evaluator) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from hybridkv.eval import lm_eval_adapter

    cls = lm_eval_adapter.register()
    assert get_model("hybridkv") is cls is lm_eval_adapter.HybridKVLM
    lm = cls.create_from_arg_string(f"pretrained={checkpoint},kv_cache_memory=64MiB,max_model_len={MAX_LEN}",
                                    {"batch_size": 1, "device": "cuda:0"})   # lm-eval's defaults; no GPU here
    ll = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)]
    assert lm.loglikelihood(ll) == pytest.approx(evaluator.loglikelihood(PAIRS))
    rolling = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=("hello world " * 6,), idx=0)]
    assert lm.loglikelihood_rolling(rolling) == pytest.approx(evaluator.loglikelihood_rolling(["hello world " * 6]))
    gen = [Instance(request_type="generate_until", doc={}, arguments=("abc", {"until": ["zz"], "max_gen_toks": 5}),
                    idx=0)]
    assert lm.generate_until(gen) == evaluator.generate_until([("abc", {"until": ["zz"], "max_gen_toks": 5})])


@needs_lm_eval
def test_cli_lm_eval_runs_local_tasks_of_every_output_type(checkpoint, tmp_path, capsys, monkeypatch) -> None:
    from hybridkv.cli import main
    from hybridkv.eval import cli as _eval_cli  # noqa: F401

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "Is the sky blue?", "choices": ["yes", "no"], "answer": 0, "text": "The sky is blue."},
        {"question": "2+2=", "choices": ["4", "5", "22"], "answer": 0, "text": "Two plus two is four."}]))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    tasks = {
        "tiny_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                       "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
        "tiny_gen": "output_type: generate_until\ndoc_to_text: 'Q: {{question}} A:'\n"
                    "doc_to_target: '{{choices[answer]}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
                    "  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n",
        "tiny_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                    "metric_list:\n  - metric: word_perplexity\n",
    }
    for name, body in tasks.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\n{common}{textwrap.dedent(body)}")
    code = main(["eval", "lm-eval", "--model", str(checkpoint), "--model-args",
                 f"kv_cache_memory=64MiB,max_model_len={MAX_LEN}", "--tasks", ",".join(tasks),
                 "--include-path", str(tmp_path), "--out", str(tmp_path / "out"), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= report["metrics"]["tiny_choice"]["acc,none"] <= 1.0
    assert report["metrics"]["tiny_gen"]["exact_match,none"] == 0.0
    assert report["metrics"]["tiny_ppl"]["word_perplexity,none"] > 1.0
    assert report["num_problems"] == {name: 2 for name in tasks}
    assert report["timing"]["total_seconds"] > 0
