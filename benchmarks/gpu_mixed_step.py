"""Is a mixed step host-bound? Mixed steps vs decode steps on the serving configuration, and where the host's time goes.

    python benchmarks/gpu_mixed_step.py [--family gemma3] [--batch 40] [--context 256] [--prompt 96]

The model of ``gpu_decode.py`` (random init, bf16, triton backend, CUDA graphs, asynchronous scheduling) with
``serve_load.py``'s engine settings (``max_num_seqs`` 256, 24 GiB of KV cache, prefix caching off). ``--batch``
requests decode at ``--context`` tokens; a mixed step adds one ``--prompt``-token request that finishes in its
prefill step. Prints the mean time of a mixed step and of a decode step (60 each, device synced at both ends), the
host's wall time per step in each engine phase, timed by wrappers, and the GPU's kernel time per step by kernel
family. ``wait`` is the host waiting for the step in flight's tokens: where it is near zero the host is the
bottleneck, else the GPU (the engine queues step N+1 before reading step N); the host's own work is the step less
``wait``. Phases nest: ``_finish`` holds ``wait`` and ``_release``; ``execute`` holds ``build_context`` (which holds
``pack``, ``upload`` and ``host_to_device_many``), ``take_pending``, ``_hidden`` (the mixed graph's replay) and
``head`` (the eager logits head; a decode step's is in its graph).

The host phases are not timed under the torch profiler: under its CUPTI hooks a mixed bucket's graph launch took
~450 µs of host time, which by wall clock is a part of ``_hidden``. The kernel table comes from a profiler trace of
10 more steps of each kind, after the timed ones (so at ~140 more tokens of context, and under CUPTI): kernel
durations, and the GPU's busy time per step (their union; a Triton kernel launched with programmatic dependent launch
starts early and waits for its predecessor inside, so durations added up overcount). Writes ``gpu_mixed_step.json``
(``_results.py``); CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from gpu_decode import random_llm  # noqa: E402
from gpu_step_phases import ms_per_call  # noqa: E402

STEPS = 60
PHASES = {"engine": ["add_request", "_step_batch", "_launch", "_finish", "_release", "_commit"],
          "scheduler": ["schedule"], "runner": ["execute", "build_context", "_hidden"],
          "static": ["pack", "upload"], "module": ["take_pending", "host_to_device_many"],
          "model": ["compute_logits_and_greedy"]}
LABELS = {"compute_logits_and_greedy": "head"}
WAIT = "wait"       # the host waiting for the step in flight's tokens


def time_phases(eng) -> dict[str, float]:
    """Wrap the engine's phases (``PHASES``) to add their wall time (s) to the returned dict."""
    import hybridkv.engine.engine as engine_module
    import hybridkv.engine.model_runner as runner_module

    spent: dict[str, float] = defaultdict(float)
    runner = eng.runner
    owners = {"engine": eng, "scheduler": eng.scheduler, "runner": runner, "module": runner_module,
              "static": runner.mixed_graphs.static if runner.mixed_graphs else None, "model": eng.model}

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t

        setattr(obj, name, timed)

    for key, names in PHASES.items():
        for name in names if owners[key] is not None else ():
            wrap(owners[key], name, LABELS.get(name, name))
    wrap(engine_module._Launched, "tokens_on_host", WAIT)
    return spent


KERNEL_FAMILIES = {"attention": ("_paged_attention", "_reduce_segments"), "GEMM (cuBLAS)": ("nvjet", "cublas", "gemm"),
                   "GEMM (Triton)": ("_skinny_linear",), "norms": ("rms_norm",), "rope and KV write": ("rope",),
                   "activation": ("_act_mul",), "copies": ("Memcpy", "Memset")}


def kernel_us(fn: Callable[[], None], steps: int = 10) -> tuple[dict[str, float], float, float]:
    """GPU µs per call of ``fn`` by kernel family (``KERNEL_FAMILIES``, the rest as "other") and in all, the GPU's
    busy µs per call (the union of the kernels' intervals) and the kernels per call, from a torch profiler trace (the
    profiler inflates the host's launches, not the kernels' durations)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = sorted((e for e in json.loads(Path(f.name).read_text())["traceEvents"]
                         if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    families: dict[str, float] = defaultdict(float)
    busy, end = 0.0, float("-inf")
    for e in events:
        family = next((k for k, keys in KERNEL_FAMILIES.items() if any(key in e["name"] for key in keys)), "other")
        families[family] += e["dur"] / steps
        families["all kernels"] += e["dur"] / steps
        start, stop = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return dict(families), busy / steps, len(events) / steps


def per_step_us(fn: Callable[[], None], spent: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``fn``'s wall time (µs per call, device synced at both ends) and each phase's µs per call."""
    for _ in range(10):
        fn()
    spent.clear()
    wall = ms_per_call(fn, STEPS) * 1e3
    return wall, {k: v / STEPS * 1e6 for k, v in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gemma3")
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=96)
    add_output_args(ap, "gpu_mixed_step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_mixed_step.py needs a CUDA device")
    from hybridkv import SamplingParams

    llm = random_llm(args.family, max_num_seqs=256, kv_cache_memory="24GiB", enable_prefix_caching=False)
    eng = llm.engine
    rng = np.random.default_rng(0)
    vocab = min(30000, eng.vocab_size)
    for i in range(args.batch):
        eng.add_request(f"d{i}", rng.integers(3, vocab, args.context).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    while eng.scheduler.waiting or any(len(r.token_ids) <= args.context + 1 for r in eng.scheduler.running):
        eng.step()
    ids = iter(range(10**9))

    def mixed() -> None:
        eng.add_request(f"p{next(ids)}", rng.integers(3, vocab, args.prompt).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=1))
        eng.step(only_finished=True)

    spent = time_phases(eng)
    mixed_us, mixed_phases = per_step_us(mixed, spent)
    decode_us, decode_phases = per_step_us(lambda: eng.step(only_finished=True), spent)
    (mixed_kernels, mixed_busy, mixed_n), (decode_kernels, decode_busy, decode_n) = \
        kernel_us(mixed), kernel_us(lambda: eng.step(only_finished=True))
    print(f"{args.family}: {args.batch} decodes at {args.context} tokens: mixed step (+{args.prompt} prompt tokens) "
          f"{mixed_us / 1e3:.2f} ms, decode step {decode_us / 1e3:.2f} ms", flush=True)
    print(f"host µs per step        {'mixed':>8s} {'decode':>8s}   (phases nest: module docstring)")
    for name in sorted(set(mixed_phases) | set(decode_phases), key=lambda k: -mixed_phases.get(k, 0.0)):
        print(f"  {name:20s} {mixed_phases.get(name, 0.0):8.0f} {decode_phases.get(name, 0.0):8.0f}")
    print(f"  {'(step less wait)':20s} {mixed_us - mixed_phases.get(WAIT, 0.0):8.0f} "
          f"{decode_us - decode_phases.get(WAIT, 0.0):8.0f}")
    print(f"GPU µs per step         {'mixed':>8s} {'decode':>8s}   (under the profiler)")
    print(f"  {'busy':20s} {mixed_busy:8.0f} {decode_busy:8.0f}   ({mixed_n:.0f} / {decode_n:.0f} kernels)")
    for name in sorted(set(mixed_kernels) | set(decode_kernels), key=lambda k: -mixed_kernels.get(k, 0.0)):
        print(f"  {name:20s} {mixed_kernels.get(name, 0.0):8.0f} {decode_kernels.get(name, 0.0):8.0f}")
    write_json(args, "gpu_mixed_step", {"meta": {"device": torch.cuda.get_device_name(0), "commit": commit(),
                                                 "command": " ".join(sys.argv), "torch": torch.__version__},
                                        "mixed_step_ms": mixed_us / 1e3, "decode_step_ms": decode_us / 1e3,
                                        "host_us_per_step": {"mixed": mixed_phases, "decode": decode_phases},
                                        "gpu_busy_us_per_step": {"mixed": mixed_busy, "decode": decode_busy},
                                        "kernels_per_step": {"mixed": mixed_n, "decode": decode_n},
                                        "kernel_us_per_step": {"mixed": mixed_kernels, "decode": decode_kernels}})


if __name__ == "__main__":
    main()
