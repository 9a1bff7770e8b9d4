"""Is a mixed step host-bound? Mixed steps vs decode steps on the serving configuration, and where the GPU waits.

    python benchmarks/gpu_mixed_step.py [--family gemma3] [--batch 40] [--context 256] [--prompt 96]

The model of ``gpu_decode.py`` (random init, bf16, triton backend, CUDA graphs, asynchronous scheduling) with
``serve_load.py``'s engine settings (``max_num_seqs`` 256, 24 GiB of KV cache, prefix caching off). ``--batch``
requests decode at ``--context`` tokens; a mixed step adds one ``--prompt``-token request that finishes in its
prefill step. Prints the mean time of a mixed step and of a decode step (30 each, device synced at both ends), then
a torch-profiler trace of 8 mixed steps with the engine's host phases annotated: per phase, its mean host time and
how long the GPU sat idle while the host was in it. A step whose GPU idles is host-bound: its time is the host's.
Writes ``gpu_mixed_step.json`` (``_results.py``); CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from gpu_decode import random_llm  # noqa: E402
from gpu_step_phases import ms_per_call  # noqa: E402

TRACED = 8          # mixed steps in the trace
PHASES = {"scheduler": ["schedule"], "engine": ["_step_batch", "_launch", "_finish", "_release", "_commit"],
          "runner": ["execute", "build_context", "_hidden"], "model": ["compute_logits_and_greedy"],
          "static": ["pack", "upload"], "mixed": ["run"]}


def annotate(eng) -> None:
    """Wrap the engine's host phases in profiler ranges named ``@phase``."""
    from torch.profiler import record_function

    owners = {"scheduler": eng.scheduler, "engine": eng, "runner": eng.runner, "model": eng.model,
              "static": eng.runner.mixed_graphs.static if eng.runner.mixed_graphs else None,
              "mixed": eng.runner.mixed_graphs}
    for key, names in PHASES.items():
        obj = owners[key]
        for name in names if obj is not None else ():
            fn = getattr(obj, name)

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                with record_function("@" + _name):
                    return _fn(*args, **kwargs)

            setattr(obj, name, wrapped)


def idle_by_phase(trace: dict) -> dict[str, dict[str, float]]:
    """Per annotated phase: its mean host µs per call and the GPU's idle µs while it ran (summed over the trace)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    busy: list[list[float]] = []
    for e in sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"]):
        if busy and e["ts"] <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e["ts"] + e["dur"])
        else:
            busy.append([e["ts"], e["ts"] + e["dur"]])
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)]
    out: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("cat") != "user_annotation" or not e["name"].startswith("@"):
            continue
        lo, hi = e["ts"], e["ts"] + e["dur"]
        idle = sum(max(0.0, min(hi, g1) - max(lo, g0)) for g0, g1 in gaps)
        row = out.setdefault(e["name"][1:], {"calls": 0, "host_us": 0.0, "gpu_idle_us": 0.0})
        row["calls"] += 1
        row["host_us"] += e["dur"]
        row["gpu_idle_us"] += idle
    for row in out.values():
        row["host_us"] /= row["calls"]
    return out


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

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        return ms_per_call(fn, 30)

    mixed_ms, decode_ms = ms(mixed), ms(lambda: eng.step(only_finished=True))
    annotate(eng)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(TRACED):
            mixed()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        phases = idle_by_phase(json.loads(Path(f.name).read_text()))
    print(f"{args.family}: {args.batch} decodes at {args.context} tokens: mixed step (+{args.prompt} prompt tokens) "
          f"{mixed_ms:.2f} ms, decode step {decode_ms:.2f} ms", flush=True)
    print("host phase (under the profiler)     host µs/call   GPU idle µs/step while in it")
    for name, row in sorted(phases.items(), key=lambda kv: -kv[1]["host_us"] * kv[1]["calls"]):
        print(f"  {name:32s} {row['host_us']:10.0f}   {row['gpu_idle_us'] / TRACED:10.0f}")
    write_json(args, "gpu_mixed_step", {"meta": {"device": torch.cuda.get_device_name(0), "commit": commit(),
                                                 "command": " ".join(sys.argv), "torch": torch.__version__},
                                        "mixed_step_ms": mixed_ms, "decode_step_ms": decode_ms, "phases": phases})


if __name__ == "__main__":
    main()
