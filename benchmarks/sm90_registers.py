"""Registers and spills of the mixed step's heavy kernels as ptxas compiles them for sm_90a (no GPU needed).

    python benchmarks/sm90_registers.py [--save]   # writes sm90_registers.json (``_results.py``)

Each case is compiled by Triton for an sm_90a target (its PTX), then assembled by the ptxas Triton ships with
``-v``, which reports the registers per thread, the stack frame and the bytes spilled to local memory. A spill
is a store and a load through the L1 on every trip of the loop that holds it, so on the latency-bound small
steps of serving it is time. The cases: the paged attention's prefill form at d = 256 (Gemma-3's heads) at the
shape ``launch_config`` picks for a small step (64 rows, split in two as a captured mixed step is) and for a long
prefill (128 rows, unsplit), with and without a sliding window; the Mamba2 scan at ``ssd_launch_config``'s shape for
64 heads x 64 channels, state 128 (the NemotronH-like model of ``gpu_decode.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)      # (triton.jit decides at decoration time: before the kernels' import)

import triton  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402

from hybridkv.backends import triton_attention as ta  # noqa: E402
from hybridkv.backends import triton_ssd as ts  # noqa: E402

FLOATS = {"scale", "softcap", "eps", "attn_scale", "floor_scale", "dt_min", "dt_max"}
INT_PTRS = {"qsl_ptr", "seq_lens_ptr", "bt_ptr", "pos_ptr", "slot_ptr", "idx_ptr", "init_ptr"}
PTXAS_FIELDS = {"registers": r"Used (\d+) registers", "stack_bytes": r"(\d+) bytes stack frame",
                "spill_store_bytes": r"(\d+) bytes spill stores", "spill_load_bytes": r"(\d+) bytes spill loads"}
FP32_PTRS = {"part_acc_ptr", "part_ml_ptr", "inv_freq_ptr", "state_ptr", "A_ptr", "D_ptr", "dtb_ptr"}


def ptx_for_sm90(fn, consts: dict, *, num_warps: int, num_stages: int) -> str:
    """``fn``'s PTX for sm_90a: pointers bf16 unless named above, other scalars i32 unless floats."""
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INT_PTRS else "*fp32" if name in FP32_PTRS else "*bf16"
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    out = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps, "num_stages": num_stages})
    return out.asm["ptx"]


def _number(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else 0


def ptxas_report(ptx: str) -> dict[str, int]:
    """``ptxas -v`` on ``ptx`` for sm_90a: registers, stack frame and spill bytes. Triton ships two assemblers; the
    first that accepts this PTX's version is used."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp) / "k.ptx", Path(tmp) / "k.o"
        src.write_text(ptx)
        errors = []
        for name in ("ptxas-blackwell", "ptxas"):
            exe = bin_dir / name
            if not exe.exists():
                continue
            run = subprocess.run([str(exe), "--gpu-name", "sm_90a", "-v", "-O3", str(src), "-o", str(obj)],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                return {key: _number(pattern, run.stdout + run.stderr) for key, pattern in PTXAS_FIELDS.items()}
            errors.append(f"{name}: {run.stderr.strip()[-300:]}")
    raise RuntimeError("no ptxas Triton ships accepts this PTX: " + " | ".join(errors) if errors else
                       f"no ptxas in {bin_dir}")


def attention_case(rows: int, window: bool) -> tuple[str, object, dict, dict]:
    cfg = ta.launch_config(head_dim=256, group=4, max_query_len=260 if rows == 64 else 2048)
    assert cfg["BLOCK_M"] == rows, cfg
    consts = dict(HEAD_DIM=256, HEAD_DIM_P=256, GROUP=4, BLOCK_M=cfg["BLOCK_M"], BLOCK_Q=cfg["BLOCK_Q"],
                  TILE=cfg["TILE"], BLOCK_SIZE=16, IS_CAUSAL=True, USE_WINDOW=window, USE_SOFTCAP=False,
                  HAS_SINKS=False, SPLIT=rows == 64, SEGS=2 if rows == 64 else 0, PRECISION="tf32", DECODE=False,
                  PREP=False, ROT_DIM=0, INTERLEAVED=False, QK_NORM=False, POST_NORM=False, GEMMA=False,
                  TEMPERATURE=False, PDL=True)
    name = (f"attention prefill d=256, {cfg['BLOCK_M']} x {cfg['TILE']}, {cfg['num_warps']} warps"
            f"{', window' if window else ''}{', 2 segments (captured)' if rows == 64 else ', unsplit'}")
    return name, ta._paged_attention_kernel.graph, consts, cfg


def ssd_case() -> tuple[str, object, dict, dict]:
    cfg = ts.ssd_launch_config(headdim=64, dstate=128, decode=False)
    consts = dict(CHUNK=cfg["CHUNK"], BLOCK_P=cfg["BLOCK_P"], N_P=128, D_MODE=1, HAS_Z=True, HAS_DT_BIAS=True,
                  SOFTPLUS=True, PRECISION="tf32", PDL=True)
    name = f"Mamba2 scan, {cfg['CHUNK']}-token chunks x {cfg['BLOCK_P']} channels, {cfg['num_warps']} warps"
    return name, ts._ssd_scan_kernel, consts, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap, "sm90_registers")
    args = ap.parse_args()
    cases = [attention_case(64, False), attention_case(64, True), attention_case(128, False),
             attention_case(128, True), ssd_case()]
    rows = []
    for name, fn, consts, cfg in cases:
        report = ptxas_report(ptx_for_sm90(fn, consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        rows.append({"kernel": name, **report})
    table = Table(title=f"sm_90a registers and spills (ptxas -v; triton {triton.__version__}, {commit()})")
    for col in ("kernel", "registers", "stack B", "spill stores B", "spill loads B"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in rows:
        table.add_row(r["kernel"], str(r["registers"]), str(r["stack_bytes"]), str(r["spill_store_bytes"]),
                      str(r["spill_load_bytes"]))
    Console(width=140).print(table)
    write_json(args, "sm90_registers", {"meta": {"device": f"CPU ({platform.processor() or platform.machine()}), "
                                                           "compiled for sm_90a", "commit": commit(),
                                                 "command": " ".join(["benchmarks/sm90_registers.py", *sys.argv[1:]]),
                                                 "triton": triton.__version__},
                                        "kernels": rows})


if __name__ == "__main__":
    main()
