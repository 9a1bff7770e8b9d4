# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Triton Mamba kernels on the GPU: correctness vs the fp32 references, then speed vs the torch references.

    python benchmarks/gpu_mamba.py [--quick] [--save]     # writes gpu_mamba.json (``_results.py``)

Kernels: ``causal_conv1d_triton`` / ``causal_conv1d_update_triton`` (hybridkv/backends/triton_conv1d.py) and
``ssd_chunk_scan_triton`` / ``ssd_state_update_triton`` (hybridkv/backends/triton_ssd.py).

1. Copy bandwidth (bytes read + written of a large device copy): the roofline of these memory-bound ops.
2. Correctness, bf16 inputs (fresh random packed batches: mixed lengths incl. 1 and non-multiples of the chunk,
   with / without initial state, shuffled slots, unused slots NaN): relative error vs the fp32 reference
   (``*_ref`` on the same bf16-representable values) for our kernel and for the same math in bf16 eager torch.
   Pass: NaN-free, ours <= 2x the bf16 eager error + 1e-4, and every slot the batch does not use still NaN.
3. Prefill: the SSD chunk scan and the conv over packed batches (1 x 4096, 8 x 2048 tokens; Codestral-like
   128 heads x 64 x state 128, 8 groups, and 64 heads, 1 group); time per call (``do_bench``, L2 flushed),
   bytes moved (x, dt, B, C read, y written, states read + written) and % of the copy bandwidth; the torch
   references timed once for scale.
4. Decode: the SSD state update and the conv update at batch 1, 8, 32, 128; time per call as CUDA-graph
   replays over rotated state-slot sets (> 4x L2 touched, so HBM is measured) and eager; bytes = state read
   + written (+ the small inputs / outputs); % of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, write_json  # noqa: E402
from gpu_attention import copy_bandwidth, device_meta, eager_time_us, fmt, graph_time_us, print_table  # noqa: E402

from hybridkv.backends.triton_conv1d import causal_conv1d_triton, causal_conv1d_update_triton  # noqa: E402
from hybridkv.backends.triton_ssd import (  # noqa: E402
    ssd_chunk_scan_triton,
    ssd_launch_config,
    ssd_state_update_triton,
)
from hybridkv.layers.ops.conv1d_ref import causal_conv1d_ref, causal_conv1d_update_ref  # noqa: E402
from hybridkv.layers.ops.ssd_ref import ssd_chunk_scan_ref, ssd_state_update_ref  # noqa: E402

NAN = float("nan")

# name, nheads, headdim, dstate, ngroups, conv width
SHAPES = [("codestral-like 128h/64/128 g8", 128, 64, 128, 8, 4), ("64h/64/128 g1", 64, 64, 128, 1, 4)]


# ------------------------------------------------------------------------------------------ inputs

class Packed:
    """A packed batch on the GPU: lengths, query_start_loc, shuffled distinct slots (+ spares), flags."""

    def __init__(self, lens: list[int], seed: int, spare: int = 3, init_frac: float = 0.6):
        rng = np.random.default_rng(seed)
        self.lens = list(lens)
        self.num_tokens = sum(lens)
        self.num_slots = len(lens) + spare
        self.slots_list = [int(s) for s in rng.permutation(self.num_slots)[: len(lens)]]
        self.init_list = [bool(v) for v in rng.random(len(lens)) < init_frac]
        self.qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device="cuda")
        self.slots = torch.tensor(self.slots_list, device="cuda")
        self.init = torch.tensor(self.init_list, device="cuda")

    def pool(self, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, scale: float = 1.0):
        """Random where a request continues from its slot; NaN in fresh and unused slots."""
        pool = torch.full((self.num_slots, *shape), NAN, dtype=dtype, device="cuda")
        for s, h in zip(self.slots_list, self.init_list, strict=True):
            if h:
                pool[s] = (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)
        return pool

    def unused_nan(self, pool: torch.Tensor) -> bool:
        unused = [s for s in range(self.num_slots) if s not in self.slots_list]
        return bool(torch.isnan(pool[unused]).all()) if unused else True


def ssd_inputs(n: int, nheads: int, headdim: int, dstate: int, ngroups: int, g: torch.Generator, *,
               dtype=torch.bfloat16, use_z: bool = False, pad: int = 0) -> dict:
    """Mamba2-like inputs, x/B/C as strided views of one packed xBC row (as ``Mamba2Layer`` passes them), dt a
    strided view; values representable in ``dtype``. ``pad`` extra columns per row (odd: row strides that are
    not multiples of 16, which the compiler cannot vectorise on)."""
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    width = nheads * headdim + 2 * ngroups * dstate
    xbc = r(n, width + nheads + pad).to(dtype)          # + the dt columns, like the in_proj output
    x = xbc[:, : nheads * headdim].view(n, nheads, headdim)
    B = xbc[:, nheads * headdim: nheads * headdim + ngroups * dstate].view(n, ngroups, dstate)
    C = xbc[:, nheads * headdim + ngroups * dstate: width].view(n, ngroups, dstate)
    dt = xbc[:, width:width + nheads]
    out = dict(x=x, dt=dt, A=-torch.exp(torch.rand(nheads, generator=g, device="cuda") * 3 - 1) / 4,
               B=B, C=C, D=1.0 + 0.5 * r(nheads), dt_bias=r(nheads) - 1.0)
    if use_z:
        out["z"] = r(n, nheads, headdim).to(dtype)
    return out


def f32(p: dict) -> dict:
    return {k: v.float() for k, v in p.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return float("nan")
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ bf16 baselines

def conv_eager_lowp(x, w, b, pool, pk: Packed) -> torch.Tensor:
    """Per request F.conv1d on bf16 tensors, primed from the slot; silu in bf16."""
    outs = []
    for r in range(len(pk.lens)):
        t0, t1 = int(pk.qsl[r]), int(pk.qsl[r + 1])
        pre = pool[pk.slots_list[r]] if pk.init_list[r] else torch.zeros_like(pool[0])
        seq = torch.cat([pre.to(x.dtype), x[t0:t1].T], 1)[None]
        outs.append(F.silu(F.conv1d(seq, w[:, None, :], b, groups=w.shape[0])[0].T))
    return torch.cat(outs)


def ssd_eager_lowp(p: dict, pool: torch.Tensor, pk: Packed, chunk: int = 64, dtype=torch.bfloat16):
    """The chunked SSD algorithm with bf16 tensors (dt, cumsum, decays, scores, dots), the state carried
    between chunks in fp32 (the pool's dtype). Returns (y, final states of the used slots)."""
    x, B, C = p["x"].to(dtype), p["B"].to(dtype), p["C"].to(dtype)
    hpg = x.shape[1] // B.shape[1]
    dt = F.softplus((p["dt"] + p["dt_bias"]).to(dtype))
    a_all = dt * p["A"].to(dtype)
    ys, finals = [], []
    for r in range(len(pk.lens)):
        t0, t1 = int(pk.qsl[r]), int(pk.qsl[r + 1])
        s = pk.slots_list[r]
        state = pool[s].float().clone() if pk.init_list[r] else torch.zeros_like(pool[0]).float()
        for c0 in range(t0, t1, chunk):
            sl = slice(c0, min(c0 + chunk, t1))
            xs, d, a = x[sl], dt[sl], a_all[sl]
            Bh, Ch = B[sl].repeat_interleave(hpg, 1), C[sl].repeat_interleave(hpg, 1)
            cum = a.cumsum(0)
            L = xs.shape[0]
            causal = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()[..., None]
            decay = torch.exp(cum[:, None] - cum[None, :]).masked_fill(~causal, 0)
            y = torch.einsum("lsh,shp->lhp", torch.einsum("lhn,shn->lsh", Ch, Bh) * decay * d[None], xs)
            y = y + torch.einsum("lhn,hpn->lhp", Ch, state.to(dtype)) * torch.exp(cum)[..., None]
            wgt = torch.exp(cum[-1][None] - cum) * d
            state = state * torch.exp(cum[-1].float())[:, None, None] + \
                torch.einsum("lhn,lh,lhp->hpn", Bh, wgt, xs).float()
            ys.append(y + p["D"].to(dtype)[:, None] * xs)
        finals.append(state)
    return torch.cat(ys), torch.stack(finals)


def ssd_update_eager_lowp(p: dict, pool: torch.Tensor, slots: torch.Tensor, dtype=torch.bfloat16):
    x, B, C = p["x"].to(dtype), p["B"].to(dtype), p["C"].to(dtype)
    hpg = x.shape[1] // B.shape[1]
    d = F.softplus((p["dt"] + p["dt_bias"]).to(dtype))
    dA = torch.exp(d * p["A"].to(dtype))
    st = dA[..., None, None] * pool[slots].to(dtype) + \
        (d[..., None] * x)[..., None] * B.repeat_interleave(hpg, 1)[:, :, None]
    y = torch.einsum("bhpn,bhn->bhp", st, C.repeat_interleave(hpg, 1)) + p["D"].to(dtype)[:, None] * x
    if "z" in p:
        y = y * F.silu(p["z"].to(dtype))
    return y, st.float()


# ------------------------------------------------------------------------------------------ correctness

def correctness(quick: bool) -> list[dict]:
    rows = []
    batches = [("mixed 7 reqs", [1, 700, 64, 129, 1, 333, 2048]), ("1 x 4096", [4096])]
    if quick:
        batches = batches[:1]
    for bname, lens in batches:
        for sname, H, P, N, G, W in (SHAPES[:1] if quick else SHAPES):
            seed = len(rows)
            g = torch.Generator(device="cuda").manual_seed(seed)
            pk = Packed(lens, seed)
            conv_dim = H * P + 2 * G * N
            # conv prefill + decode update
            x = torch.randn(pk.num_tokens, conv_dim + 64, generator=g, device="cuda").bfloat16()[:, :conv_dim]
            w = (torch.randn(conv_dim, W, generator=g, device="cuda") * 0.5).bfloat16()
            b = torch.randn(conv_dim, generator=g, device="cuda").bfloat16()
            pool = pk.pool((conv_dim, W - 1), torch.bfloat16, g)
            ref_pool, ours_pool = pool.clone(), pool.clone()
            ref = causal_conv1d_ref(x.float(), w.float(), b.float(), conv_states=ref_pool, query_start_loc=pk.qsl,
                                    state_indices=pk.slots, has_initial_state=pk.init)
            ours = causal_conv1d_triton(x, w, b, conv_states=ours_pool, query_start_loc=pk.qsl,
                                        state_indices=pk.slots, has_initial_state=pk.init)
            base = conv_eager_lowp(x, w, b, pool, pk)
            e_o, e_b = rel_err(ours, ref), rel_err(base, ref)
            st_ok = bool(torch.equal(ours_pool.nan_to_num(), ref_pool.nan_to_num())) and pk.unused_nan(ours_pool)
            rows.append(_row("conv1d prefill", bname, sname, e_o, e_b, st_ok, 0.0))
            xd = torch.randn(len(lens), conv_dim, generator=g, device="cuda").bfloat16()
            window = torch.cat([ref_pool[pk.slots].float(), xd.float()[:, :, None]], -1)
            base = F.silu((window.bfloat16() * w).sum(-1) + b)
            ref = causal_conv1d_update_ref(xd.float(), conv_states=ref_pool, weight=w.float(), bias=b.float(),
                                           state_indices=pk.slots)
            ours = causal_conv1d_update_triton(xd, conv_states=ours_pool, weight=w, bias=b, state_indices=pk.slots)
            st_ok = bool(torch.equal(ours_pool.nan_to_num(), ref_pool.nan_to_num())) and pk.unused_nan(ours_pool)
            rows.append(_row("conv1d update", bname, sname, rel_err(ours, ref), rel_err(base, ref), st_ok, 0.0))

            # SSD scan + decode update
            p = ssd_inputs(pk.num_tokens, H, P, N, G, g, pad=5 if seed % 2 else 0)
            spool = pk.pool((H, P, N), torch.float32, g, scale=0.1)
            ref_pool, ours_pool = spool.clone(), spool.clone()
            meta = dict(query_start_loc=pk.qsl, state_indices=pk.slots, has_initial_state=pk.init)
            ref = ssd_chunk_scan_ref(**f32(p), chunk_size=256, ssm_states=ref_pool, **meta)
            ours = ssd_chunk_scan_triton(**p, chunk_size=256, ssm_states=ours_pool, **meta)
            base_y, base_st = ssd_eager_lowp(p, spool, pk)
            e_st = rel_err(ours_pool[pk.slots], ref_pool[pk.slots])
            e_st_b = rel_err(base_st, ref_pool[pk.slots])
            rows.append(_row("ssd scan", bname, sname, rel_err(ours, ref), rel_err(base_y, ref),
                             pk.unused_nan(ours_pool) and e_st <= 2 * e_st_b + 1e-4, e_st, e_st_b))
            q = ssd_inputs(len(lens), H, P, N, G, g, use_z=True, pad=5 if seed % 2 else 0)
            ref = ssd_state_update_ref(ref_pool, **f32(q), state_indices=pk.slots)
            base_y, base_st = ssd_update_eager_lowp(q, ours_pool, pk.slots)
            ours = ssd_state_update_triton(ours_pool, **q, state_indices=pk.slots)
            e_st = rel_err(ours_pool[pk.slots], ref_pool[pk.slots])
            e_st_b = rel_err(base_st, ref_pool[pk.slots])
            rows.append(_row("ssd state update", bname, sname, rel_err(ours, ref), rel_err(base_y, ref),
                             pk.unused_nan(ours_pool) and e_st <= 2 * e_st_b + 1e-4, e_st, e_st_b))
            torch.cuda.empty_cache()
    return rows


def _row(op, batch, shape, e_ours, e_base, states_ok, e_st, e_st_base=float("nan")) -> dict:
    ok = math.isfinite(e_ours) and e_ours <= 2 * e_base + 1e-4 and states_ok
    return {"op": op, "batch": batch, "shape": shape, "err_ours": e_ours, "err_bf16_eager": e_base,
            "state_err_ours": e_st, "state_err_bf16_eager": e_st_base, "states_ok": states_ok, "pass": ok}


# ------------------------------------------------------------------------------------------ timing

def time_ref_us(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def prefill_bench(copy_bw: float, quick: bool) -> list[dict]:
    rows = []
    batches = [(1, 4096), (8, 2048)] if not quick else [(1, 4096)]
    for sname, H, P, N, G, W in (SHAPES if not quick else SHAPES[:1]):
        for nreq, S in batches:
            g = torch.Generator(device="cuda").manual_seed(nreq * S)
            pk = Packed([S] * nreq, seed=S, spare=0, init_frac=0.5)
            p = ssd_inputs(pk.num_tokens, H, P, N, G, g)
            spool = torch.randn(pk.num_slots, H, P, N, generator=g, device="cuda") * 0.1
            out = torch.empty(p["x"].shape, dtype=p["x"].dtype, device="cuda")
            meta = dict(query_start_loc=pk.qsl, state_indices=pk.slots, has_initial_state=pk.init)
            T, el = pk.num_tokens, 2
            n_init = sum(pk.init_list)
            ssd_bytes = (T * (2 * H * P + H + 2 * G * N) * el + (n_init + nreq) * H * P * N * 4)

            t = eager_time_us(lambda: ssd_chunk_scan_triton(**p, chunk_size=256, ssm_states=spool, out=out, **meta))
            t_ref = time_ref_us(lambda: ssd_chunk_scan_ref(**p, chunk_size=256, ssm_states=spool, **meta), 2)
            rows.append({"op": "ssd scan", "shape": sname, "reqs": nreq, "seq": S, "us": t, "us_ref": t_ref,
                         "Mtok/s": T / t, "bytes": ssd_bytes, "GB/s": ssd_bytes / t / 1e3,
                         "pct_copy_bw": 100 * ssd_bytes / (t * 1e-6) / copy_bw,
                         "config": ssd_launch_config(headdim=P, dstate=N, decode=False)})
            print("prefill", rows[-1], flush=True)

            conv_dim = H * P + 2 * G * N
            x = torch.randn(T, conv_dim, generator=g, device="cuda").bfloat16()
            w = torch.randn(conv_dim, W, generator=g, device="cuda").bfloat16()
            b = torch.randn(conv_dim, generator=g, device="cuda").bfloat16()
            cpool = torch.randn(pk.num_slots, conv_dim, W - 1, generator=g, device="cuda").bfloat16()
            yc = torch.empty_like(x)
            conv_bytes = 2 * T * conv_dim * el + (n_init + nreq) * conv_dim * (W - 1) * el

            def conv():
                return causal_conv1d_triton(x, w, b, conv_states=cpool, out=yc, **meta)

            t = eager_time_us(conv)
            t_ref = time_ref_us(lambda: causal_conv1d_ref(x, w, b, conv_states=cpool, **meta))
            rows.append({"op": "conv1d", "shape": sname, "reqs": nreq, "seq": S, "us": t, "us_ref": t_ref,
                         "Mtok/s": T / t, "bytes": conv_bytes, "GB/s": conv_bytes / t / 1e3,
                         "pct_copy_bw": 100 * conv_bytes / (t * 1e-6) / copy_bw, "config": {}})
            print("prefill", rows[-1], flush=True)

            torch.cuda.empty_cache()
    return rows


def decode_bench(copy_bw: float, quick: bool) -> list[dict]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    batches = [1, 8, 32, 128] if not quick else [1, 32]
    for sname, H, P, N, G, W in (SHAPES if not quick else SHAPES[:1]):
        conv_dim = H * P + 2 * G * N
        for B in batches:
            g = torch.Generator(device="cuda").manual_seed(B)
            # --- SSD state update: rotated slot sets so the states come from HBM
            set_bytes = B * H * P * N * 4
            n_sets = int(min(64, max(1, math.ceil(4 * l2 / set_bytes))))
            pool = torch.randn(n_sets * B, H, P, N, generator=g, device="cuda") * 0.1
            perm = torch.randperm(n_sets * B, generator=g, device="cuda")
            idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n_sets)]
            ins = [ssd_inputs(B, H, P, N, G, g) for _ in range(n_sets)]
            outs = [torch.empty(B, H, P, dtype=torch.bfloat16, device="cuda") for _ in range(n_sets)]
            nbytes = 2 * set_bytes + B * (2 * H * P + H + 2 * G * N) * 2

            def upd(i):
                return lambda: ssd_state_update_triton(pool, **ins[i], state_indices=idx[i], out=outs[i])

            t_graph = graph_time_us([upd(i) for i in range(n_sets)])
            t_eager = eager_time_us(upd(0))
            t_ref = time_ref_us(lambda: ssd_state_update_ref(pool, **ins[0], state_indices=idx[0]))
            rows.append({"op": "ssd state update", "shape": sname, "batch": B, "us_graph": t_graph,
                         "us_eager": t_eager, "us_ref": t_ref, "bytes": nbytes, "GB/s": nbytes / t_graph / 1e3,
                         "pct_copy_bw": 100 * nbytes / (t_graph * 1e-6) / copy_bw,
                         "config": ssd_launch_config(headdim=P, dstate=N, decode=True)})
            print("decode", rows[-1], flush=True)
            torch.cuda.empty_cache()

            # --- conv update
            set_bytes = B * conv_dim * (W - 1) * 2
            n_sets = int(min(64, max(1, math.ceil(4 * l2 / set_bytes))))
            cpool = torch.randn(n_sets * B, conv_dim, W - 1, generator=g, device="cuda").bfloat16()
            perm = torch.randperm(n_sets * B, generator=g, device="cuda")
            idx = [perm[i * B:(i + 1) * B].contiguous() for i in range(n_sets)]
            xs = [torch.randn(B, conv_dim, generator=g, device="cuda").bfloat16() for _ in range(n_sets)]
            ys = [torch.empty_like(x) for x in xs]
            w = torch.randn(conv_dim, W, generator=g, device="cuda").bfloat16()
            b = torch.randn(conv_dim, generator=g, device="cuda").bfloat16()
            nbytes = 2 * set_bytes + 2 * B * conv_dim * 2

            def cupd(i):
                return lambda: causal_conv1d_update_triton(xs[i], conv_states=cpool, weight=w, bias=b,
                                                           state_indices=idx[i], out=ys[i])

            t_graph = graph_time_us([cupd(i) for i in range(n_sets)])
            t_eager = eager_time_us(cupd(0))
            t_ref = time_ref_us(lambda: causal_conv1d_update_ref(xs[0], conv_states=cpool, weight=w, bias=b,
                                                                 state_indices=idx[0]))
            rows.append({"op": "conv1d update", "shape": sname, "batch": B, "us_graph": t_graph,
                         "us_eager": t_eager, "us_ref": t_ref, "bytes": nbytes, "GB/s": nbytes / t_graph / 1e3,
                         "pct_copy_bw": 100 * nbytes / (t_graph * 1e-6) / copy_bw, "config": {}})
            print("decode", rows[-1], flush=True)
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    add_output_args(ap, "gpu_mamba")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"

    meta = device_meta()
    meta["command"] = " ".join(sys.argv)
    copy_bw = copy_bandwidth()
    meta["copy_bandwidth_GBps"] = copy_bw / 1e9
    torch.cuda.empty_cache()
    corr = correctness(args.quick)
    print_table("correctness (bf16 inputs; rel. error vs fp32 reference)",
                ["op", "batch", "shape", "ours", "bf16 eager torch", "state ours", "state eager", "slots ok",
                 "pass"],
                [[r["op"], r["batch"], r["shape"], f"{r['err_ours']:.2e}", f"{r['err_bf16_eager']:.2e}",
                  f"{r['state_err_ours']:.2e}", f"{r['state_err_bf16_eager']:.2e}", r["states_ok"], r["pass"]]
                 for r in corr])
    pre = prefill_bench(copy_bw, args.quick)
    dec = decode_bench(copy_bw, args.quick)
    write_json(args, "gpu_mamba", {"meta": meta, "correctness": corr, "prefill": pre, "decode": dec})
    print_table(f"prefill on {meta['device']}; copy bw {copy_bw / 1e9:.0f} GB/s",
                ["op", "shape", "reqs x seq", "ours µs", "Mtok/s", "GB/s", "% copy", "ref µs", "speedup"],
                [[r["op"], r["shape"], f"{r['reqs']} x {r['seq']}", fmt(r["us"]), fmt(r["Mtok/s"], 2),
                  fmt(r["GB/s"], 0), fmt(r["pct_copy_bw"]), fmt(r["us_ref"], 0), fmt(r["us_ref"] / r["us"])]
                 for r in pre])
    print_table(f"decode on {meta['device']}; copy bw {copy_bw / 1e9:.0f} GB/s",
                ["op", "shape", "B", "ours µs (graph)", "eager µs", "ref µs", "MB moved", "GB/s", "% copy"],
                [[r["op"], r["shape"], r["batch"], fmt(r["us_graph"]), fmt(r["us_eager"]), fmt(r["us_ref"], 0),
                  fmt(r["bytes"] / 1e6, 2), fmt(r["GB/s"], 0), fmt(r["pct_copy_bw"])] for r in dec])
    if not all(r["pass"] for r in corr):
        print("CORRECTNESS FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
