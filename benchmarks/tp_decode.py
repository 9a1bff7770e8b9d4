# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Tensor parallelism over NCCL with Llama-4-Scout's text model: the full 48-layer model at tp 2 (load time,
decode speed against the HBM floor), a truncated one at tp 1 vs tp 2 (correctness), the MoE layer's
sync-free paths on the GPU, and what a dead or stuck rank does to rank 0.

    python benchmarks/tp_decode.py                 # full Scout, tp 2 -> tp_decode.json, scenario full
    python benchmarks/tp_decode.py --layers 4 --compare   # truncated, tp 1 vs tp 2 -> scenario compare
    python benchmarks/tp_decode.py --tiny          # CPU smoke test (gloo, tiny dims; numbers meaningless)
    # options: --batches 1,32 --prompt 512 --steps 128 --cases ... (robustness; '' for none) --save | --out PATH
    # (the JSON goes to benchmarks/out/ unless --save: ``_results.py``)

Model: the bundled Llama-4-Scout text config (``load_model_config("llama4-scout")``, hidden 5120, 40 heads, 8
kv heads, head dim 128, 16 experts of 8192 + a shared expert, vocab 202048, chunk 8192; 48 layers, 107.8 B
parameters, 53.9 B per rank at tp 2 = 107.8 GB of bf16 per GPU), optionally cut to its first ``--layers``
layers (4: three chunked-local RoPE layers and the global NoPE layer 3), bf16, random init (seed 0) drawn on
the GPUs (``build_model(init="device")``, what ``LLM(config, device="cuda")`` does): each rank builds only its
shard, straight on its GPU, in seconds (host draws took ~12 min per rank for the full model).

Steps, each printed as it happens:

1. MoE on one GPU (``moe_gpu_check``): Scout's MoE layer at one rank's shape (16 experts x 4096 channels) with
   every expert implementation the batch size allows (reference loop, grouped GEMM, padded bmm, Triton GEMVs
   and tiles): max difference, time per call at several batch
   sizes, whether a forward makes any device->host sync (``torch.cuda.set_sync_debug_mode("error")``) and
   whether it can be captured and replayed as a CUDA graph.
2. ``--compare`` only (the model must fit one GPU): tp 1 greedy tokens and first-step logits, teacher-forced
   log-probabilities of tp 1, tp 2 and an fp32 forward of the same weights (bf16 noise vs a sharding error).
3. tp 2: ``LLM(config, tensor_parallel_size=2)``; construction time (spawn, groups, rank 0's weight init, KV
   cache) and GPU memory; a warm-up (Triton compiles); then per batch size (random 512-token prompts,
   ``ignore_eos``) the prefill time and every decode step timed, median step against the HBM floor of what a
   step reads per rank: attention, shared expert, router, the routed experts the batch picks (top-1: min(batch,
   16), an upper bound), the LM head's vocab shard, the embedding rows, and the KV cache (chunked layers read at
   most their chunk); bytes / tp / (4.8 TB/s nominal | measured copy bandwidth). A short profile of batch-1
   steps on rank 0 gives GPU busy time vs wall time.
4. Robustness (tiny model, ``distributed_timeout`` 10 s, each case its own process, all at once, after the big
   model is gone): rank 1 killed between steps, killed unnoticed (check_alive off), stuck (SIGSTOP), killed
   2 s into a step, dying or stopping *inside* the forward (rank 1 spawned through ``tests/_tp_fault_worker.py``:
   after the first half of the layers' all-reduces), rank 0 killed (rank 1 must exit); and a tiny fp32 model
   launched by
   ``torchrun --nproc-per-node 2`` against tp 1.

Time on 2x H200 (estimate): start + MoE check ~1 min, tp-2 construction well under a minute, warm-up and
speed ~1-2 min, robustness ~1-2 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, output_path, with_scenario  # noqa: E402
from gpu_attention import print_table  # noqa: E402
from gpu_decode import copy_bandwidth, profile_steps, sync  # noqa: E402

HBM_TBPS = 4.8          # H200 nominal HBM bandwidth per GPU
ROBUST_TIMEOUT = 10.0   # distributed_timeout of the robustness cases (seconds)
FAULT_STEP = 12         # the robustness cases' in-forward failures hit rank 1's 12th step (the second generate)
CASES = ("killed", "killed_unnoticed", "stuck", "killed_in_step", "died_in_forward", "stuck_in_forward",
         "driver_killed")
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


# -- model -------------------------------------------------------------------------------------------------
def scout_config(layers: int, tiny: bool):
    """Llama-4-Scout's text config cut to its first ``layers`` layers; ``tiny``: every dim scaled down (same
    layer kinds: chunked-local RoPE + global NoPE attention, top-1 sigmoid MoE with a shared expert)."""
    from hybridkv.models.config import Attention, MoE
    from hybridkv.planning import load_model_config

    cfg = load_model_config("llama4-scout")
    cfg = dataclasses.replace(cfg, layers=cfg.layers[:layers])
    if not any(isinstance(x.mixer, Attention) and x.mixer.rope is None for x in cfg.layers):
        raise SystemExit(f"--layers {layers}: no global NoPE layer kept (Scout's first is layer 3)")
    if tiny:
        def shrink(layer):
            m, f = layer.mixer, layer.ffn
            m = dataclasses.replace(m, num_heads=4, num_kv_heads=2, head_dim=16,
                                    attention_chunk_size=16 if m.attention_chunk_size else None)
            if isinstance(f, MoE):
                f = dataclasses.replace(f, num_experts=4, intermediate_size=64, shared_intermediate_size=64)
            return dataclasses.replace(layer, mixer=m, ffn=f)

        cfg = dataclasses.replace(cfg, vocab_size=509, hidden_size=64, layers=tuple(map(shrink, cfg.layers)),
                                  bos_token_id=None, eos_token_ids=())
    return cfg


def count_params(cfg, tp: int = 1) -> int:
    """Parameters of the model (tp 1) or of one rank's shard."""
    from hybridkv.layers.parallel import TensorParallel
    from hybridkv.models.hybrid import HybridModel

    with torch.device("meta"):
        return sum(p.numel() for p in HybridModel(cfg, tp=TensorParallel(rank=0, size=tp)).parameters())


def active_bytes(cfg, batch: int, ctx: int, elem: int = 2) -> dict[str, int]:
    """Bytes one decode step reads over all ranks: weights of attention, shared expert, router, the routed
    experts the batch picks (top-1: min(batch, experts), upper bound), the LM head, ``batch`` embedding rows;
    and the KV cache (chunked layers read at most their chunk). Divided by tp per rank (routers are replicated
    and tiny)."""
    from hybridkv.models.config import Attention, MoE

    h = cfg.hidden_size
    out = {"attention": 0, "shared_expert": 0, "routed_experts": 0, "router": 0, "kv": 0}
    for layer in cfg.layers:
        a, f = layer.mixer, layer.ffn
        if isinstance(a, Attention):
            out["attention"] += 2 * h * a.num_heads * a.head_dim + 2 * h * a.num_kv_heads * a.head_dim
            keys = min(ctx, a.attention_chunk_size) if a.attention_chunk_size else ctx
            out["kv"] += batch * keys * 2 * a.num_kv_heads * a.head_dim
        if isinstance(f, MoE):
            per = (3 if f.gated else 2) * h
            out["shared_expert"] += per * f.shared_intermediate_size
            out["routed_experts"] += per * f.intermediate_size * min(batch * f.top_k, f.num_experts)
            out["router"] += h * f.num_experts
    out["lm_head"] = cfg.vocab_size * h
    out["embedding_rows"] = batch * h
    return {k: v * elem for k, v in out.items()}


def gpu_memory(tp: int) -> list[dict]:
    """Used / total GiB of each GPU of the group (all processes), and this process's allocated GiB."""
    out = []
    for g in range(tp):
        free, total = torch.cuda.mem_get_info(g)
        out.append({"gpu": g, "used_GiB": round((total - free) / 2**30, 2), "total_GiB": round(total / 2**30, 2),
                    "this_process_allocated_GiB": round(torch.cuda.memory_allocated(g) / 2**30, 2)})
    return out


# -- 1. the MoE layer on one GPU -------------------------------------------------------------------------------
def moe_gpu_check(cfg, tp: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Scout's MoE layer at one rank's shape (experts and shared expert with 1/tp of their channels; no
    all-reduce): each expert implementation against the reference loop (max |diff| / max |ref|), ms per call,
    device->host syncs in a forward, and a CUDA-graph capture + replay of the auto path."""
    from hybridkv.layers.moe import GEMV_MAX_ROWS, TILED_MAX_ROWS, MoEFeedForward, choose_impl
    from hybridkv.models.config import MoE
    from hybridkv.models.hybrid import bare_construction

    moe = next(x.ffn for x in cfg.layers if isinstance(x.ffn, MoE))
    moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp,
                              shared_intermediate_size=moe.shared_intermediate_size // tp)
    with bare_construction(device, dtype):
        layer = MoEFeedForward(cfg.hidden_size, moe).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    out: dict = {"shape": {"experts": moe.num_experts, "intermediate_per_rank": moe.intermediate_size,
                           "hidden": cfg.hidden_size, "dtype": str(dtype)}, "rows": []}

    def run(x: torch.Tensor, impl: str) -> torch.Tensor:
        layer.impl = impl
        with torch.inference_mode():
            return layer(x)

    def timed(x: torch.Tensor, impl: str, n: int = 10) -> float:
        run(x, impl)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            run(x, impl)
        sync(device)
        return (time.perf_counter() - t0) / n * 1e3

    for tokens in (1, 32, 512, 4096):
        x = torch.randn(tokens, cfg.hidden_size, device=device, generator=gen).to(dtype)
        ref = run(x, "ref").float()
        with torch.inference_mode():
            ids = layer.route(x)[0]
        row = {"tokens": tokens, "auto_impl": choose_impl("auto", x, ids, layer.experts()), "ms": {}, "rel_diff": {}}
        for impl in ("ref", "grouped", "padded", "gemv", "tiled"):
            if ((impl == "padded" and tokens > 512) or (impl == "gemv" and ids.numel() > GEMV_MAX_ROWS)
                    or (impl == "tiled" and ids.numel() > TILED_MAX_ROWS)):
                continue                             # sizes auto never gives these paths
            try:
                got = run(x, impl).float()
                row["rel_diff"][impl] = float((got - ref).abs().max() / ref.abs().max())
                row["ms"][impl] = timed(x, impl)
            except Exception as err:                 # recorded, not fatal: the rest still runs
                row["ms"][impl] = f"error: {type(err).__name__}: {str(err)[:200]}"
        out["rows"].append(row)
        log(f"MoE {tokens} tokens: {row}")

    x = torch.randn(32, cfg.hidden_size, device=device, generator=gen).to(dtype)
    syncs = {}
    for impl in ("ref", "grouped", "padded"):
        run(x, impl)
        sync(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(x, impl)
            syncs[impl] = "none"
        except RuntimeError as err:
            syncs[impl] = f"syncs: {str(err).splitlines()[0][:160]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    out["host_syncs_per_forward"] = syncs
    log(f"MoE host syncs: {syncs}")

    layer.impl = "auto"
    try:                                             # capture at 32 tokens, replay on new inputs
        static = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                layer(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            static_out = layer(static)
        errs = []
        for seed in (1, 2):
            new = torch.randn(x.shape, device=device, generator=torch.Generator(device=device).manual_seed(seed))
            static.copy_(new.to(dtype))
            graph.replay()
            eager = run(static.clone(), "auto")
            errs.append(float((static_out.float() - eager.float()).abs().max()))
        out["cuda_graph"] = {"captured": True, "impl": choose_impl("auto", x, layer.route(x)[0], layer.experts()),
                             "max_abs_diff_replay_vs_eager": max(errs)}
    except Exception as err:
        out["cuda_graph"] = {"captured": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    log(f"MoE CUDA graph: {out['cuda_graph']}")
    return out                                       # the caller empties the CUDA cache


# -- engine runs ---------------------------------------------------------------------------------------------
def run_engine(llm, prompts: list[list[int]], steps: int, device, record_logits: bool = False) -> dict:
    """Add the prompts, step the engine, time every step. Decode steps = those where every request gets one
    more token after its first; the steps before them are the prefill. ``record_logits``: keep the first
    step's logits (rank 0's, fp32, on the host)."""
    from hybridkv.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    eng = llm.engine
    runner = eng.runner
    first: list[torch.Tensor] = []
    if record_logits:
        execute = runner.execute

        def spy(batch):
            if not first and hasattr(batch, "needs_logits"):      # greedy steps skip the logits otherwise
                batch = dataclasses.replace(batch, needs_logits=True)
            out = execute(batch)
            if not first:
                first.append(out.logits.detach().float().cpu())
            return out

        runner.execute = spy
    base = f"b{time.monotonic_ns()}"
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"{base}-{i}.0", p, params)
        times, prefill, tokens = [], [], {}
        while eng.has_unfinished:
            sync(device)
            t0 = time.perf_counter()
            outs = eng.step()
            sync(device)
            dt = time.perf_counter() - t0
            if len(outs) == len(prompts) and min(len(o.outputs[0].token_ids) for o in outs) >= 2:
                times.append(dt)
            elif not times:
                prefill.append(dt)
            for o in outs:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        if record_logits:
            del runner.execute
    return {"step_times": times, "prefill_s": sum(prefill), "prefill_steps": len(prefill),
            "tokens": [tokens[f"{base}-{i}.0"] for i in range(len(prompts))],
            "first_logits": first[0] if first else None}


def speed(llm, cfg, tp: int, args, device, bw: float) -> list[dict]:
    """Decode tokens/s per batch size (random prompts; prefill reported apart) against the HBM floor."""
    rows = []
    for b in args.batch_list:
        prompts = [np.random.default_rng(b + i).integers(10, cfg.vocab_size, args.prompt).tolist() for i in range(b)]
        log(f"tp {tp}: batch {b}, {args.prompt}-token prompts, {args.steps} new tokens")
        r = run_engine(llm, prompts, args.steps, device)
        st = r["step_times"]
        step = statistics.median(st) if st else float("nan")
        nbytes = active_bytes(cfg, b, args.prompt + args.steps // 2)
        total = sum(nbytes.values())
        floor_nom = total / (tp * HBM_TBPS * 1e12)
        floor_meas = total / (tp * bw)
        distinct = len({t for seq in r["tokens"] for t in seq})
        rows.append({"tp": tp, "batch": b, "decode_steps": len(st), "step_ms": step * 1e3,
                     "p90_ms": float(np.percentile(st, 90) * 1e3) if st else None,
                     "tok_s": b / step, "prefill_s": r["prefill_s"], "prefill_steps": r["prefill_steps"],
                     "prefill_tok_s": b * args.prompt / r["prefill_s"] if r["prefill_s"] else None,
                     "active_GB": total / 1e9, "active_GB_per_rank": total / tp / 1e9,
                     "active_breakdown_GB": {k: v / 1e9 for k, v in nbytes.items()},
                     "floor_ms_nominal": floor_nom * 1e3, "floor_ms_measured_bw": floor_meas * 1e3,
                     "x_floor_nominal": step / floor_nom, "distinct_tokens_generated": distinct,
                     "cuda_graphs": graphs_on(llm)})
        log(f"  {json.dumps({k: v for k, v in rows[-1].items() if k != 'active_breakdown_GB'})}")
    return rows


def graphs_on(llm) -> bool:
    """Whether decode steps replay CUDA graphs (tp 1 on CUDA by default; never at tp > 1 yet)."""
    runner = llm.engine.runner
    runner = getattr(runner, "runner", runner)            # the tensor-parallel executor wraps rank 0's runner
    return getattr(runner, "graphs", None) is not None


def correctness(llm, cfg, tp: int, args, device) -> dict:
    """--compare: greedy tokens and first-step logits of the check prompts, then teacher-forced log-probs on
    tp 1's greedy sequences (``args.forced_tokens``; None on tp 1 itself)."""
    rng = np.random.default_rng(123)
    check = [rng.integers(10, cfg.vocab_size, args.prompt).tolist() for _ in range(args.check_prompts)]
    t0 = time.perf_counter()
    r = run_engine(llm, check, args.check_steps, device, record_logits=True)
    out = {"tp": tp, "check_s": time.perf_counter() - t0, "check_tokens": r["tokens"],
           "first_logits": r["first_logits"]}
    seqs = [p + t for p, t in zip(check, args.forced_tokens or r["tokens"], strict=True)]
    out["forced_seqs"] = seqs                     # tp 1's greedy sequences, fed to every run
    out["forced"] = teacher_forced(llm, seqs)
    log(f"tp {tp}: correctness prompts done ({out['check_s']:.1f}s)")
    return out


def compare(one: dict, two: dict) -> dict:
    """tp 2 vs tp 1: greedy tokens and the first step's logits."""
    a, b = one["check_tokens"], two["check_tokens"]
    same = sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True))
    total = sum(len(s) for s in a)
    diverge = [next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None)
               for s, t in zip(a, b, strict=True)]
    la, lb = one["first_logits"].double(), two["first_logits"].double()
    top2 = la.topk(2, dim=-1).values
    return {"tokens_identical_fraction": same / total, "tokens_compared": total,
            "first_divergence_per_prompt": diverge,
            "first_step_max_abs_logit_diff": float((la - lb).abs().max()),
            "first_step_mean_abs_logit_diff": float((la - lb).abs().mean()),
            "first_step_logit_std": float(la.std()), "first_step_logit_max_abs": float(la.abs().max()),
            "first_step_argmax_agree": float((la.argmax(-1) == lb.argmax(-1)).double().mean()),
            "first_step_min_top1_margin": float((top2[:, 0] - top2[:, 1]).min())}


def teacher_forced(llm, seqs: list[list[int]]) -> dict:
    """Through the engine (``prompt_logprobs``): at every position of each sequence, the top-1 prediction of
    the next token and the log-probability of the actual next token (so tp 1 and tp 2 see the same tokens)."""
    from hybridkv.engine.sampling_params import SamplingParams

    outs = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True),
                        use_tqdm=False)
    lps = [o.prompt_logprobs[1:] for o in outs]            # entry p: predicting token p + 1
    return {"top1": [np.array([t.top[0][0] for t in lp]) for lp in lps],
            "logprob": [np.array([t.logprob for t in lp]) for lp in lps]}


def reference_fp32(model, seqs: list[list[int]]) -> dict:
    """The same as ``teacher_forced`` from one fp32 no-cache forward of the (bf16-valued) tp 1 weights."""
    from hybridkv.engine.model_runner import reference_logits

    model.float()
    top1, lp = [], []
    with torch.inference_mode():
        for s in seqs:
            logits = reference_logits(model, s, backend="torch")[:-1].double()
            target = torch.as_tensor(s[1:], device=logits.device)
            top1.append(logits.argmax(-1).cpu().numpy())
            lp.append(logits.log_softmax(-1).gather(-1, target[:, None])[:, 0].cpu().numpy())
    return {"top1": top1, "logprob": lp}


def compare_forced(runs: dict[str, dict], start: int) -> dict:
    """Pairwise top-1 agreement and |logprob difference| over every position, and over the generated part
    (positions >= ``start`` - 1, predicting the generated tokens)."""
    out = {}
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for part, lo in (("all", 0), ("generated", start - 1)):
                ta = np.concatenate([x[lo:] for x in runs[a]["top1"]])
                tb = np.concatenate([x[lo:] for x in runs[b]["top1"]])
                la = np.concatenate([x[lo:] for x in runs[a]["logprob"]])
                lb = np.concatenate([x[lo:] for x in runs[b]["logprob"]])
                d = np.abs(la - lb)
                out[f"{b} vs {a} ({part})"] = {"positions": int(ta.size), "top1_agree": float((ta == tb).mean()),
                                               "mean_abs_dlogprob": float(d.mean()),
                                               "max_abs_dlogprob": float(d.max())}
    return out



def torchrun_case(device: str) -> None:
    """Under ``torchrun --nproc-per-node 2``: every process builds the same tp-2 LLM (fp32, tiny); rank 0
    then compares its greedy tokens with a tp-1 LLM of the same weights."""
    from hybridkv import LLM
    from hybridkv.engine.sampling_params import SamplingParams

    cfg = scout_config(4, tiny=True)
    kw = dict(device=device, dtype="float32", kv_cache_memory=64 << 20, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.vocab_size, 40).tolist() for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(cfg, tensor_parallel_size=2, distributed_timeout=60, **kw)      # ranks > 0 stay inside
    two = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()
    one = [list(o.outputs[0].token_ids) for o in LLM(cfg, **kw).generate(prompts, greedy, use_tqdm=False)]
    print("TORCHRUN " + json.dumps({"tokens_identical": two == one, "tokens": sum(map(len, one))}), flush=True)


def run_torchrun(device: str) -> dict:
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__,
                               "--torchrun-case", "--case-device", device], capture_output=True, text=True,
                              timeout=150)
    except subprocess.TimeoutExpired:
        return {"case": "torchrun", "hung": True, "wall_s": round(time.monotonic() - start, 2)}
    line = next((x for x in done.stdout.splitlines() if x.startswith("TORCHRUN ")), None)
    return {"case": "torchrun", "hung": False, "exit_code": done.returncode,
            "wall_s": round(time.monotonic() - start, 2), "result": json.loads(line[9:]) if line else None,
            "stderr_tail": done.stderr[-600:] if done.returncode else ""}


# -- robustness ----------------------------------------------------------------------------------------------
def robustness_case(case: str, device: str, dtype: str) -> None:
    """Rank 0 of a tiny tp-2 group: fail rank 1 as ``case`` says, report JSON lines on stdout."""
    from hybridkv import LLM
    from hybridkv.engine import distributed
    from hybridkv.engine.distributed import TensorParallelError
    from hybridkv.engine.sampling_params import SamplingParams

    def say(**kw):
        print("CASE " + json.dumps(kw), flush=True)

    if case in ("died_in_forward", "stuck_in_forward"):     # rank 1 is spawned through the tests' fault worker
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from _tp_fault_worker import fault_command

        distributed.WORKER_COMMAND = fault_command(1, FAULT_STEP, "exit" if case == "died_in_forward" else "hang")
    cfg = scout_config(4, tiny=True)
    llm = LLM(cfg, tensor_parallel_size=2, device=device, dtype=dtype, distributed_timeout=ROBUST_TIMEOUT,
              kv_cache_memory=64 << 20, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    worker = llm._executor.ctx.processes[0]
    say(event="ready", rank1_pid=worker.pid)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.vocab_size, 40).tolist() for _ in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    say(event="warm")                                     # 8 steps so far: the fault step is still ahead
    if case == "driver_killed":
        time.sleep(300)                                   # the harness kills this process
        return
    if case in ("killed", "killed_unnoticed"):
        worker.kill()
        worker.join()
        if case == "killed_unnoticed":
            llm._executor.ctx.check_alive = lambda: None  # let it fail inside the step instead
    elif case in ("stuck", "killed_in_step"):
        os.kill(worker.pid, signal.SIGSTOP)
        if case == "killed_in_step":                      # rank 0 is inside the step's collectives by then
            threading.Timer(2.0, lambda: os.kill(worker.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), use_tqdm=False)
        say(event="no_error", elapsed=time.monotonic() - t0)
    except TensorParallelError as err:
        say(event="raised", elapsed=time.monotonic() - t0, error=str(err)[:300])
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        say(event="second_call_ran")
    except TensorParallelError as err:
        say(event="second_call_raised", error=str(err)[:120])
    t1 = time.monotonic()
    llm.shutdown()
    say(event="shutdown", elapsed=time.monotonic() - t1, rank1_exitcode=worker.exitcode)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def run_case(case: str, device: str, dtype: str, limit: float) -> dict:
    """One robustness case in its own process (killed at ``limit`` s: a hang is reported, never waited out)."""
    cmd = [sys.executable, __file__, "--case", case, "--case-device", device, "--case-dtype", dtype]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict] = []
    rank1 = None
    res: dict = {"case": case}

    def read():
        for line in proc.stdout:
            if line.startswith("CASE "):
                ev = json.loads(line[5:])
                ev["t"] = round(time.monotonic() - start, 2)
                events.append(ev)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stderr: list[str] = []
    err_reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    err_reader.start()
    deadline = start + limit
    killed_driver_at = None
    while proc.poll() is None and time.monotonic() < deadline:
        if rank1 is None:
            rank1 = next((e["rank1_pid"] for e in events if e["event"] == "ready"), None)
        if case == "driver_killed" and killed_driver_at is None and any(e["event"] == "warm" for e in events):
            proc.kill()
            killed_driver_at = time.monotonic()
        time.sleep(0.05)
    if rank1 is None:
        rank1 = next((e["rank1_pid"] for e in events if e["event"] == "ready"), None)
    res["hung"] = proc.poll() is None
    if res["hung"]:
        proc.kill()
    proc.wait()
    res["exit_code"] = proc.returncode
    res["wall_s"] = round(time.monotonic() - start, 2)
    if killed_driver_at is not None and rank1 is not None:
        while _alive(rank1) and time.monotonic() < killed_driver_at + 30:
            time.sleep(0.05)
        res["rank1_exit_after_driver_killed_s"] = (None if _alive(rank1)
                                                   else round(time.monotonic() - killed_driver_at, 2))
    if rank1 is not None and _alive(rank1):
        res["rank1_left_running"] = True
        os.kill(rank1, signal.SIGKILL)                     # a stopped rank 1 outlives an aborted rank 0
    reader.join(timeout=2)
    err_reader.join(timeout=2)
    res["events"] = events
    keys = ("Watchdog", "watchdog", "timed out", "Timeout", "TensorParallelError", "abort", "Error")
    res["stderr_excerpt"] = [s.strip()[:220] for s in stderr if any(k in s for k in keys)][:6]
    return res


def robustness(device: str, dtype: str, cases: list[str]) -> list[dict]:
    """Every case, concurrently (each group has its own store port and GPUs are shared fine); "torchrun":
    the torchrun launch of a tiny model (fp32), its tokens against tp 1."""
    limit = ROBUST_TIMEOUT + 100      # NCCL's watchdog may wait for its debug dump before aborting
    results: dict[str, dict] = {}

    def one(c: str) -> None:
        results[c] = run_torchrun(device) if c == "torchrun" else run_case(c, device, dtype, limit)

    threads = [threading.Thread(target=one, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[c] for c in cases]


def _outcome(r: dict) -> str:
    if r["case"] == "torchrun":
        return "HUNG" if r["hung"] else f"tokens == tp 1: {(r.get('result') or {}).get('tokens_identical')}"
    if r["case"] == "driver_killed":
        return f"rank 1 exited {r.get('rank1_exit_after_driver_killed_s')}s after rank 0 was killed"
    if r["hung"]:
        return "HUNG (killed by the harness)"
    first = next((e["event"] for e in r["events"] if e["event"] not in ("ready", "warm")), None)
    return first or f"rank 0 died (exit {r['exit_code']})"


def _plain(text: str) -> str:
    """No rich markup (error messages carry '[file:line]')."""
    return text.replace("[", "(").replace("]", ")")


# -- main --------------------------------------------------------------------------------------------------
def timed_build_model(timing: dict) -> None:
    """Time rank 0's ``build_model`` inside ``LLM`` (the spawned ranks build theirs at the same time)."""
    import hybridkv.engine.llm as llm_module

    build = llm_module.build_model

    def timed(*a, **kw):
        t0 = time.perf_counter()
        model = build(*a, **kw)
        sync(next(model.parameters()).device)
        timing["rank0_build_model_s"] = time.perf_counter() - t0
        log(f"rank 0 built its shard in {timing['rank0_build_model_s']:.1f}s")
        return model

    llm_module.build_model = timed


def save(result: dict, out: Path, scenario: str) -> None:
    """Written after every phase, so a run cut short still leaves what it measured (as ``scenario`` of the file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(with_scenario(out, scenario, result), indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48, help="Scout's first N layers (48: the whole model)")
    ap.add_argument("--compare", action="store_true", help="tp 1 vs tp 2 correctness (the model must fit one GPU)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128, help="new tokens per request in the speed runs")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-steps", type=int, default=32)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kv-memory", default="4GiB", help="KV-cache budget per GPU")
    ap.add_argument("--cases", default=",".join((*CASES, "torchrun")),
                    help="robustness / launch checks run at the end ('' for none)")
    ap.add_argument("--skip-speed", action="store_true", help="no speed runs (with --compare: correctness only)")
    ap.add_argument("--no-moe-check", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (gloo): a smoke test of the script")
    add_output_args(ap, "tp_decode")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--case-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--case-dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--torchrun-case", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # NVLink multicast stays off here (inherited by every rank)
    if args.torchrun_case:
        torchrun_case(args.case_device)
        return
    if args.case:
        robustness_case(args.case, args.case_device, args.case_dtype)
        return
    logging.basicConfig(format="[%(name)s] %(message)s")
    logging.getLogger("hybridkv").setLevel(logging.INFO)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.prompt, args.steps, args.check_steps = min(args.prompt, 40), min(args.steps, 6), min(args.check_steps, 6)
    elif torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    args.batch_list = [int(b) for b in args.batches.split(",")]
    full = args.layers >= 48 and not args.compare
    out, scenario = output_path(args, "tp_decode"), "full" if full else "compare"
    from hybridkv import LLM
    from hybridkv.models.hybrid import build_model

    cfg = scout_config(args.layers, args.tiny)
    cuda = device.type == "cuda"
    meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "num_gpus": torch.cuda.device_count() if cuda
            else 0, "commit": commit(), "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "layers": len(cfg.layers),
            "params": count_params(cfg), "params_per_rank": count_params(cfg, args.tp), "dtype": str(dtype),
            "tp": args.tp, "prompt_len": args.prompt, "decode_steps": args.steps, "kv_memory_per_gpu": args.kv_memory,
            "init": "device" if cuda else "host", "command": " ".join(sys.argv),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_", "HYBRIDKV_"))}}
    meta["weights_GB_per_rank"] = meta["params_per_rank"] * dtype.itemsize / 1e9
    whole = meta["params"] * dtype.itemsize
    if args.compare and cuda and whole > 0.8 * torch.cuda.get_device_properties(0).total_memory:
        raise SystemExit(f"--compare needs the whole model ({whole / 1e9:.0f} GB) on one GPU; use --layers 4")
    bws = []
    for g in range(args.tp if cuda else 0):
        with torch.cuda.device(g):
            bws.append(copy_bandwidth(torch.device("cuda", g)))
            torch.cuda.empty_cache()
    meta["copy_bandwidth_GBps"] = [b / 1e9 for b in bws]
    bw = min(bws) if bws else float("nan")
    log(f"meta {json.dumps(meta)}")
    result: dict = {"meta": meta, "init": {}, "rows": []}
    save(result, out, scenario)

    if cuda and not args.no_moe_check:
        log("MoE layer on one GPU: every expert implementation against the reference loop")
        result["moe_gpu"] = moe_gpu_check(cfg, args.tp, torch.device("cuda", 0), dtype)
        gc.collect()
        torch.cuda.empty_cache()
        save(result, out, scenario)

    engine_kw = dict(max_model_len=args.prompt + max(args.steps, args.check_steps) + 64,
                     max_num_seqs=max(args.batch_list + [args.check_prompts]) + 1, enable_prefix_caching=False,
                     max_num_batched_tokens=max(4096, args.prompt),
                     kv_cache_memory=args.kv_memory if not args.tiny else 64 << 20)
    runs: dict[int, dict] = {}
    forced: dict[str, dict] = {}
    args.forced_tokens = None
    if args.compare:
        log(f"tp 1: build_model on {device} ({meta['params'] / 1e9:.2f} B parameters)")
        t0 = time.perf_counter()
        model = build_model(cfg, dtype=dtype, device=device, seed=0)
        sync(device)
        result["init"]["tp1_build_model_s"] = time.perf_counter() - t0
        llm = LLM(model, dtype=dtype, device=str(device), **engine_kw)
        runs[1] = correctness(llm, cfg, 1, args, device)
        args.forced_tokens = runs[1]["check_tokens"]
        if not args.skip_speed:
            result["rows"] += speed(llm, cfg, 1, args, device, bw)
            if cuda and not args.no_profile:
                prompt = np.random.default_rng(1).integers(10, cfg.vocab_size, args.prompt).tolist()
                result.setdefault("profiles", {})["tp1"] = profile_steps(llm, prompt, device)
        del llm
        gc.collect()
        forced = {"tp1": runs[1]["forced"], "fp32": reference_fp32(model, runs[1]["forced_seqs"])}
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        save(result, out, scenario)

    log(f"tp {args.tp}: LLM(...) with {meta['params_per_rank'] / 1e9:.2f} B parameters "
        f"({meta['weights_GB_per_rank']:.1f} GB) per rank")
    timed_build_model(result["init"])
    t0 = time.perf_counter()
    llm = LLM(cfg, dtype=dtype, device=str(device), tensor_parallel_size=args.tp, distributed_timeout=300,
              seed=0, **engine_kw)
    result["init"][f"tp{args.tp}_construct_s"] = time.perf_counter() - t0
    if cuda:
        result["memory_after_construct"] = gpu_memory(args.tp)
    log(f"tp {args.tp} LLM constructed in {result['init'][f'tp{args.tp}_construct_s']:.1f}s; "
        f"memory {result.get('memory_after_construct')}")
    save(result, out, scenario)
    try:
        if args.compare:
            runs[args.tp] = correctness(llm, cfg, args.tp, args, device)
        else:                                     # warm-up (Triton compiles) + a sanity check of the logits
            t0 = time.perf_counter()
            prompts = [np.random.default_rng(7 + i).integers(10, cfg.vocab_size, args.prompt).tolist()
                       for i in range(2)]
            r = run_engine(llm, prompts, 8, device, record_logits=True)
            logits = r["first_logits"]
            result["warmup"] = {"s": time.perf_counter() - t0, "first_logits_finite": bool(logits.isfinite().all()),
                                "first_logits_std": float(logits.std()), "tokens": r["tokens"]}
            log(f"warm-up: {result['warmup']}")
        if not args.skip_speed:
            result["rows"] += speed(llm, cfg, args.tp, args, device, bw)
            if cuda and not args.no_profile:
                prompt = np.random.default_rng(1).integers(10, cfg.vocab_size, args.prompt).tolist()
                result.setdefault("profiles", {})[f"tp{args.tp}"] = profile_steps(llm, prompt, device)
                log(f"profile tp {args.tp}: {result['profiles'][f'tp{args.tp}']}")
        if cuda:
            result["memory_peak_rank0_GiB"] = torch.cuda.max_memory_allocated(0) / 2**30
    finally:
        llm.shutdown()
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    save(result, out, scenario)

    if args.compare:
        result["correctness"] = compare(runs[1], runs[args.tp])
        forced[f"tp{args.tp}"] = runs[args.tp]["forced"]
        result["teacher_forced"] = compare_forced(forced, args.prompt)
        result["check_tokens"] = {f"tp{t}": runs[t]["check_tokens"] for t in runs}
        save(result, out, scenario)

    cases = [c for c in args.cases.split(",") if c]
    if cases:
        log(f"robustness cases (concurrently): {cases}")
        result["robustness"] = robustness(str(device), "float32" if args.tiny else "bfloat16", cases)
        save(result, out, scenario)
    report(result, args, dtype)
    log(f"done; results in {out}")


def report(result: dict, args, dtype: torch.dtype) -> None:
    meta, rows = result["meta"], result["rows"]
    if rows:
        print_table(f"Llama-4-Scout ({meta['layers']} layers, {meta['params'] / 1e9:.2f} B params), "
                    f"{meta['device']}: decode", ["tp", "batch", "step ms", "p90 ms", "tok/s", "prefill s",
                                                  "GB/rank", "floor ms (4.8 TB/s)", "floor ms (copy bw)", "x floor"],
                    [[r["tp"], r["batch"], f"{r['step_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['tok_s']:.1f}",
                      f"{r['prefill_s']:.2f}", f"{r['active_GB_per_rank']:.2f}", f"{r['floor_ms_nominal']:.3f}",
                      f"{r['floor_ms_measured_bw']:.3f}", f"{r['x_floor_nominal']:.1f}"] for r in rows])
    if "moe_gpu" in result:
        m = result["moe_gpu"]
        print_table("MoE layer, one rank's shape (ms per call; max |diff| / max |ref|)",
                    ["tokens", "auto", "ref ms", "grouped ms", "padded ms", "grouped diff", "padded diff"],
                    [[r["tokens"], r["auto_impl"], *(_fmt(r["ms"].get(i)) for i in ("ref", "grouped", "padded")),
                      *(_fmt(r["rel_diff"].get(i), ".2e") for i in ("grouped", "padded"))] for r in m["rows"]])
        print(f"host syncs per forward: {m['host_syncs_per_forward']}; CUDA graph: {m['cuda_graph']}", flush=True)
    if "correctness" in result:
        print_table(f"tp {args.tp} vs tp 1 ({str(dtype).removeprefix('torch.')})", ["check", "value"],
                    [[k, f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in result["correctness"].items()])
        print_table(f"teacher-forced on tp 1's greedy sequences ({args.check_prompts} x "
                    f"{args.prompt + args.check_steps})",
                    ["pair", "positions", "top-1 agree", "mean |d logprob|", "max |d logprob|"],
                    [[k, v["positions"], f"{v['top1_agree']:.4f}", f"{v['mean_abs_dlogprob']:.4f}",
                      f"{v['max_abs_dlogprob']:.3f}"] for k, v in result["teacher_forced"].items()])
    init = result["init"]
    print_table("model build (seconds)", list(init), [[f"{v:.1f}" for v in init.values()]])
    robust = result.get("robustness", [])
    if robust:
        print_table(f"robustness (tiny model, distributed_timeout {ROBUST_TIMEOUT:g} s)",
                    ["case", "outcome", "after s", "exit", "wall s", "hung", "rank 1 left", "stderr"],
                    [[r["case"], _outcome(r),
                      next((f"{e['elapsed']:.1f}" for e in r.get("events", []) if "elapsed" in e), "-"),
                      r.get("exit_code"), r["wall_s"], r["hung"], r.get("rank1_left_running", False),
                      _plain((r.get("stderr_excerpt", [])[-1:] or [""])[0][:90])] for r in robust])
        for r in robust:
            print(json.dumps(r), flush=True)


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)[:40]


if __name__ == "__main__":
    main()
