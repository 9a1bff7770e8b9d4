"""Where a streamed token's gap grows under Poisson load through ``hybridkv serve``: each token stamped where the
engine process sent it, where its API process received it, where the chat handler took it, where the client read it.

    python benchmarks/serve_trace.py [--family gemma3] [--rate R] [--seconds 6] [--api-server-count 4]
                                     [--server-flags "--prefill-spread 1"] [--tiny]

``hybridkv serve`` as ``serve_load.py`` starts it (the same model, conversations and flags) runs with
``_serve_trace_shim`` on its ``PYTHONPATH``: a ``sitecustomize`` that wraps the methods a token passes in each
of the server's processes and stamps them with the wall clock (that file says which). ``--seconds`` of Poisson
arrivals at ``--rate`` (default: half the family's best rate in ``benchmarks/results/serve_load.json``) come from
four of ``serve_load.py``'s load-generator processes (``load_shards``); each request names itself (``request_id``),
so its outputs are matched across the stages (``matched_gaps``). Only the middle of the run counts (from a quarter
to 85% of the clients' span: the server is full, not draining).

For every inter-token gap the client saw, the same two tokens' gap at each stage: the engine's send, the API
process's receipt, the handler; the percentiles of each, and of the delays between stages (send to receipt: the
socket and the API process's reader thread; receipt to handler: its event loop). A stage adds to the p99 what its
gaps' p99 exceeds the stage before's. For the client's slowest 1% of gaps, how much each stage added on average. The
engine's step intervals by the prompt tokens in the step (with the host's wait for the step in flight, as
``gpu_serving_steps.py``), the API processes' intakes (a chat request's handler, tokenization included) and their
event loops' time a chunk (the median time between two outputs of one engine message). And the whole run in
tenths (``timeline``): each tenth's p99 client gap and engine step interval, every request counted as
``serve_load.py`` counts them, which says whether its start or its drain is where the two differ. A
diagnostic: prints its table, writes ``serve_trace.json`` (``benchmarks/out/`` unless ``--out``/``--save``).
``--tiny``: a tiny model on the CPU, a smoke test of this script (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pickle
import re
import shlex
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, half_best_rate, write_json  # noqa: E402
from serve_load import middle_window  # noqa: E402

SHIM = Path(__file__).parent / "_serve_trace_shim" / "sitecustomize.py"
STAGES = ("client", "send", "receipt", "handler")          # (the columns of ``matched_gaps``)
DELAYS = {"send -> receipt": ("receipt", "send"), "receipt -> handler": ("handler", "receipt"),
          "handler -> client": ("client", "handler")}
PROMPT_GROUPS = ((0, 0), (1, 192), (193, 300), (301, 1 << 30))


# -- the analysis -----------------------------------------------------------------------------------------------
TIMELINE_PARTS = 10


def _ms(values: Any, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    values = np.asarray(values, dtype=float)
    return {f"p{q}": float(1e3 * np.percentile(values, q)) for q in qs} if values.size else {}


def _sample_id(request_id: str) -> str:
    return re.sub(r"\.\d+$", "", request_id)        # (the engine's id of a request's one sample)


def matched_gaps(stamps: list[dict[str, list]], clients: list[dict[str, Any]]
                 ) -> tuple[np.ndarray, tuple[float, float], int, np.ndarray]:
    """Per client gap in the run's middle, the same two outputs' gap at each of ``STAGES`` and the later output's
    time at each: a (gaps, 2 x len(STAGES)) array (s); that middle, (from, to) in wall-clock seconds; how many
    requests' stamps did not add up (left out); and every matched output's (receipt, handler) times, (outputs, 2).

    The client's events and the handler's outputs pair one to one; the engine sends, and the API process receives,
    one message a token. An output the handler takes may hold several tokens (its event loop was a step or more
    behind): it pairs with the send and receipt of its first token, the one its reader waited for longest, so the
    lateness lands on the stage that caused it."""
    times = [t for c in clients for t in c["times"]]
    if not times:
        raise RuntimeError("no client read any token")
    lo, hi = min(c["times"][0] for c in clients if c["times"]), max(times)
    lo, hi = middle_window(lo, hi)
    per_token: dict[str, dict[str, list[float]]] = {"send": defaultdict(list), "receipt": defaultdict(list)}
    handler: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for proc in stamps:
        for key, stage in (("sends", "send"), ("receipts", "receipt")):
            for t, ids in proc[key]:
                for rid in ids:
                    per_token[stage][_sample_id(rid)].append(t)
        for t, rid, tokens in proc["yields"]:
            handler[_sample_id(rid)].append((t, tokens))
    gaps, pairs, mismatched = [], [], 0
    for c in clients:
        rid = f"chatcmpl-{c['id']}"
        outputs, send, receipt = handler.get(rid, []), per_token["send"].get(rid, []), per_token["receipt"].get(rid, [])
        counts = np.asarray([k for _, k in outputs], dtype=np.int64)
        first = np.cumsum(counts) - counts                     # each output's first token
        if len(outputs) != len(c["times"]) or (len(counts) and (counts.sum() > min(len(send), len(receipt)) or
                                                                  counts.min() < 1)):
            mismatched += 1
            continue
        series = [c["times"], [send[i] for i in first], [receipt[i] for i in first], [t for t, _ in outputs]]
        pairs += zip(series[2], series[3], strict=True)
        for j in range(1, len(outputs)):
            if lo <= series[0][j] < hi:
                gaps.append([s[j] - s[j - 1] for s in series] + [s[j] for s in series])
    if not gaps:
        raise RuntimeError(f"no client gap matched the server's stamps ({mismatched} requests did not add up)")
    return np.asarray(gaps), (lo, hi), mismatched, np.asarray(pairs)


def timeline(stamps: list[dict[str, list]], clients: list[dict[str, Any]], parts: int = TIMELINE_PARTS
             ) -> list[dict[str, float]]:
    """The whole run (the clients' first token to their last) in ``parts`` equal windows: in each, the p99 of the
    client's gaps between two delta events (by the later one's time; every request, none left out, as
    ``serve_load.py``'s whole-run figures count them) and of the engine's step intervals, with their counts (a
    window with none has no such key). Where the middle's figures and the whole run's differ, this says when. The
    engine's steps outside that span (start-up, the warm-up requests, the idle engine after the run) are left out."""
    times = [t for c in clients for t in c["times"]]
    lo, end = min(c["times"][0] for c in clients if c["times"]), max(times)
    width = (end - lo) / parts or 1.0
    gaps = np.asarray([(t, t - prev) for c in clients for prev, t in itertools.pairwise(c["times"])], dtype=float)
    steps = np.asarray(sorted(s[0] for proc in stamps for s in proc["steps"]), dtype=float)
    steps = steps[(steps >= lo) & (steps <= end)]
    intervals = np.stack([steps[1:], np.diff(steps)], axis=1) if steps.size > 1 else np.zeros((0, 2))
    out = []
    for i in range(parts):
        window: dict[str, float] = {"from_s": i * width, "to_s": (i + 1) * width}
        for name, series in (("client_gap", gaps), ("engine_interval", intervals)):
            # (rounded first: a time on a boundary opens the later window, whatever the float division gives)
            at = np.floor(np.round((series[:, 0] - lo) / width, 9)).clip(0, parts - 1) if series.size else series
            sel = series[at == i, 1] if series.size else series
            if sel.size:
                window[f"{name}_p99_ms"], window[f"{name}s"] = float(1e3 * np.percentile(sel, 99)), float(sel.size)
        out.append(window)
    return out


def analyse(stamps: list[dict[str, list]], clients: list[dict[str, Any]]) -> dict[str, Any]:
    """The tables of the module docstring from the server's stamps (one dict per process) and the clients'."""
    g, (lo, hi), mismatched, pairs = matched_gaps(stamps, clients)
    k = len(STAGES)
    at = {s: g[:, k + i] for i, s in enumerate(STAGES)}
    result: dict[str, Any] = {"gaps": len(g), "requests_left_out": mismatched,
                              "gap_ms": {s: _ms(g[:, i]) for i, s in enumerate(STAGES)},
                              "delay_ms": {name: _ms(at[a] - at[b]) for name, (a, b) in DELAYS.items()}}
    slow = g[g[:, 0] >= np.percentile(g[:, 0], 99)]
    order = ("send", "receipt", "handler", "client")
    added = {"engine (send gap)": float(1e3 * slow[:, 1].mean())}
    for before, stage in zip(order, order[1:], strict=False):
        grew = slow[:, STAGES.index(stage)] - slow[:, STAGES.index(before)]
        added[f"{before} -> {stage}"] = float(1e3 * grew.mean())
    result["slowest_1pct_mean_ms"] = {"client gap": float(1e3 * slow[:, 0].mean()), **added}
    steps = np.asarray([s for proc in stamps for s in proc["steps"]], dtype=float)
    steps = steps[(steps[:, 0] >= lo) & (steps[:, 0] < hi)] if steps.size else steps
    if len(steps) > 1:
        interval = np.diff(steps[:, 0])
        prompt = steps[:-1, 2] - steps[:-1, 3]
        result["engine"] = {"steps": len(steps), "interval_ms": _ms(interval), "groups": {}}
        for a, b in PROMPT_GROUPS:
            m = (prompt >= a) & (prompt <= b)
            if m.any():
                result["engine"]["groups"][f"{a}-{b}" if b < 1 << 30 else f">{a - 1}"] = {
                    "share": float(m.mean()), "interval_ms": _ms(interval[m]),
                    "decodes": float(steps[:-1, 3][m].mean()),
                    "step_call_ms": float(1e3 * (steps[:-1, 1] - steps[:-1, 0])[m].mean()),
                    "wait_ms": float(1e3 * steps[:-1, 4][m].mean())}
    result["timeline"] = timeline(stamps, clients)
    intakes = np.asarray([i for proc in stamps for i in proc["intakes"] if lo <= i[0] < hi], dtype=float)
    if intakes.size:
        result["intake_ms"] = _ms(intakes[:, 1] - intakes[:, 0], (50, 99))
    # An API process's event loop writes the chunks of one engine message (one receipt time) one after another: the
    # time between two of them is the loop's time a chunk.
    pairs = pairs[(pairs[:, 1] >= lo) & (pairs[:, 1] < hi)]
    pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
    same = pairs[1:, 0] == pairs[:-1, 0]
    if same.any():
        result["loop_us_a_chunk"] = float(1e6 * np.median(np.diff(pairs[:, 1])[same]))
    return result


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(d: dict[str, float]) -> list[str]:
        return [f"{d[k]:.2f}" if k in d else "-" for k in ("p50", "p90", "p99")]

    table = Table(title=f"inter-token gaps of the same outputs at each stage ({result['gaps']} gaps; "
                        f"{result['requests_left_out']} requests left out), ms")
    for col in ("stage", "p50", "p90", "p99"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage in ("send", "receipt", "handler", "client"):
        table.add_row(f"gap at the {stage}", *fmt(result["gap_ms"][stage]))
    for name, d in result["delay_ms"].items():
        table.add_row(f"delay {name}", *fmt(d))
    console = Console()
    console.print(table)
    console.print("the client's slowest 1% of gaps, mean ms: " + ", ".join(
        f"{k} {v:.2f}" for k, v in result["slowest_1pct_mean_ms"].items()))
    if "engine" in result:
        e = result["engine"]
        console.print(f"engine: {e['steps']} steps, interval p50/p90/p99 {'/'.join(fmt(e['interval_ms']))} ms")
        for name, grp in e["groups"].items():
            console.print(f"  prompt tokens {name}: {100 * grp['share']:.1f}% of steps, interval "
                          f"{'/'.join(fmt(grp['interval_ms']))} ms, {grp['decodes']:.0f} decodes, step() "
                          f"{grp['step_call_ms']:.2f} ms of which waiting {grp['wait_ms']:.2f}")
    if result.get("timeline"):
        console.print("the whole run in tenths (client gap p99 / engine interval p99, ms): " + "  ".join(
            f"{w.get('client_gap_p99_ms', math.nan):.1f}/{w.get('engine_interval_p99_ms', math.nan):.1f}"
            for w in result["timeline"]))
    if "loop_us_a_chunk" in result:
        console.print(f"an API process's event loop: {result['loop_us_a_chunk']:.0f} µs a chunk (the median time "
                      "between two outputs of one engine message)")
    if "intake_ms" in result:
        console.print(f"intakes (a chat request's handler): p50 / p99 {result['intake_ms']['p50']:.2f} / "
                      f"{result['intake_ms']['p99']:.2f} ms")


# -- the run --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gemma3")
    ap.add_argument("--rate", type=float, default=None, help="requests per second (default: half the family's best "
                    "rate in benchmarks/results/serve_load.json)")
    ap.add_argument("--seconds", type=float, default=6.0, help="seconds of arrivals")
    ap.add_argument("--api-server-count", type=int, default=4)
    ap.add_argument("--server-flags", default="", help="more hybridkv serve flags, as one string")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test of this script")
    add_output_args(ap, "serve_trace")
    args = ap.parse_args()

    import torch
    from serve_load import CLIServer, build_checkpoint, conversations, load_shards

    rate = args.rate if args.rate is not None else 20.0 if args.tiny else half_best_rate(args.family)
    if args.tiny:
        device, dtype, kv = torch.device("cpu"), torch.float32, "1GiB"
        rate, args.seconds = min(rate, 20.0), min(args.seconds, 2.0)
        args.api_server_count = min(args.api_server_count, 2)
    elif not torch.cuda.is_available():
        raise SystemExit("serve_trace.py needs a CUDA device (or --tiny)")
    else:
        device, dtype, kv = torch.device("cuda"), torch.bfloat16, "24GiB"
    # (tiny: short chats and outputs, so the CPU engine keeps a few dozen requests going)
    input_len, output_len = (32, 16) if args.tiny else (256, 64)
    num_requests = max(1, math.ceil(rate * args.seconds))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, shim = Path(tmp) / "checkpoint", Path(tmp) / "shim"
        ckpt.mkdir()
        shim.mkdir()
        shutil.copy(SHIM, shim / "sitecustomize.py")
        build_checkpoint(args.family, args.tiny, ckpt, device, dtype)
        convs = conversations(ckpt, 256, input_len)
        flags = ["--device", device.type, "--dtype", str(dtype).removeprefix("torch."), "--kv-memory", kv,
                 "--max-num-seqs", "256", "--no-prefix-caching", "--api-server-count", str(args.api_server_count),
                 *shlex.split(args.server_flags)]
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), path) if p)
        try:
            server = CLIServer(ckpt, str(ckpt), flags, log=Path(tmp) / "server.log")
        finally:
            if path is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = path
        try:
            load = dict(output_len=output_len, extra={"ignore_eos": True}, processes=4)
            load_shards(server.url, str(ckpt), convs[:16], rate=min(rate, 50.0), num_requests=16, **load)
            clients = [r for shard in load_shards(server.url, str(ckpt), convs, rate=rate, num_requests=num_requests,
                                                  name_requests="r", **load) for r in shard["results"]]
        finally:
            server.stop()
        stamps = []
        for trace in sorted((shim / "traces").glob("*.pkl")) if (shim / "traces").exists() else ():
            with open(trace, "rb") as f:
                stamps.append(pickle.load(f))
    failed = num_requests - sum(1 for c in clients if c["ok"])     # (unanswered ones too)
    result = analyse(stamps, clients)
    print(f"{args.family}: {rate:g} req/s, {num_requests} requests ({failed} failed), hybridkv serve "
          f"--api-server-count {args.api_server_count} {args.server_flags}".rstrip())
    print_tables(result)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "commit": commit(),
            "command": " ".join(["benchmarks/serve_trace.py", *sys.argv[1:]]), "torch": torch.__version__,
            "family": args.family, "rate": rate, "requests": num_requests, "failed": failed,
            "server_flags": flags}
    write_json(args, "serve_trace", {"meta": meta, **result})


if __name__ == "__main__":
    main()
