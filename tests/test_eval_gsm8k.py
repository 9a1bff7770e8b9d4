"""GSM8K: answer extraction, the 8-shot prompt, scorer validity on gold answers (the full test set when
../shared/data has it, the 20-row fixture otherwise), data discovery, and ``hybridkv eval gsm8k`` end to end
on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.eval import cli as _eval_cli  # noqa: F401  (registers "hybridkv eval")
from hybridkv.eval import gsm8k

FIXTURE = Path(__file__).parent / "data" / "gsm8k_test_sample.jsonl"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"
DATA = SHARED if SHARED.is_file() else FIXTURE


@pytest.fixture(scope="module")
def examples() -> list[gsm8k.Example]:
    return gsm8k.load_examples(DATA)


# -- extraction --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("completion", "expected"), [
    (" Janet has 16 - 3 - 4 = 9 eggs. 9 * 2 = 18. So the answer is 18.", "18"),
    (" So the answer is $1,234.", "1234"),
    (" The answer is 1,000,000.", "1000000"),
    (" the answer is -7", "-7"),
    (" The answer is: 42", "42"),
    (" The answer is 3.50 dollars.", "3.5"),
    (" The answer is 18.00.", "18"),
    (" So the answer is 5. Then 6 more gives 11.", "5"),          # "answer is" beats the last number
    (" She has 5 + 4 = 9 apples.", "9"),                           # no "answer is": the last number
    (" 12 apples cost $24.50 in total.", "24.5"),
    (" Total: $2,125.", "2125"),
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18", "18"),
    (" I do not know.", None),
    ("", None),
])
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert gsm8k.extract_answer(completion) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("18", "18"), (" $18.", "18"), ("1,234", "1234"), ("-3", "-3"), ("0.50", "0.5"), ("007", "7"),
    ("1e3", "1000"), ("abc", None), ("", None), ("-0", "0"),
])
def test_normalize_number(text: str, expected: str | None) -> None:
    assert gsm8k.normalize_number(text) == expected


# -- prompt ------------------------------------------------------------------------------------------------
def test_eight_shot_prompt_format() -> None:
    prompt = gsm8k.build_prompt("  How many?  ")
    assert prompt.count("Question: ") == 9 and prompt.count("\nAnswer: ") == 8
    assert prompt.startswith("Question: There are 15 trees in the grove.")
    assert prompt.endswith("\n\nQuestion: How many?\nAnswer:")
    blocks = prompt.split("\n\n")[:-1]
    assert len(blocks) == 8
    assert all(gsm8k.extract_answer(b) == a for b, (_, _, a) in zip(blocks, gsm8k.FEWSHOT_EXEMPLARS, strict=True))
    assert all(b.endswith(f"So the answer is {a}.") for b, (_, _, a) in zip(blocks, gsm8k.FEWSHOT_EXEMPLARS,
                                                                             strict=True))
    assert gsm8k.build_prompt("Q?", num_fewshot=0) == "Question: Q?\nAnswer:"
    with pytest.raises(ValueError):
        gsm8k.build_prompt("Q?", num_fewshot=9)


# -- scorer validity ---------------------------------------------------------------------------------------
def test_data(examples: list[gsm8k.Example]) -> None:
    assert len(examples) == (1319 if DATA == SHARED else 20)
    assert all(e.gold is not None for e in examples)


def test_gold_answers_score_one(examples: list[gsm8k.Example]) -> None:
    cot = [f" {e.answer.split('####')[0].strip()} So the answer is {e.answer.split('####')[1].strip()}."
           for e in examples]
    assert gsm8k.score(examples, cot).accuracy == 1.0
    raw = [e.answer for e in examples]             # reference solutions as written: the last number is the answer
    assert gsm8k.score(examples, raw).accuracy == 1.0


def test_corrupted_answers_score_zero(examples: list[gsm8k.Example]) -> None:
    wrong = [f" So the answer is {int(e.gold) + 1}." for e in examples]
    result = gsm8k.score(examples, wrong)
    assert result.accuracy == 0.0 and result.num_correct == 0
    empty = gsm8k.score(examples, [""] * len(examples))
    assert empty.accuracy == 0.0 and empty.num_unparsed == len(examples)


def test_predictions_match_by_index_or_question(examples, tmp_path) -> None:
    path = tmp_path / "predictions.jsonl"
    rows = [{"index": 1, "completion": f"So the answer is {examples[1].gold}."},
            {"question": examples[0].question, "completion": "So the answer is -1."}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    matched, completions = gsm8k.read_predictions(path, examples)
    assert [e.index for e in matched] == [1, 0]
    assert gsm8k.score(matched, completions).num_correct == 1
    path.write_text(json.dumps({"question": "not in the data", "completion": "1"}) + "\n")
    with pytest.raises(ValueError, match="not found"):
        gsm8k.read_predictions(path, examples)


# -- data discovery --------------------------------------------------------------------------------------------
def test_missing_data_is_a_clear_error(tmp_path, monkeypatch) -> None:
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    with pytest.raises(FileNotFoundError, match="--data"):
        gsm8k.load_examples(None)


def test_finds_gsm8k_in_the_local_hf_cache(tmp_path, monkeypatch) -> None:
    pa = pytest.importorskip("pyarrow", reason="reading the HF cache's parquet files needs pyarrow")
    import pyarrow.parquet as pq

    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    snapshot = tmp_path / "hub" / "datasets--openai--gsm8k" / "snapshots" / "abc123" / "main"
    snapshot.mkdir(parents=True)
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[:5]]
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "test-00000-of-00001.parquet")
    assert gsm8k.find_cached_gsm8k() == snapshot / "test-00000-of-00001.parquet"
    loaded = gsm8k.load_examples(None)
    assert [e.question for e in loaded] == [r["question"] for r in rows]


# -- end to end --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from tests.data.tiny_eval_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_cli_gsm8k_end_to_end_on_a_tiny_model(tiny_checkpoint, tmp_path, capsys, monkeypatch) -> None:
    from hybridkv import LLM

    calls = []
    original = LLM.generate

    def counting(self, prompts, params=None, use_tqdm=True):
        calls.append((list(prompts), params))
        return original(self, prompts, params, use_tqdm=use_tqdm)

    monkeypatch.setattr(LLM, "generate", counting)
    out = tmp_path / "out"
    code = main(["eval", "gsm8k", "--model", str(tiny_checkpoint), "--data", str(FIXTURE), "--limit", "2",
                 "--max-tokens", "8", "--kv-memory", "256MiB", "--out", str(out), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert 0.0 <= report["metrics"]["exact_match"] <= 1.0
    assert report["num_problems"] == 2 and report["num_fewshot"] == 8
    assert "generation_seconds" in report["timing"]
    assert len(calls) == 1                                         # one batched, greedy generate call
    prompts, params = calls[0]
    examples = gsm8k.load_examples(FIXTURE, limit=2)
    assert prompts == [gsm8k.build_prompt(e.question) for e in examples]
    assert params.temperature == 0.0 and params.stop == ("Question:", "\n\n") and params.max_tokens == 8
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and all("\n\n" not in r["completion"] for r in rows)
    assert json.loads((out / "results.json").read_text())["metrics"] == report["metrics"]

    # The written predictions score the same without the model.
    assert main(["eval", "gsm8k", "--predictions", str(out / "predictions.jsonl"), "--data", str(FIXTURE),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == report["metrics"]


def test_cli_scores_gold_predictions(examples, tmp_path, capsys) -> None:
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps({"index": e.index, "completion": e.answer}) + "\n" for e in examples))
    assert main(["eval", "gsm8k", "--predictions", str(path), "--data", str(DATA), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"] == {"exact_match": 1.0} and report["num_problems"] == len(examples)
    assert main(["eval", "gsm8k", "--predictions", str(path), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
