"""Host cost of the metadata transforms: µs per call (median) at batch 1, 64, 256, 1024.

Scenarios: (a) all decodes with ~2k-token contexts, (b) mixed: 3/4 decodes, 1/4 prefill chunks of
32-512 tokens. Block size 16, chunk 1024 and window 1024 (so the transforms do real work at 2k contexts).
Target: <= 50 µs per host transform at batch 256 decode. The device form of the local-attention transform
is timed on the CPU too, for reference only: it is meant to be recorded in a CUDA graph.

    python benchmarks/transforms.py [--quick] [--save]   # writes transforms.json (``_results.py``)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402

from hybridkv.metadata import CommonAttentionMetadata
from hybridkv.transforms import (
    make_local_attention_virtual_batches,
    make_local_attention_virtual_batches_device,
    max_local_virtual_batches,
    permute_requests,
    reorder_decodes_first,
    split_decodes_and_prefills,
    split_microbatches,
    trim_sliding_window,
)

BLOCK = 16
CHUNK = 1024
WINDOW = 1024
BATCHES = (1, 64, 256, 1024)
TARGET_US = 50.0


def make_inputs(batch: int, scenario: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ctx = rng.integers(1792, 2304, batch)
    q = np.ones(batch, np.int64)
    if scenario == "mixed":
        prefill = rng.random(batch) < 0.25
        q[prefill] = rng.integers(32, 513, int(prefill.sum()))
        ctx[prefill] = rng.integers(0, 2048, int(prefill.sum()))
    seq = ctx + q
    width = int(-(-seq.max() // BLOCK))
    ids = rng.permutation(batch * width) + 1
    return {"query_lens": q, "seq_lens": seq, "block_table": ids.reshape(batch, width)}


def time_us(fn: Callable[[], object], min_calls: int, min_seconds: float) -> float:
    """Median µs per call over at least ``min_calls`` calls and ``min_seconds``."""
    for _ in range(10):
        fn()
    samples: list[int] = []
    start = time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def cpu_description() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model} ({os.cpu_count()} logical cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    add_output_args(parser, "transforms")
    args = parser.parse_args()
    min_calls, min_seconds = (50, 0.05) if args.quick else (300, 0.3)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)

    rows: list[dict[str, object]] = []
    for scenario in ("decode", "mixed"):
        for batch in BATCHES:
            inputs = make_inputs(batch, scenario, rng)
            cam = CommonAttentionMetadata.build(**inputs, block_size=BLOCK)
            perm = reorder_decodes_first(cam.query_lens_cpu)
            v_max = max_local_virtual_batches(CHUNK, batch, cam.num_actual_tokens)
            ops: dict[str, Callable[[], object]] = {
                "build": partial(CommonAttentionMetadata.build, **inputs, block_size=BLOCK),
                "local_virtual_batches": partial(make_local_attention_virtual_batches, cam, CHUNK),
                "trim_sliding_window": partial(trim_sliding_window, cam, WINDOW),
                "split_microbatches(2)": partial(split_microbatches, cam, num_ubatches=2),
                "split_decodes_and_prefills": partial(split_decodes_and_prefills, cam),
                "reorder_decodes_first": partial(reorder_decodes_first, cam.query_lens_cpu),
                "permute_requests": partial(permute_requests, cam, perm),
                "local_device_form (torch CPU)": partial(
                    make_local_attention_virtual_batches_device, cam, CHUNK, v_max
                ),
            }
            if cam.num_actual_tokens < 2:  # one token cannot be split in two
                del ops["split_microbatches(2)"]
            for name, fn in ops.items():
                us = time_us(fn, min_calls, min_seconds)
                row = {"scenario": scenario, "batch": batch, "op": name, "us": round(us, 2)}
                rows.append(row | {"tokens": cam.num_actual_tokens})

    table = Table(title=f"hybridkv transforms, µs per call (median) — {cpu_description()}")
    table.add_column("scenario")
    table.add_column("op")
    for batch in BATCHES:
        table.add_column(f"B={batch}", justify="right")
    names = list(dict.fromkeys(r["op"] for r in rows))
    for scenario in ("decode", "mixed"):
        for name in names:
            cells = []
            for batch in BATCHES:
                key = (scenario, name, batch)
                hit = [r for r in rows if (r["scenario"], r["op"], r["batch"]) == key]
                if not hit:
                    cells.append("-")
                    continue
                us = float(hit[0]["us"])
                over = scenario == "decode" and batch == 256 and us > TARGET_US and "device" not in name
                cells.append(f"[red]{us:.1f}[/red]" if over else f"{us:.1f}")
            table.add_row(scenario, name, *cells)
    Console().print(table)

    result = {
        "benchmark": "transforms",
        "commit": commit(),
        "command": " ".join(sys.argv),
        "unit": "us_per_call_median",
        "target_us_batch256_decode": TARGET_US,
        "config": {
            "block_size": BLOCK,
            "attn_chunk_size": CHUNK,
            "sliding_window": WINDOW,
            "decode_context": "uniform 1792..2303",
            "mixed": "25% prefill chunks of 32..512 tokens",
        },
        "host": {
            "cpu": cpu_description(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
        },
        "results": rows,
    }
    write_json(args, "transforms", result, indent=2)


if __name__ == "__main__":
    main()
