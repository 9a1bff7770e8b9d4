"""Prefix caching on serving traffic: caching on vs off, per model and workload.

    python benchmarks/prefix_caching.py [--families llama4,gemma3,mamba2,nemotronh]
                                        [--workloads shared,repeat,chat,none] [--requests 256]
                                        [--kv-memory 24GiB] [--host-cache-memory 32GiB] [--tiny]
    # writes benchmarks/results/prefix_caching.json

Models: the random-init ~1B models of ``gpu_decode.py`` (Llama-4-like: chunked local + global; Gemma-3-like:
5 sliding : 1 global; Mamba2 alone; NemotronH-like: Mamba2 + attention), bf16, triton backend, built by HF
and loaded by hybridkv. One engine per model and mode, ``LLM.generate`` on N requests (greedy, ignore_eos),
timed end to end after a warm-up run of the same workload on other tokens; hit tokens and steps are the
engine's counters over the timed part.

Workloads ("reusable" = the block-aligned prefix an earlier request computed, below the prompt's length):
  shared   N prompts = one 1536-token prefix + 64 unique tokens, 64 new. Reusable: (N - 1) x 1536.
  repeat   N prompts of 128-2048 tokens, 64 new, run twice; the second pass is timed. Reusable: each prompt.
  chat     N / 4 conversations x 3 turns; a turn = the previous prompt + its answer (64 new tokens) + 32-128
           new tokens; turns 2-3 timed. Reusable: the previous turn's prompt + answer.
  none     N unique prompts of 128-2048 tokens, 64 new: nothing to reuse, on vs off is what caching costs.
Targets: shared: on >= 3x faster than off, >= 90% of reusable tokens hit, every model; repeat, chat: >= 90%
hit; none: on <= 1.05x off. ``--tiny`` runs tiny models on the CPU (a smoke test; numbers meaningless).
``--simulate`` runs the real scheduler and KV coordinator at full size on the CPU with a runner that computes
nothing (its tokens depend only on the input): hit tokens and steps as the GPU run will see them, in seconds
(times meaningless).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import hf_config  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.engine.engine import EngineStats, LLMEngine  # noqa: E402
from hybridkv.engine.model_runner import StepBatch, StepOutput  # noqa: E402
from hybridkv.engine.request import RequestOutput  # noqa: E402
from hybridkv.kv_groups.plan import KVCachePlan  # noqa: E402
from hybridkv.planning import plan as plan_for  # noqa: E402
from hybridkv.utils import format_bytes, parse_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "prefix_caching.json"


class Sizes:
    def __init__(self, tiny: bool, requests: int) -> None:
        self.n = requests
        self.prefix, self.unique, self.new = (96, 8, 8) if tiny else (1536, 64, 64)
        self.lengths = (16, 64) if tiny else (128, 2048)
        self.turn_new = (4, 16) if tiny else (32, 128)
        self.first_turn = (16, 48) if tiny else (256, 1024)


class NoModel:
    """A step runner that computes nothing: each sampled token is a function of the step's input token."""

    device = torch.device("cpu")

    def __init__(self, plan: KVCachePlan, vocab: int) -> None:
        self.plan, self.vocab = plan, vocab

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        pass

    def host_moves_available(self) -> int:
        return 1 << 30

    def execute(self, batch: StepBatch) -> StepOutput:
        last = batch.input_ids[batch.logits_indices]
        return StepOutput(logits=None, greedy=torch.from_numpy((last * 7 + 3) % (self.vocab - 1) + 1))


class Simulated:
    """What the workloads use of ``LLM``, over an engine with ``NoModel``: the real scheduler and coordinator."""

    def __init__(self, family: str, *, caching: bool, kv_memory: int, requests: int, step_tokens: int | None,
                 host_cache_memory: int = 0) -> None:
        config, _ = hf_config(family, False)
        step = step_tokens or 8192                          # LLM's default for these models' 16k context
        self.plan = plan_for(config.to_dict(), kv_memory=kv_memory, max_num_seqs=requests, kv_dtype="bfloat16",
                             max_num_batched_tokens=step, enable_prefix_caching=caching,
                             host_cache_memory=host_cache_memory)
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=config.vocab_size, eos_token_ids=()))
        self.engine = LLMEngine(self.model, self.plan, max_num_seqs=requests, max_num_batched_tokens=step,  # type: ignore[arg-type]
                                enable_prefix_caching=caching, runner=NoModel(self.plan, config.vocab_size))
        self._next = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, use_tqdm: bool = False) -> list[RequestOutput]:
        ids = []
        for p in prompts:
            ids.append(str(self._next))
            self.engine.add_request(ids[-1], p, params)
            self._next += 1
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step(only_finished=True):
                done[out.request_id] = out
        return [done[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()


def build(family: str, *, tiny: bool, caching: bool, kv_memory: int, requests: int, step_tokens: int | None,
          simulate: bool = False, host_cache_memory: int = 0) -> LLM | Simulated:
    if simulate:
        return Simulated(family, caching=caching, kv_memory=kv_memory, requests=requests, step_tokens=step_tokens,
                         host_cache_memory=host_cache_memory)
    config, cls = hf_config(family, tiny)
    torch.manual_seed(0)
    device = "cpu" if tiny else "cuda"
    with torch.device(device):
        hf = cls(config).to(torch.float32 if tiny else torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        del hf
        return LLM(tmp, device=device, dtype=torch.float32 if tiny else torch.bfloat16,
                   backend="torch" if tiny else "triton", kv_cache_memory=kv_memory, max_num_seqs=requests,
                   max_num_batched_tokens=step_tokens, enable_prefix_caching=caching,
                   host_cache_memory=host_cache_memory)


def aligned(n: int, bs: int) -> int:
    return n // bs * bs


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float, int, int]:
    """(outputs, seconds, steps, hit tokens) of one generate call."""
    before = llm.stats()
    t0 = time.perf_counter()
    outs = tokens(llm.generate(prompts, params, use_tqdm=False))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = llm.stats()
    return outs, seconds, after.steps - before.steps, after.prefix_hit_tokens - before.prefix_hit_tokens


Result = dict[str, float]


def shared(llm: LLM, rng: np.random.Generator, s: Sizes, bs: int, vocab: int) -> Result:
    prefix = rng.integers(1, vocab, s.prefix).tolist()
    prompts = [prefix + rng.integers(1, vocab, s.unique).tolist() for _ in range(s.n)]
    _, sec, steps, hits = timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True))
    return dict(seconds=sec, steps=steps, hit_tokens=hits, reusable_tokens=(s.n - 1) * aligned(s.prefix, bs))


def repeat(llm: LLM, rng: np.random.Generator, s: Sizes, bs: int, vocab: int) -> Result:
    prompts = [rng.integers(1, vocab, int(rng.integers(*s.lengths))).tolist() for _ in range(s.n)]
    params = SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    _, sec, steps, hits = timed(llm, prompts, params)
    reusable = sum(aligned(len(p) - 1, bs) for p in prompts)
    return dict(seconds=sec, steps=steps, hit_tokens=hits, reusable_tokens=reusable)


def chat(llm: LLM, rng: np.random.Generator, s: Sizes, bs: int, vocab: int) -> Result:
    convs = [rng.integers(1, vocab, int(rng.integers(*s.first_turn))).tolist() for _ in range(max(1, s.n // 4))]
    params = SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True)
    total = dict(seconds=0.0, steps=0, hit_tokens=0, reusable_tokens=0)
    answers = tokens(llm.generate(convs, params, use_tqdm=False))
    for _ in range(2):
        total["reusable_tokens"] += sum(aligned(len(c) + len(a) - 1, bs) for c, a in zip(convs, answers, strict=True))
        convs = [c + a + rng.integers(1, vocab, int(rng.integers(*s.turn_new))).tolist()
                 for c, a in zip(convs, answers, strict=True)]
        answers, sec, steps, hits = timed(llm, convs, params)
        total["seconds"] += sec
        total["steps"] += steps
        total["hit_tokens"] += hits
    return total


def none(llm: LLM, rng: np.random.Generator, s: Sizes, bs: int, vocab: int) -> Result:
    prompts = [rng.integers(1, vocab, int(rng.integers(*s.lengths))).tolist() for _ in range(s.n)]
    _, sec, steps, hits = timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=s.new, ignore_eos=True))
    return dict(seconds=sec, steps=steps, hit_tokens=hits, reusable_tokens=0)


WORKLOADS: dict[str, Callable[[LLM, np.random.Generator, Sizes, int, int], Result]] = {
    "shared": shared, "repeat": repeat, "chat": chat, "none": none}


def verdict(workload: str, on: Result, off: Result, *, timed: bool) -> str:
    """Against the targets; without meaningful times (``--tiny``, ``--simulate``) on hit rates only."""
    speedup = off["seconds"] / on["seconds"]
    rate = on["hit_tokens"] / on["reusable_tokens"] if on["reusable_tokens"] else None
    if workload == "none":
        return "-" if not timed else "ok" if on["seconds"] <= 1.05 * off["seconds"] else "SLOWER"
    ok = rate is not None and rate >= 0.9 and (workload != "shared" or not timed or speedup >= 3.0)
    return "ok" if ok else "MISSED"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama4,gemma3,mamba2,nemotronh")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, default=None, help="N (default 256; 16 with --tiny)")
    ap.add_argument("--kv-memory", default=None, help="KV budget (default 24GiB; 64MiB with --tiny)")
    ap.add_argument("--host-cache-memory", default="0",
                    help="host memory for recurrent-state checkpoints the device slots evict (e.g. 32GiB)")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="max_num_batched_tokens (default: the engine's; 128 with --tiny)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--simulate", action="store_true", help="full size, no model: hits and steps on the CPU")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not (args.tiny or args.simulate) and not torch.cuda.is_available():
        raise SystemExit("prefix_caching.py needs CUDA (or --tiny / --simulate on the CPU)")
    n = args.requests or (16 if args.tiny else 256)
    kv_memory = parse_bytes(args.kv_memory or ("64MiB" if args.tiny else "24GiB"))
    sizes = Sizes(args.tiny, n)
    rows = []
    for family in args.families.split(","):
        results: dict[bool, dict[str, Result]] = {}
        for caching in (True, False):
            llm = build(family, tiny=args.tiny, caching=caching, kv_memory=kv_memory, requests=n,
                        step_tokens=args.step_tokens or (128 if args.tiny else None), simulate=args.simulate,
                        host_cache_memory=parse_bytes(args.host_cache_memory))
            vocab, bs = llm.model.config.vocab_size, llm.plan.block_size
            if caching:
                print(f"{family}: {llm.plan.summary()}")
            results[caching] = {}
            for i, w in enumerate(args.workloads.split(",")):
                WORKLOADS[w](llm, np.random.default_rng(1000 + i), sizes, bs, vocab)   # warm-up: other tokens
                results[caching][w] = WORKLOADS[w](llm, np.random.default_rng(i), sizes, bs, vocab)
            ckpt = llm.engine.coordinator.checkpoint_stats()
            if caching and ckpt is not None:
                print(f"{family}: checkpoints {ckpt}")
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for w in args.workloads.split(","):
            on, off = results[True][w], results[False][w]
            rate = on["hit_tokens"] / on["reusable_tokens"] if on["reusable_tokens"] else 0.0
            rows.append(dict(family=family, workload=w, on=on, off=off, speedup=off["seconds"] / on["seconds"],
                             hit_rate=rate, verdict=verdict(w, on, off, timed=not (args.tiny or args.simulate))))
    note = " (tiny models on the CPU: times meaningless)" if args.tiny else \
        " (simulated: no model, times meaningless)" if args.simulate else ""
    print(f"\nprefix caching on vs off, {n} requests, KV budget {format_bytes(kv_memory)}{note}")
    head = f"{'model':10s} {'workload':8s} {'on s':>8s} {'off s':>8s} {'off/on':>7s} {'steps on/off':>13s} " \
           f"{'hit / reusable tokens':>24s} {'hit %':>6s}  verdict"
    print(head)
    for r in rows:
        on, off = r["on"], r["off"]
        print(f"{r['family']:10s} {r['workload']:8s} {on['seconds']:8.2f} {off['seconds']:8.2f} {r['speedup']:7.2f} "
              f"{int(on['steps']):6d}/{int(off['steps']):<6d} {int(on['hit_tokens']):>11d} / "
              f"{int(on['reusable_tokens']):<10d} {100 * r['hit_rate']:6.1f}  {r['verdict']}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not (args.tiny or args.simulate) else "cpu"
    try:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=device, commit=commit, requests=n, kv_memory=kv_memory,
                                        host_cache_memory=parse_bytes(args.host_cache_memory),
                                        tiny=args.tiny, simulate=args.simulate, rows=rows), indent=1))


if __name__ == "__main__":
    main()
