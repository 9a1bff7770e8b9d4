"""cuBLAS's first use of a GEMM shape: host time of a step's linears at row counts met for the first time, then
again (the cost ``engine/mixed_graphs.py`` pads eager steps and the logits head against, ``EAGER_GRANULE``).

    python benchmarks/gpu_gemm_first_use.py [--save]

The Gemma-3-like model's four linear shapes (q|k|v, o, gate|up, down: hidden 1152, intermediate 6912), bf16, each
step one ``F.linear`` per shape on its own input. After warming 16-33792 rows once: 40 random row counts in
4097-33791 (first use), the same 40 again, then 40 counts rounded up to multiples of 256 (first and again). Host
ms per step (the launches) and total ms (to the device's end). Run it on a fresh machine: cuBLAS keeps the kernels
it builds on the machine, so a second process meets fewer new shapes. Writes ``gpu_gemm_first_use.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402

SHAPES = [(1536, 1152), (1152, 1024), (13824, 1152), (1152, 6912)]     # (out, in) of the Gemma-3-like linears
MAX_ROWS = 33792


def main() -> None:
    ap = argparse.ArgumentParser()
    add_output_args(ap, "gpu_gemm_first_use")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    torch.manual_seed(0)
    rng = random.Random(0)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in SHAPES]
    xs = {k: torch.randn(MAX_ROWS, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}

    def step(rows: int) -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w in ws:
            F.linear(xs[w.shape[1]][:rows], w)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3

    for rows in (16, 128, 1024, 4096, 8192, MAX_ROWS):
        step(rows), step(rows)
    exact = rng.sample(range(4097, MAX_ROWS), 40)
    padded = [-(-r // 256) * 256 for r in rng.sample(range(4097, MAX_ROWS), 40)]
    rows_out = {}
    for name, counts in (("exact", exact), ("padded_256", padded)):
        for phase in ("first", "again"):
            runs = [step(r) for r in counts]
            rows_out[f"{name}_{phase}"] = {"host_ms": statistics.mean(h for h, _ in runs),
                                           "host_ms_max": max(h for h, _ in runs),
                                           "total_ms": statistics.mean(t for _, t in runs)}
            print(f"{name:>10} {phase:>5}: host {rows_out[f'{name}_{phase}']['host_ms']:.3f} ms/step "
                  f"(max {rows_out[f'{name}_{phase}']['host_ms_max']:.3f}), total "
                  f"{rows_out[f'{name}_{phase}']['total_ms']:.3f} ms", flush=True)
    write_json(args, "gpu_gemm_first_use", {"meta": {"device": torch.cuda.get_device_name(), "commit": commit(),
                                                     "torch": torch.__version__, "shapes": SHAPES},
                                            "rows": rows_out})


if __name__ == "__main__":
    main()
