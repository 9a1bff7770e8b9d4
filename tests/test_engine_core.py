"""The engine in its own process (``engine/core.py``, ``engine/core_client.py``), as ``hybridkv serve`` runs it.

Through ``EngineCoreClient`` in this process: greedy and seeded outputs, streamed or not, equal the offline
API's on the same checkpoint; an abort frees the request's blocks in the engine process (seen in a snapshot);
the API-side checks (``EngineLimits``) refuse what the engine refuses, with its messages; traffic far larger
than the socket buffers flows (sends block, nothing deadlocks). A checkpoint that
cannot load is a clear start-up error (and one line from ``hybridkv serve``). A server whose engine process is
killed answers 503, fails ``/health`` and ends the streams it was serving; nothing hangs; SIGTERM to the whole
process group (a supervisor's) drains as SIGTERM to the server does. The app also serves
the Python API's in-process ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from hybridkv import SamplingParams
from hybridkv.engine import core_client
from hybridkv.engine.affinity import thread_cpus
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.core_client import EngineCoreClient, EngineStartError
from hybridkv.engine.engine import RequestError
from hybridkv.engine.front import EngineDeadError
from tests._server import ENGINE_ARGS, ROOT, ServerProcess, free_port, offline_llm, tiny_checkpoint

TIMEOUT = 60.0
PROMPTS = ["The lazy fox", "Hybrid models mix", "def add(a, b):", "1234 blocks"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
CONFIG = EngineConfig(device="cpu", kv_cache_memory="16MiB", max_num_seqs=16, max_num_batched_tokens=128)
"""``offline_llm``'s engine."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def offline(checkpoint: Path):
    return offline_llm(checkpoint)


@pytest.fixture(scope="module")
def client(checkpoint: Path):
    engine = EngineCoreClient(checkpoint, CONFIG)
    yield engine
    engine.shutdown(timeout=TIMEOUT)
    assert engine.process.returncode == 0


def run(coro, timeout: float = TIMEOUT):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(engine: EngineCoreClient, prompt, params: SamplingParams, stream: bool):
    """(token ids, text) per sample: the deltas joined, or the one final output."""
    ids: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    async for out in engine.submit(prompt, params, stream=stream):
        assert out.error is None, out.error
        for c in out.outputs:
            ids.setdefault(c.index, []).extend(c.token_ids)
            text[c.index] = text.get(c.index, "") + (c.text or "")
    return [(ids[i], text[i]) for i in sorted(ids)]


def test_outputs_equal_the_offline_api(client: EngineCoreClient, offline) -> None:
    seeded = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=7, max_tokens=6)
    stopped = SamplingParams(temperature=0.0, max_tokens=12, stop=[" "], include_stop_str_in_output=True)
    cases = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[0], seeded), (PROMPTS[1], stopped)]
    want = [[(list(c.token_ids), c.text) for c in offline.generate([p], params, use_tqdm=False)[0].outputs]
            for p, params in cases]

    async def main() -> list:
        jobs = [collect(client, p, params, stream) for stream in (False, True) for p, params in cases]
        return await asyncio.gather(*jobs)

    got = run(main())
    assert got == want + want
    # token-id prompts, and the prompt ids and text an output carries
    ids = offline.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]

    async def by_ids():
        return await client.submit({"prompt_token_ids": list(ids.prompt_token_ids)}, GREEDY, stream=False).result()

    out = run(by_ids())
    assert out.outputs[0].token_ids == ids.outputs[0].token_ids and out.prompt_token_ids == ids.prompt_token_ids


def test_an_abort_frees_the_request_in_the_engine_process(client: EngineCoreClient) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)

    async def main() -> None:
        stream = client.submit(PROMPTS[0], long)
        for _ in range(3):
            await anext(stream)
        snap = await client.snapshot()
        assert snap.running == 1 and any(snap.kv_usage.values())
        stream.abort()
        while True:
            snap = await client.snapshot()
            if snap.running == 0 and snap.waiting == 0 and not any(snap.kv_usage.values()):
                return
            await asyncio.sleep(0.05)

    run(main())


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs")
def test_the_step_loop_runs_alone_on_its_cpu(client: EngineCoreClient, checkpoint: Path, offline) -> None:
    assert client.engine_cpu is None                    # off by default outside the CLI
    cpu = max(os.sched_getaffinity(0))
    engine = EngineCoreClient(checkpoint, CONFIG, engine_cpu=cpu)
    try:
        assert engine.engine_cpu == cpu
        pid = engine.process.pid
        threads = thread_cpus(pid)
        assert threads.pop(pid) == {cpu}                  # the main thread: the step loop
        assert threads and all(cpu not in cpus for cpus in threads.values())    # readers, torch's, ...
        want = offline.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert run(collect(engine, PROMPTS[0], GREEDY, stream=True))[0][0] == list(want)
        later = thread_cpus(pid)                         # (and no thread started while serving shares it)
        assert later.pop(pid) == {cpu}
        assert all(cpu not in cpus for cpus in later.values()), later
    finally:
        engine.shutdown(timeout=TIMEOUT)
    auto = EngineCoreClient(checkpoint, CONFIG, engine_cpu="auto")
    try:
        assert auto.engine_cpu is None                    # auto: a CPU engine is not pinned
    finally:
        auto.shutdown(timeout=TIMEOUT)
    with pytest.raises(ValueError, match="engine_cpu must be"):
        EngineCoreClient(checkpoint, CONFIG, engine_cpu="on")
    with pytest.raises(EngineStartError, match="engine_cpu 100000: not one of the CPUs this process may use"):
        EngineCoreClient(checkpoint, CONFIG, engine_cpu=100000)


def test_the_api_side_checks_are_the_engines(client: EngineCoreClient, offline) -> None:
    limits = client.limits
    assert limits == offline.engine.limits
    assert client.max_model_len == offline.max_model_len and client.vocab_size == offline.engine.vocab_size
    ok = [5, 6, 7]
    cases = [([], GREEDY), ([1.5], GREEDY), ([-1], GREEDY), ([300], GREEDY), ([7] * 5000, GREEDY),
             (ok, replace(GREEDY, stop_token_ids=(400,))), (ok, replace(GREEDY, logit_bias={999: 1.0})),
             (ok, replace(GREEDY, logprobs=limits.max_logprobs + 1)),
             (ok, replace(GREEDY, prompt_logprobs=limits.max_logprobs + 1)), (ok, replace(GREEDY, n=2))]
    for ids, params in cases:
        with pytest.raises(RequestError) as theirs:
            offline.engine.validate_prompt(ids, params)
        with pytest.raises(RequestError) as ours:
            limits.check_request(ids, params)
        assert str(ours.value) == str(theirs.value)
    limits.check_request(ok, GREEDY)
    # the capacity bound: the longest request whose blocks fit, and no longer
    fits = limits.max_request_tokens
    coordinator = offline.engine.coordinator
    assert coordinator.blocks_to_admit(fits) <= offline.engine._capacity_blocks
    if fits < limits.max_model_len:
        assert coordinator.blocks_to_admit(fits + 1) > offline.engine._capacity_blocks


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_a_checkpoint_that_cannot_load_is_a_clear_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(EngineStartError, match="could not start: FileNotFoundError: .*not a checkpoint directory"):
        EngineCoreClient(tmp_path, CONFIG)
    done = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", str(tmp_path), "--device", "cpu",
                           "--port", "1"], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridkv serve: error:") and "not a checkpoint directory" in last, done.stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_a_server_whose_engine_process_dies_answers_503(checkpoint: Path, tmp_path: Path) -> None:
    with ServerProcess(checkpoint, tmp_path / "server.log", "--served-model-name", "tiny") as server:
        (core,) = _children(server.proc.pid)
        body = {"prompt": "The lazy fox", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", f"{server.url}/v1/completions",
                                                                json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(core, signal.SIGKILL)
            rest = list(lines)                 # the stream ends (with an error event), not hangs
        assert any('"code":500' in line and "engine process died" in line for line in rest), rest[-3:]
        deadline = time.monotonic() + TIMEOUT
        while (health := httpx.get(f"{server.url}/health", timeout=TIMEOUT)).status_code == 200:
            assert time.monotonic() < deadline, "/health kept answering 200"
            time.sleep(0.05)
        assert health.status_code == 503 and "engine process died" in health.json()["error"]["message"]
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=TIMEOUT)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).status_code == 200
        assert server.stop() == 0, server.log_text()


def test_a_dead_engine_process_fails_submissions_and_snapshots(checkpoint: Path) -> None:
    engine = EngineCoreClient(checkpoint, CONFIG)
    try:
        async def main() -> None:
            stream = engine.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True))
            await anext(stream)
            engine.process.kill()
            outs = [out async for out in stream]
            assert outs[-1].finished and "engine process died" in outs[-1].error
            with pytest.raises(EngineDeadError):
                engine.submit(PROMPTS[0], GREEDY)
            with pytest.raises(EngineDeadError):
                await engine.snapshot()

        run(main())
        assert "engine process died" in engine.dead
    finally:
        engine.shutdown(timeout=TIMEOUT)


@pytest.mark.slow    # seconds of traffic through tiny socket buffers: the full suite runs it
def test_a_burst_larger_than_the_socket_buffers(checkpoint: Path, offline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Socket buffers far smaller than the traffic (a burst of long prompts one way, every step's outputs the
    other), so sends block until the other side reads: every request still finishes with the offline API's
    tokens."""
    monkeypatch.setattr(core_client, "SOCKET_BUFFER_BYTES", 4096)          # (the kernel's smallest, about)
    engine = EngineCoreClient(checkpoint, CONFIG)
    try:
        prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 300, 600)] for i in range(48)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        want = [list(o.outputs[0].token_ids) for o in offline.generate(prompts, params, use_tqdm=False)]

        async def main() -> list:
            return await asyncio.gather(*(collect(engine, {"prompt_token_ids": p}, params, stream=True)
                                          for p in prompts))

        # (a hang detector: 9 s alone on a 2-core VM, but ~190 s when a second run competes for the cores; every
        # message crosses 4 KB buffers in many thread hand-offs)
        got = run(main(), timeout=300.0)
        assert [g[0][0] for g in got] == want
    finally:
        engine.shutdown(timeout=TIMEOUT)


def test_the_app_over_an_in_process_engine_thread(offline) -> None:
    """The app also serves an ``AsyncLLM`` (the Python API's engine thread): the same outputs and routes."""
    from fastapi.testclient import TestClient

    from hybridkv.engine.async_llm import AsyncLLM
    from hybridkv.server.app import ServerSettings, build_app

    engine = AsyncLLM(offline)
    try:
        app = build_app(engine, ServerSettings(served_model_names=("tiny",), model_root="tiny", stats_interval=0))
        want = offline.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
        with TestClient(app) as http:
            assert http.get("/health").status_code == 200
            body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
            assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
            events = [line for line in http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
                      if line.startswith("data: {")]
            assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events) == want
            assert http.post("/v1/completions", json={"prompt": [7] * 5000}).status_code == 400
            assert "hybridkv:num_requests_running" in http.get("/metrics").text
    finally:
        engine.shutdown(timeout=TIMEOUT)


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_sigterm_to_the_whole_process_group_drains(checkpoint: Path, tmp_path: Path) -> None:
    """A supervisor's SIGTERM reaches the engine process too: it leaves it to the server, which lets the running
    request finish, stops the engine process and exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", str(checkpoint), "--port", str(port),
                                 *ENGINE_ARGS], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        (core,) = _children(proc.pid)
        body = {"prompt": "The lazy fox", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            os.killpg(proc.pid, signal.SIGTERM)
            events = [json.loads(line[5:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 60
        assert proc.wait(TIMEOUT) == 0
        assert not Path(f"/proc/{core}").exists() or "Z" in Path(f"/proc/{core}/stat").read_text().split()[2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
