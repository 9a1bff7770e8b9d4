# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Tensor parallelism over NCCL: a truncated Llama-4-Scout at tp 1 vs tp 2 (correctness, decode speed), and
what a dead or stuck rank does to rank 0.

    python benchmarks/tp_decode.py [--layers 4] [--batches 1,32] [--prompt 512] [--steps 64]
    # needs 2 GPUs; writes benchmarks/results/tp_decode.json (--out to change)
    python benchmarks/tp_decode.py --skip-speed --cases torchrun   # correctness + torchrun launch only
    python benchmarks/tp_decode.py --tiny      # smoke test on the CPU (gloo, tiny dims; numbers meaningless)

Model: the bundled Llama-4-Scout text config (``load_model_config("llama4-scout")``) cut to its first
``--layers`` layers (4: three chunked-local RoPE layers and the global NoPE layer 3), real dims (hidden 5120,
40 heads, 8 kv heads, head dim 128, 16 experts of 8192 + a shared expert, vocab 202048, chunk 8192), bf16,
random init (seed 0). tp 2 is ``LLM(config, tensor_parallel_size=2)`` (each rank draws the full tensors on
the host and keeps its shard). tp 1 gets the *same* weights faster: built on the GPU without initialisers,
then filled by the same ``_init_weights`` draws (``build_model`` at tp 1 would build the model in fp32 on the
host and run every initialiser first); the host draw time is reported.

1. Correctness: greedy tokens of a few 512-token prompts at tp 2 vs tp 1 (fraction identical, position of
   the first divergence) and the max |logit diff| of the first step (the prefill), against the logits' scale;
   then teacher-forced on tp 1's greedy sequences (``prompt_logprobs``): top-1 agreement and |logprob diff|
   of tp 1, tp 2 and an fp32 forward of the same weights, pairwise (bf16 noise vs a sharding error).
2. Speed: decode tokens/s at each batch (random prompts, ``ignore_eos``; decode steps timed one by one,
   prefill excluded) and the batch-1 step time against the HBM floor of the *active* weights (attention,
   shared expert, top-1 routed expert, LM head, one embedding row + the KV read): bytes / (tp x 4.8 TB/s)
   nominal, and / (tp x measured copy bandwidth). A short profile of batch-1 steps on rank 0 gives GPU busy
   time vs wall time.
3. Robustness (tiny model, ``distributed_timeout`` 10 s, each case its own process, run while the big model
   is drawn): a rank killed between steps, killed unnoticed (check_alive off), stuck (SIGSTOP), killed inside
   a step (stopped, then killed 2 s into rank 0's step), rank 0 killed (rank 1 must exit); and a tiny fp32
   model launched by ``torchrun --nproc-per-node 2`` against tp 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
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

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parent))
from gpu_attention import git_commit, print_table  # noqa: E402
from gpu_decode import copy_bandwidth, profile_steps, sync  # noqa: E402

HBM_TBPS = 4.8          # H200 nominal HBM bandwidth per GPU
ROBUST_TIMEOUT = 10.0   # distributed_timeout of the robustness cases (seconds)
CASES = ("killed", "killed_unnoticed", "stuck", "killed_in_step", "driver_killed")


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


def count_params(cfg) -> int:
    from hybridkv.models.hybrid import HybridModel

    with torch.device("meta"):
        return sum(p.numel() for p in HybridModel(cfg).parameters())


def active_bytes(cfg, batch: int, ctx: int, elem: int = 2) -> dict[str, int]:
    """Bytes one decode step reads: weights of attention, shared expert, router, the routed experts the batch
    picks (top-1: min(batch, experts), upper bound), the LM head, ``batch`` embedding rows; and the KV cache
    (chunked layers read at most their chunk)."""
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


def build_tp1(cfg, device: torch.device, dtype: torch.dtype, seed: int):
    """The unsharded model with ``build_model(cfg, seed=seed)``'s weights, built on ``device`` directly."""
    from hybridkv.models.hybrid import HybridModel, _init_weights, bare_construction

    with bare_construction(device, dtype):
        model = HybridModel(cfg)
    _init_weights(model, seed)
    return model.to(device=device, dtype=dtype).eval()


# -- engine runs ---------------------------------------------------------------------------------------------
def run_engine(llm, prompts: list[list[int]], steps: int, device, record_logits: bool = False) -> dict:
    """Add the prompts, step the engine, time every step. Decode steps = those where every request gets one
    more token after its first. ``record_logits``: keep the first step's logits (rank 0's, fp32, on the host)."""
    from hybridkv.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    eng = llm.engine
    runner = eng.runner
    first: list[torch.Tensor] = []
    if record_logits:
        execute = runner.execute

        def spy(batch):
            out = execute(batch)
            if not first:
                first.append(out.detach().float().cpu())
            return out

        runner.execute = spy
    base = f"b{time.monotonic_ns()}"
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"{base}-{i}.0", p, params)
        times, tokens = [], {}
        while eng.has_unfinished:
            sync(device)
            t0 = time.perf_counter()
            outs = eng.step()
            sync(device)
            dt = time.perf_counter() - t0
            if len(outs) == len(prompts) and min(len(o.outputs[0].token_ids) for o in outs) >= 2:
                times.append(dt)
            for o in outs:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        if record_logits:
            del runner.execute
    return {"step_times": times, "tokens": [tokens[f"{base}-{i}.0"] for i in range(len(prompts))],
            "first_logits": first[0] if first else None}


def measure(llm, cfg, tp: int, args, device, bw: float) -> dict:
    """Correctness prompts (their tokens and first-step logits), then decode speed per batch size."""
    rng = np.random.default_rng(123)
    check = [rng.integers(10, cfg.vocab_size, args.prompt).tolist() for _ in range(args.check_prompts)]
    t0 = time.perf_counter()
    r = run_engine(llm, check, args.check_steps, device, record_logits=True)   # also the warm-up
    out = {"tp": tp, "check_s": time.perf_counter() - t0, "check_tokens": r["tokens"],
           "first_logits": r["first_logits"], "rows": []}
    seqs = [p + t for p, t in zip(check, args.forced_tokens or r["tokens"], strict=True)]
    out["forced_seqs"] = seqs                     # tp 1's greedy sequences, fed to every run
    out["forced"] = teacher_forced(llm, seqs)
    for b in [] if args.skip_speed else args.batch_list:
        prompts = [np.random.default_rng(b).integers(10, cfg.vocab_size, args.prompt).tolist() for _ in range(b)]
        r = run_engine(llm, prompts, args.steps, device)
        step = statistics.median(r["step_times"]) if r["step_times"] else float("nan")
        nbytes = active_bytes(cfg, b, args.prompt + args.steps // 2)
        total = sum(nbytes.values())
        floor_nom = total / (tp * HBM_TBPS * 1e12)
        floor_meas = total / (tp * bw)
        out["rows"].append({"tp": tp, "batch": b, "decode_steps": len(r["step_times"]), "step_ms": step * 1e3,
                            "p90_ms": float(np.percentile(r["step_times"], 90) * 1e3) if r["step_times"] else None,
                            "tok_s": b / step, "active_GB": total / 1e9, "floor_ms_nominal": floor_nom * 1e3,
                            "floor_ms_measured_bw": floor_meas * 1e3, "x_floor_nominal": step / floor_nom})
        print(out["rows"][-1], flush=True)
    if device.type == "cuda" and not args.skip_speed:
        prompt = np.random.default_rng(1).integers(10, cfg.vocab_size, args.prompt).tolist()
        out["profile_b1"] = profile_steps(llm, prompt, device)
        print("profile", out["profile_b1"], flush=True)
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
    from hybridkv.engine.distributed import TensorParallelError
    from hybridkv.engine.sampling_params import SamplingParams

    def say(**kw):
        print("CASE " + json.dumps(kw), flush=True)

    cfg = scout_config(4, tiny=True)
    llm = LLM(cfg, tensor_parallel_size=2, device=device, dtype=dtype, distributed_timeout=ROBUST_TIMEOUT,
              kv_cache_memory=64 << 20, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256)
    worker = llm._executor.ctx.processes[0]
    say(event="ready", rank1_pid=worker.pid)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, cfg.vocab_size, 40).tolist() for _ in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    say(event="warm")
    if case == "driver_killed":
        time.sleep(300)                                   # the harness kills this process
        return
    if case in ("killed", "killed_unnoticed"):
        worker.kill()
        worker.join()
        if case == "killed_unnoticed":
            llm._executor.ctx.check_alive = lambda: None  # let it fail inside the step instead
    else:
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
    say(event="shutdown", elapsed=time.monotonic() - t1)


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
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-steps", type=int, default=32)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cases", default=",".join((*CASES, "torchrun")),
                    help="robustness / launch checks run in the background ('' for none)")
    ap.add_argument("--skip-speed", action="store_true", help="correctness checks only")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (gloo): a smoke test of the script")
    ap.add_argument("--out", default=str(RESULTS / "tp_decode.json"))
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--case-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--case-dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--torchrun-case", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torchrun_case:
        torchrun_case(args.case_device)
        return
    if args.case:
        robustness_case(args.case, args.case_device, args.case_dtype)
        return
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.prompt, args.steps, args.check_steps = min(args.prompt, 40), min(args.steps, 6), min(args.check_steps, 6)
    elif torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    args.batch_list = [int(b) for b in args.batches.split(",")]
    from hybridkv import LLM

    cfg = scout_config(args.layers, args.tiny)
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "num_gpus": torch.cuda.device_count() if device.type == "cuda" else 0, "commit": git_commit(),
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda"
            else None, "layers": args.layers, "params": count_params(cfg), "prompt_len": args.prompt,
            "decode_steps": args.steps, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}}
    bws = []
    for g in range(args.tp if device.type == "cuda" else 0):
        with torch.cuda.device(g):
            bws.append(copy_bandwidth(torch.device("cuda", g)))
    meta["copy_bandwidth_GBps"] = [b / 1e9 for b in bws]
    bw = min(bws) if bws else float("nan")
    print(meta, flush=True)

    robust: list[dict] = []
    robust_thread = None
    cases = [c for c in args.cases.split(",") if c]
    if cases:                                      # while this process draws the big model on the host
        robust_thread = threading.Thread(target=lambda: robust.extend(
            robustness(str(device), "float32" if args.tiny else "bfloat16", cases)))
        robust_thread.start()

    engine_kw = dict(max_model_len=args.prompt + args.steps + 64, max_num_seqs=max(args.batch_list + [4]) + 1,
                     enable_prefix_caching=False, max_num_batched_tokens=max(4096, args.prompt),
                     kv_cache_memory="4GiB" if not args.tiny else 64 << 20)
    runs, init = {}, {}
    t0 = time.perf_counter()
    model = build_tp1(cfg, device, dtype, seed=0)
    sync(device)
    init["tp1_host_draw_and_fill_s"] = time.perf_counter() - t0
    print(f"tp 1 model: {init['tp1_host_draw_and_fill_s']:.1f}s", flush=True)
    if robust_thread is not None:
        robust_thread.join()                       # keep the timings below free of the robustness processes
    llm = LLM(model, dtype=dtype, device=str(device), **engine_kw)
    args.forced_tokens = None
    runs[1] = measure(llm, cfg, 1, args, device, bw)
    args.forced_tokens = runs[1]["check_tokens"]
    del llm
    gc.collect()
    forced = {"tp1": runs[1]["forced"], "fp32": reference_fp32(model, runs[1]["forced_seqs"])}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    llm = LLM(cfg, dtype=dtype, device=str(device), tensor_parallel_size=args.tp, distributed_timeout=300,
              seed=0, **engine_kw)
    init[f"tp{args.tp}_construct_s"] = time.perf_counter() - t0
    print(f"tp {args.tp} LLM: {init[f'tp{args.tp}_construct_s']:.1f}s", flush=True)
    try:
        runs[args.tp] = measure(llm, cfg, args.tp, args, device, bw)
    finally:
        llm.shutdown()

    check = compare(runs[1], runs[args.tp])
    forced[f"tp{args.tp}"] = runs[args.tp]["forced"]
    forced_cmp = compare_forced(forced, args.prompt)
    rows = runs[1]["rows"] + runs[args.tp]["rows"]
    result = {"meta": meta, "init": init, "correctness": check, "teacher_forced": forced_cmp, "rows": rows,
              "profiles": {f"tp{t}": runs[t].get("profile_b1") for t in runs},
              "check_tokens": {f"tp{t}": runs[t]["check_tokens"] for t in runs}, "robustness": robust}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print_table(f"truncated Llama-4-Scout ({args.layers} layers, {meta['params'] / 1e9:.2f} B params), "
                f"{meta['device']}: decode", ["tp", "batch", "step ms", "p90 ms", "tok/s", "active GB",
                                              "floor ms (4.8 TB/s)", "floor ms (copy bw)", "x floor"],
                [[r["tp"], r["batch"], f"{r['step_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['tok_s']:.1f}",
                  f"{r['active_GB']:.2f}", f"{r['floor_ms_nominal']:.3f}", f"{r['floor_ms_measured_bw']:.3f}",
                  f"{r['x_floor_nominal']:.1f}"] for r in rows])
    print_table(f"tp {args.tp} vs tp 1 ({str(dtype).removeprefix('torch.')})", ["check", "value"],
                [[k, f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in check.items()])
    print_table(f"teacher-forced on tp 1's greedy sequences ({args.check_prompts} x {args.prompt + args.check_steps})",
                ["pair", "positions", "top-1 agree", "mean |d logprob|", "max |d logprob|"],
                [[k, v["positions"], f"{v['top1_agree']:.4f}", f"{v['mean_abs_dlogprob']:.4f}",
                  f"{v['max_abs_dlogprob']:.3f}"] for k, v in forced_cmp.items()])
    print_table("model build (seconds)", list(init), [[f"{v:.1f}" for v in init.values()]])
    print_table("robustness (tiny model, distributed_timeout 10 s)",
                ["case", "outcome", "after s", "exit", "wall s", "hung", "rank 1 left", "stderr"],
                [[r["case"], _outcome(r),
                  next((f"{e['elapsed']:.1f}" for e in r.get("events", []) if "elapsed" in e), "-"),
                  r.get("exit_code"), r["wall_s"], r["hung"], r.get("rank1_left_running", False),
                  _plain((r.get("stderr_excerpt", [])[-1:] or [""])[0][:90])] for r in robust])
    for r in robust:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
