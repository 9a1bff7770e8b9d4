"""A real ``hybridkv serve`` process for tests: a tiny checkpoint with a real tokenizer and chat template, a
free port on 127.0.0.1, output to a log file (a full pipe would block the server), bounded waits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2
from hybridkv.models.hybrid import build_model, save_model
from tests.test_tokenizers import _bpe_dir

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 90.0


def tiny_config() -> HybridConfig:
    """Full, sliding-window and Mamba2 layers; the vocabulary of ``_bpe_dir``'s tokenizer (300); room for requests
    long enough (4096 tokens) to be caught running."""
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    mixers = (Attention(**attn), Mamba2(num_heads=2, head_dim=8, state_size=8, chunk_size=4),
              Attention(sliding_window=8, **attn))
    return HybridConfig(vocab_size=300, hidden_size=16, max_position_embeddings=4096, dtype="float32",
                        eos_token_ids=(1,), layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=32))
                                                         for m in mixers))


def tiny_checkpoint(directory: Path) -> Path:
    """A hybridkv checkpoint with ``tokenizer.json``, ``tokenizer_config.json`` (a chat template) and
    ``generation_config.json``."""
    save_model(build_model(tiny_config(), seed=5), directory)
    return _bpe_dir(directory)


ENGINE_ARGS = ("--device", "cpu", "--kv-memory", "16MiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "128")
"""What the tests' servers run with; ``offline_llm`` builds the same engine in the test process."""


def offline_llm(checkpoint: Path):
    from hybridkv import LLM

    return LLM(checkpoint, device="cpu", kv_cache_memory="16MiB", max_num_seqs=16, max_num_batched_tokens=128)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m hybridkv.cli serve CHECKPOINT ...`` on a free port; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, checkpoint: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hybridkv.cli", "serve", str(checkpoint), "--port", str(self.port),
                 *ENGINE_ARGS, *extra], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the server did not start within {START_TIMEOUT}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name{labels}: value} (comments left out)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait (bounded); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"the server did not stop within {timeout}s:\n{self.log_text()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

