"""``hybridkv serve --api-server-count 2``: two API processes over one engine process, on one port.

Concurrent clients (completions, streamed or not, and chat) get the offline API's greedy outputs whichever API
process takes their connection; ``/metrics`` from any process adds up both processes' request counters; a client
that disconnects mid-stream frees its request; SIGTERM lets a running request finish and every process exits; an
API process that dies stops the whole server (exit 1, no process left); a checkpoint that cannot load is the
CLI's one-line error. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hybridkv.engine.affinity import thread_cpus
from tests._server import ROOT, ServerProcess, free_port, offline_llm, tiny_checkpoint
from tests.test_server import GREEDY, MESSAGES, PROMPTS, TIMEOUT, engine_idle, wait_for

MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def offline(checkpoint: Path):
    return offline_llm(checkpoint)


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _gone(pids: set[int]) -> bool:
    return not any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1]
                   .split()[0] for p in pids)


def _off_the_step_loops_cpu(server: int, processes: set[int], cpu: int) -> None:
    """The engine process's main thread runs on ``cpu`` alone; every other thread of the server keeps off it."""
    for pid in {server, *processes}:
        engine = b"hybridkv.engine.core" in Path(f"/proc/{pid}/cmdline").read_bytes()
        for tid, cpus in thread_cpus(pid).items():
            assert (cpus == {cpu}) if engine and tid == pid else (cpu not in cpus), (pid, tid, cpus)


@pytest.mark.slow
def test_two_api_processes_serve_one_engine(checkpoint: Path, offline, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = ["--engine-cpu", str(cpus[-1])] if len(cpus) >= 2 else []
    with ServerProcess(checkpoint, tmp_path / "server.log", "--served-model-name", MODEL, "--api-server-count", "2",
                       "--disable-access-log", *pin) as server:
        wait_for(lambda: len(_descendants(server.proc.pid)) >= 3, "the engine and both API processes")
        children = _descendants(server.proc.pid)
        if pin:
            _off_the_step_loops_cpu(server.proc.pid, children, cpus[-1])
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(48)]
        want = [o.outputs[0].text for o in offline.generate(prompts, GREEDY, use_tqdm=False)]
        chat_want = offline.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].text

        async def one(i: int) -> bool:
            # a client (a connection) per request, so that both API processes take some
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                          timeout=TIMEOUT) as client:
                if i % 4 == 3:
                    got = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                               temperature=0)
                    return got.choices[0].message.content == chat_want
                if i % 2:
                    stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8,
                                                             temperature=0, stream=True)
                    return "".join([c.choices[0].text async for c in stream if c.choices]) == want[i]
                got = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0)
                return got.choices[0].text == want[i]

        async def main() -> list[bool]:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(48))), TIMEOUT)

        assert all(asyncio.run(main()))
        wait_for(lambda: engine_idle(server), "an idle engine")
        for _ in range(6):              # (each scrape a new connection: either process answers with the sum)
            assert sum(v for k, v in server.metrics().items() if k.startswith("hybridkv:request_success_total")) == 48

        # a client that disconnects mid-stream frees its request
        body = {"prompt": "The lazy fox", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", f"{server.url}/v1/completions",
                                                                json=body) as response:
            for events, line in enumerate(line for line in response.iter_lines() if line.startswith("data:")):
                assert json.loads(line[5:])["choices"]
                if events == 2:
                    break
        wait_for(lambda: engine_idle(server), "the disconnected request to be aborted")

        # SIGTERM: a running request finishes, then every process exits
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        stream = iter(client.completions.create(model=MODEL, prompt="The lazy fox", max_tokens=60, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        next(stream)
        server.proc.send_signal(signal.SIGTERM)
        assert list(stream)[-1].usage.completion_tokens == 60
        assert server.proc.wait(60) == 0, server.log_text()
        wait_for(lambda: _gone(children), "the engine and API processes to exit")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs")
def test_one_api_process_keeps_off_the_step_loops_cpu(checkpoint: Path, offline, tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    with ServerProcess(checkpoint, tmp_path / "server.log", "--served-model-name", MODEL, "--engine-cpu",
                       str(cpu)) as server:
        _off_the_step_loops_cpu(server.proc.pid, _descendants(server.proc.pid), cpu)
        want = offline.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
        got = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT).completions \
            .create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert got.choices[0].text == want


@pytest.mark.slow
def test_an_api_process_that_dies_stops_the_server(checkpoint: Path, tmp_path: Path) -> None:
    with ServerProcess(checkpoint, tmp_path / "server.log", "--api-server-count", "2") as server:
        wait_for(lambda: len(_descendants(server.proc.pid)) >= 3, "the engine and both API processes")
        children = _descendants(server.proc.pid)
        api = [p for p in children if "api_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(api) == 2
        os.kill(api[0], signal.SIGKILL)
        assert server.proc.wait(60) == 1
        assert "API process 0 exited" in server.log_text() or "API process 1 exited" in server.log_text()
        wait_for(lambda: _gone(children), "the engine and the other API process to exit")


@pytest.mark.slow
def test_a_checkpoint_that_cannot_load_is_a_one_line_error(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", str(tmp_path), "--device", "cpu",
                           "--port", str(free_port()), "--api-server-count", "3"], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridkv serve: error:") and "not a checkpoint directory" in last, done.stderr
    assert time.monotonic() - start < 60
    assert not list(Path(tmp_path).iterdir())
