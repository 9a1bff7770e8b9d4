"""``hybridkv serve`` with the official ``openai`` client: completions, chat, streaming, the model list.

    hybridkv serve PATH/TO/CHECKPOINT --port 8000 &          # then:
    python examples/openai_server.py --url http://127.0.0.1:8000
    python examples/openai_server.py --tiny                  # starts a server on a tiny checkpoint, then stops it
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai


def start_server(checkpoint: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", checkpoint, "--port", str(port),
                             "--device", "cpu", "--kv-memory", "64MiB", "--served-model-name", "tiny",
                             "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def demo(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    model = client.models.list().data[0].id
    print("model:", model)

    completion = client.completions.create(model=model, prompt="A hybrid model mixes", max_tokens=16, temperature=0)
    print("completion:", repr(completion.choices[0].text), completion.usage)

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=16, temperature=0.8, seed=1,
                                          extra_body={"top_k": 20, "repetition_penalty": 1.1})   # vLLM's fields
    print("chat:", repr(chat.choices[0].message.content))

    print("streamed: ", end="")
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five"}],
                                                max_tokens=16, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n({chunk.usage.completion_tokens} tokens)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server")
    ap.add_argument("--tiny", action="store_true", help="start a server on a tiny checkpoint first")
    args = ap.parse_args()
    if (args.url is None) == (not args.tiny):
        ap.error("give --url or --tiny")
    if args.url:
        demo(args.url)
        return
    from tiny import tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(str(tiny_checkpoint(tmp)))
        try:
            demo(url)
        finally:
            proc.send_signal(signal.SIGTERM)                 # running requests finish, then it exits
            print("server exit code:", proc.wait(60))


if __name__ == "__main__":
    main()
