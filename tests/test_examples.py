"""Every script in ``examples/`` runs, as a user would run it, on its tiny configuration (``--tiny``). Slow-marked:
each is a few seconds of subprocess start-up for what the feature tests already cover."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "tiny.py")
EXPECTED = {
    "custom_layer_mix.py": "190 prompt tokens ->",
    "hf_checkpoint.py": "(equal)",
    "chat.py": "assistant (",
    "streaming.py": "after both: 0 running, 0 waiting",
    "evaluate_gsm8k.py": "GSM8K exact match",
    "openai_server.py": "server exit code: 0",
}


def test_every_example_is_checked() -> None:
    assert {p.name for p in EXAMPLES} == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(example: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(example), "--tiny"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert EXPECTED[example.name] in done.stdout, done.stdout[-3000:]
