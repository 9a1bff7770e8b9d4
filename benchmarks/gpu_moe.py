# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Routed experts of decode- and mid-size batches on the GPU: the Triton tiled kernels (``impl="tiled"``) and, at up
to ``GEMV_MAX_ROWS`` assignments, the GEMVs (``impl="gemv"``) against torch's grouped GEMM (``impl="grouped"``), and
optionally another version of ``backends/triton_moe.py``.

    python benchmarks/gpu_moe.py [--tokens 1,2,4,8,16,32,64,128] [--sweep] [--sweep-gemv] [--router] [--baseline FILE]
                                 [--save]

Shapes: gpt-oss-like (32 biased experts of 2048 x 2048, top-4, clamped SwiGLU) and Qwen3-Next-like (64 experts of
512 x 2048, top-8, SiLU), bf16, uniform random routing. Each implementation is checked against the reference loop
(max |diff| / max |ref|), then timed as CUDA-graph replays; TB/s = the weight bytes of the experts the batch
touched / time, against the copy bandwidth. ``--baseline FILE``: a ``triton_moe.py`` of another commit (e.g.
``git show <commit>:hybridkv/backends/triton_moe.py > /tmp/old.py``) timed beside this one, up to its own tile size.
``--sweep``: every tile configuration of the tiled kernels at 32 tokens; ``--sweep-gemv``: the GEMV kernels'
configurations at one token (each kernel's swept with the other's as committed); ``--router``: the router's GEMV and
routing as one kernel (``linear_moe_route_triton``, a few tile shapes) against the ``linear`` + ``moe_route`` kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, write_json  # noqa: E402
from gpu_attention import copy_bandwidth, device_meta, graph_time_us, print_table  # noqa: E402

from hybridkv.backends import triton_moe  # noqa: E402
from hybridkv.layers import moe  # noqa: E402

# name, experts, top-k, dim, inter, activation, biases
SHAPES = [("gpt_oss", 32, 4, 2048, 2048, "swiglu_oai", True), ("qwen3_next", 64, 8, 2048, 512, "silu", False)]


def _experts(E: int, dim: int, inter: int, act: str, bias: bool, gen: torch.Generator) -> moe.Experts:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)

    biases = dict(gate_bias=w(E, inter), up_bias=w(E, inter), down_bias=w(E, dim)) if bias else {}
    return moe.Experts(gate=w(E, inter, dim), up=w(E, inter, dim), down=w(E, dim, inter), activation=act,
                       scale_input=False, **biases)


def _kernel_args(ex: moe.Experts) -> dict:
    return dict(gate=ex.gate, up=ex.up, down=ex.down, activation=ex.activation, scale_input=False,
                gate_bias=ex.gate_bias, up_bias=ex.up_bias, down_bias=ex.down_bias)


def compare(tokens: list[int], baseline, copy_bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, E, k, dim, inter, act, bias in SHAPES:
        ex = _experts(E, dim, inter, act, bias, gen)
        for T in tokens:
            x = torch.randn(T, dim, device="cuda", generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)])
            w = torch.rand(T, k, device="cuda", generator=gen)
            wbytes = ids.unique().numel() * 3 * inter * dim * 2
            ref = moe.moe_experts_ref(x, ids, w, ex).float()
            impls = {"tiled": lambda: triton_moe.moe_experts_tiled(x, ids, w, **_kernel_args(ex)),
                     "grouped": lambda: moe.moe_experts_grouped(x, ids, w, ex)}
            if baseline is not None and T * k <= getattr(baseline, "_TILED_MAX_ROWS", 128):
                impls["baseline tiled"] = lambda: baseline.moe_experts_tiled(x, ids, w, **_kernel_args(ex))
            if T * k <= moe.GEMV_MAX_ROWS:
                impls["gemv"] = lambda: triton_moe.moe_experts_gemv(x, ids, w, **_kernel_args(ex))
                if baseline is not None:
                    impls["baseline gemv"] = lambda: baseline.moe_experts_gemv(x, ids, w, **_kernel_args(ex))
            row = {"family": name, "tokens": T, "assignments": T * k, "experts_used": ids.unique().numel(),
                   "weight_MB": wbytes / 1e6}
            for key, fn in impls.items():
                row[f"{key} err"] = float((fn().float() - ref).abs().max() / ref.abs().max())
                us = graph_time_us([fn])
                row[f"{key} us"] = us
                row[f"{key} TB/s"] = wbytes / us / 1e6
            row["tiled % copy"] = 100 * row["tiled TB/s"] * 1e12 / copy_bw
            rows.append(row)
            print(row, flush=True)
    return rows


@contextlib.contextmanager
def _configured(**attrs: dict):
    """``backends/triton_moe.py``'s launch configurations ``attrs`` for the block (the tiled kernels' choice, cached
    per shape, cleared on the way in and out)."""
    with mock.patch.multiple(triton_moe, **attrs):
        triton_moe._tiled_config.cache_clear()
        try:
            yield
        finally:
            triton_moe._tiled_config.cache_clear()


def sweep() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for name, E, k, dim, inter, act, bias in SHAPES:
        ex = _experts(E, dim, inter, act, bias, gen)
        x = torch.randn(32, dim, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(32)])
        w = torch.rand(32, k, device="cuda", generator=gen)
        ref = moe.moe_experts_ref(x, ids, w, ex).float()
        wbytes = ids.unique().numel() * 3 * inter * dim * 2
        for bn, bk, st in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5)):
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=st)
            fn = lambda: triton_moe.moe_experts_tiled(x, ids, w, **_kernel_args(ex))
            with _configured(_TILED_GATE_UP=cfg, _TILED_DOWN=cfg):
                err = float((fn().float() - ref).abs().max() / ref.abs().max())
                us = graph_time_us([fn])
            out.append({"family": name, **cfg, "err": err, "us": us, "TB/s": wbytes / us / 1e6})
            print("sweep", out[-1], flush=True)
    return out


def sweep_gemv() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(2)
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
               for bn, bk, wp, st in itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8), (1,))]
    out = []
    for name, E, k, dim, inter, act, bias in SHAPES:
        ex = _experts(E, dim, inter, act, bias, gen)
        x = torch.randn(1, dim, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.randperm(E, device="cuda", generator=gen)[:k][None]
        w = torch.rand(1, k, device="cuda", generator=gen)
        ref = moe.moe_experts_ref(x, ids, w, ex).float()
        wbytes = k * 3 * inter * dim * 2
        fn = lambda: triton_moe.moe_experts_gemv(x, ids, w, **_kernel_args(ex))
        for kernel in ("gate_up", "down"):
            for cfg in configs:
                try:
                    with _configured(**{"_GATE_UP" if kernel == "gate_up" else "_DOWN": {"wide": cfg, "narrow": cfg}}):
                        err = float((fn().float() - ref).abs().max() / ref.abs().max())
                        us = graph_time_us([fn])
                except Exception as e:                 # a configuration that does not compile
                    print("sweep-gemv skip", name, kernel, cfg, type(e).__name__, flush=True)
                    continue
                out.append({"family": name, "kernel": kernel, **cfg, "err": err, "us": us,
                            "TB/s": wbytes / us / 1e6})
                print("sweep-gemv", out[-1], flush=True)
    for name in dict.fromkeys(r["family"] for r in out):
        for kernel in ("gate_up", "down"):
            best = min((r for r in out if r["family"] == name and r["kernel"] == kernel), key=lambda r: r["us"])
            print("sweep-gemv best", best, flush=True)
    return out


def router(tokens: list[int]) -> list[dict]:
    from hybridkv.backends import triton_linear

    gen = torch.Generator(device="cuda").manual_seed(3)
    configs = [dict(BLOCK_N=bn, BLOCK_KD=bk, num_warps=4) for bn, bk in ((1, 2048), (2, 1024), (1, 1024), (4, 256))]
    # name, rows (experts + packed gates), experts, top-k, router, bias
    shapes = [("gpt_oss", 32, 32, 4, "topk_softmax", True), ("qwen3_next", 65, 64, 8, "softmax", False)]
    out = []
    for name, n, E, k, kind, bias in shapes:
        w = (torch.randn(n, 2048, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        b = (torch.randn(n, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) if bias else None
        kw = dict(num_experts=E, router=kind, top_k=k, renormalize=kind == "softmax")
        for T in tokens:
            x = torch.randn(T, 2048, device="cuda", generator=gen).to(torch.bfloat16)

            def composite():
                logits = triton_linear.linear(x, w, b)
                return triton_moe.moe_route(logits[:, :E], router=kind, top_k=k, renormalize=kind == "softmax")

            want = composite()[0]
            row = {"family": name, "tokens": T, "linear + route us": graph_time_us([composite])}
            fn = lambda: triton_moe.linear_moe_route_triton(x, w, b, **kw)
            for cfg in configs:
                with _configured(_LINEAR_ROUTE=cfg):
                    row[f"fused {cfg['BLOCK_N']}x{cfg['BLOCK_KD']} same ids"] = bool(torch.equal(fn()[0], want))
                    row[f"fused {cfg['BLOCK_N']}x{cfg['BLOCK_KD']} us"] = graph_time_us([fn])
            out.append(row)
            print("router", row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--sweep", action="store_true", help="also time every tile configuration at 32 tokens")
    ap.add_argument("--sweep-gemv", action="store_true", help="also time the GEMV kernels' configurations")
    ap.add_argument("--router", action="store_true", help="also time the fused router against linear + route")
    ap.add_argument("--baseline", type=Path, default=None, help="another commit's triton_moe.py to time beside")
    add_output_args(ap, "gpu_moe")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    baseline = None
    if args.baseline is not None:
        spec = importlib.util.spec_from_file_location("triton_moe_baseline", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    meta = device_meta() | {"command": " ".join(sys.argv)}
    copy_bw = copy_bandwidth()
    meta["copy_bandwidth_GBps"] = copy_bw / 1e9
    rows = compare([int(t) for t in args.tokens.split(",")], baseline, copy_bw)
    swept = sweep() if args.sweep else []
    swept_gemv = sweep_gemv() if args.sweep_gemv else []
    routed = router([1, 2, 8]) if args.router else []
    write_json(args, "gpu_moe", {"meta": meta, "rows": rows, "sweep": swept, "sweep_gemv": swept_gemv,
                                 "router": routed})
    cols = ["gemv", "tiled", "grouped"] + (["baseline gemv", "baseline tiled"] if baseline is not None else [])
    print_table(f"routed experts on {meta['device']} (µs per call, graph replays; copy bw {copy_bw / 1e9:.0f} GB/s)",
                ["family", "tokens", "assignments", "experts", *[f"{c} µs" for c in cols], "tiled TB/s", "% copy",
                 "tiled err"],
                [[r["family"], r["tokens"], r["assignments"], r["experts_used"],
                  *[f"{r[f'{c} us']:.1f}" if f"{c} us" in r else "" for c in cols], f"{r['tiled TB/s']:.2f}",
                  f"{r['tiled % copy']:.0f}", f"{r['tiled err']:.1e}"] for r in rows])


if __name__ == "__main__":
    main()
