"""GSM8K (Cobbe et al., 2021) with the standard 8-shot chain-of-thought prompt (Wei et al., 2022).

Prompt: eight worked exemplars as "Question: ...\\nAnswer: <reasoning> So the answer is N.\\n\\n", then the
test question and "Answer:". Decoding is greedy and stops at the next "Question:" or a blank line. The
prediction is the number after "answer is", else the last number in the completion; it is compared, as
a number (commas, "$" and a trailing "." stripped; 18.00 == 18), with the number after "####" in the
reference answer.

Data: a JSONL file with ``question`` / ``answer`` (the GSM8K test split); without one, a GSM8K parquet or
arrow file already in the local Hugging Face cache is used (never downloaded).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from hybridkv import LLM, SamplingParams, envs

STOP_SEQUENCES = ("Question:", "\n\n")

# The classic eight exemplars (Wei et al., 2022, chain-of-thought prompting): (question, reasoning, answer).
FEWSHOT_EXEMPLARS: tuple[tuple[str, str, str], ...] = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
     "there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
     "been 21 - 15 = 6.", "6"),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5.", "5"),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
     "they had 74 - 35 = 39.", "39"),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
     "Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8.",
     "8"),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
     "now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
     "5 + 4 = 9.", "9"),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday "
     "to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29.", "29"),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
     "balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
     "he had 35 - 2 = 33 golf balls.", "33"),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
     "left. 23 - 15 is 8.", "8"),
)

_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?"
_ANSWER_IS = re.compile(r"answer is\s*:?\s*(" + _NUMBER + r")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


@dataclass(frozen=True, kw_only=True)
class Example:
    index: int
    question: str
    answer: str          # the reference solution, ending in "#### N"

    @property
    def gold(self) -> str | None:
        return normalize_number(self.answer.split("####")[-1]) if "####" in self.answer else None


@dataclass(frozen=True, kw_only=True)
class Prediction:
    index: int
    completion: str
    extracted: str | None
    gold: str | None
    correct: bool


@dataclass(frozen=True, kw_only=True)
class GSM8KResult:
    accuracy: float
    num_problems: int
    num_correct: int
    num_unparsed: int                  # completions with no number in them
    predictions: tuple[Prediction, ...] = field(repr=False)
    generation_seconds: float | None = None
    scoring_seconds: float = 0.0
    num_fewshot: int = 8

    def to_dict(self) -> dict[str, Any]:
        timing: dict[str, float] = {"scoring_seconds": round(self.scoring_seconds, 4)}
        if self.generation_seconds is not None:
            timing["generation_seconds"] = round(self.generation_seconds, 3)
            timing["problems_per_second"] = round(self.num_problems / self.generation_seconds, 3) \
                if self.generation_seconds > 0 else None
        return {"task": "gsm8k", "metrics": {"exact_match": self.accuracy}, "num_problems": self.num_problems,
                "num_correct": self.num_correct, "num_unparsed": self.num_unparsed,
                "num_fewshot": self.num_fewshot, "timing": timing}


# -- answers ---------------------------------------------------------------------------------------------
def normalize_number(text: str) -> str | None:
    """"$1,234.50." -> "1234.5"; "18.00" -> "18"; None when ``text`` is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(completion: str) -> str | None:
    """The number after the first "answer is", else the last number in the text, normalized; None if the
    completion has no number."""
    match = _ANSWER_IS.search(completion)
    if match is not None:
        return normalize_number(match.group(1))
    numbers = _ANY_NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


# -- data ------------------------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{i}: not JSON ({err})") from None
    return rows


def find_cached_gsm8k() -> Path | None:
    """A GSM8K test-split parquet/arrow file in the local HF cache (datasets cache or hub snapshots)."""
    for root in envs.hf_cache_dirs():
        if not root.is_dir():
            continue
        for sub in sorted(root.iterdir()):
            if "gsm8k" not in sub.name.lower():
                continue
            files = sorted(p for p in sub.rglob("*") if p.suffix in (".parquet", ".arrow")
                           and "test" in p.name and "socratic" not in str(p))
            if files:
                return files[0]
    return None


def _read_table(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError(f"reading {path} needs pyarrow (pip install pyarrow), or pass --data FILE.jsonl") from None
    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:       # datasets' cache files are Arrow IPC streams
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()


MISSING_DATA = ("no GSM8K data: pass --data FILE.jsonl (the test split, one {\"question\", \"answer\"} object "
                "per line: test.jsonl from github.com/openai/grade-school-math, or "
                "datasets.load_dataset('openai/gsm8k', 'main', split='test').to_json(FILE)); no GSM8K file was "
                "found in the local Hugging Face cache either")


def load_examples(path: str | Path | None = None, *, limit: int | None = None) -> list[Example]:
    """Examples from ``path`` (jsonl, parquet or arrow), else from the local HF cache; a clear error if
    neither exists."""
    if path is None:
        path = find_cached_gsm8k()
        if path is None:
            raise FileNotFoundError(MISSING_DATA)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    rows = _read_table(path) if path.suffix in (".parquet", ".arrow") else _read_jsonl(path)
    examples = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "question" not in row or "answer" not in row:
            raise ValueError(f"{path}: row {i} has no question/answer fields")
        examples.append(Example(index=i, question=str(row["question"]), answer=str(row["answer"])))
    return examples[:limit] if limit is not None else examples


# -- prompting -------------------------------------------------------------------------------------------
def fewshot_prefix(num_fewshot: int = 8) -> str:
    if not 0 <= num_fewshot <= len(FEWSHOT_EXEMPLARS):
        raise ValueError(f"num_fewshot must be in [0, {len(FEWSHOT_EXEMPLARS)}], got {num_fewshot}")
    return "".join(f"Question: {q}\nAnswer: {r} So the answer is {a}.\n\n"
                   for q, r, a in FEWSHOT_EXEMPLARS[:num_fewshot])


def build_prompt(question: str, num_fewshot: int = 8) -> str:
    return f"{fewshot_prefix(num_fewshot)}Question: {question.strip()}\nAnswer:"


def generate_completions(llm: LLM, examples: Sequence[Example], *, num_fewshot: int = 8, max_tokens: int = 256,
                         use_tqdm: bool = True) -> list[str]:
    """Greedy completions for every example from ONE batched ``generate`` call (the shared few-shot prefix
    is a prefix-cache hit after the first request). A rejected request yields an empty completion."""
    if llm.tokenizer is None:
        raise ValueError("GSM8K needs a model with a tokenizer (text prompts and stop strings)")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP_SEQUENCES)
    outputs = llm.generate([build_prompt(e.question, num_fewshot) for e in examples], params, use_tqdm=use_tqdm)
    return [(out.outputs[0].text or "") if out.error is None and out.outputs else "" for out in outputs]


# -- scoring ---------------------------------------------------------------------------------------------
def score(examples: Sequence[Example], completions: Sequence[str], *, num_fewshot: int = 8,
          generation_seconds: float | None = None) -> GSM8KResult:
    if len(examples) != len(completions):
        raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
    if not examples:
        raise ValueError("no examples to score")
    start = time.perf_counter()
    predictions = []
    for example, completion in zip(examples, completions, strict=True):
        extracted, gold = extract_answer(completion), example.gold
        predictions.append(Prediction(index=example.index, completion=completion, extracted=extracted, gold=gold,
                                      correct=extracted is not None and extracted == gold))
    correct = sum(p.correct for p in predictions)
    return GSM8KResult(accuracy=correct / len(predictions), num_problems=len(predictions), num_correct=correct,
                       num_unparsed=sum(p.extracted is None for p in predictions),
                       predictions=tuple(predictions), generation_seconds=generation_seconds,
                       scoring_seconds=time.perf_counter() - start, num_fewshot=num_fewshot)


def read_predictions(path: str | Path, examples: Sequence[Example]) -> tuple[list[Example], list[str]]:
    """Match each prediction row (``index`` or ``question``, plus ``completion``) to its example."""
    by_question = {e.question.strip(): e for e in examples}
    matched_examples, completions = [], []
    for i, row in enumerate(_read_jsonl(Path(path)), 1):
        if not isinstance(row, dict) or "completion" not in row:
            raise ValueError(f"{path}:{i}: expected an object with 'completion' and 'index' or 'question'")
        if "index" in row:
            idx = int(row["index"])
            if not 0 <= idx < len(examples):
                raise ValueError(f"{path}:{i}: index {idx} is outside the data ({len(examples)} examples)")
            example = examples[idx]
        elif "question" in row:
            example = by_question.get(str(row["question"]).strip())
            if example is None:
                raise ValueError(f"{path}:{i}: question not found in the data")
        else:
            raise ValueError(f"{path}:{i}: needs 'index' or 'question'")
        matched_examples.append(example)
        completions.append(str(row["completion"]))
    return matched_examples, completions


def write_predictions(path: str | Path, result: GSM8KResult, examples: Iterable[Example]) -> None:
    questions = {e.index: e.question for e in examples}
    with open(path, "w", encoding="utf-8") as f:
        for p in result.predictions:
            f.write(json.dumps({"index": p.index, "question": questions.get(p.index), "completion": p.completion,
                                "extracted": p.extracted, "gold": p.gold, "correct": p.correct}) + "\n")
