"""``hybridkv eval humaneval | gsm8k | lm-eval``: registered into the ``hybridkv`` command on import.

Each task either runs a model end to end (``--model DIR``) or scores existing outputs without one
(``--samples`` / ``--predictions``). ``--json`` prints one JSON object (metrics, number of problems,
timing); ``--out DIR`` keeps the generated outputs and ``results.json``. Progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridkv.commands import Command, UsageError, positive_int, register


def _k_list(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(k) for k in text.split(",") if k.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return ks


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--dtype", default="auto")
    group.add_argument("--device", default="auto")
    group.add_argument("--kv-memory", default=None, help="KV-cache budget, e.g. 4GiB (default: a share of free memory)")
    group.add_argument("--max-num-seqs", type=positive_int, default=256, help="concurrent requests (default 256)")
    group.add_argument("--max-model-len", type=positive_int, default=None)
    group.add_argument("--seed", type=int, default=0)


def _load_llm(args: argparse.Namespace) -> Any:
    from hybridkv import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_memory,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, seed=args.seed)


def _write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")


def _out_dir(args: argparse.Namespace) -> Path | None:
    if args.out is None:
        return None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


# -- humaneval -------------------------------------------------------------------------------------------
def _humaneval_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory to generate completions with")
    source.add_argument("--samples", help="score this samples.jsonl (task_id, completion) instead")
    parser.add_argument("--n", type=positive_int, default=1, help="samples per problem (default 1)")
    parser.add_argument("--k", type=_k_list, default=(1, 10), help="pass@k values, e.g. 1,10 (default 1,10; "
                        "k larger than the samples per problem is skipped)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling when temperature > 0")
    parser.add_argument("--limit", type=positive_int, default=None, help="first N problems only")
    parser.add_argument("--max-tokens", type=positive_int, default=512)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per completion's tests (default 5)")
    parser.add_argument("--memory-limit-mb", type=positive_int, default=1024,
                        help="address-space limit of each test process (default 1024)")
    parser.add_argument("--workers", type=positive_int, default=None, help="test processes (default: CPUs)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run completions without the namespace sandbox (resource limits only) where the "
                        "kernel denies namespaces: only for completions you trust (docs/sandbox.md)")
    parser.add_argument("--out", default=None, help="directory for samples.jsonl and results.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    _model_arguments(parser)


def run_humaneval(args: argparse.Namespace) -> int:
    from hybridkv.eval import humaneval as he
    from hybridkv.eval.sandbox import SandboxLimits, SandboxUnavailable, sandbox_unavailable_reason

    limits = SandboxLimits(timeout=args.timeout, memory_bytes=args.memory_limit_mb << 20,
                           unsafe_no_sandbox=args.unsafe_no_sandbox)
    if args.unsafe_no_sandbox:
        print("hybridkv eval humaneval: --unsafe-no-sandbox: completions run as this user, with this user's "
              "network and files (resource limits only)", file=sys.stderr)
    elif (reason := sandbox_unavailable_reason()) is not None:    # refuse before spending time generating
        raise UsageError(f"hybridkv eval humaneval: {reason}")
    problems = he.load_problems()
    out = _out_dir(args)
    generation_seconds = None
    if args.samples is not None:
        samples = he.read_samples(args.samples)
        if args.limit is not None:
            keep = {p.task_id for p in problems[:args.limit]}
            samples = [s for s in samples if s.task_id in keep]
    else:
        problems = problems[:args.limit] if args.limit is not None else problems
        llm = _load_llm(args)
        start = time.perf_counter()
        samples = he.generate_samples(llm, problems, n=args.n, temperature=args.temperature, top_p=args.top_p,
                                      max_tokens=args.max_tokens, seed=args.seed, use_tqdm=not args.json)
        generation_seconds = time.perf_counter() - start
        if out is not None:
            he.write_samples(out / "samples.jsonl", samples)
    try:
        result = he.score_samples(samples, problems, ks=args.k, limits=limits, workers=args.workers,
                                  use_tqdm=not args.json)
    except SandboxUnavailable as err:
        raise UsageError(f"hybridkv eval humaneval: {err}") from None
    result = replace(result, generation_seconds=generation_seconds)
    report = {**result.to_dict(), "model": args.model, "samples_file": args.samples,
              "skipped_k": [k for k in args.k if k not in result.pass_at_k]}
    if out is not None:
        _write_json(out / "results.json", report)
    if args.json:
        print(json.dumps(report))
    else:
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in report["metrics"].items()) or "none"
        timing = report["timing"]
        print(f"HumanEval: {metrics} over {result.num_problems} problems ({result.num_samples} samples)")
        if generation_seconds is not None:
            print(f"  generation {timing['generation_seconds']:.1f}s")
        print(f"  execution {timing['execution_seconds']:.1f}s ({timing['problems_per_second']:.1f} problems/s); "
              + ", ".join(f"{k} {v}" for k, v in result.statuses.items() if v))
        if report["skipped_k"]:
            print(f"  skipped pass@k for k={report['skipped_k']}: needs --n >= k", file=sys.stderr)
        if out is not None:
            print(f"  wrote {out}")
    return 0


# -- gsm8k -----------------------------------------------------------------------------------------------
def _gsm8k_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint directory to generate answers with")
    source.add_argument("--predictions", help="score this jsonl ({index or question, completion}) instead")
    parser.add_argument("--data", default=None, help="GSM8K test jsonl (question, answer); default: a GSM8K "
                        "file in the local Hugging Face cache")
    parser.add_argument("--num-fewshot", type=int, default=8, choices=range(9), metavar="0..8")
    parser.add_argument("--limit", type=positive_int, default=None, help="first N problems only")
    parser.add_argument("--max-tokens", type=positive_int, default=256)
    parser.add_argument("--out", default=None, help="directory for predictions.jsonl and results.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    _model_arguments(parser)


def run_gsm8k(args: argparse.Namespace) -> int:
    from hybridkv.eval import gsm8k

    examples = gsm8k.load_examples(args.data, limit=args.limit)
    out = _out_dir(args)
    if args.predictions is not None:
        matched, completions = gsm8k.read_predictions(args.predictions, examples)
        result = gsm8k.score(matched, completions, num_fewshot=args.num_fewshot)
    else:
        llm = _load_llm(args)
        start = time.perf_counter()
        completions = gsm8k.generate_completions(llm, examples, num_fewshot=args.num_fewshot,
                                                 max_tokens=args.max_tokens, use_tqdm=not args.json)
        result = gsm8k.score(examples, completions, num_fewshot=args.num_fewshot,
                             generation_seconds=time.perf_counter() - start)
        matched = examples
    report = {**result.to_dict(), "model": args.model, "predictions_file": args.predictions,
              "data": str(args.data) if args.data else "huggingface cache"}
    if out is not None:
        gsm8k.write_predictions(out / "predictions.jsonl", result, matched)
        _write_json(out / "results.json", report)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"GSM8K ({result.num_fewshot}-shot): exact_match {result.accuracy:.4f} "
              f"({result.num_correct}/{result.num_problems}; {result.num_unparsed} without a number)")
        if result.generation_seconds is not None:
            print(f"  generation {report['timing']['generation_seconds']:.1f}s")
        if out is not None:
            print(f"  wrote {out}")
    return 0


# -- lm-eval ---------------------------------------------------------------------------------------------
def _lm_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (lm-eval's pretrained=)")
    parser.add_argument("--model-args", default="", help="more lm-eval model_args, e.g. dtype=float32,batch_size=64")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    parser.add_argument("--include-path", default=None, help="directory of extra lm-eval task YAMLs")
    parser.add_argument("--out", default=None, help="directory for results.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_lm_eval(args: argparse.Namespace) -> int:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UsageError("hybridkv eval lm-eval: needs lm-eval (pip install lm-eval)") from None
    from hybridkv.eval.lm_eval_adapter import register

    model_class = register()
    model_args = ",".join(a for a in (f"pretrained={args.model}", args.model_args) if a)
    start = time.perf_counter()
    model = model_class.create_from_arg_string(model_args)
    results = lm_eval.simple_evaluate(
        model=model, tasks=[t for t in args.tasks.split(",") if t], num_fewshot=args.num_fewshot,
        limit=args.limit, task_manager=TaskManager(include_path=args.include_path), log_samples=False)
    seconds = time.perf_counter() - start
    if results is None:
        return 1
    metrics = {task: {k: v for k, v in values.items()
                      if isinstance(v, int | float) and k not in ("alias", "sample_len")}
               for task, values in results.get("results", {}).items()}
    counts = {task: n.get("effective", n.get("original")) if isinstance(n, dict) else n
              for task, n in results.get("n-samples", {}).items()}
    report = {"task": "lm-eval", "tasks": args.tasks, "metrics": metrics, "num_problems": counts,
              "timing": {"total_seconds": round(seconds, 3)}, "model": args.model, "model_args": model_args}
    out = _out_dir(args)
    if out is not None:
        _write_json(out / "results.json", report)
    if args.json:
        print(json.dumps(report))
    else:
        for task, values in metrics.items():
            print(f"{task} (n={counts.get(task)}): " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
    return 0


# -- the command -------------------------------------------------------------------------------------------
TASKS = {
    "humaneval": ("HumanEval pass@k: generate, run each completion's tests in an isolated process",
                  _humaneval_arguments, run_humaneval),
    "gsm8k": ("GSM8K 8-shot chain-of-thought exact match", _gsm8k_arguments, run_gsm8k),
    "lm-eval": ("any lm-evaluation-harness task through the hybridkv lm-eval model", _lm_eval_arguments,
                run_lm_eval),
}


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_task", metavar="TASK", parser_class=type(parser))
    for name, (help_text, add_arguments, _) in TASKS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))


def run_eval(args: argparse.Namespace) -> int:
    if args.eval_task is None:
        raise UsageError(f"hybridkv eval: give a task ({', '.join(TASKS)})")
    return TASKS[args.eval_task][2](args)


register(Command(name="eval", help="evaluate a checkpoint: HumanEval, GSM8K, or lm-eval tasks",
                 add_arguments=_eval_arguments, run=run_eval))
