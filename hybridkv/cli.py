"""The ``hybridkv`` command: ``hybridkv plan | demo | generate | eval | serve``.

Subcommands live in ``commands.COMMANDS``; each is one ``Command`` (a name, a help line, a function that adds
its arguments and a function that runs it and returns the exit code), so adding one is one ``register`` call.
Every error, bad input or not (a missing file, bad JSON, an unsupported or corrupt checkpoint, a device that is
not there, a model that does not fit, a budget too small), is one line on stderr with exit code 2, never a
traceback; ``--debug`` prints the traceback too. ``hybridkv --version`` names the versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import hybridkv.eval.cli  # noqa: F401  (registers "hybridkv eval")
import hybridkv.server.cli  # noqa: F401  (registers "hybridkv serve")
from hybridkv import __version__
from hybridkv.commands import (
    COMMANDS,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Command,
    UsageError,
    device_arg,
    positive_int,
    register,
)
from hybridkv.planning import bundled_config_names, load_model_config, plan
from hybridkv.utils import format_bytes

if TYPE_CHECKING:
    from hybridkv.kv_groups.plan import KVCachePlan

# Errors whose message says it all; anything else is also named by its type (it may be a bug).
_PLAIN_ERRORS = (OSError, ValueError, MemoryError)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so every error is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message}")


_DEBUG_HELP = "on an error, print the traceback as well as the one-line message"


def version_line() -> str:
    return (f"hybridkv {__version__} (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
            f"python {platform.python_version()})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridkv", description="Hybrid-LLM runtime with a per-layer-kind KV cache.")
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS.values():
        command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(command_parser)
        # Accepted after the subcommand too; SUPPRESS keeps the top-level value when it is absent here.
        command_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def error_line(prog: str, err: BaseException) -> str:
    """``err`` as one line: ``<prog>: error: <message>`` (the type too where the message may not say it)."""
    if isinstance(err, UsageError):
        return " ".join(str(err).split())
    message = " ".join(str(err).split())
    if not isinstance(err, _PLAIN_ERRORS) or not message:
        message = f"{type(err).__name__}: {message}" if message else type(err).__name__
    return f"{prog}: error: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridkv`` console script; returns the exit code. Never raises (but for
    ``SystemExit`` of a subcommand): every error is one line on stderr and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    prog = "hybridkv"
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as done:              # --help, --version: printed, and a clean exit
            return done.code if isinstance(done.code, int) else 0
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        prog = f"hybridkv {args.command}"
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if debug:
            traceback.print_exc()
        print(error_line(prog, err), file=sys.stderr)
        return EXIT_USAGE


# -- plan ---------------------------------------------------------------------------------------------------
def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG_OR_DIR",
                        help="config.json, a checkpoint directory, or a bundled config name "
                             f"({', '.join(bundled_config_names())})")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="tokens per request (default: the model's max positions)")
    parser.add_argument("--kv-memory", default="40GiB", help="KV-cache budget, e.g. 40GiB (default: 40GiB)")
    parser.add_argument("--host-cache-memory", default="0",
                        help="host memory for more recurrent-state prefix-cache checkpoints, e.g. 32GiB (default: 0)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default: 16)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None,
                        help="cap on concurrent requests")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="tokens per scheduler step (default: 2048)")
    parser.add_argument("--kv-dtype", default=None, help="KV dtype (default: the checkpoint dtype)")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="GPUs the model is sharded over; --kv-memory and every byte figure are then "
                             "per GPU (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def layer_ranges(names: Sequence[str]) -> str:
    """Cache names -> compact layer ranges: layers.0..2,4 -> "0-2,4"; ".parallel"/".shared" caches get
    their suffix once per run of equal suffixes ("0-3 parallel")."""
    parts: list[tuple[int, str]] = []
    for name in names:
        m = re.fullmatch(r"layers\.(\d+)(?:\.(\w+))?", name)
        if m is None:
            return ",".join(names)
        parts.append((int(m.group(1)), m.group(2) or ""))
    out: list[str] = []
    i = 0
    while i < len(parts):
        j = i
        while j + 1 < len(parts) and parts[j + 1] == (parts[j][0] + 1, parts[i][1]):
            j += 1
        start, suffix = parts[i]
        text = str(start) if j == i else f"{start}-{parts[j][0]}"
        out.append(f"{text} {suffix}" if suffix else text)
        i = j + 1
    return ",".join(out)


def plan_report(args: argparse.Namespace) -> tuple[dict[str, Any], KVCachePlan]:
    """(JSON-ready dict, KVCachePlan) for the parsed ``plan`` arguments."""
    config = load_model_config(args.config)
    result = plan(config, max_model_len=args.max_model_len, kv_memory=args.kv_memory,
                  block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_dtype=args.kv_dtype,
                  tensor_parallel_size=args.tensor_parallel_size, host_cache_memory=args.host_cache_memory)
    report = {"model": str(args.config), "architecture": config.architecture,
              "num_layers": len(config.layers), **result.to_dict()}
    if args.tensor_parallel_size > 1:      # byte figures above are one GPU's (its shard of every request)
        report["tensor_parallel_size"] = args.tensor_parallel_size
        report["bytes_per_request_max_all_gpus"] = args.tensor_parallel_size * result.bytes_per_request_max
    for group in report["groups"]:
        group["layer_ranges"] = layer_ranges(group["layers"])
        if "kv_shared_layers" in group:
            group["reader_ranges"] = layer_ranges(list(group["kv_shared_layers"]))
    return report, result


def _page_layers(report: dict[str, Any]) -> str:
    """Layers per pool page: one count, or the range when groups of several KV shapes fill it differently."""
    counts = sorted({len(g["layers"]) for g in report["groups"] if "num_blocks" in g})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _print_tables(report: dict[str, Any], result: KVCachePlan) -> None:
    from rich.console import Console
    from rich.table import Table

    width = shutil.get_terminal_size((160, 24)).columns if sys.stdout.isatty() else 160
    console = Console(file=sys.stdout, width=max(width, 100), highlight=False)
    tp = report.get("tensor_parallel_size", 1)
    per_gpu = f" per GPU, tensor parallel x{tp} (bytes are per GPU)" if tp > 1 else ""
    title = (f"{report['architecture']} ({report['model']}): {report['num_layers']} layers, "
             f"max_model_len {report['max_model_len']}, budget {format_bytes(report['budget_bytes'])}{per_gpu}")
    groups = Table(title=title, title_justify="left")
    for name, justify in (("group", "right"), ("kind", "left"), ("spec", "left"), ("layers", "left"),
                          ("block size", "right"), ("bytes/token", "right"), ("per request", "right"),
                          ("bytes/request", "right")):
        groups.add_column(name, justify=justify)
    for g, gp in zip(report["groups"], result.group_plans, strict=True):
        spec = gp.group.spec
        per_token = (format_bytes(spec.bytes_per_token * len(g["layers"]))
                     if spec.is_attention else "constant")
        unit = "blocks" if spec.is_attention else "slot"
        layers = g["layer_ranges"].replace(",", ", ")
        if "reader_ranges" in g:        # KV-sharing layers reading this group's blocks, owning none
            layers += f" (+ {g['reader_ranges'].replace(',', ', ')} read)"
        groups.add_row(str(g["group_id"]), g["kind"], g["spec"], layers,
                       str(g["block_size"]),
                       per_token, f"{g['blocks_per_request_max']} {unit}",
                       format_bytes(g["bytes_per_request_max"]))
    console.print(groups)

    full = report["max_concurrent_requests_if_all_full_attention"]
    summary = Table(show_header=False, title="Budget", title_justify="left")
    summary.add_column("", justify="left")
    summary.add_column("", justify="right")
    rows = [
        ("bytes per max-length request", format_bytes(report["bytes_per_request_max"])),
        ("… if every attention layer were full",
         format_bytes(report["bytes_per_request_if_all_full_attention"])),
        ("block pool", f"{report['num_blocks']} blocks x {format_bytes(report['page_bytes'])} "
                       f"({_page_layers(report)} layers x {report['block_size']} tokens)"
                       if report["num_blocks"] else "none (no attention layers)"),
        ("state slots", f"{report['num_state_slots']} ({report['num_checkpoint_slots']} checkpoint)"
                        + (f" + {report['num_host_checkpoint_slots']} checkpoint in host memory "
                           f"({format_bytes(report['host_checkpoint_bytes'])})"
                           if report["num_host_checkpoint_slots"] else "")),
        ("step reserve (prefill chunks)", f"{report['reserved_step_blocks']} blocks"),
        ("allocated", f"{format_bytes(report['allocated_bytes'])} of {format_bytes(report['budget_bytes'])}"),
        ("padding bytes", str(report["padding_bytes"])),
        *([("KV-sharing layers", f"{report['kv_shared_layers']} (no cache of their own: "
                                 f"{format_bytes(report['kv_shared_bytes_per_request'])} per request saved)")]
          if report["kv_shared_layers"] else []),
        ("max concurrent requests", str(report["max_concurrent_requests"])),
        ("… if all full attention", f"{full} (ratio {report['concurrency_vs_all_full_attention']:.2f}x)"),
    ]
    for row in rows:
        summary.add_row(*row)
    console.print(summary)


def run_plan(args: argparse.Namespace) -> int:
    report, result = plan_report(args)
    if args.json:
        print(json.dumps(report))
    else:
        _print_tables(report, result)
    return 0


register(Command(name="plan", help="show layer -> KV-cache group and the concurrency a memory budget buys",
                 add_arguments=_plan_arguments, run=run_plan))


# -- demo ----------------------------------------------------------------------------------------------
def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=positive_int, default=12, help="requests to serve (default 12)")
    parser.add_argument("--max-tokens", type=positive_int, default=24, help="tokens per request (default 24)")
    parser.add_argument("--seed", type=int, default=0)


def run_demo(args: argparse.Namespace) -> int:
    from hybridkv.demo import run_demo as demo

    result = demo(num_requests=args.num_requests, max_tokens=args.max_tokens, seed=args.seed)
    return 0 if result.matched == result.total else 1


register(Command(name="demo", help="serve a built-in four-kind hybrid model and check it against the reference",
                 add_arguments=_demo_arguments, run=run_demo))


# -- generate ------------------------------------------------------------------------------------------
def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (HF or hybridkv)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); token ids as '1,2,3' "
                        "when the model has no tokenizer")
    parser.add_argument("--prompts-file", help="one prompt per line; '-' reads standard input")
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", type=device_arg, default="auto",
                        help="cpu, cuda, cuda:N, or auto (CUDA when available; default)")
    parser.add_argument("--kv-memory", default=None,
                        help="KV-cache budget, e.g. 4GiB (default: a share of free memory)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        stream = (sys.stdin if args.prompts_file == "-"
                  else open(args.prompts_file, encoding="utf-8"))  # noqa: SIM115
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        raise UsageError("hybridkv generate: give --prompt or --prompts-file")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from hybridkv import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_memory)
    prompts: list[str | list[int]] = []
    for text in _read_prompts(args):
        if llm.tokenizer is None:
            try:
                prompts.append([int(t) for t in text.replace(" ", "").split(",")])
            except ValueError:
                raise UsageError("this model has no tokenizer: give prompts as comma-separated token ids") from None
        else:
            prompts.append(text)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    failed = False
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=not args.json), strict=True):
        failed |= out.error is not None
        if args.json:
            record = {"prompt": prompt, "error": out.error}
            if out.outputs:
                c = out.outputs[0]
                record |= {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason}
            print(json.dumps(record))
        elif out.error is not None:
            print(f"error: {out.error}", file=sys.stderr)
        else:
            c = out.outputs[0]
            print(c.text if c.text is not None else ",".join(map(str, c.token_ids)))
    return 1 if failed else 0


register(Command(name="generate", help="generate text (or token ids) for prompts with a checkpoint",
                 add_arguments=_generate_arguments, run=run_generate))


if __name__ == "__main__":
    raise SystemExit(main())
