"""Device cost of a step's sampling work per batch: the greedy argmax, temperature sampling, the non-finite
check, and logits processing (logit bias only; repetition + frequency + presence penalties over a token history
of L tokens per row) — what a step pays when some of its requests use vLLM's sampling controls.

    python benchmarks/sampling.py [--device cuda] [--quick]   # writes benchmarks/results/sampling[_cpu].json

Each cell: the median of timed calls (device-synchronised) in µs. Target: penalties on every row of a
batch-32 step with a 152k vocabulary and 4k-token histories cost less than one temperature-sampling pass
(which every sampled step already pays).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hybridkv.engine.sampler import LogitsProcessing, SamplingTensors, process_logits, row_max_finite, sample

RESULTS = Path(__file__).parent / "results"


def time_us(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    samples = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def cases(rows: int, vocab: int, history: int, device: torch.device) -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=gen)
    ids = torch.randint(0, vocab, (rows, history), device=device, generator=gen)
    ones = torch.ones(rows, device=device)
    st = SamplingTensors(temperature=ones * 0.8, top_k=torch.zeros(rows, dtype=torch.int64, device=device),
                         top_p=ones, min_p=ones * 0, seeds=torch.arange(rows, device=device),
                         counters=torch.zeros(rows, dtype=torch.int64, device=device), needs_filtering=False)
    bias = LogitsProcessing(bias_ids=ids[:, :8], bias_values=torch.ones(rows, 8, device=device), masked_ids=None,
                            mask_active=None, history=None, num_prompt=None, num_tokens=None, presence=None,
                            frequency=None, repetition=None)
    full = LogitsProcessing(bias_ids=None, bias_values=None, masked_ids=None, mask_active=None, history=ids,
                            num_prompt=torch.full((rows,), history // 2, device=device),
                            num_tokens=torch.full((rows,), history, device=device), presence=ones * 0.5,
                            frequency=ones * 0.3, repetition=ones * 1.2)
    return {"greedy argmax": lambda: logits.argmax(-1), "non-finite check": lambda: row_max_finite(logits),
            "temperature sample": lambda: sample(logits, st),
            "logit bias (8 ids)": lambda: process_logits(logits, bias),
            "penalties": lambda: process_logits(logits, full)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer calls (a CPU smoke run)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    shapes = [(1, 32_000, 512), (32, 32_000, 512), (32, 152_064, 4096), (256, 152_064, 4096)]
    if args.quick:
        shapes = [(1, 8_000, 256), (8, 32_000, 512), (32, 32_000, 1024)]
    calls = 5 if args.quick else 50
    table = Table(title=f"sampling work per step on {device} (µs, median)")
    table.add_column("rows x vocab, history")
    names = list(cases(1, 16, 4, device))
    for name in names:
        table.add_column(name, justify="right")
    results = []
    for rows, vocab, history in shapes:
        row = {"rows": rows, "vocab": vocab, "history": history}
        for name, fn in cases(rows, vocab, history, device).items():
            row[name] = time_us(fn, device, calls)
        results.append(row)
        table.add_row(f"{rows} x {vocab}, {history}", *(f"{row[n]:.0f}" for n in names))
    Console().print(table)
    out = Path(args.out) if args.out else RESULTS / f"sampling{'' if device.type == 'cuda' else '_cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out.write_text(json.dumps({"device": name, "commit": commit, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
