"""Host-side cost of one engine step (schedule + KV coordinator + step batch + per-group metadata and
transforms), model excluded, for N decoding requests over 4 groups (full, sliding, chunked, Mamba), or
the 3 attention groups alone (``--no-mamba``).

    python benchmarks/engine_cpu.py [--requests 64 256] [--context 2048] [--steps 200] [--no-mamba]
    python benchmarks/engine_cpu.py --mixed [--steps 200]
    python benchmarks/engine_cpu.py --streamed [--requests 64 256] [--steps 200]

Requests are placed in the decode phase directly (their prompts registered with the coordinator
without running the model), then each timed step does exactly what ``LLMEngine.step`` does on the
host, with a fixed token standing in for sampling. "metadata" is the eager path's per-group CAMs and
transforms (the CPU engine's); "graph_packing" is what a CUDA decode step does instead (the step tables
packed into the captured graph's buffers, here host arrays of that layout); "total" and "total_graphs"
add schedule, step batch and commit to each. Prints a table and writes ``engine_cpu.json`` (scenario
``default``, or ``no_mamba``; ``--save``: the tracked result, see ``_results.py``). Target: <= 300 µs per step at
256 requests.

``--mixed``: a mixed step's host work instead, the step of ``gpu_mixed_step.py`` (40 requests decoding at 256
tokens, one 96-token prompt arriving each step and finishing in it) on a Gemma-3-like plan (26 layers, 5 sliding
window 512 : 1 full: 13 groups), ``max_num_seqs`` 256: schedule, step batch, the step's inputs packed into the
mixed graphs' static buffers (host arrays here) and copied (a CPU copy here, one per copy call on CUDA), and commit
+ freeing the finished prompt (scenario ``mixed``).

``--streamed``: what ``LLMEngine.step`` costs the host while N requests stream (``OutputKind.DELTA``, as
``hybridkv serve`` runs them), all of it but the model (``_sleep_engine.SleepRunner``, with no sleep, stands in for
it). A new 32-token prompt arrives whenever a request finishes (64 new tokens each), so the engine keeps N in
flight, and a step reads back the last step's tokens, checks stops, builds each stream's output and admits and
frees requests as they come and go (scenario ``streamed``; median of ``--steps`` steps after as many warm-up ones,
the best of three runs).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from _sleep_engine import SleepRunner  # noqa: E402

from hybridkv import LLM, SamplingParams
from hybridkv.engine.cuda_graphs import _Layout, pack_host
from hybridkv.engine.mixed_graphs import mixed_buckets
from hybridkv.engine.mixed_metadata import MixedStepBuffers
from hybridkv.engine.request import OutputKind
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2


def bench_config(context: int, *, mamba: bool = True) -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=8)
    mixers = (Attention(sliding_window=1024, **attn), Attention(attention_chunk_size=1024, **attn), Attention(**attn))
    if mamba:
        mixers = (Mamba2(num_heads=2, head_dim=8, state_size=8), *mixers)
    return HybridConfig(vocab_size=128, hidden_size=16, max_position_embeddings=context + 1024, dtype="float32",
                        layers=tuple(Layer(mixer=m, ffn=MLP(intermediate_size=16)) for m in mixers))


def to_decode(sched, coord) -> None:
    """Skip the model for the prefill: register every waiting prompt as computed, leaving one token to decode."""
    while sched.waiting:
        req = sched.pop_waiting()
        n = req.num_tokens
        assert coord.allocate(req.request_id, num_computed_tokens=0, num_new_tokens=n, token_ids=req.token_ids)
        coord.commit(req.request_id, num_computed_tokens=n - 1)
        sched.mark_running(req)


def measure(num_requests: int, context: int, steps: int, *, mamba: bool = True) -> dict[str, float]:
    llm = LLM(bench_config(context, mamba=mamba), device="cpu", max_num_seqs=num_requests, kv_cache_memory=1 << 30,
              max_num_batched_tokens=max(2048, num_requests))
    engine, coord, sched = llm.engine, llm.engine.coordinator, llm.engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        n = int(context - rng.integers(0, 16))
        engine.add_request(str(i), rng.integers(0, 128, n).tolist(), params)
    to_decode(sched, coord)

    # A CUDA decode step packs the same tables into the captured graph's buffers instead of building CAMs:
    # timed here on host arrays shaped like that layout (no CUDA needed).
    lay = _Layout.make(llm.plan, num_requests)
    h64, h32 = np.zeros(lay.i64_size, np.int64), np.zeros(lay.i32_size, np.int32)
    timings = {"schedule": [], "step_batch": [], "metadata": [], "graph_packing": [], "commit": [], "total": [],
               "total_graphs": []}
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        batch = sched.schedule()
        t1 = time.perf_counter_ns()
        step = engine._step_batch(batch)
        t2 = time.perf_counter_ns()
        engine.runner.build_context(step)
        t3 = time.perf_counter_ns()
        pack_host(lay, h64, h32, step.input_ids, step.seq_lens - 1, engine.runner.graph_inputs(step),
                  stale=num_requests)
        t4 = time.perf_counter_ns()
        for req in batch.requests:         # what the engine does per request: append the sampled token
            req.token_ids.append(1)
        sched.add_sampled(batch.rows)
        sched.set_last_tokens(batch.rows, np.ones(batch.num_reqs, np.int64))
        coord.commit_batch(batch.rows, batch.num_computed + batch.num_new_tokens)
        t5 = time.perf_counter_ns()
        common = (t1 - t0) + (t2 - t1) + (t5 - t4)
        for key, value in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, common + t3 - t2,
                                        common + t4 - t3), strict=True):
            timings[key].append(value / 1000)
        assert batch.num_reqs == num_requests
    return {key: statistics.median(values) for key, values in timings.items()}


def measure_mixed(steps: int, *, decodes: int = 40, context: int = 256, prompt: int = 96) -> dict[str, float]:
    """Median µs per phase of a mixed step's host work (``--mixed``)."""
    attn = dict(num_heads=4, num_kv_heads=1, head_dim=16)
    layers = tuple(Layer(mixer=Attention(**attn) if i % 6 == 5 else Attention(sliding_window=512, **attn),
                         ffn=MLP(intermediate_size=16)) for i in range(26))
    config = HybridConfig(vocab_size=128, hidden_size=64, max_position_embeddings=16384, dtype="float32",
                          layers=layers)
    llm = LLM(config, device="cpu", max_num_seqs=256, kv_cache_memory=1 << 30, max_num_batched_tokens=8192,
              enable_prefix_caching=False)
    engine, coord, sched, runner = llm.engine, llm.engine.coordinator, llm.engine.scheduler, llm.engine.runner
    rng = np.random.default_rng(0)
    for i in range(decodes):
        engine.add_request(f"d{i}", rng.integers(0, 128, context).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True))
    to_decode(sched, coord)
    buckets = mixed_buckets(8192)
    static = MixedStepBuffers(llm.plan, max_tokens=buckets[-1], max_reqs=256, device="cpu", pin=False)

    class Buckets:                          # what the runner asks the (CUDA-only) mixed graphs
        @staticmethod
        def bucket_for(n: int) -> int:
            return next(b for b in buckets if b >= n)

    runner.mixed_graphs = Buckets()
    timings: dict[str, list[float]] = {"schedule": [], "step_batch": [], "inputs": [], "commit_finish": [],
                                       "total": []}
    for i in range(steps + 20):
        engine.add_request(f"p{i}", rng.integers(0, 128, prompt).tolist(), SamplingParams(temperature=0.0,
                                                                                        max_tokens=1))
        t0 = time.perf_counter_ns()
        batch = sched.schedule()
        t1 = time.perf_counter_ns()
        step = engine._step_batch(batch)
        t2 = time.perf_counter_ns()
        static.pack_step(np.asarray(step.input_ids, np.int64), step.positions(), step.input_sources,
                         np.asarray(step.logits_indices, np.int64))
        runner.build_context(step, (), static)
        t3 = time.perf_counter_ns()
        for req in batch.requests:
            req.token_ids.append(1)
        sched.add_sampled(batch.rows)
        sched.set_last_tokens(batch.rows, np.ones(batch.num_reqs, np.int64))
        coord.commit_batch(batch.rows, batch.num_computed + batch.num_new_tokens)
        sched.finish(batch.requests[-1])    # the prompt: one token asked, sampled in its prefill step
        t4 = time.perf_counter_ns()
        assert batch.num_reqs == decodes + 1
        if i >= 20:                         # (warm-up)
            for key, value in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                timings[key].append(value / 1000)
    return {key: statistics.median(values) for key, values in timings.items()}


def measure_streamed(num_requests: int, steps: int) -> float:
    """Median µs per ``LLMEngine.step`` with ``num_requests`` DELTA streams in flight (``--streamed``)."""
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=16)
    layers = tuple(Layer(mixer=Attention(**attn) if i % 6 == 5 else Attention(sliding_window=64, **attn),
                         ffn=MLP(intermediate_size=16)) for i in range(12))
    config = HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=1024, dtype="float32",
                          layers=layers)
    llm = LLM(config, device="cpu", max_num_seqs=256, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    engine = llm.engine
    engine.runner = SleepRunner(llm.plan, engine.vocab_size, step_s=0.0, token_s=0.0, first=3)   # (no model)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rng = np.random.default_rng(0)
    added = 0

    def run(n: int) -> list[float]:
        nonlocal added
        times = []
        for _ in range(n):
            while engine.num_unfinished_requests < num_requests:
                engine.add_request(f"r{added}", rng.integers(3, 250, 32).tolist(), params,
                                   output_kind=OutputKind.DELTA)
                added += 1
            t0 = time.perf_counter_ns()
            engine.step()
            times.append((time.perf_counter_ns() - t0) / 1000)
        return times

    run(steps)
    return min(statistics.median(run(steps)) for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-mamba", action="store_true",
                        help="3 attention groups only: every decode block is hashed and registered for prefix "
                             "caching (with Mamba, only blocks up to the last state checkpoint are)")
    parser.add_argument("--mixed", action="store_true", help="a mixed step's host work instead (module docstring)")
    parser.add_argument("--streamed", action="store_true",
                        help="a step's host work with --requests DELTA streams in flight (module docstring)")
    add_output_args(parser, "engine_cpu")
    args = parser.parse_args()
    if args.streamed:
        us = {str(n): measure_streamed(n, args.steps) for n in args.requests}
        table = Table(title=f"host cost per step with N streamed requests, model stubbed (µs, median of {args.steps})")
        table.add_column("requests", justify="right")
        table.add_column("µs per step", justify="right")
        for n, v in us.items():
            table.add_row(n, f"{v:.0f}")
        Console().print(table)
        write_json(args, "engine_cpu", {"cpu": platform.processor() or platform.machine(), "commit": commit(),
                                         "command": " ".join(sys.argv), "us_per_step": us}, scenario="streamed")
        return
    if args.mixed:
        row = measure_mixed(args.steps)
        table = Table(title=f"host cost per mixed step, Gemma-3-like plan, 13 groups (µs, median of {args.steps})")
        for key in row:
            table.add_column(key, justify="right")
        table.add_row(*(f"{v:.0f}" for v in row.values()))
        Console().print(table)
        write_json(args, "engine_cpu", {"cpu": platform.processor() or platform.machine(), "commit": commit(),
                                         "command": " ".join(sys.argv), "us_per_mixed_step": row}, scenario="mixed")
        return
    rows = {}
    for n in args.requests:
        gc.collect()            # the previous size's engine is garbage: not left for the timed steps to scan
        rows[n] = measure(n, args.context, args.steps, mamba=not args.no_mamba)

    groups = "3 attention groups" if args.no_mamba else "4 groups"
    table = Table(title=f"host cost per decode step, {groups} (µs, median of {args.steps}; model excluded)")
    table.add_column("requests", justify="right")
    for key in next(iter(rows.values())):
        table.add_column(key, justify="right")
    table.add_column("target", justify="right")
    for n, r in rows.items():
        table.add_row(str(n), *(f"{v:.0f}" for v in r.values()), "<= 300" if n == 256 else "")
    Console().print(table)
    write_json(args, "engine_cpu", {"cpu": platform.processor() or platform.machine(), "commit": commit(),
                                     "groups": groups, "context": args.context, "command": " ".join(sys.argv),
                                     "us_per_step": {str(k): v for k, v in rows.items()}},
               scenario="no_mamba" if args.no_mamba else "default")


if __name__ == "__main__":
    main()
