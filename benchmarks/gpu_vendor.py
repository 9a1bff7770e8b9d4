# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Vendor kernels on the GPU: each vendor op against our torch reference, then timed against the triton op.

    bash benchmarks/build_vendor.sh start; bash benchmarks/build_vendor.sh wait   # mamba-ssm, causal-conv1d
    VENDOR_PACKAGES=flash_attn bash benchmarks/build_vendor.sh start   # flash-attn (reduced build, ~7.5 min)
    PYTHONPATH=/tmp/site:. python benchmarks/gpu_vendor.py [--quick] [--save]
    # writes gpu_vendor.json, scenario <the importable packages>, e.g. mamba_ssm (``_results.py``)

1. Correctness: random packed batches (new requests, continuations, 0/1-token requests, shuffled slots; fresh
   slots hold NaN that must never be read), fp32 and bf16 inputs. Relative Frobenius error of the output and of
   the whole state pool vs the reference run on the same inputs (fp32 math). Cases that a kernel cannot run are
   recorded with the error (UnsupportedConfig = the adapter refused, anything else = a gap to fix).
2. Speed: ``triton.testing.do_bench`` (median, L2 flushed) of the vendor op vs the triton backend's op on
   model-sized shapes: a Mamba-Codestral-7B-like Mamba2 layer (128 heads x 64, 8 groups, d_state 128, conv
   dim 10240, kernel 4, chunk 256) and a Jamba-like Mamba-1 decode (8192 channels, d_state 16); flash-attn
   (when importable) on block size 256 vs our paged attention, at the benchmark models' head shapes.
Packages that are not importable are reported and skipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from gpu_attention import eager_time_us, print_table  # noqa: E402

from hybridkv.backends import get_backend  # noqa: E402
from hybridkv.backends import vendor_flash_attn as vfa  # noqa: E402
from hybridkv.backends import vendor_mamba as vm  # noqa: E402
from hybridkv.backends.base import UnsupportedConfig  # noqa: E402
from hybridkv.layers.ops import (  # noqa: E402
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    paged_attention_ref,
    selective_state_update_mamba1_ref,
    ssd_chunk_scan_ref,
    ssd_state_update_ref,
)
from hybridkv.metadata import CommonAttentionMetadata  # noqa: E402

DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().nan_to_num(0.0), b.float().nan_to_num(0.0)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ packed batches

class Packed:
    """Packed requests with state slots: qsl, slot ids, has-initial flags; fresh slots are NaN in pools."""

    def __init__(self, lens: list[int], seed: int, spare: int = 2) -> None:
        rng = np.random.default_rng(seed)
        self.lens = lens
        self.num_slots = len(lens) + spare
        self.slots = [int(s) for s in rng.permutation(self.num_slots)[:len(lens)]]
        self.has_init = [bool(b) for b in rng.integers(0, 2, size=len(lens))]
        self.qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=DEV)
        self.idx = torch.tensor(self.slots, device=DEV)
        self.init = torch.tensor(self.has_init, device=DEV)
        self.g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, device=DEV).to(dtype)

    def pool(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        p = self.randn(self.num_slots, *shape, dtype=dtype)
        for s, h in zip(self.slots, self.has_init, strict=True):
            if not h:
                p[s] = float("nan")
        return p


def random_lens(rng: np.random.Generator, n: int, max_len: int) -> list[int]:
    return [int(x) for x in rng.choice([0, 1, 2, 3, 17, 64, 255, 256, 257, max_len], size=n)]


# ------------------------------------------------------------------------------------------ correctness

def check_conv(ops, lens, seed, dtype, dim=256, width=4) -> dict:
    b = Packed(lens, seed)
    x, w, bias = b.randn(sum(lens), dim, dtype=dtype), b.randn(dim, width, dtype=dtype), b.randn(dim, dtype=dtype)
    pool = b.pool(dim, width - 1, dtype=dtype)
    ref_pool = pool.clone()
    ref = causal_conv1d_ref(x, w, bias, conv_states=ref_pool, query_start_loc=b.qsl, state_indices=b.idx,
                            has_initial_state=b.init)
    out = ops["causal_conv1d"](x, w, bias, conv_states=pool, query_start_loc=b.qsl, state_indices=b.idx,
                               has_initial_state=b.init)
    res = {"out": rel(out, ref), "state": rel(pool, ref_pool), "nan_ok": bool(torch.equal(pool.isnan(),
                                                                                          ref_pool.isnan()))}
    xd = b.randn(len(lens), dim, dtype=dtype)
    pool = pool.nan_to_num(0.0)
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(xd, conv_states=ref_pool, weight=w, bias=bias, state_indices=b.idx)
    out = ops["causal_conv1d_update"](xd, conv_states=pool, weight=w, bias=bias, state_indices=b.idx)
    res.update(update_out=rel(out, ref), update_state=rel(pool, ref_pool))
    return res


def ssd_inputs(b: Packed, t: int, h: int, p: int, g: int, n: int, dtype) -> dict:
    return dict(x=b.randn(t, h, p, dtype=dtype), dt=b.randn(t, h, dtype=dtype) - 1.0,
                A=-(torch.rand(h, generator=b.g, device=DEV) * 4 + 0.1), B=b.randn(t, g, n, dtype=dtype),
                C=b.randn(t, g, n, dtype=dtype), D=b.randn(h), dt_bias=b.randn(h))


def check_ssd(ops, lens, seed, dtype, h=8, p=64, g=2, n=64, chunk=256, limit=(0.0, math.inf)) -> dict:
    b = Packed(lens, seed)
    kw = ssd_inputs(b, sum(lens), h, p, g, n, dtype)
    pool = b.pool(h, p, n)
    ref_pool = pool.clone()
    ref = ssd_chunk_scan_ref(**kw, chunk_size=chunk, query_start_loc=b.qsl, ssm_states=ref_pool,
                             state_indices=b.idx, has_initial_state=b.init, dt_limit=limit)
    out = ops["ssd_chunk_scan"](**kw, chunk_size=chunk, query_start_loc=b.qsl, ssm_states=pool,
                                state_indices=b.idx, has_initial_state=b.init, dt_limit=limit)
    res = {"out": rel(out, ref), "state": rel(pool, ref_pool),
           "nan_ok": bool(torch.equal(pool.isnan(), ref_pool.isnan()))}
    d = ssd_inputs(b, len(lens), h, p, g, n, dtype)
    x, dt, A, B, C = (d.pop(k) for k in ("x", "dt", "A", "B", "C"))
    pool = pool.nan_to_num(0.0)
    ref_pool = pool.clone()
    ref = ssd_state_update_ref(ref_pool, x, dt, A, B, C, state_indices=b.idx, dt_limit=limit, **d)
    out = ops["ssd_state_update"](pool, x, dt, A, B, C, state_indices=b.idx, dt_limit=limit, **d)
    res.update(update_out=rel(out, ref), update_state=rel(pool, ref_pool))
    return res


def check_mamba1_update(ops, batch, seed, dtype, dim=512, n=16) -> dict:
    b = Packed([1] * batch, seed)
    x, dt = b.randn(batch, dim, dtype=dtype), b.randn(batch, dim, dtype=dtype)
    A = -torch.rand(dim, n, generator=b.g, device=DEV)
    B, C, z = b.randn(batch, n, dtype=dtype), b.randn(batch, n, dtype=dtype), b.randn(batch, dim, dtype=dtype)
    pool = b.pool(dim, n).nan_to_num(0.0)
    ref_pool = pool.clone()
    kw = dict(D=b.randn(dim), z=z, dt_bias=b.randn(dim))
    ref = selective_state_update_mamba1_ref(ref_pool, x, dt, A, B, C, state_indices=b.idx, **kw)
    out = ops["selective_state_update"](pool, x, dt, A, B, C, state_indices=b.idx, **kw)
    return {"update_out": rel(out, ref), "update_state": rel(pool, ref_pool)}


def attention_batch(q_lens, s_lens, *, bs, heads, kv_heads, d, dtype, seed):
    """CAM + the engine's strided pool views; blocks no request references hold NaN."""
    rng = np.random.default_rng(seed)
    need = [-(-s // bs) for s in s_lens]
    ids = rng.permutation(np.arange(1, sum(need) + 3))
    bt = np.zeros((len(s_lens), max(need)), np.int64)
    off = 0
    for r, k in enumerate(need):
        bt[r, :k] = ids[off:off + k]
        off += k
    cam = CommonAttentionMetadata.build(query_lens=q_lens, seq_lens=s_lens, block_table=bt, block_size=bs,
                                        device=DEV)
    pool = torch.full((sum(need) + 3, 2, bs, kv_heads, d), float("nan"), device=DEV, dtype=dtype)
    used = torch.from_numpy(ids[:sum(need)]).to(DEV)
    pool[used] = torch.randn(len(used), 2, bs, kv_heads, d, device=DEV).to(dtype)
    q = torch.randn(sum(q_lens), heads, d, device=DEV).to(dtype)
    return cam, q, pool[:, 0], pool[:, 1], d ** -0.5


def check_flash(ops, q_lens, s_lens, heads, kv_heads, d, window, softcap, seed) -> dict:
    cam, q, k, v, scale = attention_batch(q_lens, s_lens, bs=256, heads=heads, kv_heads=kv_heads, d=d,
                                          dtype=torch.bfloat16, seed=seed)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), cam, scale=scale, sliding_window=window,
                              softcap=softcap)
    out = ops["paged_attention"](q, k, v, cam, scale=scale, sliding_window=window, softcap=softcap)
    return {"out": rel(out, ref), "nan_free": not bool(out.isnan().any())}


def run_case(rows: list, op: str, case: str, dtype, fn: Callable[[], dict], tol: float) -> None:
    entry = {"op": op, "case": case, "dtype": str(dtype).removeprefix("torch.")}
    try:
        entry.update(fn())
        errs = [v for k, v in entry.items() if isinstance(v, float)]
        flags = [v for k, v in entry.items() if isinstance(v, bool)]
        entry["pass"] = all(e < tol for e in errs) and all(flags)
    except UnsupportedConfig as e:
        entry.update({"error": f"UnsupportedConfig: {e.constraint}", "pass": None})
    except Exception as e:                     # a kernel crash is a finding, not a reason to stop
        entry.update(error=f"{type(e).__name__}: {e}".splitlines()[0][:300], traceback=traceback.format_exc(limit=3))
    rows.append(entry)


def correctness(mamba_ops, flash_ops, quick: bool) -> list[dict]:
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    seeds = range(2 if quick else 5)
    for dtype, tol in ((torch.float32, 5e-3), (torch.bfloat16, 3e-2)):
        if mamba_ops:
            for s in seeds:
                lens = random_lens(rng, int(rng.integers(1, 6)), 700)
                run_case(rows, "causal_conv1d(+update)", f"lens {lens}", dtype,
                         lambda: check_conv(mamba_ops, lens, s, dtype, width=2 + s % 3), tol)
                run_case(rows, "ssd_chunk_scan(+update)", f"lens {lens}", dtype,
                         lambda: check_ssd(mamba_ops, lens, s, dtype), tol)
            run_case(rows, "ssd_chunk_scan(+update)", "one request, 1000 tokens, dt_limit (0.01, 0.5)", dtype,
                     lambda: check_ssd(mamba_ops, [1000], 7, dtype, limit=(0.01, 0.5)), tol)
            run_case(rows, "ssd_chunk_scan(+update)", "odd shapes: h 3, p 24, g 1, n 24, chunk 32", dtype,
                     lambda: check_ssd(mamba_ops, [40, 0, 5, 77], 8, dtype, h=3, p=24, g=1, n=24, chunk=32), tol)
            run_case(rows, "ssd_chunk_scan(+update)", "chunk 8", dtype,
                     lambda: check_ssd(mamba_ops, [20, 3], 9, dtype, chunk=8), tol)
            run_case(rows, "causal_conv1d(+update)", "dim 24", dtype,
                     lambda: check_conv(mamba_ops, [30, 2], 10, dtype, dim=24), tol)
            run_case(rows, "selective_state_update (Mamba-1)", "batch 7", dtype,
                     lambda: check_mamba1_update(mamba_ops, 7, 11, dtype), tol)
    if flash_ops:
        cases = [([1, 7, 300, 1], [9, 7, 300, 700], 8, 2, 64, None, None),
                 ([1] * 8, [3000, 17, 256, 1024, 5, 600, 4096, 1], 32, 8, 128, None, None),
                 ([40, 1, 300], [900, 600, 300], 4, 4, 128, 200, None),
                 ([5, 100], [5, 300], 4, 2, 256, 64, 20.0)]
        for i, (ql, sl, h, kvh, d, w, cap) in enumerate(cases):
            run_case(rows, "paged_attention (flash-attn)", f"q {ql} s {sl} {h}/{kvh}/{d} w {w} cap {cap}",
                     torch.bfloat16, lambda: check_flash(flash_ops, ql, sl, h, kvh, d, w, cap, i), 2e-2)
    return rows


# ------------------------------------------------------------------------------------------ speed

def timing(mamba_ops, flash_ops, triton_be, quick: bool) -> list[dict]:
    rows: list[dict] = []
    dt_ = torch.bfloat16

    def add(op: str, shape: str, vendor: Callable[[], object], ours: Callable[[], object]) -> None:
        entry = {"op": op, "shape": shape}
        for key, fn in (("vendor_us", vendor), ("triton_us", ours)):
            try:
                entry[key] = round(eager_time_us(fn), 1)
            except Exception as e:
                entry[key] = None
                entry[key.replace("_us", "_error")] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        if entry.get("vendor_us") and entry.get("triton_us"):
            entry["vendor_speedup"] = round(entry["triton_us"] / entry["vendor_us"], 2)
        rows.append(entry)

    if mamba_ops:
        h, p, g, n, conv_dim, width, chunk = 128, 64, 8, 128, 10240, 4, 256
        prefills = [[4096], [1024] * 4, [2048, 512, 100, 17]] if not quick else [[2048], [512, 100]]
        for lens in prefills:
            b = Packed(lens, 0, spare=0)
            t = sum(lens)
            x, w, bias = b.randn(t, conv_dim, dtype=dt_), b.randn(conv_dim, width, dtype=dt_), b.randn(conv_dim,
                                                                                                       dtype=dt_)
            pool = b.pool(conv_dim, width - 1, dtype=dt_).nan_to_num(0.0)
            conv_kw = dict(conv_states=pool, query_start_loc=b.qsl, state_indices=b.idx, has_initial_state=b.init)
            add("causal_conv1d", f"lens {lens} dim {conv_dim}",
                lambda: mamba_ops["causal_conv1d"](x, w, bias, **conv_kw),
                lambda: triton_be.causal_conv1d(x, w, bias, **conv_kw))
            kw = ssd_inputs(b, t, h, p, g, n, dt_)
            spool = b.pool(h, p, n).nan_to_num(0.0)
            scan_kw = dict(chunk_size=chunk, query_start_loc=b.qsl, ssm_states=spool, state_indices=b.idx,
                           has_initial_state=b.init)
            add("ssd_chunk_scan", f"lens {lens} {h}x{p} g{g} n{n}",
                lambda: mamba_ops["ssd_chunk_scan"](**kw, **scan_kw),
                lambda: triton_be.ssd_chunk_scan(**kw, **scan_kw))
        for batch in ([1, 32] if quick else [1, 32, 128]):
            b = Packed([1] * batch, 1, spare=batch)
            xd, w, bias = b.randn(batch, conv_dim, dtype=dt_), b.randn(conv_dim, width, dtype=dt_), b.randn(
                conv_dim, dtype=dt_)
            pool = b.pool(conv_dim, width - 1, dtype=dt_).nan_to_num(0.0)
            add("causal_conv1d_update", f"batch {batch} dim {conv_dim}",
                lambda: mamba_ops["causal_conv1d_update"](xd, conv_states=pool, weight=w, bias=bias,
                                                          state_indices=b.idx),
                lambda: triton_be.causal_conv1d_update(xd, conv_states=pool, weight=w, bias=bias,
                                                       state_indices=b.idx))
            d = ssd_inputs(b, batch, h, p, g, n, dt_)
            x, dt, A, B, C = (d.pop(k) for k in ("x", "dt", "A", "B", "C"))
            spool = b.pool(h, p, n).nan_to_num(0.0)
            add("ssd_state_update", f"batch {batch} {h}x{p} g{g} n{n}",
                lambda: mamba_ops["ssd_state_update"](spool, x, dt, A, B, C, state_indices=b.idx, **d),
                lambda: triton_be.ssd_state_update(spool, x, dt, A, B, C, state_indices=b.idx, **d))
            dim1, n1 = 8192, 16
            x1, dt1 = b.randn(batch, dim1, dtype=dt_), b.randn(batch, dim1, dtype=dt_)
            A1 = -torch.rand(dim1, n1, device=DEV)
            B1, C1 = b.randn(batch, n1, dtype=dt_), b.randn(batch, n1, dtype=dt_)
            pool1 = b.pool(dim1, n1).nan_to_num(0.0)
            kw1 = dict(D=b.randn(dim1), z=b.randn(batch, dim1, dtype=dt_), dt_bias=b.randn(dim1))
            add("selective_state_update (Mamba-1)", f"batch {batch} dim {dim1} n {n1}",
                lambda: mamba_ops["selective_state_update"](pool1, x1, dt1, A1, B1, C1, state_indices=b.idx, **kw1),
                lambda: triton_be.selective_state_update(pool1, x1, dt1, A1, B1, C1, state_indices=b.idx, **kw1))
    if flash_ops:
        # head shapes: Llama-like 32/8/128 (NemotronH-like's head dim), and the benchmark models' Gemma-3-like
        # 4/1/256 and Llama-4-like 32/8/64 (benchmarks/gpu_decode.py)
        cases = [("decode B=1 ctx 8192", [1], [8192]), ("decode B=32 ctx 4096", [1] * 32, [4096] * 32),
                 ("prefill 1x4096", [4096], [4096]), ("mixed", [1] * 16 + [2048], [4096] * 16 + [2048])]
        if not quick:
            cases.append(("prefill 1x8192", [8192], [8192]))
        for h, kvh, d in ((32, 8, 128), (4, 1, 256), (32, 8, 64)):
            for name, ql, sl in cases:
                cam, q, k, v, scale = attention_batch(ql, sl, bs=256, heads=h, kv_heads=kvh, d=d, dtype=dt_, seed=0)
                k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
                add("paged_attention", f"{name} {h}/{kvh}/{d} bs 256",
                    lambda: flash_ops["paged_attention"](q, k, v, cam, scale=scale),
                    lambda: triton_be.paged_attention(q, k, v, cam, scale=scale))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    add_output_args(ap, "gpu_vendor")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    import triton

    status: dict[str, str] = {}
    mamba_ops = flash_ops = None
    try:
        mamba_ops = vm.mamba_ssm_ops()
        status["mamba_ssm"] = "ok"
    except ImportError as e:
        status["mamba_ssm"] = f"not importable: {e}"
    try:
        flash_ops = vfa.flash_attn_ops()
        status["flash_attn"] = "ok"
    except ImportError as e:
        status["flash_attn"] = f"not importable: {e}"
    print("vendor packages:", status)
    triton_be = get_backend("triton", DEV)

    corr = correctness(mamba_ops, flash_ops, args.quick)
    print_table("correctness: relative error vs the fp32 reference (out / state; +update = the decode op)",
                ["op", "case", "dtype", "out", "state", "upd out", "upd state", "pass / error"],
                [[r["op"], r["case"][:60], r["dtype"]] + [f"{r[k]:.2e}" if isinstance(r.get(k), float) else "-"
                                                         for k in ("out", "state", "update_out", "update_state")]
                 + [r.get("error", r.get("pass"))] for r in corr])
    speed = timing(mamba_ops, flash_ops, triton_be, args.quick)
    print_table("speed (bf16, do_bench median, µs): vendor vs the triton backend's op",
                ["op", "shape", "vendor µs", "triton µs", "triton / vendor"],
                [[r["op"], r["shape"], r.get("vendor_us"), r.get("triton_us"), r.get("vendor_speedup", "-")]
                 for r in speed])
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "commit": commit(), "command": " ".join(sys.argv),
        "versions": {d: version(d) for d in ("mamba-ssm", "causal-conv1d", "flash-attn")},
        "status": status, "correctness": corr, "timing": speed,
    }
    write_json(args, "gpu_vendor", result, scenario="_".join(p for p, s in sorted(status.items()) if s == "ok"))
    failed = [r for r in corr if r.get("pass") is False or ("traceback" in r)]
    if failed:
        print(f"{len(failed)} correctness case(s) failed or crashed")


if __name__ == "__main__":
    main()
