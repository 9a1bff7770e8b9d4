# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Triton gated delta rule / KDA kernels on the GPU: correctness vs the fp32 references, then speed vs the torch
references and, when installed, flash-linear-attention (``backend="fla"``, an optional vendor comparison).

    python benchmarks/gpu_delta_rule.py [--quick] [--sweep] [--save]     # writes gpu_delta_rule.json

Kernels (hybridkv/backends/triton_gated_delta.py): the chunked prefill (``gated_delta_rule_triton``,
``kda_triton``), the token-by-token prefill (``*_recurrent_triton``) and the decode update (``*_update_triton``);
fla through ``hybridkv/backends/vendor_fla.py`` (``chunk_gated_delta_rule``, ``chunk_kda``, and its continuous-
batching recurrent kernel for decode), i.e. what ``backend="fla"`` runs, adapter costs included.

Shapes, one layer of a ~1B model, head dims 128 (Qwen3-Next's and Kimi-Linear's): "gdn 16/16" 16 q/k and 16 value
heads; "gdn 16/32 GVA" 16 q/k heads shared by 32 value heads (Qwen3-Next's ratio); "kda 16" 16 heads. bf16 inputs,
fp32 states, q/k L2 norm in the op, the decay computed in the op from A_log / dt_bias (as the layers call it).

1. Correctness (a mixed packed batch: lengths 1, 700, 64, 129, 1, 333, 2048 with and without initial states,
   shuffled slots, unused slots NaN; and 1 x 4096): relative error of outputs and final states vs the fp32
   reference on the same bf16 values; fla's beside ours. Pass: finite, < 2e-2 (bf16 dots), unused slots still NaN.
2. Prefill: 1 x 4096, 8 x 2048 and 64 x 64 tokens; time per call (``do_bench``), Mtok/s; the reference once.
3. Decode: batch 1, 8, 32, 128; CUDA-graph replays over rotated state-slot sets (> 4x L2 touched: HBM measured) and
   eager; bytes = states read + written (+ the small inputs); % of the copy bandwidth.
4. ``--sweep [gdn,kda,update]``: every tile configuration of the chunked and decode kernels, each checked against
   the reference first, timed at 1 x 4096 tokens / batch 32: the numbers behind ``delta_launch_config``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, write_json  # noqa: E402
from gpu_attention import copy_bandwidth, device_meta, eager_time_us, fmt, graph_time_us, print_table  # noqa: E402

from hybridkv.backends import triton_gated_delta as tg  # noqa: E402
from hybridkv.layers.ops.gated_delta_ref import (  # noqa: E402
    gated_delta_rule_ref,
    gated_delta_rule_update_ref,
    kda_ref,
    kda_update_ref,
)

NAN = float("nan")
DEVICE = "cuda"

# name, kind, q/k heads, value heads, head_k_dim, head_v_dim
SHAPES = [("gdn 16/16 x128", "gdn", 16, 16, 128, 128), ("gdn 16/32 GVA x128", "gdn", 16, 32, 128, 128),
          ("kda 16 x128", "kda", 16, 16, 128, 128)]
REF = {"gdn": gated_delta_rule_ref, "kda": kda_ref}
REF_UPDATE = {"gdn": gated_delta_rule_update_ref, "kda": kda_update_ref}
OURS = {("gdn", "chunk"): tg.gated_delta_rule_triton, ("gdn", "recurrent"): tg.gated_delta_rule_recurrent_triton,
        ("kda", "chunk"): tg.kda_triton, ("kda", "recurrent"): tg.kda_recurrent_triton}
OURS_UPDATE = {"gdn": tg.gated_delta_rule_update_triton, "kda": tg.kda_update_triton}


def fla_ops() -> dict[str, Callable] | None:
    """backend="fla"'s ops, or None when flash-linear-attention is not installed (reported, not an error)."""
    try:
        from hybridkv.backends.vendor_fla import fla_ops as ops

        return ops()
    except ImportError as e:
        print(f"fla not available ({e}): vendor columns left empty", flush=True)
        return None


# ------------------------------------------------------------------------------------------ inputs

class Packed:
    """A packed batch: lengths, query_start_loc, shuffled distinct slots (+ spares), has_initial_state."""

    def __init__(self, lens: list[int], seed: int, spare: int = 3, init_frac: float = 0.6):
        rng = np.random.default_rng(seed)
        self.lens = list(lens)
        self.num_tokens = sum(lens)
        self.num_slots = len(lens) + spare
        self.slots_list = [int(s) for s in rng.permutation(self.num_slots)[: len(lens)]]
        self.init_list = [bool(v) for v in rng.random(len(lens)) < init_frac]
        self.meta = dict(query_start_loc=torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32,
                                                      device=DEVICE),
                         state_indices=torch.tensor(self.slots_list, device=DEVICE),
                         has_initial_state=torch.tensor(self.init_list, device=DEVICE))

    def pool(self, shape: tuple[int, ...], g: torch.Generator, scale: float = 0.1) -> torch.Tensor:
        """fp32; random where a request continues from its slot, NaN in fresh and unused slots."""
        pool = torch.full((self.num_slots, *shape), NAN, device=DEVICE)
        for s, h in zip(self.slots_list, self.init_list, strict=True):
            if h:
                pool[s] = torch.randn(shape, generator=g, device=DEVICE) * scale
        return pool

    def unused_nan(self, pool: torch.Tensor) -> bool:
        unused = [s for s in range(self.num_slots) if s not in self.slots_list]
        return bool(torch.isnan(pool[unused]).all()) if unused else True


def inputs(n: int, kind: str, hk: int, hv: int, dk: int, dv: int, g: torch.Generator, dtype=torch.bfloat16) -> dict:
    """The layer's call: q / k / v strided views of one packed conv-output row, the raw gate input with A_log /
    dt_bias (the decay computed in the op), beta = sigmoid; values representable in ``dtype``."""
    r = lambda *s: torch.randn(*s, generator=g, device=DEVICE)
    row = r(n, 2 * hk * dk + hv * dv).to(dtype)
    q = row[:, : hk * dk].view(n, hk, dk)
    k = row[:, hk * dk: 2 * hk * dk].view(n, hk, dk)
    v = row[:, 2 * hk * dk:].view(n, hv, dv)
    g_shape = (n, hv, dk) if kind == "kda" else (n, hv)
    return dict(q=q, k=k, v=v, g=r(*g_shape), beta=torch.sigmoid(r(n, hv)),
                A_log=torch.log(torch.rand(hv, generator=g, device=DEVICE) * 4 + 0.5),
                dt_bias=r(*g_shape[1:]))


def f32(p: dict) -> dict:
    return {k: v.float() for k, v in p.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return float("nan")
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@contextlib.contextmanager
def launch_config(overrides: dict | None) -> Iterator[None]:
    """``delta_launch_config`` with ``overrides`` applied (the sweep)."""
    rule = tg.delta_launch_config
    if overrides:
        tg.delta_launch_config = lambda **kw: {**rule(**kw), **overrides}
    try:
        yield
    finally:
        tg.delta_launch_config = rule


# ------------------------------------------------------------------------------------------ correctness

TOL = 2e-2


def correctness(quick: bool, vendor: dict | None) -> list[dict]:
    rows = []
    batches = [("mixed 7 reqs", [1, 700, 64, 129, 1, 333, 2048]), ("1 x 4096", [4096])]
    for bname, lens in batches[:1] if quick else batches:
        for sname, kind, hk, hv, dk, dv in SHAPES[::2] if quick else SHAPES:
            seed = len(rows)
            g = torch.Generator(device=DEVICE).manual_seed(seed)
            pk = Packed(lens, seed)
            p = inputs(pk.num_tokens, kind, hk, hv, dk, dv, g)
            pool = pk.pool((hv, dk, dv), g)
            ref_pool = pool.clone()
            ref = REF[kind](**f32(p), ssm_states=ref_pool, use_qk_l2norm=True, **pk.meta)
            used = pk.meta["state_indices"]
            candidates = [(m, OURS[(kind, m)]) for m in ("chunk", "recurrent")]
            if vendor is not None:
                candidates.append(("fla", vendor["kda" if kind == "kda" else "gated_delta_rule"]))
            finals = {}
            for method, fn in candidates:
                ours_pool = pool.clone()
                y = fn(**p, ssm_states=ours_pool, use_qk_l2norm=True, **pk.meta)
                finals[method] = ours_pool
                rows.append(_row(f"{kind} prefill", method, bname, sname, rel_err(y, ref),
                                 rel_err(ours_pool[used], ref_pool[used]), pk.unused_nan(ours_pool)))
            # decode: one token per request on the states just computed
            q = inputs(len(pk.lens), kind, hk, hv, dk, dv, g)
            upd_ref_pool = ref_pool.clone()
            ref = REF_UPDATE[kind](upd_ref_pool, **f32(q), state_indices=used, use_qk_l2norm=True)
            updates = [("update", OURS_UPDATE[kind])]
            if vendor is not None:
                updates.append(("fla", vendor["kda_update" if kind == "kda" else "gated_delta_rule_update"]))
            for method, fn in updates:
                ours_pool = ref_pool.clone()
                y = fn(ours_pool, **q, state_indices=used, use_qk_l2norm=True)
                rows.append(_row(f"{kind} decode", method, bname, sname, rel_err(y, ref),
                                 rel_err(ours_pool[used], upd_ref_pool[used]), pk.unused_nan(ours_pool)))
            print("correctness", rows[-1], flush=True)
            torch.cuda.empty_cache()
    return rows


def _row(op, method, batch, shape, e_y, e_state, slots_ok) -> dict:
    ok = math.isfinite(e_y) and math.isfinite(e_state) and e_y < TOL and e_state < TOL and slots_ok
    return {"op": op, "method": method, "batch": batch, "shape": shape, "err_y": e_y, "err_state": e_state,
            "unused_slots_untouched": slots_ok, "pass": ok}


# ------------------------------------------------------------------------------------------ timing

def time_ref_us(fn, reps: int = 2) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def prefill_bench(quick: bool, vendor: dict | None) -> list[dict]:
    rows = []
    batches = [(1, 4096), (8, 2048), (64, 64)] if not quick else [(1, 4096)]
    for sname, kind, hk, hv, dk, dv in SHAPES:
        for nreq, S in batches:
            g = torch.Generator(device=DEVICE).manual_seed(nreq * S)
            pk = Packed([S] * nreq, seed=S, spare=0, init_frac=0.5)
            p = inputs(pk.num_tokens, kind, hk, hv, dk, dv, g)
            pool = torch.randn(pk.num_slots, hv, dk, dv, generator=g, device=DEVICE) * 0.1
            out = torch.empty(p["v"].shape, dtype=p["v"].dtype, device=DEVICE)
            kw = dict(ssm_states=pool, use_qk_l2norm=True, **pk.meta)
            row = {"op": f"{kind} prefill", "shape": sname, "reqs": nreq, "seq": S}
            for method in ("chunk", "recurrent"):
                fn = OURS[(kind, method)]
                row[f"us_{method}"] = eager_time_us(lambda: fn(**p, out=out, **kw))
            row["us_fla"] = NAN
            if vendor is not None:
                fn = vendor["kda" if kind == "kda" else "gated_delta_rule"]
                row["us_fla"] = eager_time_us(lambda: fn(**p, **kw))
            row["us_ref"] = time_ref_us(lambda: REF[kind](**p, **kw)) if nreq * S <= 16384 else NAN
            row["Mtok/s_chunk"] = pk.num_tokens / row["us_chunk"]
            row["config"] = tg.delta_launch_config(head_k_dim=dk, head_v_dim=dv, per_channel=kind == "kda",
                                                   kind="chunk")
            rows.append(row)
            print("prefill", row, flush=True)
            torch.cuda.empty_cache()
    return rows


def decode_bench(copy_bw: float, quick: bool, vendor: dict | None) -> list[dict]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for sname, kind, hk, hv, dk, dv in SHAPES:
        for B in [1, 8, 32, 128] if not quick else [1, 32]:
            g = torch.Generator(device=DEVICE).manual_seed(B)
            set_bytes = B * hv * dk * dv * 4
            n_sets = int(min(64, max(1, math.ceil(4 * l2 / set_bytes))))
            pool = torch.randn(n_sets * B, hv, dk, dv, generator=g, device=DEVICE) * 0.1
            perm = torch.randperm(n_sets * B, generator=g, device=DEVICE)
            idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n_sets)]
            ins = [inputs(B, kind, hk, hv, dk, dv, g) for _ in range(n_sets)]
            outs = [torch.empty(B, hv, dv, dtype=torch.bfloat16, device=DEVICE) for _ in range(n_sets)]
            g_elems = B * hv * (dk if kind == "kda" else 1)
            nbytes = 2 * set_bytes + B * (2 * hk * dk + 2 * hv * dv + hv) * 2 + g_elems * 4
            fn = OURS_UPDATE[kind]

            def upd(i):
                return lambda: fn(pool, **ins[i], state_indices=idx[i], use_qk_l2norm=True, out=outs[i])

            row = {"op": f"{kind} decode", "shape": sname, "batch": B, "us_graph": graph_time_us(
                [upd(i) for i in range(n_sets)]), "us_eager": eager_time_us(upd(0)), "us_fla": NAN}
            if vendor is not None:
                vfn = vendor["kda_update" if kind == "kda" else "gated_delta_rule_update"]
                row["us_fla"] = eager_time_us(lambda: vfn(pool, **ins[0], state_indices=idx[0], use_qk_l2norm=True))
            row["us_ref"] = time_ref_us(lambda: REF_UPDATE[kind](pool, **ins[0], state_indices=idx[0],
                                                                 use_qk_l2norm=True))
            row |= {"bytes": nbytes, "GB/s": nbytes / row["us_graph"] / 1e3,
                    "pct_copy_bw": 100 * nbytes / (row["us_graph"] * 1e-6) / copy_bw,
                    "config": tg.delta_launch_config(head_k_dim=dk, head_v_dim=dv, per_channel=kind == "kda",
                                                     kind="update")}
            rows.append(row)
            print("decode", row, flush=True)
            torch.cuda.empty_cache()
    return rows


def sweep(parts: set[str]) -> list[dict]:
    """Every tile configuration, correct first, then timed (chunked prefill at 1 x 4096, decode at batch 32).
    ``parts``: any of "gdn", "kda" (the chunked kernels of each), "update" (the decode kernels)."""
    rows = []
    for sname, kind, hk, hv, dk, dv in SHAPES:
        if kind not in parts and "update" not in parts:
            continue
        g = torch.Generator(device=DEVICE).manual_seed(0)
        pk = Packed([4096], seed=0, spare=0, init_frac=1.0)
        p = inputs(pk.num_tokens, kind, hk, hv, dk, dv, g)
        pool = torch.randn(1, hv, dk, dv, generator=g, device=DEVICE) * 0.1
        ref_pool = pool.clone()
        ref = REF[kind](**f32(p), ssm_states=ref_pool, use_qk_l2norm=True, **pk.meta)
        if kind == "kda":
            configs = [{"BT": bt, "BK": bk, "BV": bv, "num_warps": warps}
                       for bt, bk, bv, warps in itertools.product((16, 32), (16, 32, 64), (16, 32, 64), (4, 8))]
        else:                   # the two-launch gated delta rule: factors kernel warps, state pass tiles
            configs = [{"BT": bt, "BV": bv, "num_warps": warps, "num_stages": stages, "wy_warps": wy}
                       for bt, bv, warps, stages, wy in itertools.product((32, 64), (32, 64), (4, 8), (2,), (4, 8))]
        for cfg in configs if kind in parts else []:
            row = {"kernel": f"{kind} chunk", "shape": sname, "config": cfg}
            try:
                with launch_config(cfg):
                    test_pool = pool.clone()
                    y = OURS[(kind, "chunk")](**p, ssm_states=test_pool, use_qk_l2norm=True, **pk.meta)
                    row["err_y"], row["err_state"] = rel_err(y, ref), rel_err(test_pool, ref_pool)
                    row["us"] = (eager_time_us(lambda: OURS[(kind, "chunk")](**p, ssm_states=test_pool,
                                                                             use_qk_l2norm=True, **pk.meta))
                                 if row["err_y"] < TOL and row["err_state"] < TOL else NAN)
            except Exception as e:          # a configuration the compiler or the device refuses: recorded
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["us"] = NAN
            rows.append(row)
            print("sweep", row, flush=True)
        if "update" not in parts:
            continue
        B = 32
        q = inputs(B, kind, hk, hv, dk, dv, g)
        upool = torch.randn(B, hv, dk, dv, generator=g, device=DEVICE) * 0.1
        idx = torch.randperm(B, generator=g, device=DEVICE)
        ref_pool = upool.clone()
        ref = REF_UPDATE[kind](ref_pool, **f32(q), state_indices=idx, use_qk_l2norm=True)
        for bv, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8)):
            cfg = {"BV": bv, "num_warps": warps}
            row = {"kernel": f"{kind} update", "shape": sname, "config": cfg}
            try:
                with launch_config(cfg):
                    test_pool = upool.clone()
                    y = OURS_UPDATE[kind](test_pool, **q, state_indices=idx, use_qk_l2norm=True)
                    row["err_y"], row["err_state"] = rel_err(y, ref), rel_err(test_pool, ref_pool)
                    row["us"] = (graph_time_us([lambda: OURS_UPDATE[kind](test_pool, **q, state_indices=idx,
                                                                          use_qk_l2norm=True)])
                                 if row["err_y"] < TOL and row["err_state"] < TOL else NAN)
            except Exception as e:          # a configuration the compiler or the device refuses: recorded
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["us"] = NAN
            rows.append(row)
            print("sweep", row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", nargs="?", const="gdn,kda,update", default="",
                    help="also time every tile configuration of these kernels (gdn, kda: chunked; update: decode)")
    add_output_args(ap, "gpu_delta_rule")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"

    meta = device_meta()
    meta["command"] = " ".join(sys.argv)
    copy_bw = copy_bandwidth()
    meta["copy_bandwidth_GBps"] = copy_bw / 1e9
    vendor = fla_ops()
    meta["fla"] = vendor is not None
    torch.cuda.empty_cache()
    corr = correctness(args.quick, vendor)
    print_table("correctness (bf16 inputs; rel. error vs the fp32 reference on the same values)",
                ["op", "method", "batch", "shape", "y err", "state err", "unused slots NaN", "pass"],
                [[r["op"], r["method"], r["batch"], r["shape"], f"{r['err_y']:.2e}", f"{r['err_state']:.2e}",
                  r["unused_slots_untouched"], r["pass"]] for r in corr])
    pre = prefill_bench(args.quick, vendor)
    dec = decode_bench(copy_bw, args.quick, vendor)
    swept = sweep(set(args.sweep.split(","))) if args.sweep else []
    write_json(args, "gpu_delta_rule", {"meta": meta, "correctness": corr, "prefill": pre, "decode": dec,
                                        "sweep": swept})
    print_table(f"prefill on {meta['device']} (µs per call, bf16)",
                ["op", "shape", "reqs x seq", "chunk µs", "Mtok/s", "recurrent µs", "fla µs", "ref µs",
                 "fla / chunk"],
                [[r["op"], r["shape"], f"{r['reqs']} x {r['seq']}", fmt(r["us_chunk"]), fmt(r["Mtok/s_chunk"], 2),
                  fmt(r["us_recurrent"]), fmt(r["us_fla"]), fmt(r["us_ref"], 0), fmt(r["us_fla"] / r["us_chunk"], 2)]
                 for r in pre])
    print_table(f"decode on {meta['device']}; copy bw {copy_bw / 1e9:.0f} GB/s",
                ["op", "shape", "B", "ours µs (graph)", "eager µs", "fla µs (eager)", "ref µs", "MB moved", "GB/s",
                 "% copy"],
                [[r["op"], r["shape"], r["batch"], fmt(r["us_graph"]), fmt(r["us_eager"]), fmt(r["us_fla"]),
                  fmt(r["us_ref"], 0), fmt(r["bytes"] / 1e6, 2), fmt(r["GB/s"], 0), fmt(r["pct_copy_bw"])]
                 for r in dec])
    if swept:
        best: dict[str, dict] = {}
        for r in swept:
            key = f"{r['kernel']} | {r['shape']}"
            if math.isfinite(r["us"]) and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        print_table("sweep: best configuration per kernel and shape", ["kernel | shape", "config", "µs"],
                    [[key, r["config"], fmt(r["us"])] for key, r in best.items()])
    if not all(r["pass"] for r in corr if r["method"] != "fla"):
        print("CORRECTNESS FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
