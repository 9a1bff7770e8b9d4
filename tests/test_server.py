"""``hybridkv serve`` end to end: a real server process on 127.0.0.1 with a tiny checkpoint that ships a
``tokenizer.json`` and a chat template, driven by the official ``openai`` client (and httpx for raw HTTP).

Completions and chat completions, streamed or not, give the offline API's outputs on the same checkpoint
(greedy and seeded sampling); 64 concurrent clients each get theirs; a client that disconnects mid-stream
or while waiting frees its request (seen in ``/metrics``); every error case is an OpenAI-shaped error with
its status and the server keeps serving; SIGTERM lets a running request finish, then the process exits 0;
a 2000-request soak leaves no request, block or slot held and bounded memory. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from hybridkv import SamplingParams
from tests._server import ServerProcess, offline_llm, tiny_checkpoint
from tests.test_tokenizers import MESSAGES

MODEL = "tiny"
PROMPTS = ["The lazy fox", "Hybrid models mix", "def add(a, b):", "1234 blocks", "Sphinx of black quartz",
           "A paged KV cache stores keys"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess(checkpoint, log, "--served-model-name", MODEL, "other-name", "--stats-interval", "1") as s:
        yield s
        assert s.stop() == 0, s.log_text()


@pytest.fixture(scope="module")
def offline(checkpoint: Path):
    return offline_llm(checkpoint)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def offline_text(offline, prompt: str, params: SamplingParams = GREEDY) -> str:
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def engine_idle(server: ServerProcess) -> bool:
    m = server.metrics()
    usage = [v for k, v in m.items() if k.startswith("hybridkv:kv_cache_usage_perc")]
    return (m["hybridkv:num_requests_running"] == 0 and m["hybridkv:num_requests_waiting"] == 0 and usage
            and not any(usage))


# -- the routes ------------------------------------------------------------------------------------------
def test_models_health_version_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/version", timeout=10).json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "other-name"]
    assert models.data[0].max_model_len == 4096
    m = server.metrics()
    for name in ("hybridkv:num_requests_running", "hybridkv:num_requests_waiting", "hybridkv:num_preemptions_total"):
        assert name in m
    groups = {k for k in m if k.startswith("hybridkv:kv_cache_usage_perc")}
    assert len(groups) == 3 and any('kind="mamba"' in g for g in groups)
    assert any(k.startswith("hybridkv:prefix_cache_hits_total") for k in m)
    steps = sorted((float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items()
                   if k.startswith("hybridkv:engine_step_seconds_bucket"))
    counts = [v for _, v in steps]              # cumulative, the last (+Inf) the count
    assert steps[-1][0] == float("inf") and counts == sorted(counts)
    assert counts[-1] == m["hybridkv:engine_step_seconds_count"] and "hybridkv:engine_step_seconds_sum" in m


def test_completions_equal_the_offline_api(server: ServerProcess, client: openai.OpenAI, offline) -> None:
    want = {p: offline_text(offline, p) for p in PROMPTS}
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert one.choices[0].text == want[PROMPTS[0]] and one.model == MODEL
    ids = offline.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert one.usage.prompt_tokens == len(ids.prompt_token_ids)
    assert one.usage.completion_tokens == len(ids.outputs[0].token_ids)
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [want[p] for p in PROMPTS]
    # token ids, one list or several; return_token_ids (vLLM's extra field) gives the ids back
    by_ids = client.completions.create(model=MODEL, prompt=[list(ids.prompt_token_ids)] * 2, max_tokens=8,
                                       temperature=0, extra_body={"return_token_ids": True})
    for c in by_ids.choices:
        assert c.text == want[PROMPTS[0]] and c.model_extra["token_ids"] == list(ids.outputs[0].token_ids)
    flat = client.completions.create(model=MODEL, prompt=list(ids.prompt_token_ids), max_tokens=8, temperature=0)
    assert flat.choices[0].text == want[PROMPTS[0]]
    # streamed: the deltas join to the same text; usage at the end
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[PROMPTS[1]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_chat_equals_the_offline_api(server: ServerProcess, client: openai.OpenAI, offline) -> None:
    want = offline.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == want.outputs[0].text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    assert list(want.prompt_token_ids).count(0) == 1          # BOS exactly once
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": MESSAGES},
                           timeout=TIMEOUT).json()
    assert tokenized["tokens"] == list(want.prompt_token_ids) and tokenized["max_model_len"] == 4096


def test_sampling_fields_match_the_offline_api(server: ServerProcess, client: openai.OpenAI, offline) -> None:
    prompt = PROMPTS[2]
    # seeded sampling, n samples: the offline API's samples, in order
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=6)
    want = [c.text for c in offline.generate([prompt], params, use_tqdm=False)[0].outputs]
    got = client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=0.9, top_p=0.95, seed=11,
                                    max_tokens=6)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=3, temperature=0.9, top_p=0.95, seed=11,
                                           max_tokens=6, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == want
    # vLLM's extra fields
    extra = dict(top_k=5, min_p=0.01, repetition_penalty=1.3, min_tokens=4, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=7, presence_penalty=0.5, frequency_penalty=0.3,
                            logit_bias={5: 3.0}, **extra)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, presence_penalty=0.5,
                                    frequency_penalty=0.3, logit_bias={"5": 3.0}, extra_body=extra)
    assert got.choices[0].text == offline_text(offline, prompt, params)
    # logprobs: the sampled token's and the top k, as the offline API computes them
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2).choices[0]
    assert got.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
    assert all(1 <= len(top) <= 3 for top in got.logprobs.top_logprobs)      # (keyed by text: ids may share one)
    assert "".join(got.logprobs.tokens) == got.text
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
    got = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                           "prompt_logprobs": 1}, timeout=TIMEOUT).json()
    got = got["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g[str(w.token_id)]["logprob"] == pytest.approx(w.logprob, abs=1e-5) and 1 <= len(g) <= 2
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3).choices[0]
    assert len(chat.logprobs.content) == 4 and all(len(t.top_logprobs) == 3 for t in chat.logprobs.content)
    # a stop string: the text ends before it
    full = offline_text(offline, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stop = full[3:5]
    if stop.strip():
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
        assert got.text == full[:full.index(stop)] and got.finish_reason == "stop"
        assert got.model_extra["stop_reason"] == stop
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop], stream=True,
            extra_body={"ignore_eos": True}))
        assert text == got.text


def test_tokenize_and_detokenize(server: ServerProcess, offline) -> None:
    ids = offline.tokenizer.encode(PROMPTS[0])
    got = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True},
                     timeout=TIMEOUT).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and len(got["token_strs"]) == len(ids)
    assert ids.count(0) == 1                                   # the BOS token
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids[1:]}, timeout=TIMEOUT).json()
    assert back["prompt"] == PROMPTS[0]


# -- errors ----------------------------------------------------------------------------------------------
def error_of(response: httpx.Response, status: int, param: str | None = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param != "":
        assert error["param"] == param, error
    return error


def test_errors_are_openai_shaped(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    post = lambda body: httpx.post(url, json=body, timeout=TIMEOUT)  # noqa: E731
    bad_json = httpx.post(url, content=b'{"prompt": "x", ', headers={"content-type": "application/json"},
                          timeout=TIMEOUT)
    assert error_of(bad_json, 400)["type"] == "BadRequestError"
    error_of(post({"model": MODEL}), 400, "prompt")
    error_of(post({"prompt": "x", "temperature": -1}), 400, "temperature")
    error_of(post({"prompt": "x", "n": "many"}), 400, "n")
    error_of(post({"prompt": "x", "top_p": 2}), 400, "top_p")
    error_of(post({"prompt": "x", "logprobs": 50}), 400)
    error_of(post({"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias")
    error_of(post({"prompt": [7] * 5000}), 400, "prompt")                         # longer than the model allows
    long = error_of(post({"prompt": "x", "max_tokens": 5000}), 400, "max_tokens")
    assert "maximum context length is 4096" in long["message"]
    error_of(post({"prompt": "x", "stream_options": {"include_usage": True}}), 400, "stream_options")
    error_of(post({"prompt": "x", "suffix": "y"}), 400, "suffix")
    error_of(post({"prompt": "x", "prompt_logprobs": 1, "stream": True}), 400, "prompt_logprobs")
    error_of(post({"prompt": [[]]}), 400)
    assert error_of(post({"model": "nope", "prompt": "x"}), 404, "model")["type"] == "NotFoundError"
    chat = f"{server.url}/v1/chat/completions"
    error_of(httpx.post(chat, json={"messages": []}, timeout=TIMEOUT), 400, "messages")
    error_of(httpx.post(chat, json={"messages": [{"content": "no role"}]}, timeout=TIMEOUT), 400, "messages")
    error_of(httpx.post(chat, json={"messages": MESSAGES, "tools": [{"type": "function"}]}, timeout=TIMEOUT), 400,
             "tool_choice")
    error_of(httpx.post(chat, json={"messages": MESSAGES, "top_logprobs": 2}, timeout=TIMEOUT), 400, "top_logprobs")
    error_of(httpx.get(f"{server.url}/v1/nothing", timeout=TIMEOUT), 404)
    error_of(httpx.post(f"{server.url}/detokenize", json={"tokens": [10**6]}, timeout=TIMEOUT), 400, "tokens")
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).completions.create(
            model="nope", prompt="x")
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200       # still serving
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=TIMEOUT).status_code == 200


@pytest.mark.slow          # ~7 s: a server process of its own, a queue filled and drained
def test_api_key_and_the_waiting_queue_bound(checkpoint: Path, tmp_path: Path) -> None:
    with ServerProcess(checkpoint, tmp_path / "server.log", "--api-key", "secret", "--max-waiting", "1",
                       "--max-num-seqs", "1", "--served-model-name", MODEL) as server:
        models = f"{server.url}/v1/models"
        assert error_of(httpx.get(models, timeout=TIMEOUT), 401)["type"] == "AuthenticationError"
        error_of(httpx.get(models, headers={"Authorization": "Bearer wrong"}, timeout=TIMEOUT), 401)
        key = {"Authorization": "Bearer secret"}
        assert httpx.get(models, headers=key, timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", max_retries=0, timeout=TIMEOUT)
        # one request runs (max_num_seqs 1), one waits (max_waiting 1), the next is refused with Retry-After
        running = client.completions.create(model=MODEL, prompt="The lazy fox", max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        next(iter(running))
        waiting: list = []
        thread = threading.Thread(target=lambda: waiting.append(client.completions.create(
            model=MODEL, prompt="Hybrid", max_tokens=2, temperature=0)), daemon=True)
        thread.start()
        wait_for(lambda: server.metrics()["hybridkv:num_requests_waiting"] == 1, "a waiting request")
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=key,
                             timeout=TIMEOUT)
        assert error_of(refused, 429)["type"] == "RateLimitError"
        assert int(refused.headers["retry-after"]) >= 1
        running.close()                                  # the client leaves: the waiting request runs
        thread.join(TIMEOUT)
        assert waiting and waiting[0].choices[0].finish_reason in ("stop", "length")
        wait_for(lambda: engine_idle(server), "an idle engine")
        assert server.stop() == 0


# -- many clients, clients that leave ----------------------------------------------------------------------
def test_64_concurrent_clients(server: ServerProcess, offline) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    want = [o.outputs[0].text for o in offline.generate(prompts, GREEDY, use_tqdm=False)]
    chat_want = offline.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].text

    async def one(client: openai.AsyncOpenAI, i: int) -> bool:
        if i % 4 == 3:
            got = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
            return got.choices[0].message.content == chat_want
        if i % 2:
            stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices]) == want[i]
        got = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8, temperature=0)
        return got.choices[0].text == want[i]

    async def main() -> list[bool]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=TIMEOUT) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), TIMEOUT)

    assert all(asyncio.run(main()))
    wait_for(lambda: engine_idle(server), "an idle engine")


def test_a_client_that_disconnects_frees_its_request(server: ServerProcess) -> None:
    aborted = lambda: server.metrics().get('hybridkv:request_aborted_total{model_name="tiny"}', 0)  # noqa: E731
    before = aborted()
    body = {"prompt": "The lazy fox", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", f"{server.url}/v1/completions",
                                                            json=body) as response:
        events = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                assert json.loads(line[5:])["choices"]
                events += 1
            if events == 3:           # (still reading: leaving the loop closes the stream)
                assert server.metrics()["hybridkv:num_requests_running"] == 1
                break
    # (leaving the block closed the connection mid-stream)
    wait_for(lambda: engine_idle(server) and aborted() == before + 1, "the request to be aborted")
    # not streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_for(lambda: engine_idle(server) and aborted() == before + 2, "the request to be aborted")


def test_the_stats_line_is_logged(server: ServerProcess) -> None:
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=TIMEOUT)
    wait_for(lambda: "Avg generation throughput" in server.log.read_text(), "a stats line", timeout=10)


def test_the_event_loop_and_http_parser_are_chosen_and_logged(server: ServerProcess, monkeypatch) -> None:
    """uvloop and httptools where they import (the server extra installs both), asyncio and h11 otherwise; the
    server logs which it runs on."""
    import importlib

    from hybridkv.server.cli import event_loop_impls

    loop, http = event_loop_impls()
    assert f"uvicorn with the {loop} event loop and the {http} parser" in server.log.read_text()
    real = importlib.import_module

    def without(missing: set[str]):
        def import_module(name: str, *args: object):
            if name in missing:
                raise ImportError(f"no module named {name!r}")
            return real(name, *args)
        return import_module

    for missing, want in [({"uvloop"}, ("asyncio", http)), ({"httptools"}, (loop, "h11")),
                          ({"uvloop", "httptools"}, ("asyncio", "h11"))]:
        monkeypatch.setattr(importlib, "import_module", without(missing))
        assert event_loop_impls() == want


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_sigterm_lets_running_requests_finish(checkpoint: Path, tmp_path: Path) -> None:
    server = ServerProcess(checkpoint, tmp_path / "server.log", "--served-model-name", MODEL)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        stream = iter(client.completions.create(model=MODEL, prompt="The lazy fox", max_tokens=60, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        first = next(stream)
        server.proc.send_signal(15)
        rest = list(stream)
        assert rest[-1].usage.completion_tokens == 60
        assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"
        assert server.proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
        assert "Shutting down" in server.log_text()
    finally:
        server.kill()


@pytest.mark.slow
def test_soak_2000_requests(checkpoint: Path, tmp_path: Path) -> None:
    """2000 short requests, 32 at a time: all succeed, nothing is held afterwards, memory stays bounded."""
    with ServerProcess(checkpoint, tmp_path / "server.log", "--disable-access-log", "--stats-interval", "0") as server:
        async def run(n: int, start: int) -> list[int]:
            limit = asyncio.Semaphore(32)

            async def one(http: httpx.AsyncClient, i: int) -> int:
                body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "max_tokens": 1 + i % 4, "temperature": 0,
                        "stream": i % 3 == 0}
                async with limit:
                    r = await http.post(f"{server.url}/v1/completions", json=body)
                    return r.status_code

            async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=32)) as http:
                return await asyncio.wait_for(asyncio.gather(*(one(http, start + i) for i in range(n))), 300)

        assert set(asyncio.run(run(200, 0))) == {200}
        warm = server.rss_bytes()
        assert set(asyncio.run(run(1800, 200))) == {200}
        wait_for(lambda: engine_idle(server), "an idle engine")
        grown = server.rss_bytes() - warm
        assert grown < 16 << 20, f"RSS grew by {grown >> 20} MiB over 1800 requests"
        done = sum(v for k, v in server.metrics().items() if k.startswith("hybridkv:request_success_total"))
        assert done == 2000
        assert server.stop() == 0
