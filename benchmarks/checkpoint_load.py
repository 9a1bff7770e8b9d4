"""What the checks of a checkpoint load cost: the NaN/inf check per tensor, and the header checks.

A native checkpoint of ~400 MB (fp32; a 4-layer attention + MLP model with a 16k vocabulary, ~100 M
parameters) and its bf16 twin are written once and loaded with ``load_model`` as fp32 and as bf16, with the
finite check on and off (``copy_finite`` patched to a plain copy); best of ``--reps``. Also timed, per GB on the
same tensors: ``all_finite`` (one min/max reduction), ``torch.isfinite(t).all()`` (what it replaces; it writes
a bool per element) and the parameter copy itself; and ``read_header`` + the meta build + the shape check
(everything before the first byte of tensor data is read).

    python benchmarks/checkpoint_load.py [--reps 3] [--out benchmarks/results/checkpoint_load.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hybridkv.models import MLP, Attention, HybridConfig, Layer, hybrid
from hybridkv.models.hybrid import all_finite, build_model, check_full_shapes, load_model, meta_model, save_model
from hybridkv.models.safetensors_file import read_header


def best(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def plain_copy(dest: torch.Tensor, value: torch.Tensor) -> bool:
    """``copy_finite`` without the check."""
    with torch.no_grad():
        dest.copy_(value)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint_load.json"))
    args = ap.parse_args()

    attention = Attention(num_heads=16, num_kv_heads=4, head_dim=64)
    config = HybridConfig(vocab_size=16384, hidden_size=1024, layers=tuple(
        Layer(mixer=attention, ffn=MLP(intermediate_size=4096)) for _ in range(4)))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(build_model(config, seed=0), tmp)
        save_model(build_model(config, seed=0, dtype=torch.bfloat16), Path(tmp) / "bf16")
        size = (Path(tmp) / "model.safetensors").stat().st_size
        for stored, directory in (("float32", tmp), ("bfloat16", str(Path(tmp) / "bf16"))):
            for dtype in (torch.float32, torch.bfloat16):
                on = best(lambda directory=directory, dtype=dtype: load_model(directory, dtype=dtype), args.reps)
                original = hybrid.copy_finite
                hybrid.copy_finite = plain_copy
                try:
                    off = best(lambda directory=directory, dtype=dtype: load_model(directory, dtype=dtype), args.reps)
                finally:
                    hybrid.copy_finite = original
                rows.append({"what": f"{stored} file -> {str(dtype).removeprefix('torch.')}", "check_on_s": on,
                             "check_off_s": off, "overhead_pct": 100 * (on - off) / off})
        def checks_before_data() -> None:
            header = read_header(Path(tmp) / "model.safetensors")
            check_full_shapes(meta_model(config, torch.float32), {n: h.shape for n, h in header.items()},
                              where=tmp)

        before_data = best(checks_before_data, args.reps)
        model = load_model(tmp)
        params = [p.detach() for p in model.parameters()]
        dst = [torch.empty_like(p) for p in params]
        gb = sum(p.numel() * p.element_size() for p in params) / 1e9
        per_gb = {
            "copy_": best(lambda: [d.copy_(p) for d, p in zip(dst, params, strict=True)], args.reps) / gb,
            "all_finite": best(lambda: [all_finite(p) for p in params], args.reps) / gb,
            "isfinite().all()": best(lambda: [bool(torch.isfinite(p).all()) for p in params], args.reps) / gb,
        }

    table = Table(title=f"checkpoint load, {size / 1e6:.0f} MB as fp32 safetensors (best of {args.reps})")
    for column in ("load", "finite check on (s)", "off (s)", "overhead"):
        table.add_column(column, justify="left" if column == "load" else "right")
    for row in rows:
        table.add_row(row["what"], f"{row['check_on_s']:.3f}", f"{row['check_off_s']:.3f}",
                      f"{row['overhead_pct']:+.1f}%")
    per = Table(title="per GB of fp32 parameters")
    per.add_column("op")
    per.add_column("s/GB", justify="right")
    for name, value in per_gb.items():
        per.add_row(name, f"{value:.3f}")
    per.add_row("headers + meta build + shape check (whole checkpoint)", f"{before_data:.4f} s")
    console = Console(width=110)
    console.print(table)
    console.print(per)

    result = {"meta": {"host": platform.node(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "load_average": os.getloadavg(), "file_bytes": size},
              "loads": rows, "seconds_per_gb": per_gb, "checks_before_data_s": before_data}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
