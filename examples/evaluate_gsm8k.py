"""GSM8K through the evaluation API: the 8-shot chain-of-thought prompt, one batched greedy ``generate``,
numeric exact match (``hybridkv eval gsm8k`` is the same as a command).

    python examples/evaluate_gsm8k.py PATH/TO/CHECKPOINT --data gsm8k_test.jsonl [--limit 100]
    python examples/evaluate_gsm8k.py --tiny    # a tiny random model on the repository's GSM8K sample: ~0%
"""

from __future__ import annotations

import time
from pathlib import Path

from tiny import checkpoint_parser, open_llm

from hybridkv.eval import gsm8k

SAMPLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "gsm8k_test_sample.jsonl"


def main() -> None:
    ap = checkpoint_parser(__doc__, "a checkpoint directory with a tokenizer")
    ap.add_argument("--data", default=None, help="GSM8K test jsonl (question / answer); default: a local HF cache")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    if args.tiny:
        args.data, args.limit = args.data or SAMPLE, args.limit or 4
    with open_llm(ap, args) as llm:
        examples = gsm8k.load_examples(args.data, limit=args.limit)
        start = time.perf_counter()
        completions = gsm8k.generate_completions(llm, examples, max_tokens=32 if args.tiny else 256, use_tqdm=False)
        result = gsm8k.score(examples, completions, generation_seconds=time.perf_counter() - start)
        print(f"GSM8K exact match {result.accuracy:.1%} ({result.num_correct}/{result.num_problems}, "
              f"{result.num_unparsed} without a number) in {result.generation_seconds:.1f} s")
        first = result.predictions[0]
        print(f"first problem: predicted {first.extracted!r}, gold {first.gold!r}")


if __name__ == "__main__":
    main()
