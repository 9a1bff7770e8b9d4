"""The engine's steps under serving traffic, without HTTP: what its share of the inter-token latency is made of.

    python benchmarks/gpu_serving_steps.py [--family gemma3] [--rate R] [--seconds 8] [--prompt 260]
                                           [--output 64] [--max-num-batched-tokens 2048]
                                           [--prefill-spread 8 [1 ...]] [--prefill-floor 192 [...]]
                                           [--engine-cpu auto|off|N] [--tiny]

The model of ``gpu_decode.py`` (random init, bf16, triton backend, CUDA graphs, asynchronous scheduling) on
``serve_load.py``'s engine settings (``max_num_seqs`` 256, 24 GiB of KV cache, prefix caching off), driven in this
process as ``hybridkv serve``'s engine loop drives it: before each step, the requests whose Poisson arrival
(``--rate`` per second) has come are added (``--prompt`` random tokens, ``--output`` new ones, greedy, streamed
outputs), then ``LLMEngine.step`` runs. After a warm-up of 2 s at the same rate, ``--seconds`` of arrivals are timed.

A step's interval (its start to the next step's start, idle gaps left out) is what a decoding request waits between
two tokens before any API work, as the engine's step histogram counts it in the server (``serve_load.py`` reads it
there; here no API process's or reader thread's work shares the host). Per step it records the tokens scheduled,
the decodes among them, and ``wait``: the host blocked on the tokens of the step in flight (the engine queues step
N+1 before it reads step N), so a step's host work is its ``step()`` time less ``wait``. Steps are grouped by the
prompt tokens of the step or of the one in flight (the larger), since the one in flight's GPU time shows up in this
step's wait; the steps that only read back the last tokens count among the decode-only ones. Prints interval
percentiles overall and per group, host work and wait per group, the host's time by phase per group and for the
slowest steps (``gpu_mixed_step.py``'s phases, nested as there, and the garbage collector's time by generation
collected, ``gc0``-``gc2``, nested in whichever phase it interrupted), the slowest steps, and the time to first token
(a request's arrival to the end of the step that returned its first token). Several ``--prefill-spread`` values
run in turn on the same model and arrivals (the engine's setting, ``Scheduler._spread``), each after its own
warm-up; likewise every ``--prefill-floor`` (``EngineConfig.prefill_floor``) with each of them. The step loop runs on
a CPU of its own as ``hybridkv serve``'s engine does (``--engine-cpu``, default auto: ``engine/affinity.py``); at the
end it reports the threads started since the pin that share that CPU (``affinity.sharing``: they inherit it).
``--tiny``: a tiny model on the CPU (synchronous steps), a smoke test of this script; its numbers mean nothing.
Writes ``gpu_serving_steps.json`` (``_results.py``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, half_best_rate, write_json  # noqa: E402
from gpu_mixed_step import WAIT, time_phases  # noqa: E402

from hybridkv.commands import positive_int  # noqa: E402
from hybridkv.engine.affinity import pin_engine, sharing  # noqa: E402
from hybridkv.engine.scheduler import DEFAULT_PREFILL_FLOOR, DEFAULT_PREFILL_SPREAD  # noqa: E402
from hybridkv.server.cli import engine_cpu_arg  # noqa: E402

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine

# ``step()``'s phases that do not nest in one another; "rest" is the step's time outside them (building outputs for
# requests that did not finish, the state copies, the step's own bookkeeping)
TOP_PHASES = ("schedule", "_step_batch", "execute", "_launch", "_finish", "_commit")
GROUPS = ((0, 0), (1, 300), (301, 600), (601, 1 << 30))       # prompt tokens in the step or the one in flight


@dataclass(frozen=True)
class Step:
    start: float          # perf_counter at the step's start
    tokens: int           # tokens scheduled
    decodes: int          # ... of which one-token continuations
    host: float           # seconds in ``step()`` less ``wait``
    wait: float           # seconds blocked on the step in flight's tokens
    after_idle: bool      # the engine had nothing left after the step before (no request waited through that gap)
    phases: dict[str, float] = field(default_factory=dict)    # ``time_phases``' seconds in this step, by phase


def instrument(eng: LLMEngine) -> dict[str, Any]:
    """``gpu_mixed_step.time_phases`` (its ``wait``: the in-flight step's tokens awaited), and the scheduler's
    ``schedule`` wrapped to record the batch, and the garbage collector's time as phases ``gc0``-``gc2`` (by the
    generation collected): the returned dict holds the running step's figures."""
    cur = time_phases(eng)
    schedule = eng.scheduler.schedule

    def scheduled(**kw):
        batch = schedule(**kw)
        cur["tokens"] = batch.num_tokens
        cur["decodes"] = int((batch.num_new_tokens == 1).sum()) if batch.num_reqs else 0
        return batch

    eng.scheduler.schedule = scheduled

    started = [0.0]

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            key = f"gc{info['generation']}"
            cur[key] = cur.get(key, 0.0) + time.perf_counter() - started[0]

    gc.callbacks.append(collected)
    return cur


def replay(eng: LLMEngine, cur: dict[str, Any], *, rate: float, seconds: float, prompt: int, output: int,
           rng: np.random.Generator, tag: str) -> tuple[list[Step], list[float]]:
    """Poisson arrivals for ``seconds`` (then until every request finished): one ``Step`` per step run, and each
    request's time to first token (s)."""
    from hybridkv import SamplingParams
    from hybridkv.engine.request import OutputKind

    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    vocab = min(30000, eng.vocab_size)
    arrivals = np.cumsum(rng.exponential(1 / rate, max(1, int(rate * seconds))))
    steps, n, t0, idle = [], 0, time.perf_counter(), True
    waiting: dict[str, float] = {}                # request -> its arrival, until its first token
    ttft: list[float] = []
    while n < len(arrivals) or eng.has_unfinished:
        now = time.perf_counter() - t0
        while n < len(arrivals) and arrivals[n] <= now:
            eng.add_request(f"{tag}{n}", rng.integers(3, vocab, prompt).tolist(), params,
                            output_kind=OutputKind.DELTA)
            waiting[f"{tag}{n}"] = t0 + arrivals[n]
            n += 1
        if not eng.has_unfinished:
            time.sleep(max(0.0, arrivals[n] - now))
            continue
        cur.clear()
        start = time.perf_counter()
        outputs = eng.step()
        end = time.perf_counter()
        spent = end - start
        phases = dict(cur)                  # (now: a collection while the outputs are read is not this step's)
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids and out.request_id in waiting:
                ttft.append(end - waiting.pop(out.request_id))
        tokens, decodes = phases.pop("tokens", 0), phases.pop("decodes", 0)
        steps.append(Step(start=start, tokens=tokens, decodes=decodes, host=spent - phases.get(WAIT, 0.0),
                          wait=phases.get(WAIT, 0.0), after_idle=idle,
                          phases=dict(phases, rest=spent - sum(phases.get(k, 0.0) for k in TOP_PHASES))))
        idle = not eng.has_unfinished         # (as the engine's own histogram counts: ``LLMEngine.add_request``)
    return steps, ttft


def pct(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 and mean of ``values`` (s), in ms."""
    a = 1e3 * np.asarray(values)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)} | {"mean": float(a.mean())}


def summarize(steps: list[Step], ttft: list[float] | None = None) -> dict[str, Any]:
    """Interval percentiles (ms) overall and per ``GROUPS`` entry, with the mean host work and wait (ms); the
    time to first token's (ms), when given."""
    rows = []                                   # (interval, prompt tokens here or in flight, step)
    for i in range(len(steps) - 1):
        if steps[i + 1].after_idle:
            continue
        interval = steps[i + 1].start - steps[i].start
        prompt = steps[i].tokens - steps[i].decodes
        if i:
            prompt = max(prompt, steps[i - 1].tokens - steps[i - 1].decodes)
        rows.append((interval, prompt, steps[i]))

    out = {"steps": len(rows), "interval_ms": pct([r[0] for r in rows]), "groups": {}, "slowest": []}
    if ttft:
        out["ttft_ms"] = pct(ttft)
    for lo, hi in GROUPS:
        group = [r for r in rows if lo <= r[1] <= hi]
        if group:
            out["groups"][f"{lo}-{hi}" if hi < 1 << 30 else f">{lo - 1}"] = {
                "share": len(group) / len(rows), "interval_ms": pct([r[0] for r in group]),
                "host_ms": 1e3 * float(np.mean([r[2].host for r in group])),
                "wait_ms": 1e3 * float(np.mean([r[2].wait for r in group])),
                "decodes": float(np.mean([r[2].decodes for r in group])),
                "phases_ms": mean_phases([r[2] for r in group])}
    for interval, prompt, step in sorted(rows, key=lambda r: -r[0])[:8]:
        out["slowest"].append({"interval_ms": 1e3 * interval, "prompt_tokens_here_or_in_flight": prompt,
                               "tokens": step.tokens, "decodes": step.decodes, "host_ms": 1e3 * step.host,
                               "wait_ms": 1e3 * step.wait, "phases_ms": mean_phases([step])})
    return out


def mean_phases(steps: list[Step]) -> dict[str, float]:
    """Each phase's mean ms per step over ``steps`` (a phase a step did not enter counts 0), largest first."""
    names = {name for step in steps for name in step.phases}
    means = {name: 1e3 * float(np.mean([step.phases.get(name, 0.0) for step in steps])) for name in names}
    return dict(sorted(means.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gemma3")
    ap.add_argument("--rate", type=float, default=None, help="requests per second (default: half the best rate "
                    "of the family's server in benchmarks/results/serve_load.json)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--prompt", type=int, default=260)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the step's token budget (default 2048, the engine's; hybridkv serve's flag of that name)")
    ap.add_argument("--prefill-spread", type=positive_int, nargs="+", default=[DEFAULT_PREFILL_SPREAD],
                    help=f"the engine's prefill_spread, one run per value (default {DEFAULT_PREFILL_SPREAD}, the "
                    "engine's; 1: off)")
    ap.add_argument("--prefill-floor", type=positive_int, nargs="+", default=[DEFAULT_PREFILL_FLOOR],
                    help=f"the engine's prefill_floor, one run per value and spread (default {DEFAULT_PREFILL_FLOOR})")
    ap.add_argument("--engine-cpu", default="auto", type=engine_cpu_arg,
                    help="the step loop's CPU, as hybridkv serve's flag (default auto; off: not pinned)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke test of this script")
    add_output_args(ap, "gpu_serving_steps")
    args = ap.parse_args()
    if args.rate is None:
        args.rate = 50.0 if args.tiny else half_best_rate(args.family)
    if args.tiny:
        from hybridkv import LLM
        from hybridkv.models import MLP, Attention, HybridConfig, Layer

        config = HybridConfig(vocab_size=256, hidden_size=32, max_position_embeddings=1024, dtype="float32",
                              layers=(Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=16),
                                            ffn=MLP(intermediate_size=32)),))
        llm = LLM(config, device="cpu", max_num_seqs=64, kv_cache_memory=64 << 20, enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        args.rate, args.seconds, args.prompt, args.output = min(args.rate, 50.0), min(args.seconds, 1.0), \
            min(args.prompt, 32), min(args.output, 8)
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_serving_steps.py needs a CUDA device (or --tiny)")
    else:
        from gpu_decode import random_llm

        llm = random_llm(args.family, max_num_seqs=256, kv_cache_memory="24GiB", enable_prefix_caching=False,
                         max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    cpu = pin_engine(args.engine_cpu, eng.device)
    cur = instrument(eng)
    runs = []
    for floor, spread in itertools.product(args.prefill_floor, args.prefill_spread):
        # (one model for every value: the scheduler reads its config each step)
        eng.scheduler.config = replace(eng.scheduler.config, prefill_spread=spread, prefill_floor=floor)
        rng = np.random.default_rng(0)
        kw = dict(rate=args.rate, prompt=args.prompt, output=args.output, rng=rng)
        tag = f"{floor}-{spread}-"
        replay(eng, cur, seconds=min(2.0, args.seconds), tag=f"w{tag}", **kw)
        result = {"prefill_spread": spread, "prefill_floor": floor,
                  **summarize(*replay(eng, cur, seconds=args.seconds, tag=f"r{tag}", **kw))}
        runs.append(result)
        i, t = result["interval_ms"], result["ttft_ms"]
        print(f"{args.family}: {args.rate:g} req/s, {args.prompt}-token prompts, {args.output} new, prefill_spread "
              f"{spread}, prefill_floor {floor}: {result['steps']} steps, interval p50 / p90 / p99 {i['p50']:.2f} / "
              f"{i['p90']:.2f} / {i['p99']:.2f} ms, first token p50 / p99 {t['p50']:.1f} / {t['p99']:.1f} ms")
        print(f"  {'prompt tokens here or in flight':32s} {'share':>6s} {'p50':>6s} {'p99':>6s} {'host':>6s} "
              f"{'wait':>6s} {'decodes':>7s}   (ms)")
        for name, g in result["groups"].items():
            print(f"  {name:32s} {100 * g['share']:5.1f}% {g['interval_ms']['p50']:6.2f} "
                  f"{g['interval_ms']['p99']:6.2f} {g['host_ms']:6.2f} {g['wait_ms']:6.2f} {g['decodes']:7.0f}")
        for name, g in result["groups"].items():
            print(f"  {name} phases (ms, nested, host's view): " + ", ".join(
                f"{k} {v:.2f}" for k, v in g["phases_ms"].items() if v >= 0.01))
        for s in result["slowest"][:4]:
            print(f"  slow step {s['interval_ms']:.2f} ms phases: " + ", ".join(
                f"{k} {v:.2f}" for k, v in s["phases_ms"].items() if v >= 0.01))
        print("  slowest: " + "; ".join(f"{s['interval_ms']:.2f} ms ({s['tokens']} tokens, {s['decodes']} decodes, "
                                        f"host {s['host_ms']:.2f}, wait {s['wait_ms']:.2f})"
                                        for s in result["slowest"][:4]))
    shared = sharing(cpu) if cpu is not None else []
    if shared:
        print(f"  {len(shared)} thread(s) started since the pin share the step loop's CPU {cpu}: {shared}")
    write_json(args, "gpu_serving_steps", {
        "meta": {"device": torch.cuda.get_device_name(0) if not args.tiny else "cpu", "commit": commit(),
                 "command": " ".join(sys.argv), "torch": torch.__version__, "rate": args.rate,
                 "seconds": args.seconds, "prompt": args.prompt, "output": args.output,
                 "max_num_batched_tokens": args.max_num_batched_tokens, "engine_cpu": cpu,
                 "threads_sharing_engine_cpu": len(shared)}, "runs": runs})


if __name__ == "__main__":
    main()
