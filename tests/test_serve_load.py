"""``benchmarks/serve_load.py``'s rate sweep: where it stops, what it extends, and when its best rate is only a
lower bound (the last point run still met the TTFT target)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _point(rate: float, ttft_p99: float, failed: int = 0, kept_up: float | None = 1.0) -> dict:
    return {"rate": rate, "ttft_p99": ttft_p99, "failed": failed, "kept_up": kept_up}


@pytest.mark.parametrize(("limit", "extend", "want_rates", "want_best", "want_bound"), [
    (150.0, 2, [50, 80, 100, 125, 156.25], 125, False),              # extended once, then a miss
    (1000.0, 2, [50, 80, 100, 125, 156.25, 195.312], 195.312, True),   # extended twice, still met: a lower bound
    (1000.0, 0, [50, 80, 100, 125], 125, True),
    (90.0, 2, [50, 80, 100], 80, False),                              # a miss stops the sweep
    (10.0, 2, [50], None, False),
])
def test_sweep_stops_at_a_miss_and_extends_while_met(limit, extend, want_rates, want_best, want_bound) -> None:
    from serve_load import sweep_rates

    runs = []

    def run(rate: float) -> dict:
        runs.append(rate)
        return _point(rate, 0.5 if rate <= limit else 3.0)

    points, best, bound = sweep_rates([50.0, 80.0, 100.0, 125.0], run, extend=extend)
    assert runs == want_rates and [p["rate"] for p in points] == want_rates
    assert best == want_best and bound is want_bound


def test_a_point_with_failed_requests_misses() -> None:
    from serve_load import sweep_rates

    points, best, bound = sweep_rates([10.0, 20.0], lambda r: _point(r, 0.1, failed=int(r > 10)), extend=2)
    assert [p["rate"] for p in points] == [10.0, 20.0] and best == 10.0 and not bound


@pytest.mark.parametrize(("kept_up", "passes"), [(1.0, True), (0.95, True), (0.85, False), (None, True)])
def test_a_point_whose_server_fell_behind_misses(kept_up, passes) -> None:
    """Within the TTFT target but with a growing backlog (a short run hides it): a miss. (None: an all-at-once run.)"""
    from serve_load import _passes

    assert _passes(_point(100.0, 0.5, kept_up=kept_up)) is passes


def _done(start: float, ttft: float, gaps: list[float], tokens: int | None = None) -> dict:
    return {"start": start, "ttft": ttft, "gaps": gaps, "tokens": len(gaps) + 1 if tokens is None else tokens,
            "e2e": ttft + sum(gaps)}


def _steady(rate: float, span: float, latency: float) -> list[dict]:
    """Arrivals every 1/rate s over ``span``, each streaming 10 tokens evenly over ``latency`` after a 10 ms TTFT."""
    n = round(rate * span)
    return [_done(i / rate, 0.01, [(latency - 0.01) / 9] * 9) for i in range(n)]


@pytest.mark.parametrize(("rate", "last", "done", "want"), [
    (100.0, 4.0, _steady(100.0, 4.0, 0.3), 1.0),        # steady: the second half streams what is asked
    (100.0, 4.0, _steady(100.0, 4.0, 3.0), 1.0),        # ... counted once full (from the median latency)
    (100.0, 4.0, _steady(100.0, 4.0, 3.5), 0.939),       # (from 3/4 of the span at the latest: still filling)
    # a few uneven arrivals: counted as they came
    (5.0, 5.8, [_done(t, 0.05, [0.05] * 9) for t in (0.1, 0.2, 0.25, 1.9, 2.0, 3.1, 4.7, 4.8, 4.9, 5.8)], 1.0),
    # an ever larger batch: first tokens quick, the other nine over 40 s
    (100.0, 4.0, [_done(i / 100, 0.01, [40.0 / 9] * 9) for i in range(400)], 0.1),
    # a queue: the first token of the request sent at t comes at 2t
    (100.0, 4.0, [_done(i / 100, i / 100, [0.001] * 9) for i in range(400)], 0.5),
    (100.0, 4.0, [_done(i / 100, 4.5 - i / 100, [], tokens=10) for i in range(400)], 0.0),   # stalled
    (math.inf, 0.0, _steady(100.0, 0.08, 0.3), None),     # all at once: not a Poisson run
    (100.0, 4.0, [], None),                               # nothing finished
    (100.0, 4.0, [_done(0.1, 0.01, [0.01] * 9)], 0.0),    # nobody sent in the window: too few to judge, a miss
    (100.0, 4.0, [_done(i / 100, 0.01, [], tokens=0) for i in range(400)], 0.0),   # no tokens at all
])
def test_kept_up_is_the_late_streamed_tokens_over_those_asked(rate, last, done, want) -> None:
    from serve_load import kept_up

    got = kept_up(rate, last, done)
    assert got == want if want is None else got == pytest.approx(want, abs=0.002)


@pytest.mark.parametrize(("before", "after", "q", "want"), [
    ({0.001: 0, 0.002: 0, math.inf: 0}, {0.001: 50, 0.002: 100, math.inf: 100}, 50, 0.001),
    ({0.001: 0, 0.002: 0, math.inf: 0}, {0.001: 50, 0.002: 100, math.inf: 100}, 99, 0.00198),   # within its bucket
    ({0.001: 10, 0.002: 10, math.inf: 10}, {0.001: 10, 0.002: 110, math.inf: 110}, 50, 0.0015),  # the gain only
    ({}, {0.001: 0, 0.002: 1, math.inf: 2}, 99, 0.002),              # past the last bound: that bound
    ({0.001: 5, math.inf: 5}, {0.001: 5, math.inf: 5}, 50, None),    # nothing gained
])
def test_histogram_quantile_interpolates_within_the_bucket(before, after, q, want) -> None:
    from serve_load import histogram_quantile

    got = histogram_quantile(before, after, q)
    assert got == want if want is None else got == pytest.approx(want)


def test_a_point_merges_its_load_generators() -> None:
    """Each client process sends its share of one schedule; the point's figures are over all of them."""
    from serve_load import summarize

    def req(ttft: float, gaps: list[float]) -> dict:
        return {"ok": True, "ttft": ttft, "gaps": gaps, "tokens": len(gaps) + 1, "e2e": ttft + sum(gaps),
                "error": None, "start": 0.5}

    shards = [{"results": [req(0.1, [0.01, 0.01])], "wall_s": 2.0, "last_arrival": 1.5, "cpu_s": 0.5},
              {"results": [req(0.3, [0.03]), {"ok": False, "error": "HTTP 503: busy"}], "wall_s": 2.5,
               "last_arrival": 1.5, "cpu_s": 1.0}]
    p = summarize(10.0, 4, shards)
    assert (p["failed"], p["errors"], p["wall_s"], p["client_processes"]) == (2, ["HTTP 503: busy"], 2.5, 2)
    assert p["output_tok_s"] == pytest.approx(5 / 2.5) and p["client_busy"] == pytest.approx(1.5 / 2.5 / 2)
    assert p["itl_p50"] == pytest.approx(0.01) and p["ttft_p99"] is None      # (two never came back: infinitely late)


def test_the_middle_of_a_run_holds_the_gaps_read_between_a_quarter_and_85_percent_of_its_span() -> None:
    """Two requests' chunks over 0-100 ms: request a's first gap is 20 ms (filling up) and b's last is 30 ms (a
    drain): the middle, 25-85 ms, holds only the 10 ms gaps read there, which the point reports as its middle's p99
    beside the whole run's."""
    from serve_load import middle_gaps, summarize

    ms = 1e-3

    def req(start: float, ttft: float, gaps: list[float]) -> dict:
        return {"ok": True, "start": start * ms, "ttft": ttft * ms, "gaps": [g * ms for g in gaps],
                "tokens": len(gaps) + 1, "e2e": (ttft + sum(gaps)) * ms, "error": None}

    a = req(0, 0, [20, 10, 10, 10, 10, 10, 10, 10])      # chunks at 0, 20, 30, ..., 90 ms
    b = req(0, 10, [10, 10, 10, 10, 10, 10, 30])         # chunks at 10, 20, ..., 70, 100 ms
    # span 0-100 ms: the middle is 25-85 ms; a's chunks at 30-80 ms, b's at 30-70 ms end gaps there
    assert sorted(np.round(middle_gaps([a, b]) / ms, 6).tolist()) == [10.0] * 11
    p = summarize(100.0, 2, [{"results": [a, b], "wall_s": 0.1, "last_arrival": 0.0, "cpu_s": 0.0}])
    assert p["itl_p99_middle"] == pytest.approx(10 * ms) and p["itl_p99"] > 20 * ms
    assert middle_gaps([req(0, 5, [])]).size == 0                     # (no gap at all: nothing to count)


def test_the_peers_points_are_kept_as_they_come(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped during the peer's second point (a time limit's SIGTERM unwinds as an exception) leaves the first
    point in the family's ``peer`` figures, which the partial save writes; a second point whose load generators hang
    past their deadline ends the sweep there (``stopped``), the run going on; a finished sweep adds its best rate
    (none here: both points miss, so the rate falls 4x)."""
    import argparse

    import serve_load

    stopped = {"peer": True}

    class FakePeer:
        url = "http://127.0.0.1:1"

        def __init__(self, *a, **kw) -> None:
            pass

        def stop(self) -> None:
            stopped["peer"] = True

    calls = []          # (the first call is the peer's two-request probe, at an infinite rate)

    def run_load(url, name, convs, *, rate, num_requests, output_len, **kw):
        calls.append(rate)
        if rate != math.inf and len(calls) == 3 and stop_at_second:
            raise stop_at_second(["client"], 1.0) if stop_at_second is subprocess.TimeoutExpired else stop_at_second
        return {"rate": rate, "requests": num_requests, "failed": int(rate != math.inf), "errors": [], "ttft_p50": 1.0,
                "ttft_p99": 3.0, "tpot_p50": 0.2, "tpot_p99": 0.3, "itl_p50": 0.2, "itl_p99": 0.3, "output_tok_s": 10.0,
                "requests_s": 1.0, "kept_up": 0.1}

    monkeypatch.setattr(serve_load, "PeerServer", FakePeer)
    monkeypatch.setattr(serve_load, "run_load", run_load)
    args = argparse.Namespace(output_len=4, peer_points=2, max_requests_per_rate=64, seconds_per_rate=1.0,
                              peer_drain_timeout=1.0, client_processes=1)
    device = type("Device", (), {"type": "cpu"})()
    for stop_at_second in (KeyboardInterrupt, subprocess.TimeoutExpired, None):
        calls.clear()
        stopped["peer"] = False
        out: dict = {}
        if stop_at_second is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                serve_load._peer(Path("ckpt"), "m", [[]] * 4, args, device, "torch.float32", 400.0, out=out)
            assert [p["rate"] for p in out["rates"]] == [40.0] and "best_rate" not in out
        elif stop_at_second is subprocess.TimeoutExpired:
            assert serve_load._peer(Path("ckpt"), "m", [[]] * 4, args, device, "torch.float32", 400.0, out=out) is out
            assert [p["rate"] for p in out["rates"]] == [40.0] and out["best_rate"] is None
            assert out["stopped"] == "at 10 req/s: a load generator timed out after 1 s"
        else:
            assert serve_load._peer(Path("ckpt"), "m", [[]] * 4, args, device, "torch.float32", 400.0, out=out) is out
            assert [p["rate"] for p in out["rates"]] == [40.0, 10.0] and out["best_rate"] is None
        assert out["first_rate"] == 40.0 and stopped["peer"]


@pytest.mark.parametrize(("peer", "want"), [
    ({}, "-"),                                                  # --no-peer
    ({"skipped": ["refused"]}, "-"),
    ({"rates": [], "first_rate": 40.0, "best_rate": None}, "-"),    # --peer-points 0
    ({"rates": [{"rate": 40.0}, {"rate": 10.0}], "best_rate": None}, ">40x"),    # missed at every rate tried
    ({"rates": [{"rate": 40.0}]}, ">10x"),                    # a run stopped before the sweep's end
])
def test_the_summary_ratio_reads_what_the_peer_measured(peer: dict, want: str) -> None:
    import serve_load

    tok = {"output_tok_s": 100.0}
    result = {"family": "f", "http": {"stream": tok, "no_stream": tok}, "offline": tok, "best_rate": 400.0,
              "peer": peer, "decode_step_b32_s": 0.001}
    assert serve_load.summary_rows([result])[0][7] == want


def test_a_load_generator_waits_its_drain_timeout_after_the_last_arrival() -> None:
    """A server that never answers: each load generator stops ``drain_timeout`` after its last arrival (the
    arrivals' span is not counted twice), so the parent's own deadline never cuts it off first."""
    import socket

    from serve_load import load_shards

    with socket.socket() as listener:            # accepts nothing: every request waits for ever
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        (shard,) = load_shards(url, "m", [[{"role": "user", "content": "hi"}]], rate=4.0, num_requests=8,
                               output_len=4, drain_timeout=0.2, processes=1)
    assert shard["results"] == []
    assert shard["last_arrival"] > 0.5
    assert shard["wall_s"] < shard["last_arrival"] + 0.2 + 0.5


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 CPUs")
@pytest.mark.parametrize("pinned", [True, False])
def test_the_engine_cpu_of_a_server(pinned: bool) -> None:
    """``engine_cpu`` finds the CPU an engine process (a child of the server's process, named by its command line)
    runs on alone; None when it is not pinned (here this test process is the server's)."""
    from serve_load import engine_cpu

    cpu = max(os.sched_getaffinity(0))
    pin = f"os.sched_setaffinity(0, {{{cpu}}}); " if pinned else ""
    code = f"import os, sys, time; {pin}print('up', flush=True); sys.stdin.read()  # hybridkv.engine.core"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert engine_cpu(os.getpid()) == (cpu if pinned else None)
    finally:
        child.communicate(timeout=30)
