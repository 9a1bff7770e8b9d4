"""Where a decode step's time goes on the GPU path: the step, the captured graph replayed alone, and the
step split into phases with a device sync around each (schedule, step batch, execute = host inputs + pack +
replay, sample = argmax, finish = reading the sampled tokens back + stop checks, KV commit).

    python benchmarks/gpu_step_phases.py [--families llama4,gemma3,mamba2,nemotronh] [--batches 1,32]

Models as in ``gpu_decode.py`` (random init, saved by HF, loaded by hybridkv), bf16, triton backend, CUDA
graphs, ``max_num_seqs=64``, 512-token prompts, greedy. "replay-only" replays the batch's captured graph
back to back (GPU time of the forward, no host work); execute minus replay-only is the host work the runner
does before the replay. The synced phases add their sync overheads, so they sum to more than a plain step.
Prints one line per (family, batch); CUDA only.

``--mixed P``: the steps measured are mixed, as under serving traffic: ``batch`` decodes plus one new request of P
prompt tokens each step, with the mixed-step graphs (``engine/mixed_graphs.py``) and without (eager); besides the
phases, the GPU kernel time per step (torch profiler) and the host work that takes the most time of such steps
(cProfile, and torch profiler's host ops). The profiler's hooks slow the host's launches (a graph launch most), so
whether a mixed step is bound by the host or the GPU is ``gpu_mixed_step.py``'s to tell (its ``wait``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import random_llm  # noqa: E402

PHASES = (("scheduler", "schedule"), ("engine", "_step_batch"), ("runner", "execute"), ("engine", "_sample"),
          ("engine", "_finish"), ("coordinator", "commit_batch"))


def sync() -> None:
    torch.cuda.synchronize()


def ms_per_call(fn, n: int) -> float:
    """Mean ms of ``n`` back-to-back calls, device synced before and after."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def synced_phases(eng, step, n: int) -> tuple[float, str]:
    """Mean ms of ``n`` calls of ``step`` with the device synced around each phase, and the phases' ms."""
    owners = {"scheduler": eng.scheduler, "engine": eng, "runner": eng.runner, "coordinator": eng.coordinator}
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    for owner, name in PHASES:
        setattr(owners[owner], name, timed(name, getattr(owners[owner], name)))
    try:
        total = ms_per_call(step, n)
    finally:
        for owner, name in PHASES:
            delattr(owners[owner], name)
    return total, " ".join(f"{k.lstrip('_')}={v / n * 1e3:.3f}" for k, v in spent.items())


def measure(eng, family: str, batch: int) -> str:
    from hybridkv import SamplingParams

    rng = np.random.default_rng(batch)
    for i in range(batch):
        eng.add_request(f"{family}{batch}-{i}", rng.integers(10, 30000, 512).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    while any(len(r.token_ids) <= 513 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    step = ms_per_call(lambda: eng.step(only_finished=True), 20)      # as LLM.generate drives it
    graphs = eng.runner.graphs
    graph, _, _ = graphs._graphs[graphs.bucket_for(batch)]
    replay = ms_per_call(graph.replay, 50)
    total, phases = synced_phases(eng, lambda: eng.step(only_finished=True), 10)
    while eng.has_unfinished:
        eng.step()
    return (f"{family} B={batch}: step {step:.2f} ms, replay-only {replay:.2f} ms | synced phases (ms): {phases} "
            f"total={total:.2f}")


def kernel_ms(step, steps: int) -> tuple[dict[str, float], float, float]:
    """GPU ms per step by kernel name (torch profiler over ``steps`` calls of ``step``), their total, and the
    kernels launched per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / 1e3 / steps
    return by_name, sum(by_name.values()), len(kernels) / steps


def measure_mixed(eng, family: str, batch: int, prefill: int, steps: int = 10, context: int = 512) -> str:
    """``batch`` running decodes (``context``-token prompts), then ``steps`` mixed steps, each adding one
    ``prefill``-token request that finishes in its prefill step (so the decode batch stays ``batch``)."""
    import cProfile
    import io
    import pstats

    from hybridkv import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = min(30000, eng.vocab_size)
    for i in range(batch):
        eng.add_request(f"{family}{batch}-{i}", rng.integers(10, vocab, context).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    while eng.scheduler.waiting or any(len(r.token_ids) <= context + 1 for r in eng.scheduler.running):
        eng.step()
    counter = iter(range(10**9))

    def mixed_step() -> None:
        eng.add_request(f"p{family}{batch}-{next(counter)}", rng.integers(10, vocab, prefill).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        eng.step(only_finished=True)

    for _ in range(3):
        mixed_step()
    step = ms_per_call(mixed_step, steps)
    runner = eng.runner
    mixed_graphs, runner.mixed_graphs = runner.mixed_graphs, None
    try:
        eager = ms_per_call(mixed_step, steps)              # the same steps without the mixed-step graphs
    finally:
        runner.mixed_graphs = mixed_graphs
    decode = ms_per_call(lambda: eng.step(only_finished=True), steps)
    synced, phases = synced_phases(eng, mixed_step, steps)
    mixed_kernels, gpu_ms, launches = kernel_ms(mixed_step, steps)
    decode_kernels, decode_gpu_ms, _ = kernel_ms(lambda: eng.step(only_finished=True), steps)
    heavy = ", ".join(f"{n} {t:.3f}" for n, t in sorted(mixed_kernels.items(), key=lambda kv: -kv[1])[:8])
    heavy_decode = ", ".join(f"{n} {t:.3f}" for n, t in sorted(decode_kernels.items(), key=lambda kv: -kv[1])[:8])
    extra = {n: t - decode_kernels.get(n, 0.0) for n, t in mixed_kernels.items()}
    added = ", ".join(f"{n} {t:.3f}" for n, t in sorted(extra.items(), key=lambda kv: -kv[1])[:14])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        mixed_step()
    sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(16)
    top = "\n".join(line for line in text.getvalue().splitlines() if line.strip()[:1].isdigit())
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(40)
    cum = "\n".join(line for line in text.getvalue().splitlines() if line.strip()[:1].isdigit())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            mixed_step()
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48)
    for r in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        eng.abort(r.request_id)
    while eng.has_unfinished:
        eng.step()
    graphed = "graphed" if mixed_graphs is not None else "eager: no mixed-step graphs"
    return (f"{family} B={batch} (prompts of {context}) +{prefill} prompt tokens: mixed step {step:.2f} ms "
            f"({graphed}; eager {eager:.2f} ms; decode-only {decode:.2f} ms), "
            f"GPU kernels {gpu_ms:.2f} ms/step ({decode_gpu_ms:.2f} decode-only), {launches:.0f} kernels/step\n"
            f"heaviest kernels (ms/step): {heavy}\n"
            f"heaviest kernels of the decode-only step (ms/step): {heavy_decode}\n"
            f"what the {prefill} prompt tokens add, by kernel (ms/step): {added}\n"
            f"synced phases (ms): {phases} total={synced:.2f}\n"
            f"host functions by own time over {steps} mixed steps (cProfile, ncalls tottime percall cumtime):\n{top}\n"
            f"host functions by cumulative time (cProfile):\n{cum}\n"
            f"host ops by own CPU time over {steps} mixed steps (torch profiler):\n{table}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama4,gemma3,mamba2,nemotronh")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--mixed", type=int, default=0, help="measure mixed steps with this many prompt tokens")
    ap.add_argument("--contexts", default="512", help="with --mixed: the decoding requests' prompt lengths")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="the engine's (default: max(64, batch + 8))")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_phases.py needs a CUDA device")
    for family in args.families.split(","):
        batches = [int(b) for b in args.batches.split(",")]
        llm = random_llm(family, max_num_seqs=args.max_num_seqs or max(64, max(batches) + 8))
        for batch in batches:
            if args.mixed:
                for context in (int(c) for c in args.contexts.split(",")):
                    print(measure_mixed(llm.engine, family, batch, args.mixed, context=context), flush=True)
            else:
                print(measure(llm.engine, family, batch), flush=True)
        llm.shutdown()
        del llm                     # (its KV cache took 80% of free memory: give it back before the next family)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
