# ruff: noqa: B023  (the timed closures run inside the iteration that made them)
"""Launch-configuration sweeps behind the Triton defaults (H100), each with its correctness check.

    python benchmarks/gpu_sweeps.py decode-segments   # paged-attention decode: split-KV segments 1..64
    python benchmarks/gpu_sweeps.py decode-tiles      # paged-attention decode: TILE x warps x stages x segments
    python benchmarks/gpu_sweeps.py decode-stream     # Gemma-3-like decode KV: read-only kernel vs attention
    python benchmarks/gpu_sweeps.py prefill-tiles     # paged-attention prefill: BLOCK_M x TILE x warps x stages
    python benchmarks/gpu_sweeps.py moe-gemv          # MoE expert GEMVs: BLOCK_N x BLOCK_K x warps x stages
    python benchmarks/gpu_sweeps.py moe-tiled         # MoE expert tiles (16-128 assignments), vs grouped / GEMVs
    python benchmarks/gpu_sweeps.py skinny-linear     # dense linears at 1-128 rows: Triton tiles vs cuBLAS
    python benchmarks/gpu_sweeps.py skinny-wide       # wider tile sweep for the Gemma-3-like down and gate|up
    python benchmarks/gpu_sweeps.py pdl-chain         # kernel chains in a CUDA graph with / without PDL
    python benchmarks/gpu_sweeps.py small-warps       # warps of the add + norm and split-KV reduction kernels

Times are CUDA-graph replays (``gpu_attention.graph_time_us``) or ``triton.testing.do_bench`` (moe-gemv, which
also times the grouped-GEMM path end to end, launches included). Prefill prints the relative error of each
configuration against fp32 SDPA on the same dense K/V (``tests/test_moe.py`` checks the GEMVs' values).
What ``docs/gpu.md`` quotes (session 12): decode segments stay as chosen; prefill d = 256 -> 128 x 64 x 8 warps,
d <= 64 -> 128 x 128 x 4 warps; GEMVs 4 output channels per program.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from gpu_attention import PagedBatch, graph_time_us  # noqa: E402

from hybridkv.backends.pdl import pdl_wait  # noqa: E402


def decode_segments() -> None:
    from hybridkv.backends.triton_attention import launch_config, paged_attention_triton

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for h, kv, d, B, ctx in [(32, 8, 64, 32, 512), (32, 8, 64, 1, 512), (4, 1, 256, 32, 512), (4, 1, 256, 1, 512),
                             (32, 8, 128, 32, 1024), (32, 8, 128, 32, 8192), (32, 8, 128, 128, 8192),
                             (4, 1, 256, 32, 8192)]:
        set_bytes = 2 * B * ctx * kv * d * 2
        n_sets = int(min(64, max(1, math.ceil(4 * l2 / set_bytes))))
        b = PagedBatch([1] * B, [ctx] * B, bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16, seed=B + ctx,
                       n_sets=n_sets, poison=False)
        outs = [torch.empty_like(q) for q in b.q]
        res = []
        for segs in (1, 2, 4, 8, 16, 32, 64):
            fns = [lambda i=i, s=segs: paged_attention_triton(b.q[i], b.k_cache, b.v_cache, b.cams[i],
                                                               scale=b.scale, out=outs[i], num_segments=s)
                   for i in range(n_sets)]
            res.append(f"{segs}:{graph_time_us(fns, 100):.1f}")
        cfg = launch_config(head_dim=d, group=h // kv, max_query_len=1)
        progs = (B // cfg["BLOCK_Q"] + B) * kv
        print(f"{h}/{kv}/{d} B={B} ctx={ctx} progs(seg1)={progs} bytes={set_bytes / 1e6:.1f}MB "
              f"us by segments: {' '.join(res)}", flush=True)
        torch.cuda.empty_cache()


def _attention_configs(b: PagedBatch, warps: tuple[int, ...]) -> tuple[float, list]:
    """The decode attention's default time and sorted (µs, rel. error vs the default, (TILE, warps, stages,
    segments)) over TILE 16-64 x ``warps`` x 2-4 stages x segments (None = the default rule), CUDA-graph timed."""
    from hybridkv.backends.triton_attention import paged_attention_triton

    outs = [torch.empty_like(q) for q in b.q]
    want = paged_attention_triton(b.q[0], b.k_cache, b.v_cache, b.cams[0], scale=b.scale)
    default = graph_time_us([lambda i=i: paged_attention_triton(b.q[i], b.k_cache, b.v_cache, b.cams[i],
                                                                scale=b.scale, out=outs[i]) for i in range(8)], 100)
    res = []
    for tile, nw, ns, segs in itertools.product((16, 32, 64), warps, (2, 3, 4), (None, 8, 16, 32)):
        cfg = dict(TILE=tile, num_warps=nw, num_stages=ns)
        try:
            got = paged_attention_triton(b.q[0], b.k_cache, b.v_cache, b.cams[0], scale=b.scale, config=cfg,
                                         num_segments=segs)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            t = graph_time_us([lambda i=i: paged_attention_triton(
                b.q[i], b.k_cache, b.v_cache, b.cams[i], scale=b.scale, out=outs[i], config=cfg,
                num_segments=segs) for i in range(8)], 100)
            res.append((t, err, (tile, nw, ns, segs)))
        except Exception as e:  # noqa: BLE001  (a config out of resources)
            print(f"   skipped {(tile, nw, ns, segs)}: {type(e).__name__}")
    return default, sorted(res)


def decode_tiles() -> None:
    for h, kv, d, B, ctx in [(4, 1, 256, 1, 544), (4, 1, 256, 32, 544), (32, 8, 64, 1, 544), (32, 8, 64, 32, 544),
                             (16, 8, 128, 32, 544)]:
        b = PagedBatch([1] * B, [ctx] * B, bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16, seed=B + ctx,
                       n_sets=8, poison=False)
        default, res = _attention_configs(b, (4,))
        print(f"{h}/{kv}/{d} B={B} ctx={ctx}: default {default:.1f} us; best (TILE, warps, stages, segments):",
              flush=True)
        for t, err, c in res[:6]:
            print(f"   {t:.1f} us err {err:.1e} {c}", flush=True)
        torch.cuda.empty_cache()

@triton.jit
def _stream_kernel(out_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, stride_kb, stride_ks, stride_bt,
                   HEAD_DIM: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SEG: tl.constexpr,
                   PDL: tl.constexpr = False):
    """decode-stream's read-only kernel: program (request, segment) reads its share of K and V, writes a sum."""
    pdl_wait(PDL)
    req = tl.program_id(0)
    seg = tl.program_id(1)
    seq_len = tl.load(seq_ptr + req)
    per = ((seq_len + TILE - 1) // TILE + NUM_SEG - 1) // NUM_SEG
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    for t in range(seg * per, tl.minimum((seq_len + TILE - 1) // TILE, seg * per + per)):
        kp = t * TILE + offs_t
        ok = kp < seq_len
        blk = tl.load(bt_ptr + req * stride_bt + kp // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        base = (blk * stride_kb + (kp % BLOCK_SIZE).to(tl.int64) * stride_ks)[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + base, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + base, mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) * v.to(tl.float32)
    tl.store(out_ptr + req * NUM_SEG + seg, tl.sum(tl.sum(acc, 1), 0))


def decode_stream() -> None:
    """How fast the Gemma-3-like decode KV (4 q / 1 KV head, d = 256, 544 keys, 16-token blocks) can be read by
    a kernel that only streams it through the block table (the same paging, split and PDL chain as attention),
    next to the attention kernel's own best launch configurations: the gap is what attention's structure costs."""
    from hybridkv.backends.pdl import pdl_kwargs

    h, kv, d, ctx = 4, 1, 256, 544
    for B in (32, 1):
        b = PagedBatch([1] * B, [ctx] * B, bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16, seed=B, n_sets=8,
                       poison=False)
        mb = b.kv_bytes / 1e6
        res = []
        for tile, nw, ns, segs in itertools.product((16, 32, 64), (4, 8), (2, 4), (4, 8, 16, 32)):
            o = torch.empty(B * segs, device="cuda")
            res.append((graph_time_us([lambda i=i: _stream_kernel[(B, segs)](
                o, b.k_cache, b.v_cache, b.cams[i].block_table_tensor, b.cams[i].seq_lens, b.k_cache.stride(0),
                b.k_cache.stride(1), b.cams[i].block_table_tensor.stride(0), HEAD_DIM=d, TILE=tile, BLOCK_SIZE=16,
                NUM_SEG=segs, num_warps=nw, num_stages=ns, **pdl_kwargs(o.device)) for i in range(8)], 100),
                (tile, nw, ns, segs)))
        res.sort()
        print(f"B={B} {mb:.1f} MB, read-only kernel, best (us, (TILE, warps, stages, segments)):",
              [(round(t, 1), c, f"{mb / t:.2f} TB/s") for t, c in res[:5]], flush=True)
        dflt, res = _attention_configs(b, (4, 8))
        print(f"B={B} attention default {dflt:.1f} us ({mb / dflt:.2f} TB/s); best:", flush=True)
        for t, err, c in res[:8]:
            print(f"   {t:.1f} us err {err:.1e} {c}", flush=True)
        torch.cuda.empty_cache()


def prefill_tiles() -> None:
    from hybridkv.backends.triton_attention import launch_config, paged_attention_triton

    for h, kv, d, S in [(32, 8, 64, 8192), (32, 8, 64, 2048), (32, 8, 128, 8192), (4, 1, 256, 8192),
                        (4, 1, 256, 2048)]:
        b = PagedBatch([S], [S], bs=16, heads=h, kv_heads=kv, d=d, dtype=torch.bfloat16, seed=S + d, n_sets=1)
        kd, vd, g = b.k_dense[0][0], b.v_dense[0][0], h // kv
        ref = F.scaled_dot_product_attention(
            b.q[0].float().transpose(0, 1), kd.float().transpose(0, 1).repeat_interleave(g, 0),
            vd.float().transpose(0, 1).repeat_interleave(g, 0), is_causal=True, scale=b.scale).transpose(0, 1)
        qd, kdd, vdd = b.q[0].transpose(0, 1)[None], kd.transpose(0, 1)[None], vd.transpose(0, 1)[None]
        t_sdpa = graph_time_us([lambda: F.scaled_dot_product_attention(qd, kdd, vdd, is_causal=True, enable_gqa=True,
                                                                      scale=b.scale)], 10)
        out = torch.empty_like(b.q[0])

        def timed(config):
            t = graph_time_us([lambda: paged_attention_triton(b.q[0], b.k_cache, b.v_cache, b.cams[0],
                                                              scale=b.scale, out=out, config=config)], 10)
            return t, ((out.float() - ref).norm() / ref.norm()).item()

        print(f"{h}/{kv}/{d} S={S}: default {launch_config(head_dim=d, group=g, max_query_len=S)}; "
              f"SDPA (flash, dense) {t_sdpa:.1f} us", flush=True)
        t0, e0 = timed(None)
        print(f"   default: {t0:.1f} us err {e0:.2e}")
        res = []
        for bm, tile, nw, ns in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
            c = {"BLOCK_M": bm, "TILE": tile, "num_warps": nw, "num_stages": ns}
            try:
                res.append((*timed(c), c))
            except Exception as e:  # noqa: BLE001  (out of shared memory / registers for this shape)
                print(f"   skipped {c}: {type(e).__name__}")
        for t, err, c in sorted(res, key=lambda r: r[0])[:5]:
            print(f"   {t:.1f} us err {err:.2e} {c}", flush=True)
        torch.cuda.empty_cache()


def moe_gemv() -> None:
    import triton

    from hybridkv.backends import triton_moe as tm
    from hybridkv.layers.moe import Experts, moe_experts_grouped

    dev = "cuda"
    for dim, inter, E, rows in ((2048, 2048, 4, 1), (2048, 2048, 4, 8), (5120, 8192, 16, 1)):
        g = torch.Generator(device=dev).manual_seed(0)
        gate, up = (torch.randn(E, inter, dim, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in "gu")
        down = torch.randn(E, dim, inter, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(rows, dim, device=dev, dtype=torch.bfloat16, generator=g)
        ids = torch.randint(0, E, (rows, 1), device=dev, generator=g)
        w = torch.rand(rows, 1, device=dev, generator=g)
        ex = Experts(gate=gate, up=up, down=down, activation="silu", scale_input=True)
        nexp = len(set(ids.flatten().tolist()))
        gu_bytes, d_bytes = nexp * 2 * inter * dim * 2, nexp * inter * dim * 2
        t_grp = triton.testing.do_bench(lambda: moe_experts_grouped(x, ids, w, ex), warmup=20, rep=100)
        print(f"dim {dim} inter {inter} E {E} rows {rows}: grouped path {t_grp * 1e3:.1f} us with launches "
              f"({(gu_bytes + d_bytes) / t_grp / 1e6:.0f} GB/s)")
        h = torch.empty(rows, inter, device=dev, dtype=torch.bfloat16)
        y = torch.empty(rows, dim, device=dev)
        fi, fw = ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()
        res = []
        for bn, bk, nw, ns in itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8), (1, 3)):
            if not 256 <= bn * bk <= 16384:
                continue
            f1 = lambda: tm._gate_up_kernel[(rows, triton.cdiv(inter, bn))](  # noqa: E731
                x, fi, fw, gate, up, h, dim, inter, 1, x.stride(0), gate.stride(0), gate.stride(1), up.stride(0),
                up.stride(1), h.stride(0), ACT=0, GATED=True, SCALE_INPUT=True, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=nw, num_stages=ns)
            f2 = lambda: tm._down_kernel[(rows, triton.cdiv(dim, bn))](  # noqa: E731
                h, fi, fw, down, y, dim, inter, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
                SCALE_INPUT=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            res.append((triton.testing.do_bench(f1, warmup=5, rep=30), triton.testing.do_bench(f2, warmup=5, rep=30),
                        (bn, bk, nw, ns)))
        b1, b2 = min(res), min(res, key=lambda r: r[1])
        print(f"  best gate_up {b1[0] * 1e3:.1f} us ({gu_bytes / b1[0] / 1e6:.0f} GB/s) cfg {b1[2]}; "
              f"best down {b2[1] * 1e3:.1f} us ({d_bytes / b2[1] / 1e6:.0f} GB/s) cfg {b2[2]}")
        for r in sorted(res, key=lambda r: r[0] + r[1])[:5]:
            print(f"  sum-best {r[2]}: {r[0] * 1e3:.1f} + {r[1] * 1e3:.1f} us")


def moe_tiled() -> None:
    import triton

    from hybridkv.backends import triton_moe as tm
    from hybridkv.layers.moe import Experts, moe_experts_gemv, moe_experts_grouped, moe_experts_tiled

    dev = "cuda"
    # (dim, inter, experts, top_k, tokens): the Llama-4-like benchmark model's experts; a many-expert top-8 MoE.
    for dim, inter, E, k, tokens in ((2048, 2048, 4, 1, 16), (2048, 2048, 4, 1, 32), (2048, 2048, 4, 1, 64),
                                     (2048, 2048, 4, 1, 128), (2048, 768, 64, 8, 8)):
        g = torch.Generator(device=dev).manual_seed(0)
        gate_up = torch.randn(E, 2 * inter, dim, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        down = torch.randn(E, dim, inter, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, device=dev, generator=g)
        ex = Experts(gate=gate, up=up, down=down, activation="silu", scale_input=k == 1, gate_up=gate_up)
        rows, nexp = tokens * k, len(set(ids.flatten().tolist()))
        gu_bytes, d_bytes = nexp * 2 * inter * dim * 2, nexp * inter * dim * 2
        want = moe_experts_grouped(x, ids, w, ex)
        err = ((moe_experts_tiled(x, ids, w, ex) - want).norm() / want.norm()).item()
        line = f"dim {dim} inter {inter} E {E} top-{k} tokens {tokens} (rows {rows}): tiled rel err {err:.1e};"
        for name, fn in (("grouped", moe_experts_grouped), ("gemv", moe_experts_gemv), ("tiled", moe_experts_tiled)):
            t = triton.testing.do_bench(lambda: fn(x, ids, w, ex), warmup=20, rep=100)
            line += f" {name} {t * 1e3:.1f} us ({(gu_bytes + d_bytes) / t / 1e6:.0f} GB/s)"
        print(line, flush=True)
        if rows > 128:
            continue
        bm = max(16, triton.next_power_of_2(rows))
        h = torch.empty(rows, inter, device=dev, dtype=torch.bfloat16)
        y = torch.empty(rows, dim, device=dev)
        fi, fw = ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()
        res = []
        for bn, bk, nw, ns in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 5)):
            if nw == 8 and bm < 64:
                continue
            f1 = lambda: tm._gate_up_tiled_kernel[(E, triton.cdiv(inter, bn))](  # noqa: E731
                x, fi, fw, gate, up, h, rows, dim, inter, k, x.stride(0), gate.stride(0), gate.stride(1),
                up.stride(0), up.stride(1), h.stride(0), ACT=0, GATED=True, SCALE_INPUT=k == 1, BLOCK_M=bm,
                BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            f2 = lambda: tm._down_tiled_kernel[(E, triton.cdiv(dim, bn))](  # noqa: E731
                h, fi, fw, down, y, rows, dim, inter, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
                SCALE_INPUT=k == 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            try:
                res.append((triton.testing.do_bench(f1, warmup=5, rep=30),
                            triton.testing.do_bench(f2, warmup=5, rep=30), (bn, bk, nw, ns)))
            except Exception as e:  # noqa: BLE001  (a config out of shared memory)
                print(f"   skipped {(bn, bk, nw, ns)}: {type(e).__name__}")
        b1, b2 = min(res), min(res, key=lambda r: r[1])
        print(f"  best gate_up {b1[0] * 1e3:.1f} us ({gu_bytes / b1[0] / 1e6:.0f} GB/s) cfg {b1[2]}; "
              f"best down {b2[1] * 1e3:.1f} us ({d_bytes / b2[1] / 1e6:.0f} GB/s) cfg {b2[2]}", flush=True)


# (name, output channels, input features, gated): the Gemma-3-like and Llama-4-like benchmark models' linears
_SKINNY_SHAPES = (("gemma qkv", 1536, 1152, False), ("gemma o", 1152, 1024, False),
                  ("gemma gate_up", 6912, 1152, True), ("gemma down", 1152, 6912, False),
                  ("gemma lm_head", 262144, 1152, False), ("llama qkv", 3072, 2048, False),
                  ("llama o", 2048, 2048, False), ("llama mlp gate_up", 8192, 2048, True),
                  ("llama mlp down", 2048, 8192, False), ("llama shared gate_up", 2048, 2048, True),
                  ("llama shared down", 2048, 2048, False), ("llama lm_head", 32768, 2048, False))


def skinny_linear() -> None:
    from hybridkv.backends.triton_fused import act_mul_triton
    from hybridkv.backends.triton_linear import default_config, linear_act_mul_triton, linear_triton

    dev, l2 = "cuda", torch.cuda.get_device_properties(0).L2_cache_size
    for name, n, k, gated in _SKINNY_SHAPES:
        w_rows = 2 * n if gated else n
        n_sets = int(min(32, max(1, math.ceil(3 * l2 / (w_rows * k * 2)))))
        g = torch.Generator(device=dev).manual_seed(n + k)
        ws = [torch.randn(w_rows, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5 for _ in range(n_sets)]
        for rows in (1, 8, 32, 64, 128):
            xs = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(n_sets)]
            if gated:
                ref = lambda i, cfg=None: act_mul_triton(F.linear(xs[i], ws[i]), activation="gelu_tanh")  # noqa: E731
                ours = lambda i, cfg=None: linear_act_mul_triton(xs[i], ws[i], activation="gelu_tanh",  # noqa: E731
                                                                 config=cfg)
            else:
                ref = lambda i, cfg=None: F.linear(xs[i], ws[i])  # noqa: E731
                ours = lambda i, cfg=None: linear_triton(xs[i], ws[i], config=cfg)  # noqa: E731
            want = ref(0).float()
            first = ours(0)
            err = ((first.float() - want).norm() / want.norm()).item()
            t_ref = graph_time_us([lambda i=i: ref(i) for i in range(n_sets)], 100)
            t_def = graph_time_us([lambda i=i: ours(i) for i in range(n_sets)], 100)
            same = torch.equal(ours(0), first)           # deterministic across graph replays (split-K counters)
            mb = w_rows * k * 2 / 1e6
            line = (f"{name} ({w_rows}x{k}, {mb:.1f} MB) rows {rows}: cuBLAS{'+act' if gated else ''} {t_ref:.1f} us "
                    f"({mb / t_ref:.2f} TB/s); triton default {t_def:.1f} us ({mb / t_def:.2f} TB/s, "
                    f"{default_config(rows, n, k, gated=gated)}) err vs cuBLAS {err:.1e} repeat-equal {same}")
            print(line, flush=True)
            if rows not in (1, 32, 128) or n > 100000:
                continue
            res = []
            for bn, bk, split in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8)):
                cfg = dict(BLOCK_M=max(16, triton_next_pow2(rows)), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                           num_warps=4, num_stages=4)
                try:
                    res.append((graph_time_us([lambda i=i: ours(i, cfg) for i in range(n_sets)], 100), bn, bk, split))
                except Exception as e:  # noqa: BLE001  (a config out of shared memory)
                    print(f"   skipped {cfg}: {type(e).__name__}")
            res.sort()
            print("   best (us, BLOCK_N, BLOCK_K, SPLIT_K): " + ", ".join(f"{r[0]:.1f} {r[1:]}" for r in res[:5]),
                  flush=True)
        torch.cuda.empty_cache()


def skinny_wide() -> None:
    """A wider tile sweep than ``skinny-linear`` (BLOCK_N 16-64 x BLOCK_K 64-256 x split-K x 4/8 warps x 3/4/6
    stages) for the Gemma-3-like down projection (32 and 1 rows) and gate|up (32 rows), each family of
    configurations cut off after ~170 s; err = relative error against the default configuration's output."""
    from hybridkv.backends.triton_linear import default_config, linear_act_mul_triton, linear_triton

    dev, l2 = "cuda", torch.cuda.get_device_properties(0).L2_cache_size
    for name, n, k, gated, row_counts in (("gemma down", 1152, 6912, False, (32, 1)),
                                          ("gemma gate_up", 6912, 1152, True, (32,))):
        w_rows = 2 * n if gated else n
        n_sets = int(min(32, max(1, math.ceil(3 * l2 / (w_rows * k * 2)))))
        g = torch.Generator(device=dev).manual_seed(n + k)
        ws = [torch.randn(w_rows, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5 for _ in range(n_sets)]
        mb = w_rows * k * 2 / 1e6
        for rows in row_counts:
            xs = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(n_sets)]
            if gated:
                f = lambda i, cfg=None: linear_act_mul_triton(xs[i], ws[i], activation="gelu_tanh",  # noqa: E731
                                                              config=cfg)
            else:
                f = lambda i, cfg=None: linear_triton(xs[i], ws[i], config=cfg)  # noqa: E731
            want = f(0).float()
            t_def = graph_time_us([lambda i=i: f(i) for i in range(n_sets)], 100)
            print(f"{name} rows {rows}: default {t_def:.2f} us ({mb / t_def:.2f} TB/s) "
                  f"{default_config(rows, n, k, gated=gated)}", flush=True)
            res, t0 = [], time.time()
            splits = (1, 2, 4) if gated else (2, 4, 8, 16)
            for bn, bk, split, nw, ns in itertools.product((16, 32, 64), (64, 128, 256), splits, (4, 8), (3, 4, 6)):
                if time.time() - t0 > 170:
                    break
                cfg = dict(BLOCK_M=max(16, triton_next_pow2(rows)), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                           num_warps=nw, num_stages=ns)
                try:
                    err = ((f(0, cfg).float() - want).norm() / want.norm()).item()
                    res.append((graph_time_us([lambda i=i: f(i, cfg) for i in range(n_sets)], 100), err,
                                bn, bk, split, nw, ns))
                except Exception:  # noqa: BLE001, S112  (a config out of shared memory)
                    continue
            res.sort()
            print(f"  tried {len(res)}; best (us, err, BLOCK_N, BLOCK_K, SPLIT, warps, stages):", flush=True)
            for r in res[:6]:
                print(f"   {r[0]:.2f} us ({mb / r[0]:.2f} TB/s) err {r[1]:.1e} {r[2:]}", flush=True)
        torch.cuda.empty_cache()


def pdl_chain() -> None:
    """Per-kernel time of chains of small kernels captured in one CUDA graph, launched plainly or with
    programmatic dependent launch (``hybridkv/backends/pdl.py``): one-program RMS norms alone, norm + the
    decode-size linear kernel, norm + cuBLAS (PDL edges into a kernel that is not ours)."""
    import hybridkv.backends.pdl as pdl
    from hybridkv.backends.triton_fused import rms_norm_triton
    from hybridkv.backends.triton_linear import linear_triton

    dev, dim, out, layers = torch.device("cuda"), 1152, 1536, 60
    if not pdl.pdl_kwargs(dev)["PDL"]:
        raise SystemExit("pdl-chain: PDL is off here (pre-Hopper GPU or HYBRIDKV_PDL=0)")
    xs = [torch.randn(1, dim, device=dev, dtype=torch.bfloat16) for _ in range(layers + 1)]
    norm_w = torch.randn(dim, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(out, dim, device=dev, dtype=torch.bfloat16) * dim ** -0.5 for _ in range(layers)]

    def chains() -> dict[str, float]:
        def norms() -> None:
            for i in range(layers):
                rms_norm_triton(xs[i], norm_w, eps=1e-6)

        def with_linear() -> None:
            for i in range(layers):
                linear_triton(rms_norm_triton(xs[i], norm_w, eps=1e-6), ws[i])

        def with_cublas() -> None:
            for i in range(layers):
                F.linear(rms_norm_triton(xs[i], norm_w, eps=1e-6), ws[i])

        fns = {"norms": norms, "norm + linear": with_linear, "norm + cuBLAS": with_cublas}
        return {name: graph_time_us([fn], 1) / layers for name, fn in fns.items()}

    on = chains()
    os.environ["HYBRIDKV_PDL"] = "0"
    pdl._enabled.cache_clear()                       # the launch keywords are cached per device
    off = chains()
    for name in on:
        print(f"{name}: {off[name]:.2f} us per layer plain, {on[name]:.2f} us with PDL")


def small_warps() -> None:
    """Warps per program of the latency-bound small kernels, each timed in a chain of 24 distinct layers in
    one CUDA graph (PDL on where available): ``add_rms_norm`` then the projection that reads it (Gemma-3-like
    sandwich norms at 1152, Llama-4-like at 2048, Mamba2's fp32 residual at 2048), and the split-KV
    reduction of decode attention alone (Gemma-3-like 4 heads x 256, Llama-4-like 32 x 64, NemotronH-like
    16 x 128; 8-32 segments; each timed twice)."""
    from hybridkv.backends.pdl import pdl_kwargs
    from hybridkv.backends.triton_attention import _reduce_segments_kernel, reduce_warps
    from hybridkv.backends.triton_fused import _warps, add_rms_norm_triton
    from hybridkv.backends.triton_linear import linear_triton

    dev, layers = torch.device("cuda"), 24
    g = torch.Generator(device=dev).manual_seed(0)
    for name, dim, out, post, res_dtype in (("gemma", 1152, 1536, True, torch.bfloat16),
                                            ("llama", 2048, 3072, False, torch.bfloat16),
                                            ("mamba2", 2048, 10304, False, torch.float32)):
        ws = [torch.randn(out, dim, device=dev, dtype=torch.bfloat16, generator=g) * dim ** -0.5
              for _ in range(layers)]
        nw = torch.randn(dim, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
        dw = torch.randn(dim, device=dev, dtype=torch.bfloat16, generator=g) * 0.1 if post else None
        for rows in (1, 8, 32):
            ds = [torch.randn(rows, dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(layers)]
            rs = [torch.randn(rows, dim, device=dev, generator=g).to(res_dtype) for _ in range(layers)]
            kw = dict(weight=nw, eps=1e-6, gemma=post, delta_weight=dw)
            want = add_rms_norm_triton(ds[0], rs[0], **kw)
            cells = []
            for warps in (1, 2, 4, 8, 16):
                got = add_rms_norm_triton(ds[0], rs[0], num_warps=warps, **kw)
                same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                norms = graph_time_us([lambda w=warps: [add_rms_norm_triton(ds[i], rs[i], num_warps=w, **kw)
                                                        for i in range(layers)]], 1) / layers
                pair = graph_time_us([lambda w=warps: [
                    linear_triton(add_rms_norm_triton(ds[i], rs[i], num_warps=w, **kw)[0], ws[i])
                    for i in range(layers)]], 1) / layers
                cells.append(f"{warps} warps {norms:.2f} / {pair:.2f}{'' if same else ' (differs)'}")
            default = _warps(triton_next_pow2(dim))
            print(f"{name} add+norm ({dim}) rows {rows}, norm alone / norm + linear us per layer (default "
                  f"{default} warps): " + ", ".join(cells), flush=True)
    for (name, tokens, heads, d), seg in itertools.product(
            (("gemma", 1, 4, 256), ("gemma", 32, 4, 256), ("llama", 1, 32, 64), ("llama", 32, 32, 64),
             ("nemotronh", 1, 16, 128)), (8, 16, 32)):
        parts = [(torch.randn(tokens * heads * seg, d, device=dev, generator=g),
                  torch.stack([torch.randn(tokens * heads * seg, device=dev, generator=g),
                               torch.rand(tokens * heads * seg, device=dev, generator=g) + 1], -1).contiguous())
                 for _ in range(layers)]
        outs = [torch.empty(tokens, heads, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]

        def reduce(i, warps):
            o = outs[i]
            _reduce_segments_kernel[(tokens, heads)](o, parts[i][0], parts[i][1], heads, o.stride(0), o.stride(1),
                                                     HEAD_DIM=d, HEAD_DIM_P=d, NUM_SEG=seg, num_warps=warps,
                                                     **pdl_kwargs(dev))
        cells = []
        for warps in (1, 2, 4, 8):
            ts = [graph_time_us([lambda w=warps: [reduce(i, w) for i in range(layers)]], 1) / layers
                  for _ in range(2)]
            cells.append(f"{warps} warps {ts[0]:.2f}/{ts[1]:.2f}")
        print(f"{name} split-KV reduction ({tokens} tokens x {heads} heads x {d}, {seg} segments; default "
              f"{reduce_warps(d)} warps) us per launch, two runs: " + ", ".join(cells), flush=True)


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", choices=("decode-segments", "decode-tiles", "decode-stream", "prefill-tiles",
                                      "moe-gemv", "moe-tiled", "skinny-linear", "skinny-wide", "pdl-chain",
                                      "small-warps"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sweeps.py needs a CUDA device")
    {"decode-segments": decode_segments, "decode-tiles": decode_tiles, "decode-stream": decode_stream,
     "prefill-tiles": prefill_tiles,
     "moe-gemv": moe_gemv, "moe-tiled": moe_tiled, "skinny-linear": skinny_linear, "skinny-wide": skinny_wide,
     "pdl-chain": pdl_chain, "small-warps": small_warps}[args.sweep]()


if __name__ == "__main__":
    main()
