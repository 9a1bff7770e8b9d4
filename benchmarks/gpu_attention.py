# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Triton paged attention on the GPU: correctness vs fp32, then speed vs the torch reference and SDPA.

    python benchmarks/gpu_attention.py [--quick] [--sections correctness,decode,prefill,sinks] [--save]
    # writes gpu_attention.json (``_results.py``)

1. Copy bandwidth (bytes read + written of a large device copy): the decode roofline.
2. Correctness, bf16 inputs, random mixed batches (decode / prefill / chunked prefill, shuffled block ids,
   unreferenced blocks and the output poisoned with NaN): relative error vs an fp32 reference
   (``paged_attention_ref`` on fp32-upcast inputs) for our kernel, for SDPA in bf16 on the dense
   equivalent (where it applies: no softcap) and for the same math in bf16 eager torch. Pass: NaN-free and
   ours <= 2x the bf16 torch baseline (the larger of the two baselines' errors is NOT used: the eager one).
3. Decode: one query token per request; time per call as CUDA-graph replays over rotated input sets
   (total > 4x L2, so HBM is measured, not L2) and eager (``do_bench``, L2 flushed); KV bytes / time vs the
   copy bandwidth. SDPA: flash on the dense (B, kv_heads, S, d) cache with the GQA group as the query axis.
   The torch reference (a Python loop over requests) is timed eagerly.
4. Prefill: causal, whole prompt per request; TFLOP/s vs SDPA (is_causal, enable_gqa) on dense tensors.
5. Sinks (gpt-oss): the same decode batches (gpt-oss's 64 q / 8 kv heads of 64; a full layer, and a sliding
   128 layer on its trimmed table) with and without attention sinks, as CUDA-graph replays: the sink-aware
   kernel's time over the sink-free one's (target <= 1.05), at the split the eager heuristic picks.
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
from _results import add_output_args, commit, write_json  # noqa: E402

from hybridkv.backends.triton_attention import launch_config, paged_attention_triton
from hybridkv.layers.ops.attention_ref import paged_attention_ref
from hybridkv.metadata import CommonAttentionMetadata


def device_meta() -> dict:
    """What a GPU benchmark's JSON records about where it ran: device, SMs, L2, versions, commit, time."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
            "torch": torch.__version__, "triton": triton.__version__, "commit": commit(),
            "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def print_table(title: str, cols: list[str], rows: list[list]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*[str(x) for x in r])
        Console(width=200).print(t)
    except ImportError:
        print(f"\n{title}\n" + " | ".join(cols))
        for r in rows:
            print(" | ".join(str(x) for x in r))


# ------------------------------------------------------------------------------------------ batches

class PagedBatch:
    """Random paged batch on the GPU: pool (num_blocks, 2, bs, kv_heads, d) with shuffled block ids, poisoned
    (NaN) everywhere no request references, plus the dense per-request K/V and the query."""

    def __init__(self, q_lens, s_lens, *, bs, heads, kv_heads, d, dtype, seed, windows=None,
                 n_sets: int = 1, poison: bool = True):
        g = torch.Generator(device="cuda").manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.q_lens, self.s_lens, self.bs = list(q_lens), list(s_lens), bs
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        need = [-(-s // bs) for s in s_lens]
        per_set = sum(need)
        nb = per_set * n_sets + 1 + 3
        fill = float("nan") if poison else 0.0
        self.pool = torch.full((nb, 2, bs, kv_heads, d), fill, dtype=dtype, device="cuda")
        self.k_cache, self.v_cache = self.pool[:, 0], self.pool[:, 1]
        ids = rng.permutation(np.arange(1, nb))
        self.cams, self.k_dense, self.v_dense = [], [], []
        width = max(need)
        for i in range(n_sets):
            bt = np.zeros((len(s_lens), width), np.int64)
            off = i * per_set
            for r, k in enumerate(need):
                bt[r, :k] = ids[off:off + k]
                off += k
            cam = CommonAttentionMetadata.build(query_lens=q_lens, seq_lens=s_lens, block_table=bt, block_size=bs,
                                                device="cuda")
            kd, vd = [], []
            for r, s in enumerate(s_lens):
                k = torch.randn(s, kv_heads, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
                v = torch.randn(s, kv_heads, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
                blocks = torch.from_numpy(bt[r, :need[r]]).cuda()
                pad = need[r] * bs - s
                kp = torch.cat([k, k.new_zeros(pad, kv_heads, d)]).view(need[r], bs, kv_heads, d)
                vp = torch.cat([v, v.new_zeros(pad, kv_heads, d)]).view(need[r], bs, kv_heads, d)
                self.pool[blocks, 0] = kp
                self.pool[blocks, 1] = vp
                kd.append(k)
                vd.append(v)
            self.cams.append(cam)
            self.k_dense.append(kd)
            self.v_dense.append(vd)
        t = sum(q_lens)
        self.q = [torch.randn(t, heads, d, generator=g, device="cuda", dtype=torch.float32).to(dtype)
                  for _ in range(n_sets)]
        self.scale = d ** -0.5

    @property
    def kv_bytes(self) -> int:
        """K+V bytes a call must read at least (each visible key once; causal, no window)."""
        return 2 * sum(self.s_lens) * self.kv_heads * self.d * self.pool.element_size()


def eager_bf16_dense(b: PagedBatch, i: int, window, softcap, sinks=None) -> torch.Tensor:
    """The same attention in plain eager torch with bf16 tensors (matmuls accumulate in fp32 inside cuBLAS,
    every intermediate is stored in bf16): the low-precision torch baseline. ``sinks``: HF gpt-oss's extra
    softmax column."""
    outs, t = [], 0
    group = b.heads // b.kv_heads
    for r, (ql, s) in enumerate(zip(b.q_lens, b.s_lens, strict=True)):
        q = b.q[i][t:t + ql].transpose(0, 1)                                  # (h, n, d)
        k = b.k_dense[i][r].repeat_interleave(group, 1).transpose(0, 1)      # (h, s, d)
        v = b.v_dense[i][r].repeat_interleave(group, 1).transpose(0, 1)
        logits = (q @ k.transpose(1, 2)) * b.scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        pq = torch.arange(s - ql, s, device="cuda")[:, None]
        pk = torch.arange(s, device="cuda")[None, :]
        mask = pk <= pq
        if window is not None:
            mask &= pq - pk < window
        logits = logits.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            column = sinks.to(logits.dtype)[:, None, None].expand(-1, ql, 1)
            p = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
        else:
            p = torch.softmax(logits, -1)
        outs.append((p @ v).transpose(0, 1))
        t += ql
    return torch.cat(outs)


def sdpa_dense(b: PagedBatch, i: int, window) -> torch.Tensor:
    outs, t = [], 0
    for r, (ql, s) in enumerate(zip(b.q_lens, b.s_lens, strict=True)):
        q = b.q[i][t:t + ql].transpose(0, 1)[None]
        k = b.k_dense[i][r].transpose(0, 1)[None]
        v = b.v_dense[i][r].transpose(0, 1)[None]
        pq = torch.arange(s - ql, s, device="cuda")[:, None]
        pk = torch.arange(s, device="cuda")[None, :]
        mask = pk <= pq
        if window is not None:
            mask &= pq - pk < window
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=b.scale,
                                                   enable_gqa=True)[0].transpose(0, 1))
        t += ql
    return torch.cat(outs)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return float("nan")
    return float((x.float() - ref).norm() / ref.norm())


def correctness(quick: bool) -> list[dict]:
    cases = [
        # name, q_lens, s_lens, bs, heads, kv, d, window, softcap
        ("mixed llama-like", [1, 1, 1, 1, 300, 129, 1], [700, 33, 2048, 1500, 300, 900, 5], 16, 32, 8, 128, None, None),
        ("mixed window+softcap", [1, 1, 200, 64, 1], [3000, 800, 1200, 64, 4100], 16, 32, 8, 128, 1024, 50.0),
        ("gemma-1B-like w512", [1, 1, 400, 1], [2000, 600, 1000, 3], 16, 4, 1, 256, 512, None),
        ("gemma-4 global 8/1/512", [1, 1, 300, 1], [2000, 600, 900, 3], 16, 8, 1, 512, None, None),
        ("block size 1, group 5", [1, 40, 1, 7], [300, 40, 17, 90], 1, 40, 8, 128, None, None),
        ("block size 5, d 64", [1, 13, 100], [1000, 50, 100], 5, 16, 2, 64, 77, 20.0),
        ("decode B=32 ctx~4k (split)", [1] * 32, list(range(3000, 3000 + 32 * 37, 37)), 16, 32, 8, 128, None, None),
        ("prefill 4096", [4096], [4096], 16, 32, 8, 128, None, None),
        ("gpt-oss-like sinks, full", [1, 1, 300, 1], [2000, 700, 900, 5000], 16, 64, 8, 64, None, "sinks"),
        ("gpt-oss-like sinks, w128", [1, 1, 300, 1], [2000, 700, 900, 5000], 16, 64, 8, 64, 128, "sinks"),
        ("decode B=32 sinks (split)", [1] * 32, list(range(3000, 3000 + 32 * 37, 37)), 16, 64, 8, 64, None, "sinks"),
    ]
    if quick:
        cases = cases[:3] + cases[-2:]
    rows = []
    for n, (name, ql, sl, bs, h, kv, d, w, sc) in enumerate(cases):
        b = PagedBatch(ql, sl, bs=bs, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16, seed=n)
        sinks = None
        if sc == "sinks":           # gpt-oss sink logits: magnitudes 1-3, both signs, in the model dtype
            g = torch.Generator(device="cuda").manual_seed(n)
            sinks = ((1 + 2 * torch.rand(h, generator=g, device="cuda"))
                     * (torch.randint(0, 2, (h,), generator=g, device="cuda") * 2 - 1)).to(torch.bfloat16)
            sc = None
        cam = b.cams[0]
        from hybridkv.transforms import trim_sliding_window

        cam_k = trim_sliding_window(cam, w) if w is not None else cam
        ref = paged_attention_ref(b.q[0].float(), b.k_cache.float(), b.v_cache.float(), cam_k, scale=b.scale,
                                  sliding_window=w, softcap=sc, sinks=sinks).float()
        out = torch.full_like(b.q[0], float("nan"))
        paged_attention_triton(b.q[0], b.k_cache, b.v_cache, cam_k, scale=b.scale, sliding_window=w, softcap=sc,
                               sinks=sinks, out=out)
        torch.cuda.synchronize()
        e_ours = rel_err(out, ref)
        e_eager = rel_err(eager_bf16_dense(b, 0, w, sc, sinks), ref)
        e_sdpa = rel_err(sdpa_dense(b, 0, w), ref) if sc is None and sinks is None else float("nan")
        ok = math.isfinite(e_ours) and e_ours <= 2 * e_eager
        rows.append({"case": name, "err_ours": e_ours, "err_bf16_eager": e_eager, "err_sdpa_bf16": e_sdpa,
                     "pass": ok, "tokens": sum(ql), "keys": sum(sl), "block_size": bs})
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------ timing

def graph_time_us(fns: list, min_calls: int = 200) -> float:
    """Median µs per call of CUDA-graph replays of ``fns`` called in rotation."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    reps = max(1, -(-min_calls // len(fns)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(a.elapsed_time(e) * 1e3 / (reps * len(fns)))
    del g
    return float(np.median(times))


def eager_time_us(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")) * 1e3


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = eager_time_us(lambda: y.copy_(x))
    return 2 * (2 << 30) / (us * 1e-6)


def decode_bench(copy_bw: float, quick: bool) -> list[dict]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shapes = [("llama-like 32/8/128", 32, 8, 128), ("gemma-1B-like 4/1/256", 4, 1, 256),
              ("gemma-4 global 8/1/512", 8, 1, 512)]
    batches = [1, 8, 32, 128] if not quick else [1, 32]
    ctxs = [1024, 8192] if not quick else [4096]
    rows = []
    for sname, h, kv, d in shapes:
        for B in batches:
            for ctx in ctxs:
                s_lens = [ctx] * B
                set_bytes = 2 * B * ctx * kv * d * 2
                n_sets = int(min(64, max(1, math.ceil(4 * l2 / set_bytes))))
                b = PagedBatch([1] * B, s_lens, bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16,
                               seed=B * 7 + ctx, n_sets=n_sets, poison=False)
                outs = [torch.empty_like(q) for q in b.q]
                cfg = launch_config(head_dim=d, group=h // kv, max_query_len=1)
                # the segment count the eager heuristic picks, fixed for the graph
                segs = _eager_segments(b, cfg)

                def ours(i, segs=segs):
                    return lambda: paged_attention_triton(b.q[i], b.k_cache, b.v_cache, b.cams[i], scale=b.scale,
                                                          out=outs[i], num_segments=segs)

                nbytes = b.kv_bytes
                t_ours = graph_time_us([ours(i) for i in range(n_sets)])
                t_eager = eager_time_us(ours(0))
                # SDPA flash on a dense cache: q (B, kv, G, d) non-causal == decode GQA
                kd = [torch.stack(b.k_dense[i]).transpose(1, 2).contiguous() for i in range(n_sets)]
                vd = [torch.stack(b.v_dense[i]).transpose(1, 2).contiguous() for i in range(n_sets)]
                qd = [q.view(B, kv, h // kv, d) for q in b.q]
                t_sdpa = graph_time_us([
                    (lambda i=i: F.scaled_dot_product_attention(qd[i], kd[i], vd[i], scale=b.scale))
                    for i in range(n_sets)])
                t_ref = float("nan")
                if B <= 32:
                    def ref():
                        return paged_attention_ref(b.q[0], b.k_cache, b.v_cache, b.cams[0], scale=b.scale)
                    ref()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        ref()
                    torch.cuda.synchronize()
                    t_ref = (time.perf_counter() - t0) / 3 * 1e6
                rows.append({"shape": sname, "batch": B, "ctx": ctx, "segments": segs, "us_graph": t_ours,
                             "us_eager": t_eager, "us_sdpa_graph": t_sdpa, "us_ref_eager": t_ref,
                             "GB/s": nbytes / t_ours / 1e3, "pct_copy_bw": 100 * nbytes / (t_ours * 1e-6) / copy_bw,
                             "sdpa_pct_copy_bw": 100 * nbytes / (t_sdpa * 1e-6) / copy_bw})
                torch.cuda.empty_cache()
    return rows


def _eager_segments(b: PagedBatch, cfg: dict, cam: CommonAttentionMetadata | None = None) -> int:
    """What ``paged_attention_triton`` picks outside a graph (re-derived to fix it for the capture); ``cam``:
    the metadata the call reads (default: the batch's first)."""
    from hybridkv.backends import triton_attention as ta

    cam = cam if cam is not None else b.cams[0]
    n_qblocks = cam.num_actual_tokens // cfg["BLOCK_Q"] + cam.num_reqs
    return ta.split_segments(programs=n_qblocks * b.kv_heads, sms=ta._num_sms(0), max_seq_len=cam.max_seq_len,
                             tile=cfg["TILE"])


def sinks_bench(quick: bool) -> list[dict]:
    """Decode with and without sinks on the same batches (gpt-oss's heads), each as CUDA-graph replays over
    rotated input sets at the eager heuristic's split; a sliding layer reads its window through the trimmed
    table, as the engine's builder gives it."""
    from hybridkv.transforms import trim_sliding_window

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    h, kv, d = 64, 8, 64
    rows = []
    for window in (None, 128):
        for B in ([1, 32] if quick else [1, 8, 32, 128]):
            for ctx in ([4096] if quick else [1024, 8192]):
                set_bytes = 2 * B * (min(ctx, window) if window else ctx) * kv * d * 2
                n_sets = int(min(64, max(1, math.ceil(4 * l2 / set_bytes))))
                b = PagedBatch([1] * B, [ctx] * B, bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16,
                               seed=B * 5 + ctx, n_sets=n_sets, poison=False)
                cams = [trim_sliding_window(c, window) if window else c for c in b.cams]
                sinks = (torch.randn(h, device="cuda") * 2).to(torch.bfloat16)
                outs = [torch.empty_like(q) for q in b.q]
                segs = _eager_segments(b, launch_config(head_dim=d, group=h // kv, max_query_len=1), cams[0])

                def call(i, with_sinks):
                    return lambda: paged_attention_triton(b.q[i], b.k_cache, b.v_cache, cams[i], scale=b.scale,
                                                          sliding_window=window, out=outs[i], num_segments=segs,
                                                          sinks=sinks if with_sinks else None)

                t_none = graph_time_us([call(i, False) for i in range(n_sets)])
                t_sinks = graph_time_us([call(i, True) for i in range(n_sets)])
                rows.append({"layer": f"sliding {window}" if window else "full", "batch": B, "ctx": ctx,
                             "segments": segs, "us_no_sinks": t_none, "us_sinks": t_sinks,
                             "ratio": t_sinks / t_none})
                torch.cuda.empty_cache()
    return rows


def prefill_bench(quick: bool) -> list[dict]:
    rows = []
    shapes = [("llama-like 32/8/128", 32, 8, 128), ("gemma-1B-like 4/1/256", 4, 1, 256),
              ("gemma-4 global 8/1/512", 8, 1, 512)]
    for sname, h, kv, d in shapes:
        for B, S in ([(1, 2048), (1, 8192), (4, 2048)] if not quick else [(1, 4096)]):
            b = PagedBatch([S] * B, [S] * B, bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16, seed=S + B,
                           poison=False)
            out = torch.empty_like(b.q[0])
            flops = 4 * B * h * d * S * (S + 1) / 2

            t = eager_time_us(lambda: paged_attention_triton(b.q[0], b.k_cache, b.v_cache, b.cams[0], scale=b.scale,
                                                             out=out))
            qd = b.q[0].view(B, S, h, d).transpose(1, 2)
            kd = torch.stack(b.k_dense[0]).transpose(1, 2)
            vd = torch.stack(b.v_dense[0]).transpose(1, 2)
            t_sdpa = eager_time_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=b.scale,
                                                                          enable_gqa=True))
            rows.append({"shape": sname, "batch": B, "seq": S, "us": t, "TFLOP/s": flops / t / 1e6,
                         "us_sdpa": t_sdpa, "sdpa_TFLOP/s": flops / t_sdpa / 1e6})
            torch.cuda.empty_cache()
    return rows


def fmt(x, p=1):
    return f"{x:.{p}f}" if isinstance(x, float) else str(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="correctness,decode,prefill,sinks",
                    help="comma list of correctness, decode, prefill, sinks")
    add_output_args(ap, "gpu_attention")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    sections = set(args.sections.split(","))

    meta = device_meta()
    copy_bw = copy_bandwidth()
    meta["copy_bandwidth_GBps"] = copy_bw / 1e9
    meta["command"] = " ".join(sys.argv)
    corr = correctness(args.quick) if "correctness" in sections else []
    dec = decode_bench(copy_bw, args.quick) if "decode" in sections else []
    pre = prefill_bench(args.quick) if "prefill" in sections else []
    sink = sinks_bench(args.quick) if "sinks" in sections else []
    write_json(args, "gpu_attention", {"meta": meta, "correctness": corr, "decode": dec, "prefill": pre,
                                       "sinks": sink})

    print_table(f"prefill (causal) on {meta['device']}", ["shape", "B", "S", "ours µs", "ours TFLOP/s", "SDPA µs",
                                                      "SDPA TFLOP/s"],
                [[r["shape"], r["batch"], r["seq"], fmt(r["us"]), fmt(r["TFLOP/s"]), fmt(r["us_sdpa"]),
                  fmt(r["sdpa_TFLOP/s"])] for r in pre])
    print_table(f"decode on {meta['device']}; copy bw {copy_bw / 1e9:.0f} GB/s",
                ["shape", "B", "ctx", "seg", "ours µs (graph)", "eager µs", "SDPA µs", "ref µs", "ours GB/s",
                 "% copy", "SDPA % copy"],
                [[r["shape"], r["batch"], r["ctx"], r["segments"], fmt(r["us_graph"]), fmt(r["us_eager"]),
                  fmt(r["us_sdpa_graph"]), fmt(r["us_ref_eager"], 0), fmt(r["GB/s"], 0), fmt(r["pct_copy_bw"]),
                  fmt(r["sdpa_pct_copy_bw"])] for r in dec])
    print_table("decode with vs without attention sinks (gpt-oss heads 64/8/64; graph replays; target ratio <= 1.05)",
                ["layer", "B", "ctx", "seg", "no sinks µs", "sinks µs", "ratio"],
                [[r["layer"], r["batch"], r["ctx"], r["segments"], fmt(r["us_no_sinks"], 2), fmt(r["us_sinks"], 2),
                  fmt(r["ratio"], 3)] for r in sink])
    print_table("correctness (bf16 inputs; rel. error vs fp32 reference)",
                ["case", "ours", "bf16 eager torch", "SDPA bf16", "pass (<= 2x eager, no NaN)"],
                [[r["case"], f"{r['err_ours']:.2e}", f"{r['err_bf16_eager']:.2e}", f"{r['err_sdpa_bf16']:.2e}",
                  r["pass"]] for r in corr])
    if not all(r["pass"] for r in corr):
        sys.exit(1)


if __name__ == "__main__":
    main()
