"""What the GPU does between two decode-graph replays: a torch.profiler trace of a few engine steps, split at
the captured graphs' kernels.

    python benchmarks/gpu_step_gaps.py [--families gemma3,llama4] [--batches 1,32] [--steps 4]

Models as in ``gpu_decode.py`` (random init, saved by HF, loaded by hybridkv), bf16, triton backend, CUDA
graphs, asynchronous scheduling, 512-token prompts, greedy. For each (family, batch) it prints the graph's span
(first to last kernel of one replay) and the device's time from one replay's last kernel to the next one's
first, with every kernel and copy in between (gap before it, duration). Profiling slows the host, so at batch
1 the host may not keep ahead of the device and the gaps then measure the host; the list of what runs between
two replays is the point. Writes ``gpu_step_gaps.json`` (``_results.py``); CUDA only.
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

PROMPT = 512


def to_steady_decode(eng, family: str, batch: int, steps: int) -> None:
    from hybridkv import SamplingParams

    rng = np.random.default_rng(batch)
    for i in range(batch):
        eng.add_request(f"{family}{batch}-{i}", rng.integers(10, 30000, PROMPT).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True))
    while any(len(r.token_ids) <= PROMPT + 1 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()


def device_events(eng, steps: int) -> list[dict]:
    """Kernels and copies of ``steps`` engine steps in time order; ``graph``: launched by a graph replay."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step(only_finished=True)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]            # noqa: SIM115
    replays = {e["args"].get("correlation") for e in events if e.get("ph") == "X" and e["name"] == "cudaGraphLaunch"}
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return [dict(ts=e["ts"], dur=e["dur"], name=e["name"], graph=e["args"].get("correlation") in replays)
            for e in sorted(gpu, key=lambda e: e["ts"])]


def between_replays(events: list[dict]) -> list[dict]:
    """One entry per pair of consecutive replays: the first one's span and what ran until the next."""
    runs, i = [], 0
    while i < len(events):
        if events[i]["graph"]:
            j = i
            while j + 1 < len(events) and events[j + 1]["graph"]:
                j += 1
            runs.append((i, j))
            i = j + 1
        else:
            i += 1
    out = []
    for (a0, a1), (b0, _) in zip(runs, runs[1:], strict=False):
        end = events[a1]["ts"] + events[a1]["dur"]
        ops, t = [], end
        for e in events[a1 + 1:b0]:
            ops.append(dict(gap_us=e["ts"] - t, us=e["dur"], name=e["name"][:90]))
            t = e["ts"] + e["dur"]
        out.append(dict(graph_span_us=end - events[a0]["ts"], graph_kernels=a1 - a0 + 1,
                        between_us=events[b0]["ts"] - end, ops=ops, gap_to_next_us=events[b0]["ts"] - t))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gemma3,llama4")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=4)
    add_output_args(ap, "gpu_step_gaps")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_gaps.py needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    result = {"meta": {"device": torch.cuda.get_device_name(0), "commit": commit(), "torch": torch.__version__,
                       "command": " ".join(sys.argv)},
              "rows": []}
    for family in args.families.split(","):
        llm = random_llm(family, max_num_seqs=max(batches) + 1, max_model_len=PROMPT + args.steps + 96,
                         enable_prefix_caching=False, max_num_batched_tokens=4096, kv_cache_memory="16GiB")
        for batch in batches:
            eng = llm.engine
            to_steady_decode(eng, family, batch, args.steps)
            pairs = between_replays(device_events(eng, args.steps + 1))
            while eng.has_unfinished:
                eng.step()
            result["rows"].append(dict(family=family, batch=batch, replays=pairs))
            if not pairs:
                print(f"{family} B={batch}: fewer than two graph replays traced")
                continue
            print(f"{family} B={batch}: graph span {np.mean([p['graph_span_us'] for p in pairs]):.1f} us "
                  f"({pairs[-1]['graph_kernels']} kernels), between replays "
                  + " / ".join(f"{p['between_us']:.1f}" for p in pairs) + " us; the last:")
            for op in pairs[-1]["ops"]:
                print(f"    +{op['gap_us']:6.1f} gap {op['us']:6.1f} us  {op['name'][:80]}")
            print(f"    +{pairs[-1]['gap_to_next_us']:6.1f} gap to the next replay", flush=True)
    write_json(args, "gpu_step_gaps", result)


if __name__ == "__main__":
    main()
