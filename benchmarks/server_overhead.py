"""The HTTP server's own cost, without a model: ``hybridkv serve``'s app over an engine whose step is a fixed sleep.

    python benchmarks/server_overhead.py [--requests 256] [--input-len 256] [--output-len 64] [--step-ms 5]
                                         [--prefill-us-per-token 0.5] [--host-ms 0] [--vocab 262144]
                                         [--profile DIR]

The real ``LLM`` (scheduler, KV coordinator, sampler bookkeeping, detokenizer, chat template, tokenizer) over a
tiny checkpoint whose vocabulary is a word-level tokenizer as large as Gemma-3's, but its step runner computes
nothing (``_sleep_engine.py``): it sleeps ``--step-ms`` (plus ``--prefill-us-per-token`` per scheduled token), as
a GPU step lets the host wait without the GIL, and returns a token that is a function of the step's input (every
id is a word, so every streamed chunk has text). So the engine's Python work is the real one and the model's time
is a known constant; the rest is what serving costs.

Runs, each on the same ``--requests`` chat conversations, all at once, greedy, ``ignore_eos``:
  offline   ``LLM.chat`` in this process (after a warm-up run).
  http      the app (FastAPI + uvicorn on 127.0.0.1, in a thread of this process, as ``serve_load.py`` runs it)
            non-streamed and streamed, loaded by ``serve_load.py --client`` (a separate process); over the engine
            in its own process as ``hybridkv serve`` runs it (``EngineCoreClient``, the stand-in built there by
            its factory), and, the rows marked "(thread)", over an engine thread of this process (``AsyncLLM``).
  intake    the same requests with ``max_tokens`` 1, non-streamed: what taking a request costs.
Per run: wall seconds, output tok/s, HTTP/offline, CPU seconds of the engine (its thread, or its whole process)
and of the API side (the event-loop thread, plus the engine process's reader thread) (Linux ``/proc``), steps;
derived: the server's extra CPU per request (intake run) and per streamed chunk (streamed - non-streamed, over
the chunks). Targets (GPU, ``serve_load.py``): HTTP >= 90% of offline.
Last, a full collection of the garbage collector in a fresh process holding an API process's imports (torch among
them), before and after ``freeze_startup_heap`` (what the server's processes do once started): the pause a full
collection would put in the middle of a stream's chunks without it.
``--profile DIR``: also run each HTTP load under py-spy (all threads, ``--idle`` off) when installed, writing
flame graphs and the top functions per thread.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from _sleep_engine import sleep_llm  # noqa: E402
from gpu_attention import print_table  # noqa: E402
from serve_load import InProcessServer, conversations, run_load, write_tokenizer  # noqa: E402

from hybridkv import EngineConfig, SamplingParams  # noqa: E402
from hybridkv.engine.async_llm import AsyncLLM  # noqa: E402
from hybridkv.engine.core_client import EngineCoreClient  # noqa: E402
from hybridkv.models import MLP, Attention, HybridConfig, Layer  # noqa: E402
from hybridkv.models.hybrid import build_model, save_model  # noqa: E402

HERE = Path(__file__).resolve().parent


def write_checkpoint(directory: Path, args: argparse.Namespace) -> EngineConfig:
    """The tiny checkpoint (a vocabulary as large as Gemma-3's) and the engine config every run uses."""
    config = HybridConfig(vocab_size=args.vocab, hidden_size=8, max_position_embeddings=4096, dtype="float32",
                          eos_token_ids=(1,), layers=(Layer(mixer=Attention(num_heads=1, num_kv_heads=1, head_dim=8),
                                                            ffn=MLP(intermediate_size=8)),))
    save_model(build_model(config, seed=0), directory)
    write_tokenizer(directory, args.vocab)
    # no prefix caching: every run sends the same conversations, and each must do the same work
    return EngineConfig(device="cpu", kv_cache_memory="256MiB", max_num_seqs=args.requests,
                        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)


def thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall time, steps and CPU of a run: ``cpu`` name -> a function giving CPU seconds so far (summed per name)."""

    def __init__(self, steps: Callable[[], int], cpu: dict[str, list[Callable[[], float]]]) -> None:
        self.steps_of, self.sources = steps, cpu

    def _cpu(self) -> dict[str, float]:
        return {k: sum(f() for f in fs) for k, fs in self.sources.items()}

    def __enter__(self) -> Meter:
        self.cpu0 = self._cpu()
        self.steps0 = self.steps_of()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = {k: v - self.cpu0[k] for k, v in self._cpu().items()}
        self.steps = self.steps_of() - self.steps0


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
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="Python work per step holding the GIL before the sleep (a GPU step's launch work; on the "
                    "H200 at batch 256 the engine's host work per decode step is about the step itself)")
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
    times = {"step_s": args.step_ms / 1e3, "token_s": args.prefill_us_per_token / 1e6, "host_s": args.host_ms / 1e3}
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        config = write_checkpoint(ckpt, args)
        llm = sleep_llm(ckpt, config, **times)
        convs = conversations(ckpt, n, args.input_len)
        main_thread = threading.get_native_id()
        for _ in range(2):                   # the second run is timed
            with Meter(lambda: llm.engine.runner.steps, {"engine": [lambda: thread_cpu(main_thread)]}) as m:
                outs = llm.chat(convs, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == n * new, tokens
        rows["offline"] = {"seconds": m.seconds, "tokens": tokens, "steps": m.steps, "cpu_engine": m.cpu["engine"],
                           "cpu_loop": 0.0}
        # the engine in a thread of this process (AsyncLLM), then in its own process, as ``hybridkv serve`` runs it
        server = InProcessServer(AsyncLLM(llm), str(ckpt))
        threads = server.engine._thread, server.thread
        try:
            http_runs(rows, " (thread)", server, convs, args, Meter(
                lambda: llm.engine.runner.steps, {"engine": [lambda: thread_cpu(threads[0].native_id)],
                                                  "loop": [lambda: thread_cpu(threads[1].native_id)]}))
        finally:
            server.stop()
        # the engine process imports the stand-in's factory by name (from this directory)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        client = EngineCoreClient(ckpt, config, factory=functools.partial(sleep_llm, **times))
        server = InProcessServer(client, str(ckpt))
        pid, api = client.process.pid, (server.thread, client._reader)
        try:
            http_runs(rows, "", server, convs, args, Meter(
                lambda: asyncio.run(client.snapshot()).steps,
                {"engine": [lambda: process_cpu(pid)], "loop": [lambda t=t: thread_cpu(t.native_id) for t in api]}))
        finally:
            server.stop()
    off = rows["offline"]
    for r in rows.values():
        r["output_tok_s"] = r["tokens"] / r["seconds"]
        r["vs_offline"] = r["seconds"] and off["seconds"] / r["seconds"] if r["tokens"] == off["tokens"] else None
    derived = {"ideal_seconds": off["steps"] * (args.step_ms + args.host_ms) / 1e3
               + n * args.input_len * args.prefill_us_per_token / 1e6}
    for mode in ("", " (thread)"):
        chunks = rows[f"http stream{mode}"]["text_chunks"]        # (fewer than the tokens when a stream merges steps)
        http, stream, intake = (rows[f"{k}{mode}"] for k in ("http", "http stream", "intake"))
        key = "_thread" if mode else ""
        derived |= {
            f"server_cpu_per_request_ms{key}": 1e3 * (http["cpu_loop"] + http["cpu_engine"] - off["cpu_engine"]) / n,
            f"intake_cpu_per_request_ms{key}": 1e3 * (intake["cpu_loop"] + intake["cpu_engine"]) / n,
            f"stream_cpu_per_chunk_us{key}": 1e6 * (stream["cpu_loop"] + stream["cpu_engine"] - http["cpu_loop"]
                                                    - http["cpu_engine"]) / chunks,
            f"tokens_per_chunk{key}": n * new / chunks,
        }
    derived["api_process_gc"] = full_collection_ms()
    meta = {"commit": commit(), "command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count(), "python": sys.version.split()[0], "requests": n, "input_len": args.input_len,
            "output_len": new, "step_ms": args.step_ms, "host_ms": args.host_ms,
            "prefill_us_per_token": args.prefill_us_per_token,
            "vocab": args.vocab, "switch_interval": sys.getswitchinterval()}
    write_json(args, "server_overhead", {"meta": meta, "runs": rows, "derived": derived})

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:.1f}"

    print_table(f"server_overhead ({meta['commit']}; {n} chats of ~{args.input_len} tokens, {new} new; model step "
                f"{args.step_ms} ms sleep + {args.host_ms} ms host work; model-only "
                f"time {derived['ideal_seconds']:.2f} s)",
                ["run", "seconds", "tok/s", "vs offline", "steps", "CPU engine s", "CPU loop s", "CPU client s",
                 "TPOT p50 ms", "ITL p99 ms"],
                [[k, f"{r['seconds']:.2f}", f"{r['output_tok_s']:.0f}",
                  "-" if r["vs_offline"] is None else f"{100 * r['vs_offline']:.0f}%", r["steps"],
                  f"{r['cpu_engine']:.2f}", f"{r['cpu_loop']:.2f}",
                  f"{r['cpu_client']:.2f}" if "cpu_client" in r else "-", ms(r.get("tpot_p50")), ms(r.get("itl_p99"))]
                 for k, r in rows.items()])
    for key, what in (("", "engine process"), ("_thread", "engine thread")):
        print(f"{what}: server CPU per request (non-streamed, beyond offline): "
              f"{derived[f'server_cpu_per_request_ms{key}']:.2f} ms; intake CPU per request (max_tokens 1): "
              f"{derived[f'intake_cpu_per_request_ms{key}']:.2f} ms; streaming CPU per text chunk: "
              f"{derived[f'stream_cpu_per_chunk_us{key}']:.0f} us ({derived[f'tokens_per_chunk{key}']:.2f} tokens "
              f"per chunk)", flush=True)
    gcs = derived["api_process_gc"]
    print(f"an API process's imports: {gcs['objects']} objects the collector tracks; a full collection "
          f"{gcs['full_collection_ms']:.1f} ms, {gcs['after_freeze_ms']:.2f} ms once they are set aside "
          "(freeze_startup_heap)", flush=True)


# Run in a fresh interpreter: this process's own imports and runs would be counted too.
_FULL_COLLECTION = """
import gc, json, time
import hybridkv.server.launcher, hybridkv.server.app, hybridkv.engine.core_client   # an API process's imports
from hybridkv.utils import freeze_startup_heap

def best():
    times = []
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)

objects, before = len(gc.get_objects()), best()
freeze_startup_heap()
print(json.dumps({"objects": objects, "full_collection_ms": before, "after_freeze_ms": best()}))
"""


def full_collection_ms() -> dict[str, float]:
    """A full collection's time (ms, the best of three) in a fresh process with an API process's imports, before
    and after ``freeze_startup_heap``, and the objects the collector tracked."""
    out = subprocess.run([sys.executable, "-c", _FULL_COLLECTION], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def http_runs(rows: dict[str, dict[str, Any]], suffix: str, server: InProcessServer, convs: list,
              args: argparse.Namespace, meter: Meter) -> None:
    """The warm-up, then the non-streamed, streamed and intake loads; a row each (its name + ``suffix``)."""
    n, new = args.requests, args.output_len
    run_load(server.url, server.name, convs[:8], rate=math.inf, num_requests=8, output_len=new,
             extra={"ignore_eos": True})                                   # warm-up
    for name, stream, max_tokens in [("http", False, new), ("http stream", True, new), ("intake", False, 1)]:
        extra = {"ignore_eos": True, **({"stream_options": {"include_usage": True}} if stream else {})}
        label = (name + suffix).replace(" ", "_").replace("(", "").replace(")", "")
        spy = _py_spy(os.getpid(), args.profile, label) if args.profile else None
        if spy is not None:
            time.sleep(1.0)          # (py-spy attaches)
        with meter as m:
            point = run_load(server.url, server.name, convs, rate=math.inf, num_requests=n, output_len=max_tokens,
                             extra=extra, stream=stream)
        if spy is not None:
            _stop_spy(spy, args.profile, label)
        if point["failed"]:
            raise RuntimeError(f"{name}{suffix}: {point['failed']} requests failed: {point['errors']}")
        rows[name + suffix] = {"seconds": point["wall_s"],    # (the client's clock: its process start excluded)
                               "tokens": n * max_tokens, "steps": m.steps, "cpu_engine": m.cpu["engine"],
                               "cpu_loop": m.cpu["loop"], "cpu_client": point["client_cpu_s"],
                               "text_chunks": point["text_chunks"], "itl_p50": point["itl_p50"],
                               "itl_p99": point["itl_p99"], "tpot_p50": point["tpot_p50"],
                               "ttft_p99": point["ttft_p99"]}


if __name__ == "__main__":
    main()
