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
    """Three requests, a token every 10 ms from the engine. Request a's third token waits 2 ms in its API process's
    event loop (the handler), b's second 1 ms on the way from the engine (the receipt); c's event loop took its third
    token 10 ms late, together with its fourth, as one output. Only the gaps in the run's middle count (a quarter to
    85% of the clients' span)."""
    from serve_trace import STAGES, analyse, matched_gaps

    ms = 1e-3
    send = {"a": [0, 10, 20, 30, 40], "b": [2, 12, 22, 32, 42], "c": [4, 14, 24, 34, 44]}
    receipt = {"a": [0.1, 10.1, 20.1, 30.1, 40.1], "b": [2.1, 13.1, 22.1, 32.1, 42.1],
               "c": [t + 0.1 for t in send["c"]]}
    outputs = {"a": [(0.2, 1), (10.2, 1), (22.2, 1), (30.2, 1), (40.2, 1)],        # (handler time, new tokens)
               "b": [(2.2, 1), (13.2, 1), (22.2, 1), (32.2, 1), (42.2, 1)],
               "c": [(4.2, 1), (14.2, 1), (34.2, 2), (44.2, 1)]}
    steps = range(0, 46, 2)
    engine = {"steps": [(t * ms, (t + 1) * ms, 300 if t == 20 else 3, 3, 0.0) for t in steps],
              "sends": [(t * ms, [f"chatcmpl-{r}.0" for r in send if t in send[r]]) for t in steps],
              "receipts": [], "yields": [], "intakes": []}
    api = {"steps": [], "sends": [], "intakes": [(12 * ms, 13 * ms)],
           "receipts": [(t * ms, [f"chatcmpl-{r}.0"]) for r, ts in receipt.items() for t in ts],
           "yields": [(t * ms, f"chatcmpl-{r}", k) for r, outs in outputs.items() for t, k in outs]}
    clients = [{"id": r, "ok": True, "times": [(t + 0.1) * ms for t, _ in outs]} for r, outs in outputs.items()]
    gaps, _, left_out, _ = matched_gaps([engine, api], clients)
    # the clients' span is 0.3-44.3 ms, its middle 11.3-37.7 ms: a's outputs 2-3, b's 1-3, c's 1-2: seven gaps
    by_stage = {s: sorted(round(1e3 * v, 6) for v in gaps[:, i]) for i, s in enumerate(STAGES)}
    assert left_out == 0
    assert by_stage["send"] == [10] * 7                       # c's merged output pairs with its first token's send
    assert by_stage["receipt"] == [9, 10, 10, 10, 10, 10, 11]  # b's 1 ms on the way, in the gap before and after
    assert by_stage["handler"] == by_stage["client"] == [8, 9, 10, 10, 11, 12, 20]
    out = analyse([engine, api], clients)
    assert out["gaps"] == 7
    assert out["delay_ms"]["receipt -> handler"]["p99"] == pytest.approx(9.62)    # of 0.1 x 5, 2.1 and 10.1 ms
    slowest = out["slowest_1pct_mean_ms"]                    # c's 20 ms gap: the engine's 10, the loop's 10
    assert slowest["client gap"] == pytest.approx(20) and slowest["engine (send gap)"] == pytest.approx(10)
    assert slowest["receipt -> handler"] == pytest.approx(10) and slowest["send -> receipt"] == pytest.approx(0)
    assert out["intake_ms"]["p50"] == pytest.approx(1.0)
    groups = out["engine"]["groups"]                        # steps every 2 ms; the one at 20 ms took a prompt
    assert set(groups) == {"0-0", "193-300"} and groups["193-300"]["share"] == pytest.approx(1 / 12)
    # a request whose outputs hold more tokens than the engine sent does not add up: left out, not misread
    clients.append({"id": "d", "ok": True, "times": [1 * ms, 11 * ms, 21 * ms]})
    api["yields"] += [(t * ms, "chatcmpl-d", 1) for t in (0.9, 10.9, 20.9)]
    assert matched_gaps([engine, api], clients)[2] == 1


def test_the_loops_time_a_chunk_is_taken_within_one_message() -> None:
    """Two requests' tokens arrive in one API process's message every 10 ms; the loop writes the first request's
    chunk 0.1 ms after the receipt and the second's 0.05 ms after that: 50 µs a chunk, whatever the step's length."""
    from serve_trace import analyse

    ms, ticks = 1e-3, [10.0 * i for i in range(9)]
    engine = {"steps": [], "receipts": [], "yields": [], "intakes": [],
              "sends": [(t * ms, ["chatcmpl-a.0", "chatcmpl-b.0"]) for t in ticks]}
    api = {"steps": [], "sends": [], "intakes": [], "receipts": [((t + 0.1) * ms, ["chatcmpl-a.0", "chatcmpl-b.0"])
                                                                 for t in ticks],
           "yields": [((t + dt) * ms, f"chatcmpl-{r}", 1) for t in ticks for r, dt in (("a", 0.2), ("b", 0.25))]}
    clients = [{"id": r, "ok": True, "times": [(t + dt + 0.1) * ms for t in ticks]}
               for r, dt in (("a", 0.2), ("b", 0.25))]
    assert analyse([engine, api], clients)["loop_us_a_chunk"] == pytest.approx(50)


def test_the_timeline_counts_every_gap_in_its_tenth_of_the_run() -> None:
    """Two requests read a token every 10 ms over 0-100 ms, except that request a's tokens at 90 and 100 ms come 5 ms
    late (a 15 ms gap, then a 5 ms one): only the last tenth (90-100 ms) has them. The engine steps every 10 ms but
    skips 10 ms: the step at 20 ms ends a 20 ms interval, counted in the third tenth. Its steps before the clients'
    first token (start-up, warm-up) and after their last one are left out, not counted in the first or last tenth."""
    from serve_trace import timeline

    ms = 1e-3
    clients = [{"id": "a", "times": [t * ms for t in (0, 10, 20, 30, 40, 50, 60, 70, 80, 95, 100)]},
               {"id": "b", "times": [t * ms for t in range(0, 101, 10)]}]
    engine = {"steps": [(t * ms, 0, 0, 0, 0.0) for t in (-5000, -4998, 0, 20, 30, 40, 50, 60, 70, 80, 90, 100, 900)]}
    windows = timeline([engine, {"steps": []}], clients, parts=10)
    assert [w["from_s"] for w in windows] == pytest.approx([i * 0.01 for i in range(10)])
    assert [w.get("client_gaps", 0) for w in windows] == [0, 2, 2, 2, 2, 2, 2, 2, 2, 4]
    assert "client_gap_p99_ms" not in windows[0]               # (a gap counts where its later token is read)
    assert windows[9]["client_gap_p99_ms"] == pytest.approx(14.85)     # of 5, 10, 10 and 15 ms
    assert all(w["client_gap_p99_ms"] == pytest.approx(10) for w in windows[1:9])
    assert windows[2]["engine_interval_p99_ms"] == pytest.approx(20)   # the step at 20 ms came 20 ms after its last
    assert windows[3]["engine_interval_p99_ms"] == pytest.approx(10) and "engine_intervals" not in windows[1]
    assert windows[9]["engine_intervals"] == 2                          # 90 and 100 ms (the end is in the last)
    assert "engine_intervals" not in windows[0]        # (the step at 0 ms has none before it in the run)


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
    assert sum(w.get("client_gaps", 0) for w in result["timeline"]) >= result["gaps"]
