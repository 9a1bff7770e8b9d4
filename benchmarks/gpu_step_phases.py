"""Where a decode step's time goes on the GPU path: the step, the captured graph replayed alone, and the
step split into phases with a device sync around each (schedule, step batch, execute = host inputs + pack +
replay, sample = argmax, finish = reading the sampled tokens back + stop checks, KV commit).

    python benchmarks/gpu_step_phases.py [--families llama4,gemma3,mamba2,nemotronh] [--batches 1,32]

Models as in ``gpu_decode.py`` (random init, saved by HF, loaded by hybridkv), bf16, triton backend, CUDA
graphs, ``max_num_seqs=64``, 512-token prompts, greedy. "replay-only" replays the batch's captured graph
back to back (GPU time of the forward, no host work); execute minus replay-only is the host work the runner
does before the replay. The synced phases add their sync overheads, so they sum to more than a plain step.
Prints one line per (family, batch); CUDA only.
"""

from __future__ import annotations

import argparse
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
    total = ms_per_call(lambda: eng.step(only_finished=True), 10)
    for owner, name in PHASES:
        delattr(owners[owner], name)
    while eng.has_unfinished:
        eng.step()
    phases = " ".join(f"{k.lstrip('_')}={v / 10 * 1e3:.3f}" for k, v in spent.items())
    return (f"{family} B={batch}: step {step:.2f} ms, replay-only {replay:.2f} ms | synced phases (ms): {phases} "
            f"total={total:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama4,gemma3,mamba2,nemotronh")
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_phases.py needs a CUDA device")
    for family in args.families.split(","):
        llm = random_llm(family, max_num_seqs=64)
        for batch in (int(b) for b in args.batches.split(",")):
            print(measure(llm.engine, family, batch), flush=True)


if __name__ == "__main__":
    main()
