"""HTTP serving under load: Poisson arrivals over the OpenAI API, against the offline API and ``transformers serve``.

    python benchmarks/serve_load.py [--families gemma3,nemotronh] [--no-peer] [--save] [--tiny]

Per model (the ~1B random-init Gemma-3-like and NemotronH-like mixes of ``gpu_decode.py``, built by
transformers, saved with ``save_pretrained`` plus a byte-level BPE tokenizer with a chat template, bf16):

1. **Offline**: ``LLM.chat`` on all ``--num-prompts`` conversations at once (prompts of ``--input-len``
   tokens, ``--output-len`` new tokens, greedy, ``ignore_eos``): output tok/s and requests/s (the capacity
   C; the median of ``--throughput-runs`` runs, as for the HTTP throughput below); and the batch-32 decode step
   (32 short prompts decoding together: mean time between tokens).
2. **HTTP**: ``hybridkv serve`` started as users start it (a subprocess; prefix caching off, as the runs repeat the
   conversations; ``--server-flags`` adds flags), once per ``--api-server-counts`` value (API processes over the one
   engine process; the load comes from ``--client-processes`` processes of its own, which keep off the CPU the
   engine's step loop took, as clients on other machines do: ``--engine-cpu``): the same conversations all at once,
   streamed and not (throughput vs offline, medians of ``--throughput-runs``); then, on the last count, Poisson
   arrivals, streamed, at ``--rates`` (default: 0.5, 0.8, 1.0, 1.25 x C, then up to ``--extra-rate-points`` more at
   1.25x each while the last still keeps p99 TTFT <= 2 s): TTFT, TPOT (per request: time after the first token /
   tokens after it), ITL (time between streamed chunks, as a client sees it) p50 / p99 over the whole run and the p99
   over its middle alone (``middle_gaps``: neither filling up nor draining), output tok/s; and from the server's
   ``/metrics`` the p50 / p99 of the engine's step intervals and of the API side's inter-token gaps. Each rate point
   runs ``--seconds-per-rate`` of arrivals (at least 16 requests, at most ``--max-requests-per-rate``), then waits
   for them to finish (bounded). A point meets the target when no request failed, p99 TTFT <= 2 s and the server kept
   up (late in the arrival span, once full, it streamed at least 0.9 of the tokens per second asked by the requests
   streaming then, ``kept_up``: a short run can hide a growing backlog under the TTFT target, in a queue or in an
   ever larger batch). The half-rate point runs again on a server started with ``--itl-server-flags`` as well
   (default ``--prefill-spread 1``: each step takes every waiting prompt its token budget holds, as before the engine
   spread bursts of prompts over steps: what the spreading buys).
3. **Peer**: ``transformers serve`` on the same checkpoint and conversations, with its continuous batching
   (without where that refuses the model: Mamba layers), streamed chat completions from a tenth of hybridkv's
   best rate, points as hybridkv's: up 2x while they meet the target, down 4x while none has, for at most
   ``--peer-points`` (a point whose load generators hang past their deadline ends the sweep: ``peer.stopped``).

Targets (GPU): HTTP throughput >= 90% of offline on the same requests; the highest rate with p99 TTFT <= 2 s
>= 10x the peer's; p99 ITL at half that rate <= 2x the batch-32 decode step. The summary table prints
exactly these. ``--tiny``: tiny models on the CPU, a smoke test of the script (and of the peer when
transformers serve can run here); the numbers mean nothing (there the offline run and the server's engine
thread each get an OpenMP pool, and the two spin against each other on a small machine).

The load generator is this file run with ``--client SPEC``; its imports stay light (no torch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
TTFT_SLO = 2.0
KEPT_UP = 0.9       # a point whose server needed > 1 / 0.9 of the arrival span (``kept_up``) missed
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


# -- the load generator (its own process) ----------------------------------------------------------------
class _HTTPError(Exception):
    pass


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, AsyncIterator[bytes]]:
    """POST ``body`` as JSON on a new HTTP/1.1 connection: the status and the response body's pieces as they
    come (chunked or sized). The load generator's own client: httpx spends several ms of CPU per request with
    hundreds of connections open, so a load of 256 requests would measure the client, not the server."""
    host, _, port = url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port or 80))
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: "
                 f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    status_line = await reader.readline()
    if not status_line.startswith(b"HTTP/1.1 "):
        writer.close()
        raise _HTTPError(f"not an HTTP response: {status_line[:80]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()

    async def pieces() -> AsyncIterator[bytes]:
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while size := int((await reader.readline()).split(b";")[0], 16):
                    yield await reader.readexactly(size)
                    await reader.readexactly(2)
            elif "content-length" in headers:
                yield await reader.readexactly(int(headers["content-length"]))
            else:
                yield await reader.read()
        finally:
            writer.close()

    return int(status_line.split()[1]), pieces()


async def _one(url: str, body: dict[str, Any], *, stamps: bool = False) -> dict[str, Any]:
    """One chat completion; streamed: TTFT (first chunk with text), the gaps between later chunks, tokens; with
    ``stamps`` also ``times``: the wall-clock time of every delta event after the role's (one per output the
    server's handler takes, text or not: ``serve_trace.py`` matches them with the server's stamps)."""
    start = time.perf_counter()
    try:
        status, pieces = await _post(url, "/v1/chat/completions", body)
        if status != 200 or not body["stream"]:
            text = b"".join([p async for p in pieces]).decode()
            if status != 200:
                return {"ok": False, "error": f"HTTP {status}: {text[:200]}"}
            e2e = time.perf_counter() - start
            return {"ok": True, "ttft": e2e, "gaps": [], "tokens": json.loads(text)["usage"]["completion_tokens"],
                    "e2e": e2e, "error": None}
        ttft, last, gaps, chunks, usage, buffer, times = None, None, [], 0, None, b"", []
        async for piece in pieces:
            *lines, buffer = (buffer + piece).split(b"\n")
            for raw in lines:
                if stamps and b'"delta":{"role":null' in raw:
                    times.append(time.time())
                line = raw.decode()
                if not line.startswith("data:") or line.startswith("data: [DONE]"):
                    continue
                # (parsing every chunk would make this process the bottleneck at high rates: after the first
                # token only the usage chunk is parsed, every other chunk counts as one more delta)
                if ttft is None or '"usage":{' in line:
                    event = json.loads(line[5:])
                    if event.get("usage"):
                        usage = event["usage"]
                    choices = event.get("choices") or ()
                    if not choices or not (choices[0].get("delta") or {}).get("content"):
                        continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
                chunks += 1
    except (OSError, asyncio.IncompleteReadError, ValueError, _HTTPError) as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ok": ttft is not None, "ttft": ttft, "gaps": gaps, "tokens": tokens, "e2e": end - start,
            "error": None if ttft is not None else "no tokens", **({"times": times} if stamps else {})}


def kept_up(rate: float, last_arrival: float, done: list[dict[str, Any]]) -> float | None:
    """Whether the server kept up with a Poisson run: the tokens it streamed per second late in the arrival span,
    over those asked per second by the requests that, in a steady state, stream then (at most 1; None: not a Poisson
    run, or nothing finished). A server that falls behind streams fewer than are asked, whether its backlog waits in
    a queue (first tokens come later and later) or in an ever larger batch whose every step is slower (first tokens
    stay quick): a short run's TTFT can hide either.

    Late: from the span's middle, or from the requests' median latency L when that is longer (the server is still
    filling up before), but from 3/4 of the span at the latest; a run shorter than about two latencies is judged
    while still filling up, so its slow servers miss (``_peer`` sizes its points for that). The requests that stream
    then: those sent L/2 earlier (a token streams on average half a latency after its request is sent), counted
    as they came, not as ``rate`` says (a Poisson count of a few dozen is off by a fifth). A streamed request's
    tokens are spread evenly over its chunks; a request's times count from when it was sent, ``start``."""
    if not done or not math.isfinite(rate) or last_arrival <= 0:
        return None
    latency = float(np.median([r["e2e"] for r in done]))
    lo, hi = min(max(last_arrival / 2, latency), 0.75 * last_arrival), last_arrival
    shift = min(latency / 2, lo)
    starts = np.asarray([r["start"] for r in done])
    sent = np.count_nonzero((starts >= lo - shift) & (starts < hi - shift))
    if not sent:
        return 0.0              # (too few requests to judge: a miss, not a pass)
    streamed = 0.0
    for r in done:
        times = r["start"] + r["ttft"] + np.cumsum([0.0, *r["gaps"]])
        streamed += r["tokens"] / len(times) * np.count_nonzero((times >= lo) & (times < hi))
    asked = sent * float(np.mean([r["tokens"] for r in done]))
    return float(min(1.0, streamed / asked)) if asked > 0 else 0.0


async def _load(spec: dict[str, Any], start: float) -> dict[str, Any]:
    """This process's share of Poisson arrivals at ``rate`` (inf: all at once) of ``num_requests`` conversations:
    every ``shards``-th request from the ``shard``-th, the schedule starting at ``start`` (``time.time()``); bounded
    in time. Each request's own figures, not yet summarised (``summarize``); with ``name_requests`` (a prefix) each
    request sends ``request_id`` prefix + its index, which its figures carry as ``id``, with its ``times``."""
    rng = random.Random(spec["seed"])
    rate, n, shard, shards = spec["rate"], spec["num_requests"], spec["shard"], spec["shards"]
    body = {"model": spec["model"], "max_tokens": spec["output_len"], "temperature": 0.0, "stream": spec["stream"],
            **spec.get("extra", {})}
    results: list[dict[str, Any] | None] = [None] * n
    cpu0 = time.process_time()

    named = spec.get("name_requests")

    async def run(i: int) -> None:
        sent = time.perf_counter() - t0
        conversation = spec["conversations"][i % len(spec["conversations"])]
        if named is None:
            results[i] = await _one(spec["url"], {**body, "messages": conversation}) | {"start": sent}
        else:
            results[i] = await _one(spec["url"], {**body, "messages": conversation, "request_id": f"{named}{i}"},
                                    stamps=True) | {"start": sent, "id": f"{named}{i}"}

    t0 = time.perf_counter() + (start - time.time())      # the schedule's origin, the same in every process
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    tasks, at = [], 0.0               # at: the last arrival, seconds after the start
    for i in range(n):
        if math.isfinite(rate):
            at += rng.expovariate(rate)
        if i % shards != shard:
            continue
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(run(i)))
    _, pending = await asyncio.wait(tasks, timeout=spec["drain_timeout"]) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {"results": [r for r in results if r is not None], "wall_s": time.perf_counter() - t0,
            "last_arrival": at, "cpu_s": time.process_time() - cpu0}


def middle_window(first: float, last: float) -> tuple[float, float]:
    """The middle of a run whose tokens were read from ``first`` to ``last``: a quarter to 85% of that span, where the
    server is full, neither filling up nor draining (``middle_gaps``, and ``serve_trace.py``'s gaps)."""
    return first + 0.25 * (last - first), first + 0.85 * (last - first)


def middle_gaps(done: list[dict[str, Any]]) -> np.ndarray:
    """The gaps read in the middle of a run: from a quarter to 85% of its span, the first token read to the last (as
    ``serve_trace.py`` counts its gaps). The server is full there, neither filling up nor draining; the whole run's
    percentiles (the targets') hold both ends too. A gap's time is that of the chunk that ends it."""
    series = [(r["start"] + r["ttft"] + np.cumsum(r["gaps"]), np.asarray(r["gaps"])) for r in done if r["gaps"]]
    if not series:
        return np.zeros(0)
    first, last = min(r["start"] + r["ttft"] for r in done), max(float(t[-1]) for t, _ in series)
    lo, hi = middle_window(first, last)
    return np.concatenate([g[(t >= lo) & (t < hi)] for t, g in series])


def summarize(rate: float, n: int, shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate point from its load generators' raw figures (``_load``)."""
    results = [r for s in shards for r in s["results"]]
    wall = max(s["wall_s"] for s in shards)
    at = max(s["last_arrival"] for s in shards)
    done = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]][:3]
    ttft = [r["ttft"] for r in done] + [math.inf] * (n - len(done))
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = [g for r in done for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in done)

    def pct(values: list[float], q: float) -> float | None:
        value = float(np.percentile(values, q)) if values else math.nan
        return value if math.isfinite(value) else None          # (failed requests count as infinitely late)

    cpu = sum(s["cpu_s"] for s in shards)
    return {"rate": rate, "requests": n, "failed": n - len(done), "errors": errors, "wall_s": wall,
            "client_cpu_s": cpu, "client_processes": len(shards), "client_busy": cpu / wall / len(shards),
            "text_chunks": len(itl) + len(done), "output_tok_s": tokens / wall, "requests_s": len(done) / wall,
            "kept_up": kept_up(rate, at, done),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "itl_p99_middle": pct(list(middle_gaps(done)), 99)}


def client_main(spec_file: str) -> None:
    """A load generator: says ``ready`` once imported, reads its start time (``time.time()``) from stdin, prints
    its share's raw figures as one JSON line."""
    spec = json.loads(Path(spec_file).read_text())
    spec["rate"] = float(spec["rate"])
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    print(json.dumps(asyncio.run(_load(spec, start))), flush=True)


def run_load(url: str, model: str, conversations: list, *, rate: float, num_requests: int, output_len: int,
             extra: dict[str, Any] | None = None, stream: bool = True, drain_timeout: float = 120.0,
             processes: int = 1) -> dict[str, Any]:
    """One load point, generated by ``processes`` separate processes (``--client``), each sending every
    ``processes``-th request of one Poisson schedule: a client process handles every chunk of its streams in
    turn, so one process alone, 50% busy at a few hundred requests a second, would stamp its own queueing onto
    the inter-token gaps it measures."""
    return summarize(rate, num_requests, load_shards(
        url, model, conversations, rate=rate, num_requests=num_requests, output_len=output_len, extra=extra,
        stream=stream, drain_timeout=drain_timeout, processes=processes))


def load_shards(url: str, model: str, conversations: list, *, rate: float, num_requests: int, output_len: int,
                extra: dict[str, Any] | None = None, stream: bool = True, drain_timeout: float = 120.0,
                processes: int = 1, name_requests: str | None = None) -> list[dict[str, Any]]:
    """``run_load``'s load, each load generator's raw figures (``_load``); ``name_requests``: as ``_load``."""
    spec = {"url": url, "model": model, "conversations": conversations, "rate": rate, "num_requests": num_requests,
            "output_len": output_len, "extra": extra or {}, "stream": stream, "seed": 0, "shards": processes,
            "drain_timeout": drain_timeout, "name_requests": name_requests}
    # (a load generator waits ``drain_timeout`` after its last arrival: the arrivals' span comes first)
    deadline = (num_requests / rate if math.isfinite(rate) else 0) + drain_timeout + 120
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for shard in range(processes):
                spec_file = Path(tmp) / f"spec{shard}.json"
                spec_file.write_text(json.dumps({**spec, "shard": shard}))
                # (stderr to a file: a pipe nobody reads while another process is waited on could fill, stalling it)
                with open(Path(tmp) / f"err{shard}", "w") as err:
                    procs.append(subprocess.Popen([sys.executable, __file__, "--client", str(spec_file)],
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True))
            for shard, proc in enumerate(procs):
                if proc.stdout.readline().strip() != "ready":
                    proc.wait(timeout=60)
                    raise RuntimeError("a load generator failed to start:\n"
                                       f"{(Path(tmp) / f'err{shard}').read_text()[-3000:]}")
            start = time.time() + 0.05
            for proc in procs:
                proc.stdin.write(f"{start}\n")
                proc.stdin.flush()
            shards = []
            for shard, proc in enumerate(procs):
                out, _ = proc.communicate(timeout=deadline)
                if proc.returncode != 0:
                    raise RuntimeError(f"the load generator failed:\n{(Path(tmp) / f'err{shard}').read_text()[-3000:]}")
                shards.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return shards


# -- checkpoint, conversations -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPECIAL = ["<pad>", "</s>", "<s>", "<unk>", "<|", "|>", "user", "assistant", "system"]


def _vocabulary(size: int) -> list[str]:
    """``size`` distinct tokens: the chat template's pieces, then words ("a".."z", "aa", ...)."""
    words, n = list(SPECIAL), 0
    while len(words) < size:
        n, word = n + 1, ""
        m = n
        while m:
            m, r = divmod(m - 1, 26)
            word = chr(97 + r) + word
        if word not in SPECIAL:
            words.append(word)
    return words


def build_checkpoint(family: str, tiny: bool, directory: Path, device: Any, dtype: Any) -> None:
    """The HF model of ``gpu_decode.hf_config`` (random init) and a word-level tokenizer over the model's whole
    vocabulary with a chat template: a random-init model samples ids uniformly, and every id must be text
    (a small BPE vocabulary would leave most sampled ids without any, and a stream without text chunks)."""
    import torch

    sys.path.insert(0, str(HERE))
    from gpu_decode import hf_config

    config, cls = hf_config(family, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        hf = cls(config).to(dtype)
    hf.save_pretrained(directory)
    del hf
    write_tokenizer(directory, config.vocab_size)


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` words (``_vocabulary``) with ``CHAT_TEMPLATE``, in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = _vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))


def conversations(directory: Path, n: int, input_len: int) -> list[list[dict[str, str]]]:
    """``n`` one-message conversations of about ``input_len`` tokens of random words (one token each)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    words = _vocabulary(min(tok.get_vocab_size(), 5000))[len(SPECIAL):]
    rng = random.Random(2)
    # (the template adds ~6 tokens)
    return [[{"role": "user", "content": " ".join(rng.choices(words, k=max(input_len - 6, 1)))}] for _ in range(n)]


# -- servers ----------------------------------------------------------------------------------------------
class InProcessServer:
    """``hybridkv serve``'s app (FastAPI + uvicorn) over ``engine`` (an ``EngineCoreClient``, as the server runs
    it, or an ``AsyncLLM``) in a thread of this process; ``stop()`` also shuts the engine down."""

    def __init__(self, engine: Any, name: str) -> None:
        import uvicorn

        from hybridkv.server.app import ServerSettings, build_app

        self.engine = engine
        self.name = name
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        app = build_app(self.engine, ServerSettings(served_model_names=(name,), model_root=name, stats_interval=0))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.engine.shutdown(timeout=30)


class CLIServer:
    """``hybridkv serve CHECKPOINT ...`` as users start it (a subprocess: the launcher, ``api_servers`` API
    processes, the engine process), on a free port of 127.0.0.1; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, checkpoint: Path, name: str, flags: list[str], *, log: Path) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        command = [sys.executable, "-m", "hybridkv.cli", "serve", str(checkpoint), "--host", "127.0.0.1", "--port",
                   str(port), "--served-model-name", name, "--disable-access-log", "--stats-interval", "0",
                   "--log-level", "warning", *flags]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _await_health(self.proc, self.url, log, "hybridkv serve", timeout=600)
        # This process, and the load generators it starts, keep off the engine's step loop's CPU while the server
        # runs, as clients on other machines do (``--engine-cpu``, ``hybridkv/engine/affinity.py``).
        from hybridkv.engine import affinity

        self._cpus = affinity.allowed_cpus()
        self.engine_cpu = engine_cpu(self.proc.pid)
        affinity.keep_off(self.engine_cpu)

    def stop(self) -> None:
        try:
            _terminate(self.proc, 90)
        finally:
            if self.engine_cpu is not None:
                from hybridkv.engine.affinity import set_process_cpus

                set_process_cpus(self._cpus)


def engine_cpu(server: int) -> int | None:
    """The CPU the step loop of ``hybridkv serve`` (process ``server``) runs on alone, or None: the one CPU its
    engine process's main thread may use (Linux, ``/proc``)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if (int(stat.read_text().rsplit(")", 1)[1].split()[1]) == server
                    and b"hybridkv.engine.core" in (stat.parent / "cmdline").read_bytes()):
                cpus = os.sched_getaffinity(int(stat.parent.name))
                return next(iter(cpus)) if len(cpus) == 1 else None
        except (OSError, IndexError, ValueError):      # (a process that ended meanwhile)
            continue
    return None


class PeerServer:
    """``transformers serve`` on ``checkpoint`` (a subprocess; flags as its version has them: the model as
    ``--force-model`` or as the argument), with its continuous batching or without."""

    LAUNCH = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"

    def __init__(self, checkpoint: Path, *, device: str, dtype: str, log: Path, continuous_batching: bool) -> None:
        base = [sys.executable, "-c", self.LAUNCH, "serve"]
        help_text = subprocess.run([*base, "--help"], capture_output=True, text=True, timeout=120,
                                   env={**os.environ, "COLUMNS": "250"}).stdout        # (no option name cut)
        if "--port" not in help_text:
            raise RuntimeError(f"transformers serve cannot run here:\n{help_text[-2000:]}")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        flags = ["--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", dtype, "--log-level",
                 "warning"]
        if continuous_batching:
            flags.append("--continuous-batching")
        if "--model-timeout" in help_text:
            flags += ["--model-timeout", "1000000"]
        model = ["--force-model", str(checkpoint)] if "--force-model" in help_text else [str(checkpoint)]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*base, *flags, *model], stdout=out, stderr=subprocess.STDOUT)
        _await_health(self.proc, self.url, log, "transformers serve", timeout=300)

    def stop(self) -> None:
        _terminate(self.proc, 30)


def _await_health(proc: subprocess.Popen, url: str, log: Path, what: str, *, timeout: float) -> None:
    """Return once ``url``/health answers 200; raise (after stopping ``proc``) if it exits, times out or this
    process is stopped meanwhile."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        _terminate(proc, 30)
        raise


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- one model ---------------------------------------------------------------------------------------------
_HISTOGRAMS = {"hybridkv:engine_step_seconds": "step", "hybridkv:inter_token_latency_seconds": "api_itl"}


def _scrape(url: str) -> dict[str, Any]:
    """From ``/metrics``: the engine's step and prompt-token counters, and two histograms as {upper bound:
    cumulative count}: the engine's step intervals and the API side's inter-token gaps (summed over its
    processes)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, Any] = {key: {} for key in _HISTOGRAMS.values()}
    for line in text.splitlines():
        for name in ("hybridkv:engine_steps", "hybridkv:prompt_tokens_computed"):
            if line.startswith(name + "_total ") or line.startswith(name + " "):
                out[name.split(":")[1]] = float(line.rsplit(" ", 1)[1])
        for name, key in _HISTOGRAMS.items():
            if line.startswith(name + "_bucket{"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                out[key][float(bound)] = out[key].get(float(bound), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q``-th percentile of what a cumulative histogram gained between two scrapes, interpolated within its
    bucket as Prometheus's ``histogram_quantile`` does (None: nothing gained)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q / 100 * counts[-1]
    low, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return low
            return low + (bound - low) * (rank - below) / (count - below) if count > below else bound
        low, below = bound, count
    return None


def run_profiled(url: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``run_load`` plus what the server did meanwhile: engine steps, mean step time, prompt tokens per step (the
    profile of a step's length under that load: prefill chunks ride in decode steps), and the p50 / p99 of the
    engine's step intervals and of the API side's inter-token gaps (from their histograms), to set beside the
    client's ITL: where along the way the gaps grow (percentiles of the stages do not add up)."""
    before = _scrape(url)
    point = run_load(url, *args, **kwargs)
    after = _scrape(url)
    steps = after.get("engine_steps", 0) - before.get("engine_steps", 0)
    prompt = after.get("prompt_tokens_computed", 0) - before.get("prompt_tokens_computed", 0)
    point["engine"] = {"steps": steps, "mean_step_s": point["wall_s"] / steps if steps else None,
                       "prompt_tokens_per_step": prompt / steps if steps else None}
    for key in _HISTOGRAMS.values():
        for q in (50, 99):
            point["engine"][f"{key}_p{q}"] = histogram_quantile(before[key], after[key], q)
    return point


def _passes(point: dict[str, Any]) -> bool:
    """The point met the target: no failures, p99 TTFT <= ``TTFT_SLO``, and the server kept up (``KEPT_UP``)."""
    return (point["failed"] == 0 and point["ttft_p99"] is not None and point["ttft_p99"] <= TTFT_SLO
            and (point.get("kept_up") is None or point["kept_up"] >= KEPT_UP))


def sweep_rates(rates: list[float], run: Callable[[float], dict[str, Any]], *, extend: int = 0
                ) -> tuple[list[dict[str, Any]], float | None, bool]:
    """``run`` each of ``rates`` in turn until a point misses the target (``_passes``); while the last one still meets
    it, up to ``extend`` more at 1.25x each. (points, the best rate that met it or None, whether that is only a lower
    bound: the last point run met it too)."""
    points, queue = [], list(rates)
    while queue:
        point = run(queue.pop(0))
        points.append(point)
        if not _passes(point):
            break
        if not queue and extend > 0:
            queue.append(round(point["rate"] * 1.25, 3))
            extend -= 1
    ok = [p["rate"] for p in points if _passes(p)]
    return points, (max(ok) if ok else None), bool(points) and _passes(points[-1])


def _points_per_rate(rate: float, args: argparse.Namespace) -> int:
    return int(min(args.max_requests_per_rate, max(16, rate * args.seconds_per_rate)))


def bench_family(family: str, args: argparse.Namespace, device: Any, dtype: Any,
                 progress: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """One family's figures; ``progress`` gets them as they stand before the peer runs (the slowest part)."""
    import torch

    from hybridkv import LLM, EngineConfig, SamplingParams

    result: dict[str, Any] = {"family": family}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        t0 = time.perf_counter()
        build_checkpoint(family, args.tiny, ckpt, device, dtype)
        convs = conversations(ckpt, args.num_prompts, args.input_len)
        name = str(ckpt)
        # Every run sends the same conversations again: with prefix caching the later runs would be served from
        # the cache, so the offline and HTTP runs would not do the same work.
        config = EngineConfig(device=str(device), dtype=dtype, backend=args.backend, kv_cache_memory=args.kv_memory,
                              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
        llm = LLM(ckpt, config=config)
        result["startup_s"] = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.chat(convs, params, use_tqdm=False)             # (first-call costs excluded)
        runs = []
        for _ in range(args.throughput_runs):               # a run lasts under a second: the median of a few
            t = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            runs.append(time.perf_counter() - t)
        seconds = float(np.median(runs))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["prompt_tokens_mean"] = float(np.mean([len(o.prompt_token_ids) for o in outs]))
        result["offline"] = {"seconds": seconds, "output_tok_s": tokens / seconds, "requests_s": len(outs) / seconds,
                             "runs_s": runs}
        rng = np.random.default_rng(0)
        vocab = llm.model.config.vocab_size
        short = [rng.integers(3, vocab, 16).tolist() for _ in range(32)]
        for _ in range(2):
            decoded = llm.generate(short, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                                   use_tqdm=False)
        result["decode_step_b32_s"] = float(np.median([
            (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in decoded]))
        print(f"{family}: offline {result['offline']['output_tok_s']:.0f} tok/s, "
              f"{result['offline']['requests_s']:.2f} req/s; batch-32 step {1e3 * result['decode_step_b32_s']:.2f} ms",
              flush=True)

        # The server as users start it: ``hybridkv serve`` (this process's engine freed first)
        del llm
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        flags = ["--device", str(device), "--dtype", str(dtype).removeprefix("torch."), "--backend", args.backend,
                 "--kv-memory", args.kv_memory, "--max-num-seqs", str(args.max_num_seqs), "--no-prefix-caching",
                 *shlex.split(args.server_flags)]
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        log = Path(tmp) / "server.log"
        result["http_by_api_servers"] = {}
        for count in args.api_server_counts:
            server = CLIServer(ckpt, name, [*flags, "--api-server-count", str(count)], log=log)
            try:
                run_load(server.url, name, convs[:8], rate=math.inf, num_requests=8, output_len=args.output_len,
                         extra=extra)
                throughput = _throughput(server.url, name, convs, args)
                result["http_by_api_servers"][str(count)] = throughput
                print(f"  {count} API process(es): HTTP streamed {throughput['stream']['output_tok_s']:.0f} tok/s, "
                      f"not streamed {throughput['no_stream']['output_tok_s']:.0f} tok/s", flush=True)
                if count != args.api_server_counts[-1]:
                    continue
                result["api_servers"] = count
                result["http"] = throughput
                capacity = result["offline"]["requests_s"]
                rates = ([float(r) for r in args.rates.split(",")] if args.rates != "auto"
                         else [round(capacity * f, 3) for f in args.rate_fractions])

                def run_rate(rate: float, url: str = server.url) -> dict[str, Any]:
                    point = run_profiled(url, name, convs, rate=rate,
                                         num_requests=_points_per_rate(rate, args), output_len=args.output_len,
                                         extra=extra, processes=args.client_processes)
                    _print_point("hybridkv", family, point)
                    return point

                points, best, lower_bound = sweep_rates(
                    rates, run_rate, extend=args.extra_rate_points if args.rates == "auto" else 0)
                half = None
                if best is not None:
                    # (an earlier point only at the same rate: the variant run below uses best / 2 exactly)
                    half = next((p for p in points if math.isclose(p["rate"], best / 2, rel_tol=1e-3)), None)
                    if half is None:
                        half = run_profiled(server.url, name, convs, rate=best / 2,
                                            num_requests=_points_per_rate(best / 2, args), output_len=args.output_len,
                                            extra=extra, processes=args.client_processes)
                        _print_point("hybridkv", family, half)
                        points.append(half)
                result.update(rates=points, best_rate=best, best_rate_is_lower_bound=lower_bound,
                              itl_p99_at_half=half["itl_p99"] if half else None,
                              itl_p99_at_half_middle=half.get("itl_p99_middle") if half else None,
                              api_itl_p99_at_half=half["engine"]["api_itl_p99"] if half else None,
                              engine_step_p99_at_half=half["engine"]["step_p99"] if half else None)
            finally:
                server.stop()
        best = result.get("best_rate")
        if best is not None and args.itl_server_flags:
            # the same half-rate load on a server started with --itl-server-flags (by default --prefill-spread 1:
            # without spreading bursts of prompts over steps, the comparison for what it buys)
            server = CLIServer(ckpt, name, [*flags, "--api-server-count", str(args.api_server_counts[-1]),
                                            *shlex.split(args.itl_server_flags)], log=log)
            try:
                run_load(server.url, name, convs[:8], rate=math.inf, num_requests=8, output_len=args.output_len,
                         extra=extra)
                point = run_profiled(server.url, name, convs, rate=best / 2,
                                     num_requests=_points_per_rate(best / 2, args), output_len=args.output_len,
                                     extra=extra, processes=args.client_processes)
                _print_point(f"hybridkv ({args.itl_server_flags})", family, point)
                result["half_rate_variant"] = {"server_flags": args.itl_server_flags, **point}
            finally:
                server.stop()

        if not args.no_peer:
            # filled point by point, and the same dict is what ``progress`` keeps: a run stopped during the peer's
            # points saves those it measured
            result["peer"] = {}
            progress(result)
            _peer(ckpt, name, convs, args, device, dtype, result.get("best_rate"), out=result["peer"])
    return result


def _throughput(url: str, name: str, convs: list, args: argparse.Namespace) -> dict[str, Any]:
    """Every conversation at once over HTTP, streamed (as the rate points) and not: output tok/s, the median of
    ``--throughput-runs`` runs of each (taken in turn, so the host's drift meets both alike)."""
    points: dict[str, list[dict[str, Any]]] = {"stream": [], "no_stream": []}
    for _ in range(args.throughput_runs):
        for stream in (True, False):
            extra = {"ignore_eos": True, **({"stream_options": {"include_usage": True}} if stream else {})}
            points["stream" if stream else "no_stream"].append(run_load(
                url, name, convs, rate=math.inf, num_requests=len(convs), output_len=args.output_len, extra=extra,
                stream=stream, processes=args.client_processes))
    out = {}
    for key, runs in points.items():
        mid = sorted(runs, key=lambda p: p["output_tok_s"])[len(runs) // 2]
        out[key] = {"seconds": mid["wall_s"], "output_tok_s": mid["output_tok_s"], "requests_s": mid["requests_s"],
                    "failed": sum(p["failed"] for p in runs), "runs_tok_s": [p["output_tok_s"] for p in runs]}
    return out


def _peer(ckpt: Path, name: str, convs: list, args: argparse.Namespace, device: Any, dtype: Any,
          best: float | None, *, out: dict[str, Any]) -> dict[str, Any]:
    """transformers serve at rates from a tenth of hybridkv's best: up 2x while the points meet the target, down 4x
    while none has (its best rate found within the time the points take). Its figures go into ``out`` as they come
    (returned): its ``rates`` point by point, ``best_rate`` at the end (of the points that finished: a point whose
    load generators outlive their deadline ends the sweep, ``stopped`` saying where)."""
    log = Path(tempfile.gettempdir()) / f"serve_load_peer_{os.getpid()}.log"
    errors = []
    for continuous_batching in (True, False):      # (its continuous batching refuses some layer kinds: Mamba)
        try:
            peer = PeerServer(ckpt, device=device.type, dtype=str(dtype).removeprefix("torch."), log=log,
                              continuous_batching=continuous_batching)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            errors.append(str(err)[-500:])
            continue
        try:
            first = run_load(peer.url, name, convs[:2], rate=math.inf, num_requests=2, output_len=args.output_len)
        except BaseException:
            peer.stop()
            raise
        if not first["failed"]:
            break
        errors.append(f"continuous_batching={continuous_batching}: {first['errors']} ({log.read_text()[-300:]})")
        peer.stop()
    else:
        print(f"peer skipped: {errors}", flush=True)
        out["skipped"] = errors
        return out
    print(f"  transformers serve, continuous batching {'on' if continuous_batching else 'off'}", flush=True)
    try:
        start = (best or 1.0) / 10
        points: list[dict[str, Any]] = []
        out.update(rates=points, first_rate=start, continuous_batching=continuous_batching, refused=errors)
        rate = start
        # Its requests take seconds (hybridkv's tens of ms), longer under load: each point's arrivals span at least
        # three of the longest median latencies seen so far (the first two requests', then each point's), so that
        # ``kept_up`` sees it filled.
        def latency_of(p: dict[str, Any]) -> float:
            return (p["ttft_p50"] or 0.0) + (p["tpot_p50"] or 0.0) * (args.output_len - 1)

        latency = latency_of(first)
        for _ in range(args.peer_points):
            n = min(args.max_requests_per_rate, max(_points_per_rate(rate, args), math.ceil(3 * latency * rate)))
            try:
                point = run_load(peer.url, name, convs, rate=rate, num_requests=n, output_len=args.output_len,
                                 drain_timeout=args.peer_drain_timeout, processes=args.client_processes)
            except subprocess.TimeoutExpired as err:    # (its load generators outlived their deadline: it hung)
                out["stopped"] = f"at {rate:g} req/s: a load generator timed out after {err.timeout:.0f} s"
                print(f"  transformers serve stopped {out['stopped']}", flush=True)
                break
            latency = max(latency, latency_of(point))
            points.append(point)
            _print_point("transformers serve", "", point)
            passed = [_passes(p) for p in points]
            if all(passed):
                rate *= 2
            elif not any(passed):
                rate /= 4
            else:
                break
        ok = [p["rate"] for p in points if _passes(p)]
        out["best_rate"] = max(ok) if ok else None
        return out
    finally:
        peer.stop()


def _print_point(who: str, family: str, p: dict[str, Any]) -> None:
    fmt = lambda v, scale=1e3: "-" if v is None or not math.isfinite(v) else f"{scale * v:.1f}"  # noqa: E731
    print(f"  {who} {family} rate {p['rate']:.3g}/s x{p['requests']}: TTFT p50/p99 {fmt(p['ttft_p50'])}/"
          f"{fmt(p['ttft_p99'])} ms, TPOT {fmt(p['tpot_p50'])}/{fmt(p['tpot_p99'])} ms, ITL {fmt(p['itl_p50'])}/"
          f"{fmt(p['itl_p99'])} ms (the middle of the run: p99 {fmt(p.get('itl_p99_middle'))}), "
          f"{p['output_tok_s']:.0f} tok/s, failed {p['failed']}"
          + (f", kept up {p['kept_up']:.2f}" if p.get("kept_up") is not None else "")
          + (f" ({p['errors'][0]})" if p["errors"] else "")
          + (f"; engine: {p['engine']['steps']:.0f} steps, {fmt(p['engine']['mean_step_s'])} ms each, "
             f"{p['engine']['prompt_tokens_per_step']:.0f} prompt tokens per step, step p50/p99 "
             f"{fmt(p['engine'].get('step_p50'))}/{fmt(p['engine'].get('step_p99'))} ms, API-side ITL p50/p99 "
             f"{fmt(p['engine'].get('api_itl_p50'))}/{fmt(p['engine'].get('api_itl_p99'))} ms"
             if p.get("engine", {}).get("steps") else "")
          + (f"; {p['client_processes']} client processes, {100 * p['client_busy']:.0f}% busy"
             if "client_busy" in p else ""), flush=True)


def _done_rate(peer: dict[str, Any], rate: float) -> float:
    """Requests the peer completed per second of its point at ``rate`` (arrivals through the last completion): a server
    that admits every request at once keeps its TTFT low while each token slows down, and this shows its pace."""
    return next(p["requests_s"] for p in peer["rates"] if p["rate"] == rate)


def summary_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        http, offline = r["http"]["stream"]["output_tok_s"], r["offline"]["output_tok_s"]
        plain = r["http"]["no_stream"]["output_tok_s"]
        best = r.get("best_rate")
        peer = r.get("peer", {})
        peer_best = peer.get("best_rate")
        if best is None:
            rate_ratio = "-"
        elif peer_best:
            rate_ratio = f"{best / peer_best:.1f}x"
        elif peer.get("rates"):    # the peer missed the target even at a tenth of hybridkv's best (and below)
            rate_ratio = f">{best / min(p['rate'] for p in peer['rates']):.0f}x"
        else:
            rate_ratio = "-"
        itl = r.get("itl_p99_at_half")
        shares = "/".join("-" if r.get(k) is None else f"{1e3 * r[k]:.2f}"
                          for k in ("api_itl_p99_at_half", "engine_step_p99_at_half"))
        variant = r.get("half_rate_variant") or {}
        step = r["decode_step_b32_s"]
        single = r.get("http_by_api_servers", {}).get("1")
        rows.append([r["family"], f"{offline:.0f}",
                     "-" if single is None else f"{single['stream']['output_tok_s']:.0f} / "
                     f"{single['no_stream']['output_tok_s']:.0f}",
                     f"{r.get('api_servers', 1)}: {http:.0f} / {plain:.0f}",
                     f"{100 * http / offline:.1f}% / {100 * plain / offline:.1f}%",
                     "-" if best is None else f"{'>=' if r.get('best_rate_is_lower_bound') else ''}{best:.2f}",
                     "-" if peer_best is None else f"{peer_best:.3f} ({_done_rate(peer, peer_best):.1f} done/s)",
                     rate_ratio,
                     "-" if itl is None else f"{1e3 * itl:.2f}" + (
                         "" if r.get("itl_p99_at_half_middle") is None
                         else f" (middle {1e3 * r['itl_p99_at_half_middle']:.2f})"), shares,
                     "-" if variant.get("itl_p99") is None
                     else f"{1e3 * variant['itl_p99']:.2f} ({variant['server_flags']})",
                     f"{1e3 * step:.2f}", "-" if itl is None else f"{itl / step:.2f}x"])
    return rows


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        client_main(sys.argv[2])
        return
    import torch

    sys.path.insert(0, str(HERE))
    from _results import add_output_args, commit, write_json
    from gpu_attention import print_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="gemma3,nemotronh")
    ap.add_argument("--num-prompts", type=int, default=1024,
                    help="conversations (default 1024: all at once they take ~2 s on an H200; 256 took ~0.5 s, and "
                         "the HTTP/offline ratio of such short runs moved from 66%% to 128%% between calls)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rates", default="auto", help="requests/s, comma-separated (auto: 0.5, 0.8, 1.0, 1.25 x the "
                    "offline capacity)")
    ap.add_argument("--seconds-per-rate", type=float, default=6.0, help="seconds of arrivals per rate point")
    ap.add_argument("--extra-rate-points", type=int, default=2,
                    help="with --rates auto: while the highest rate still meets the target, up to this many more "
                    "at 1.25x each (default 2), so the best rate is measured rather than bounded")
    ap.add_argument("--api-server-counts", default="1,4",
                    help="hybridkv serve --api-server-count values, comma-separated: each gets the all-at-once "
                    "throughput runs; the last also gets the rate points (default 1,4)")
    ap.add_argument("--server-flags", default="",
                    help="more hybridkv serve flags for every hybridkv server of the run, as one string (e.g. "
                    "\"--engine-cpu off\")")
    ap.add_argument("--itl-server-flags", default="--prefill-spread 1",
                    help="also run the half-rate point on a server started with these extra flags (default: "
                    "--prefill-spread 1; empty: skip)")
    ap.add_argument("--max-requests-per-rate", type=int, default=2048,
                    help="at most this many requests per rate point (the conversations are reused in turn)")
    ap.add_argument("--peer-points", type=int, default=3, help="rate points for transformers serve (default 3)")
    ap.add_argument("--peer-drain-timeout", type=float, default=60.0,
                    help="seconds a peer rate point waits for its requests after the last arrival (unfinished ones "
                    "count as failed: past the TTFT target anyway; default 60)")
    ap.add_argument("--client-processes", type=int, default=4,
                    help="load generator processes per point, each sending its share of one Poisson schedule "
                    "(default 4: one would be half busy at a few hundred requests a second, its own queueing "
                    "in the inter-token gaps it measures)")
    ap.add_argument("--throughput-runs", type=int, default=3,
                    help="timed runs of the all-at-once throughput (offline, HTTP streamed and not), each under a "
                    "second: their median is reported (default 3)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers serve")
    ap.add_argument("--kv-memory", default="24GiB")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke test of this script")
    add_output_args(ap, "serve_load")
    args = ap.parse_args()
    args.api_server_counts = [int(c) for c in args.api_server_counts.split(",")]
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.rate_fractions = (0.5, 0.8, 1.0, 1.25)
    if args.tiny:
        args.num_prompts, args.input_len, args.output_len = min(args.num_prompts, 24), min(args.input_len, 24), \
            min(args.output_len, 8)
        args.kv_memory, args.max_num_seqs, args.seconds_per_rate = "64MiB", 32, min(args.seconds_per_rate, 2.0)
        args.max_requests_per_rate = min(args.max_requests_per_rate, 24)
        args.rate_fractions, args.peer_points = (0.5, 1.0), min(args.peer_points, 2)
        args.extra_rate_points = min(args.extra_rate_points, 1)
    started = time.perf_counter()
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "commit": commit(),
            "command": " ".join(sys.argv), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "ttft_slo_s": TTFT_SLO}
    with contextlib.suppress(ImportError):
        import transformers

        meta["transformers"] = transformers.__version__
    results: list[dict[str, Any]] = []
    current: dict[str, Any] = {}            # the family being measured, as far as it got

    def save(note: str | None = None) -> None:
        """The file as it stands; ``note``: why it is incomplete (a run stopped keeps what it measured)."""
        meta["seconds"] = time.perf_counter() - started
        write_json(args, "serve_load", {"meta": {**meta, **({"incomplete": note} if note else {})},
                                        "results": [*results, *([current] if current else [])]})

    def before_peer(result: dict[str, Any]) -> None:
        current.update(result)
        save(f"{result['family']}: stopped before its peer's points")

    def on_term(signum: int, frame: object) -> None:
        # SIGTERM (``timeout``, a supervisor) unwinds like Ctrl-C: the servers' ``finally`` blocks stop them, so no
        # ``transformers serve`` is left working through its requests beside the next run; a second one waits
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    for family in args.families.split(","):
        try:
            results.append(bench_family(family, args, device, dtype, progress=before_peer))
        except BaseException:
            if current:                     # (hybridkv's figures are in: keep them, and what came before)
                save(f"{family}: stopped during its peer's points")
            elif results:
                save(f"stopped while measuring {family}")
            raise
        current.clear()
    save()
    print_table(f"serve_load on {meta['device']} ({meta['commit']}; {args.num_prompts} prompts of ~{args.input_len} "
                f"tokens, {args.output_len} new; {meta['seconds']:.0f} s)",
                ["model", "offline tok/s", "1 API process: HTTP tok/s streamed / not",
                 "API processes: HTTP tok/s streamed / not", "HTTP/offline (>=90%)", "best rate, p99 TTFT<=2s",
                 "peer best rate", "ratio (>=10x)", "p99 ITL at half, ms", "... API side / engine step, ms",
                 "same, server variant", "b32 step, ms", "ITL/step (<=2x)"],
                summary_rows(results))


if __name__ == "__main__":
    main()
