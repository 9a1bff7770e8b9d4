"""The HTTP server's own cost, without a model: ``hybridkv serve``'s app over an engine whose step is a fixed sleep.

    python benchmarks/server_overhead.py [--requests 256] [--input-len 256] [--output-len 64] [--step-ms 5]
                                         [--prefill-us-per-token 0.5] [--vocab 262144] [--profile DIR]

The real ``LLM`` (scheduler, KV coordinator, sampler bookkeeping, detokenizer, chat template, tokenizer) over a
tiny checkpoint whose vocabulary is a word-level tokenizer as large as Gemma-3's, but its step runner computes
nothing: it sleeps ``--step-ms`` (plus ``--prefill-us-per-token`` per scheduled token), as a GPU step lets the
host wait without the GIL, and returns a token that is a function of the step's input (every id is a word, so
every streamed chunk has text). So the engine thread's Python work is the real one and the model's time is a
known constant; the rest is what serving costs.

Runs, each on the same ``--requests`` chat conversations, all at once, greedy, ``ignore_eos``:
  offline   ``LLM.chat`` in this process (after a warm-up run).
  http      the app (``AsyncLLM`` + FastAPI + uvicorn on 127.0.0.1, in a thread of this process, as
            ``serve_load.py`` runs it), non-streamed and streamed, loaded by ``serve_load.py --client`` (a
            separate process).
  intake    the same requests with ``max_tokens`` 1, non-streamed: what taking a request costs.
Per run: wall seconds, output tok/s, HTTP/offline, CPU seconds of the engine thread and of the event-loop thread
(Linux ``/proc``), steps; derived: the server's extra CPU per request (intake run) and per streamed chunk
(streamed - non-streamed, over the chunks). Targets (GPU, ``serve_load.py``): HTTP >= 90% of offline.
``--profile DIR``: also run each HTTP load under py-spy (all threads, ``--idle`` off) when installed, writing
flame graphs and the top functions per thread.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from gpu_attention import print_table  # noqa: E402
from serve_load import InProcessServer, conversations, run_load, write_tokenizer  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.engine.model_runner import StepBatch, StepOutput  # noqa: E402
from hybridkv.kv_groups.plan import KVCachePlan  # noqa: E402
from hybridkv.models import MLP, Attention, HybridConfig, Layer  # noqa: E402
from hybridkv.models.hybrid import build_model, save_model  # noqa: E402


class SleepRunner:
    """A step runner standing in for the model: ``step_s + token_s x tokens`` of sleep (the GIL released, as a
    host waiting on the GPU), then each output row's token, a function of its input token (never a special one)."""

    def __init__(self, plan: KVCachePlan, vocab: int, *, step_s: float, token_s: float, first: int) -> None:
        self.plan, self.vocab, self.step_s, self.token_s, self.first = plan, vocab, step_s, token_s, first
        self.device = torch.device("cpu")
        self.steps = 0

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        pass

    def execute(self, batch: StepBatch) -> StepOutput:
        time.sleep(self.step_s + self.token_s * len(batch.input_ids))
        self.steps += 1
        last = batch.input_ids[batch.logits_indices]
        span = self.vocab - self.first
        return StepOutput(logits=None, greedy=torch.from_numpy((last * 7919 + 13) % span + self.first))


def build_llm(directory: Path, args: argparse.Namespace) -> LLM:
    config = HybridConfig(vocab_size=args.vocab, hidden_size=8, max_position_embeddings=4096, dtype="float32",
                          eos_token_ids=(1,), layers=(Layer(mixer=Attention(num_heads=1, num_kv_heads=1, head_dim=8),
                                                            ffn=MLP(intermediate_size=8)),))
    save_model(build_model(config, seed=0), directory)
    write_tokenizer(directory, args.vocab)
    # no prefix caching: every run sends the same conversations, and each must do the same work
    llm = LLM(directory, device="cpu", kv_cache_memory="256MiB", max_num_seqs=args.requests,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    llm.engine.runner = SleepRunner(llm.engine.plan, args.vocab, step_s=args.step_ms / 1e3,
                                    token_s=args.prefill_us_per_token / 1e6, first=16)
    return llm


def thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall time, steps and per-thread CPU of a run."""

    def __init__(self, llm: LLM, threads: dict[str, threading.Thread]) -> None:
        self.llm, self.threads = llm, threads

    def __enter__(self) -> Meter:
        self.cpu0 = {k: thread_cpu(t.native_id) for k, t in self.threads.items()}
        self.steps0 = self.llm.engine.runner.steps
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = {k: thread_cpu(t.native_id) - self.cpu0[k] for k, t in self.threads.items()}
        self.steps = self.llm.engine.runner.steps - self.steps0


class _Probe(threading.Thread):
    """Stands for the calling thread in ``Meter`` (offline runs drive the engine in the main thread)."""

    def __init__(self) -> None:
        super().__init__()
        self._native = threading.get_native_id()

    @property
    def native_id(self) -> int:      # type: ignore[override]
        return self._native


def _py_spy(pid: int, out: Path, name: str) -> subprocess.Popen | None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("  (py-spy is not installed: no profile)", flush=True)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--threads", "--rate", "250", "--format", "raw",
                             "--output", str(out / f"{name}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _stop_spy(proc: subprocess.Popen, out: Path, name: str) -> None:
    proc.send_signal(2)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    raw = out / f"{name}.txt"
    if raw.exists():
        (out / f"{name}.top.txt").write_text(top_functions(raw.read_text()))
        print(f"  profile: {raw} (collapsed stacks), {out / f'{name}.top.txt'}", flush=True)


def top_functions(collapsed: str, n: int = 40) -> str:
    """Per thread: samples, and the functions with the most inclusive samples (from py-spy's collapsed stacks)."""
    per_thread: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread, k = frames[0], int(count)
        totals[thread] = totals.get(thread, 0) + k
        seen = set()
        for f in frames[1:]:
            name = f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
            if name not in seen:
                seen.add(name)
                per_thread.setdefault(thread, {})[name] = per_thread.setdefault(thread, {}).get(name, 0) + k
    lines = []
    for thread, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"== {thread}: {total} samples")
        for name, k in sorted(per_thread.get(thread, {}).items(), key=lambda kv: -kv[1])[:n]:
            lines.append(f"{100 * k / total:6.1f}%  {name}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=5.0, help="the stand-in model's time per step")
    ap.add_argument("--prefill-us-per-token", type=float, default=0.5, help="... plus this per scheduled token")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds; default: Python's 0.005)")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy the HTTP runs, writing here")
    add_output_args(ap, "server_overhead")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    torch.set_num_threads(1)                 # (nothing here computes; a pool would only spin against the server)
    n, new = args.requests, args.output_len
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        llm = build_llm(ckpt, args)
        convs = conversations(ckpt, n, args.input_len)
        main_thread = {"main": _Probe()}
        for _ in range(2):                   # the second run is timed
            with Meter(llm, main_thread) as m:
                outs = llm.chat(convs, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == n * new, tokens
        rows["offline"] = {"seconds": m.seconds, "tokens": tokens, "steps": m.steps, "cpu_engine": m.cpu["main"],
                           "cpu_loop": 0.0}
        server = InProcessServer(llm, str(ckpt))
        threads = {"engine": server.engine._thread, "loop": server.thread}
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        try:
            run_load(server.url, str(ckpt), convs[:8], rate=math.inf, num_requests=8, output_len=new,
                     extra={"ignore_eos": True})                                   # warm-up
            runs = [("http", False, new), ("http stream", True, new), ("intake", False, 1)]
            for name, stream, max_tokens in runs:
                extra = {"ignore_eos": True, **({"stream_options": {"include_usage": True}} if stream else {})}
                spy = _py_spy(os.getpid(), args.profile, name.replace(" ", "_")) if args.profile else None
                if spy is not None:
                    time.sleep(1.0)          # (py-spy attaches)
                with Meter(llm, threads) as m:
                    point = run_load(server.url, str(ckpt), convs, rate=math.inf, num_requests=n,
                                     output_len=max_tokens, extra=extra, stream=stream)
                if spy is not None:
                    _stop_spy(spy, args.profile, name.replace(" ", "_"))
                if point["failed"]:
                    raise RuntimeError(f"{name}: {point['failed']} requests failed: {point['errors']}")
                rows[name] = {"seconds": point["wall_s"],    # (the client's clock: its process start excluded)
                               "tokens": n * max_tokens,
                              "steps": m.steps, "cpu_engine": m.cpu["engine"], "cpu_loop": m.cpu["loop"],
                              "cpu_client": point["client_cpu_s"], "text_chunks": point["text_chunks"],
                              "itl_p50": point["itl_p50"], "itl_p99": point["itl_p99"],
                              "tpot_p50": point["tpot_p50"], "ttft_p99": point["ttft_p99"]}
        finally:
            server.stop()
    off = rows["offline"]
    for r in rows.values():
        r["output_tok_s"] = r["tokens"] / r["seconds"]
        r["vs_offline"] = r["seconds"] and off["seconds"] / r["seconds"] if r["tokens"] == off["tokens"] else None
    chunks = rows["http stream"]["text_chunks"]        # (fewer than the tokens when a stream merges steps)
    derived = {
        "server_cpu_per_request_ms": 1e3 * (rows["http"]["cpu_loop"] + rows["http"]["cpu_engine"]
                                            - off["cpu_engine"]) / n,
        "intake_cpu_per_request_ms": 1e3 * (rows["intake"]["cpu_loop"] + rows["intake"]["cpu_engine"]) / n,
        "stream_cpu_per_chunk_us": 1e6 * (rows["http stream"]["cpu_loop"] + rows["http stream"]["cpu_engine"]
                                          - rows["http"]["cpu_loop"] - rows["http"]["cpu_engine"]) / chunks,
        "tokens_per_chunk": n * new / chunks,
        "ideal_seconds": off["steps"] * args.step_ms / 1e3 + n * args.input_len * args.prefill_us_per_token / 1e6,
    }
    meta = {"commit": commit(), "command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count(), "python": sys.version.split()[0], "requests": n, "input_len": args.input_len,
            "output_len": new, "step_ms": args.step_ms, "prefill_us_per_token": args.prefill_us_per_token,
            "vocab": args.vocab, "switch_interval": sys.getswitchinterval()}
    write_json(args, "server_overhead", {"meta": meta, "runs": rows, "derived": derived})

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}"

    print_table(f"server_overhead ({meta['commit']}; {n} chats of ~{args.input_len} tokens, {new} new; model step "
                f"{args.step_ms} ms sleep; model-only time {derived['ideal_seconds']:.2f} s)",
                ["run", "seconds", "tok/s", "vs offline", "steps", "CPU engine s", "CPU loop s", "CPU client s",
                 "TPOT p50 ms", "ITL p99 ms"],
                [[k, f"{r['seconds']:.2f}", f"{r['output_tok_s']:.0f}",
                  "-" if r["vs_offline"] is None else f"{100 * r['vs_offline']:.0f}%", r["steps"],
                  f"{r['cpu_engine']:.2f}", f"{r['cpu_loop']:.2f}",
                  f"{r['cpu_client']:.2f}" if "cpu_client" in r else "-", ms(r.get("tpot_p50")), ms(r.get("itl_p99"))]
                 for k, r in rows.items()])
    print(f"server CPU per request (non-streamed, beyond offline): {derived['server_cpu_per_request_ms']:.2f} ms; "
          f"intake CPU per request (max_tokens 1): {derived['intake_cpu_per_request_ms']:.2f} ms; "
          f"streaming CPU per text chunk: {derived['stream_cpu_per_chunk_us']:.0f} us "
          f"({derived['tokens_per_chunk']:.2f} tokens per chunk)", flush=True)


if __name__ == "__main__":
    main()
