"""``benchmarks/serve_trace.py``: a token's gap matched across the server's stages (a worked example), and the whole
script on a tiny model (a real ``hybridkv serve`` with the stamping shim)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_each_gap_is_matched_across_the_stages_by_request_id() -> None:
    """Two requests, a token every 10 ms from the engine; request a's third token waits 2 ms in its API process's
    event loop (the handler), b's second 1 ms on the way from the engine (the receipt). Only the gaps in the run's
    middle count (a quarter to 85% of the clients' span)."""
    from serve_trace import STAGES, analyse, matched_gaps

    ms = 1e-3
    send = {"a": [0, 10, 20, 30, 40], "b": [2, 12, 22, 32, 42]}          # engine sends, ms
    receipt = {"a": [0.1, 10.1, 20.1, 30.1, 40.1], "b": [2.1, 13.1, 22.1, 32.1, 42.1]}
    handler = {"a": [0.2, 10.2, 22.2, 30.2, 40.2], "b": [2.2, 13.2, 22.2, 32.2, 42.2]}
    client = {r: [t + 0.1 for t in h] for r, h in handler.items()}
    engine = {"steps": [(t * ms, (t + 1) * ms, 300 if t == 20 else 2, 2, 0.0) for t in range(0, 44, 2)],
              "sends": [(t * ms, [f"chatcmpl-{r}.0" for r in send if t in send[r]]) for t in range(0, 44, 2)],
              "receipts": [], "yields": [], "intakes": []}
    api = {"steps": [], "sends": [], "intakes": [(0.0, 0.001)],
           "receipts": [(t * ms, [f"chatcmpl-{r}.0"]) for r, ts in receipt.items() for t in ts],
           "yields": [(t * ms, f"chatcmpl-{r}") for r, ts in handler.items() for t in ts]}
    clients = [{"id": r, "status": 200, "times": [t * ms for t in ts]} for r, ts in client.items()]
    gaps, _ = matched_gaps([engine, api], clients)
    # the clients' span is 0.3-42.3 ms, its middle 10.8-36.0 ms: a's tokens 2-3 (22.3, 30.3 ms), b's 1-3 (13.3, 22.3,
    # 32.3 ms), five gaps
    by_stage = {s: sorted(round(1e3 * v, 6) for v in gaps[:, i]) for i, s in enumerate(STAGES)}
    assert by_stage["send"] == [10] * 5
    assert by_stage["receipt"] == [9, 10, 10, 10, 11]         # b's 1 ms on the way, in the gap before and after
    assert by_stage["handler"] == by_stage["client"] == [8, 9, 10, 11, 12]
    out = analyse([engine, api], clients)
    assert out["gaps"] == 5
    assert out["delay_ms"]["receipt -> handler"]["p99"] == pytest.approx(2.02)   # of 0.1 x 4 and 2.1 ms
    assert out["slowest_1pct_mean_ms"]["receipt -> handler"] == pytest.approx(2.0)   # a's 12 ms gap: 10 + 2
    assert out["intake_ms"]["p50"] == pytest.approx(1.0)
    groups = out["engine"]["groups"]                        # steps every 2 ms; the one at 20 ms took a prompt
    assert set(groups) == {"0-0", "193-300"} and groups["193-300"]["share"] == pytest.approx(1 / 11)


@pytest.mark.slow    # a real server on a tiny model, four client processes
def test_the_script_runs_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_trace.py"), "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["failed"] == 0 and result["gaps"] > 0
    assert set(result["gap_ms"]) == {"client", "send", "receipt", "handler"}
    assert result["engine"]["steps"] > 0 and result["intake_ms"]["p50"] > 0
