"""Serving-shaped traffic: what users run, against the workload's physical floor and HF's own engine.

    python benchmarks/serving.py [--models llama4,gemma3,mamba2,nemotronh] [--workloads ...]
                                 [--hf-models gemma3] [--kv-memory 24GiB] [--host-cache-memory 32GiB]
                                 [--step-trace] [--save] [--tiny]

Models: the ~1B random-init mixes of ``gpu_decode.py`` (Llama-4-like, Gemma-3-like, Mamba2, NemotronH-like),
built by transformers, saved with ``save_pretrained`` and loaded by hybridkv (bf16, triton backend).
Workloads (``LLM.generate``, greedy, ``ignore_eos``: every request makes exactly its new tokens):

- ``mixed``: 256 prompts of 128-2048 random tokens, 256 new;
- ``shared``: 256 x (1536 shared + 64 unique) tokens, 64 new; ``shared_var``: unique parts of 1-200 tokens;
- ``repeat``: the first pass's ``mixed`` prompts again, right after them (caching on only);
- ``multiturn``: 64 conversations x 4 turns; a turn's prompt = the previous prompt + its answer + 64 new
  tokens (first turns 256-1024 tokens), 128 new per turn;
- ``long``: 32 requests of 16k-32k tokens, 128 new (attention models only).

Each workload runs twice on the same engine with different random tokens of the same shape: the *first
pass* (right after start-up: anything compiled inside the serving loop shows here) and the *steady state*.
Both run with prefix caching on and off (two engines over the same weights). Per run: wall time, input and
output tok/s, engine steps, prefix-cache hit tokens / reusable tokens (what an ideal cache could serve:
block-aligned, the last prompt token always recomputed), Triton kernels compiled during the run, and the
physical floor: prefill FLOPs of the tokens no cache can serve (2 x active params + attention) / measured
bf16 matmul rate + decode bytes (weights per step, KV read, Mamba state read and written) / measured copy
bandwidth. HF transformers' continuous-batching engine (``generate_batch``, same weights, same prompts) is
the peer on ``mixed`` for ``--hf-models``.

The Mamba models keep the prefix-cache checkpoints their device slots evict in ``--host-cache-memory`` of host
memory (default 32 GiB: 24 GiB hold too few 65 MiB Mamba2 states for a repeat of 256 distinct prompts).

Writes ``benchmarks/out/serving.json`` (``--save``: the tracked ``benchmarks/results/serving.json``).
``--tiny`` runs tiny models on the CPU: a smoke test of the script (numbers meaningless).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _results import add_output_args, commit, write_json  # noqa: E402
from gpu_attention import print_table  # noqa: E402
from gpu_decode import copy_bandwidth, hf_config, matmul_rate  # noqa: E402

ATTENTION_MODELS = ("llama4", "gemma3")


# -- workloads -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Workload:
    """One pass: batches of prompts submitted together (a multi-turn chat is one batch per turn, each built
    from the answers of the one before). ``reusable``: per prompt, the tokens an ideal cache serves."""

    name: str
    new_tokens: int
    turns: list[list[list[int]]] = field(default_factory=list)     # filled turn by turn for multiturn
    reusable: list[list[int]] = field(default_factory=list)


def _rand(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(10, vocab, n).tolist()


def _reusable(length: int, bs: int) -> int:
    """What a cache can serve of a known prefix of ``length`` tokens: whole blocks, the last prompt token
    never (it must be computed to sample)."""
    return (length - 1) // bs * bs if length > 0 else 0


def make_workload(name: str, seed: int, vocab: int, bs: int, *, tiny: bool, mixed: Workload | None = None
                  ) -> Workload:
    rng = np.random.default_rng(seed)
    s = (lambda n: max(n // 64, 2)) if tiny else (lambda n: n)       # sizes; tiny: ~1/64
    if name == "mixed":
        n = 16 if tiny else 256
        prompts = [_rand(rng, vocab, int(rng.integers(s(128), s(2048) + 1))) for _ in range(n)]
        return Workload(name=name, new_tokens=s(256), turns=[prompts], reusable=[[0] * n])
    if name in ("shared", "shared_var"):
        n, shared = (16 if tiny else 256), _rand(rng, vocab, s(1536))
        lens = [s(64)] * n if name == "shared" else rng.integers(1, s(200) + 1, n).tolist()
        prompts = [shared + _rand(rng, vocab, k) for k in lens]
        # the first request computes the shared part; the others can take whole blocks of it
        reuse = [0] + [min(_reusable(len(p), bs), len(shared) // bs * bs) for p in prompts[1:]]
        return Workload(name=name, new_tokens=s(64), turns=[prompts], reusable=[reuse])
    if name == "repeat":
        assert mixed is not None
        prompts = mixed.turns[0]
        return Workload(name=name, new_tokens=mixed.new_tokens, turns=[prompts],
                        reusable=[[_reusable(len(p), bs) for p in prompts]])
    if name == "multiturn":
        n = 8 if tiny else 64
        first = [_rand(rng, vocab, int(rng.integers(s(256), s(1024) + 1))) for _ in range(n)]
        return Workload(name=name, new_tokens=s(128), turns=[first], reusable=[[0] * n])
    if name == "long":
        n = 4 if tiny else 32
        prompts = [_rand(rng, vocab, int(rng.integers(s(16384), s(32768) + 1))) for _ in range(n)]
        return Workload(name=name, new_tokens=s(128), turns=[prompts], reusable=[[0] * n])
    raise ValueError(f"unknown workload {name!r}")


MULTITURN_TURNS = 4


def next_turn(w: Workload, answers: list[list[int]], seed: int, vocab: int, bs: int, tiny: bool) -> None:
    """Append the next turn: previous prompt + its answer + 64 new user tokens."""
    rng = np.random.default_rng(seed)
    prev = w.turns[-1]
    extra = max(64 // 64, 2) if tiny else 64
    prompts = [p + a + _rand(rng, vocab, extra) for p, a in zip(prev, answers, strict=True)]
    w.turns.append(prompts)
    w.reusable.append([_reusable(len(p) + len(a), bs) for p, a in zip(prev, answers, strict=True)])


# -- the physical floor -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelCost:
    """What the floor needs of a model: params a token multiplies through, weight bytes a decode step reads,
    per attention layer (kind, window or chunk, FLOPs per key, KV bytes per token), state bytes per request."""

    params_per_token: float
    weight_bytes: dict[int, int]                  # batch -> bytes a decode step reads
    attention: list[tuple[str, int, int, int]]    # (kind, window/chunk, 4 * heads * head_dim, kv bytes/token)
    state_bytes: int                              # Mamba state of one request (all layers)


def model_cost(llm, batches: list[int]) -> ModelCost:
    from hybridkv.layers.moe import MoEFeedForward
    from hybridkv.models.config import Attention, DenseMoE, MoE

    model, config, plan = llm.model, llm.model.config, llm.plan
    moe = next((layer.ffn.moe if isinstance(layer.ffn, DenseMoE) else layer.ffn for layer in config.layers
                if isinstance(layer.ffn, (MoE, DenseMoE))), None)        # Gemma-4: a dense MLP beside the experts
    # the routed experts' stacked weights and biases (E leading): a token multiplies through top_k of them
    routed = {id(p) for m in model.modules() if isinstance(m, MoEFeedForward)
              for p in (m.gate_proj, m.up_proj, m.down_proj, m.gate_bias, m.up_bias, m.down_bias) if p is not None}
    dense, experts, embed = 0, 0, 0
    elem = next(model.parameters()).element_size()
    for name, p in model.named_parameters():
        if "embed" in name and "lm_head" not in name:
            embed += p.numel()
        elif id(p) in routed:
            experts += p.numel()
        else:
            dense += p.numel()
    head = embed if config.tie_word_embeddings else 0       # a tied table is read as the LM head
    k, e = (moe.top_k, moe.num_experts) if moe else (1, 1)
    per_token = dense + head + experts * k / e
    weight_bytes = {b: int((dense + head + experts * min(b * k, e) / e) * elem) for b in batches}
    attn = []
    kv_elem = elem
    for layer in config.layers:
        m = layer.mixer
        if isinstance(m, Attention):
            kind, span = "full", 0
            if m.sliding_window:
                kind, span = "sliding", m.sliding_window
            elif m.attention_chunk_size:
                kind, span = "chunked", m.attention_chunk_size
            attn.append((kind, span, 4 * m.num_heads * m.head_dim, 2 * m.num_kv_heads * m.head_dim * kv_elem))
    state = sum(g.spec.bytes_per_block * len(g.layer_names) for g in plan.mamba_groups)
    return ModelCost(params_per_token=per_token, weight_bytes=weight_bytes, attention=attn, state_bytes=state)


def _keys(kind: str, span: int, pos: np.ndarray) -> np.ndarray:
    """Keys a query at 0-based ``pos`` attends to (itself included)."""
    if kind == "sliding":
        return np.minimum(pos + 1, span)
    if kind == "chunked":
        return pos % span + 1
    return pos + 1


def floor_seconds(cost: ModelCost, w: Workload, answers_per_turn: list[list[int]], bw: float, mm: float
                  ) -> dict:
    """Prefill FLOPs of what no cache serves / matmul rate + decode bytes / copy bandwidth, every request of
    a turn decoding together (one weight read per step)."""
    flops = 0.0
    decode_bytes = 0.0
    for prompts, reuse, _ in zip(w.turns, w.reusable, answers_per_turn, strict=True):
        batch = len(prompts)
        for p, r in zip(prompts, reuse, strict=True):
            pos = np.arange(r, len(p), dtype=np.int64)              # positions computed
            flops += 2 * cost.params_per_token * pos.size
            for kind, span, per_key, _ in cost.attention:
                flops += per_key * float(_keys(kind, span, pos).sum())
            dec = np.arange(len(p), len(p) + w.new_tokens - 1, dtype=np.int64)   # decode-step query positions
            for kind, span, _, kv in cost.attention:
                decode_bytes += kv * float(_keys(kind, span, dec).sum())
            decode_bytes += 2 * cost.state_bytes * dec.size
        wb = cost.weight_bytes.get(batch) or max(cost.weight_bytes.values())
        decode_bytes += (w.new_tokens - 1) * wb
    prefill_s, decode_s = flops / mm, decode_bytes / bw
    return {"floor_s": prefill_s + decode_s, "floor_prefill_s": prefill_s, "floor_decode_s": decode_s}


# -- running ------------------------------------------------------------------------------------------------
class CompileCounter:
    """Triton kernels built in this process (a JIT cache miss: a compile, or a load from the disk cache)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.reprs: list[str] = []        # the specialization of each build (what made it new)
        try:
            from triton import knobs

            self._prev = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
            self.active = True
        except (ImportError, AttributeError):
            self.active = False

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", fn), "__name__", str(fn))
        self.names.append(name)
        self.reprs.append(str(kwargs.get("repr", ""))[:400])
        return self._prev(*args, **kwargs) if self._prev else False


class StepTrace:
    """Host seconds of ``ModelRunner.execute`` per step kind (``--step-trace``): "decode" (a captured decode
    graph), "mixed<B>" (the mixed-step graphs' bucket B), "eager" (the rest: more tokens than the largest bucket).
    With the engine's asynchronous scheduling this is the host's share of a step (launches, and any wait the
    step forces), which is where a first pass's extra time shows when nothing is compiled."""

    def __init__(self, llm) -> None:
        self.runner = runner = llm.engine.runner
        self.records: list[tuple[str, float]] = []
        execute = runner.execute

        def timed(batch):
            kind = self._kind(batch)
            t = time.perf_counter()
            out = execute(batch)
            self.records.append((kind, time.perf_counter() - t))
            return out

        runner.execute = timed

    def _kind(self, batch) -> str:
        if self.runner._graph_eligible(batch):
            return "decode"
        mixed = self.runner.mixed_graphs
        bucket = mixed.bucket_for(len(batch.input_ids)) if mixed is not None else None
        return "eager" if bucket is None else f"mixed{bucket}"

    def take(self) -> dict[str, dict[str, float]]:
        """Per kind: steps and host milliseconds since the last call."""
        out: dict[str, dict[str, float]] = {}
        for kind, seconds in self.records:
            entry = out.setdefault(kind, {"steps": 0, "host_ms": 0.0})
            entry["steps"] += 1
            entry["host_ms"] += 1e3 * seconds
        self.records = []
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_pass(llm, w: Workload, seed: int, vocab: int, tiny: bool, compiles: CompileCounter, device) -> dict:
    from hybridkv import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=w.new_tokens, ignore_eos=True)
    before = llm.stats()
    ckpt_before = llm.engine.coordinator.checkpoint_stats()
    n_compiled = len(compiles.names)
    answers_per_turn = []
    sync(device)
    t0 = time.perf_counter()
    turns = MULTITURN_TURNS if w.name == "multiturn" else 1
    for t in range(turns):
        outs = llm.generate(w.turns[t], params, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outs]
        answers_per_turn.append(answers)
        if t + 1 < turns:
            next_turn(w, answers, seed + 1000 + t, vocab, llm.plan.block_size, tiny)
    sync(device)
    wall = time.perf_counter() - t0
    after = llm.stats()
    prompt_tokens = sum(len(p) for turn in w.turns for p in turn)
    out_tokens = sum(len(a) for turn in answers_per_turn for a in turn)
    reusable = sum(sum(r) for r in w.reusable)
    hit = after.prefix_hit_tokens - before.prefix_hit_tokens
    ckpt = llm.engine.coordinator.checkpoint_stats()
    moved = {} if ckpt is None else {          # Mamba checkpoints: written, moved to host memory, lost
        "checkpoints_written": ckpt.written - ckpt_before.written,
        "checkpoints_to_host": ckpt.demoted - ckpt_before.demoted,
        "checkpoints_lost": ckpt.evicted - ckpt_before.evicted,
        "checkpoints_lost_host_busy": ckpt.host_busy - ckpt_before.host_busy}
    return {**moved, "wall_s": wall, "steps": after.steps - before.steps, "prompt_tokens": prompt_tokens,
            "output_tokens": out_tokens, "in_tok_s": prompt_tokens / wall, "out_tok_s": out_tokens / wall,
            "hit_tokens": hit, "reusable_tokens": reusable, "hit_of_reusable": hit / reusable if reusable else None,
            "preemptions": after.preemptions - before.preemptions,
            "compiled": compiles.names[n_compiled:], "compiled_reprs": compiles.reprs[n_compiled:],
            "answers": answers_per_turn}


@contextlib.contextmanager
def profiler(device: torch.device):
    """The torch profiler (kernels, device busy time) and cProfile (where the host's Python time goes)."""
    import cProfile

    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])) \
            as prof:
        host.enable()
        try:
            yield prof
        finally:
            host.disable()
    prof.host = host


def print_profile(prof, r: dict, device: torch.device, title: str) -> None:
    """The kernels that fill a pass, and how much of its wall time the device was busy at all (the rest is
    host time: scheduling, metadata, launches)."""
    events = prof.key_averages()
    cuda = device.type == "cuda"
    busy = sum(e.self_device_time_total for e in events) / 1e6 if cuda else float("nan")
    print(f"{title}: wall {r['wall_s']:.3f} s, device busy {busy:.3f} s, {r['steps']} steps", flush=True)
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=20,
                       max_name_column_width=60), flush=True)
    import pstats

    print("host (cProfile; its overhead inflates Python time):", flush=True)
    pstats.Stats(prof.host).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof.host).sort_stats("cumulative").print_stats("hybridkv", 30)


def run_hf(hf, prompts: list[list[int]], new_tokens: int, device) -> dict:
    """HF's continuous-batching ``generate_batch`` on the same prompts: greedy, exactly ``new_tokens`` each."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    sync(device)
    t0 = time.perf_counter()
    try:
        out = hf.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    except Exception as err:        # a peer that cannot run this model: reported, not fatal
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"wall_s": wall, "output_tokens": tokens, "out_tok_s": tokens / wall,
            "in_tok_s": sum(map(len, prompts)) / wall}


def bench_model(family: str, args, device, dtype, bw: float, mm: float, compiles: CompileCounter) -> list[dict]:
    from hybridkv import LLM

    config, cls = hf_config(family, args.tiny)
    if not args.tiny:
        config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, 33792)
    vocab = config.vocab_size
    torch.manual_seed(0)
    with torch.device(device):
        hf = cls(config).to(dtype).eval()
    tmp = tempfile.mkdtemp(prefix=f"hkv-serving-{family}-")
    hf.save_pretrained(tmp)
    rows: list[dict] = []
    workloads = [w for w in args.workloads.split(",") if w != "long" or family in ATTENTION_MODELS]
    long_len = (33 << 10) if not args.tiny else 600
    max_len = args.max_model_len or (long_len if "long" in workloads else (4096 if not args.tiny else 256))
    kw = dict(dtype=dtype, device=str(device), backend=args.backend, kv_cache_memory=args.kv_memory,
              host_cache_memory=args.host_cache_memory, max_model_len=max_len, max_num_seqs=args.max_num_seqs)
    model = None
    for caching in (True, False):
        t0 = time.perf_counter()
        n_compiled = len(compiles.names)
        llm = LLM(tmp if model is None else model, enable_prefix_caching=caching, **kw)
        sync(device)
        startup = time.perf_counter() - t0
        model = llm.model
        bs = llm.plan.block_size
        trace = StepTrace(llm) if args.step_trace else None
        cost = model_cost(llm, sorted({1, 8, 16, 32, 64, 128, 256, args.max_num_seqs}))
        print(f"[{family}] caching {'on' if caching else 'off'}: start-up {startup:.1f} s, "
              f"{len(compiles.names) - n_compiled} kernels built; plan {llm.plan.summary()}", flush=True)
        # (workload, pass) in order; the repeat follows the mixed first pass it repeats, as a user's repeats
        # follow what they repeat (the checkpoint budget of a Mamba hybrid holds a few hundred prompts, not all)
        order = [(name, p) for name in workloads if name != "repeat" for p in (0, 1)]
        if caching and "repeat" in workloads and "mixed" in workloads:
            order.insert(order.index(("mixed", 0)) + 1, ("repeat", 0))
        mixed_first = None
        for name, pass_no in order:
            label = ("first", "steady")[pass_no]
            seed = zlib.crc32(name.encode()) % 10_000 + pass_no     # each workload its own tokens
            if name == "repeat":
                w = make_workload(name, seed, vocab, bs, tiny=args.tiny, mixed=mixed_first)
            else:
                w = make_workload(name, seed, vocab, bs, tiny=args.tiny)
            if name == "mixed" and pass_no == 0:
                mixed_first = w
            profiling = name == args.profile and caching and pass_no == 1
            with profiler(device) if profiling else contextlib.nullcontext() as prof:
                r = run_pass(llm, w, seed, vocab, args.tiny, compiles, device)
            if profiling:
                print_profile(prof, r, device, f"[{family}] {name} (steady, caching on)")
            if trace is not None:
                r["step_host_ms"] = trace.take()
            answers = r.pop("answers")
            r.update(floor_seconds(cost, w, answers, bw, mm))
            r.update(model=family, workload=name, pass_=label, caching=caching,
                     x_floor=r["wall_s"] / r["floor_s"] if r["floor_s"] > 0 else None,
                     startup_s=startup)
            r["pass"] = r.pop("pass_")
            rows.append(r)
            print({k: v for k, v in r.items() if not k.startswith("compiled")} | {"compiled": len(r["compiled"])},
                  flush=True)
            for rep in r["compiled_reprs"] if args.trace_compiles else ():
                print("   built:", rep, flush=True)
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if family in args.hf_models.split(",") and "mixed" in workloads:
        w = make_workload("mixed", zlib.crc32(b"mixed") % 10_000, vocab, 16, tiny=args.tiny)
        prompts = w.turns[0][:args.hf_requests]
        h = run_hf(hf, prompts, w.new_tokens, device)
        h.update(model=family, workload="mixed", engine="HF generate_batch", requests=len(prompts))
        rows.append(h)
        print(h, flush=True)
    del hf, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def startup(family: str, args, device, dtype, compiles: CompileCounter) -> dict:
    """Seconds ``LLM(...)`` takes (load, plan, CUDA graphs, warm-up) and the kernels it builds: run it once
    with an empty Triton cache and once with a warm one (``TRITON_CACHE_DIR``) for the two figures."""
    from hybridkv import LLM

    config, cls = hf_config(family, args.tiny)
    torch.manual_seed(0)
    with torch.device(device):
        hf = cls(config).to(dtype).eval()
    tmp = tempfile.mkdtemp(prefix=f"hkv-startup-{family}-")
    hf.save_pretrained(tmp)
    del hf
    sync(device)
    t0 = time.perf_counter()
    llm = LLM(tmp, dtype=dtype, device=str(device), backend=args.backend, kv_cache_memory=args.kv_memory,
              max_model_len=4096, max_num_seqs=args.max_num_seqs)
    sync(device)
    row = {"model": family, "startup_s": time.perf_counter() - t0, "kernels_built": len(compiles.names)}
    del llm
    return row


def summarize(rows: list[dict]) -> list[list]:
    table = []
    by = {(r["model"], r["workload"], r.get("caching"), r.get("pass")): r for r in rows if "engine" not in r}
    hf = {r["model"]: r for r in rows if r.get("engine") == "HF generate_batch"}
    for (model, wl, caching, label), r in by.items():
        steady = by.get((model, wl, caching, "steady"))
        off = by.get((model, wl, False, label))
        first_vs_steady = r["wall_s"] / steady["wall_s"] if label == "first" and steady else None
        on_vs_off = off["wall_s"] / r["wall_s"] if caching and off else None
        peer = hf.get(model) if wl == "mixed" else None
        vs_hf = r["out_tok_s"] / peer["out_tok_s"] if peer and "out_tok_s" in peer else None
        hit = r["hit_of_reusable"]
        table.append([model, wl, "on" if caching else "off", label, f"{r['wall_s']:.2f}", r["steps"],
                      f"{r['in_tok_s']:.0f}", f"{r['out_tok_s']:.0f}",
                      "" if hit is None else f"{100 * hit:.1f}%", f"{r['floor_s']:.2f}",
                      f"{r['x_floor']:.2f}" if r["x_floor"] else "", len(r["compiled"]),
                      f"{first_vs_steady:.2f}" if first_vs_steady else "",
                      f"{on_vs_off:.2f}x" if on_vs_off else "", f"{vs_hf:.1f}x" if vs_hf else ""])
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama4,gemma3,mamba2,nemotronh")
    ap.add_argument("--workloads", default="mixed,shared,shared_var,repeat,multiturn,long")
    ap.add_argument("--hf-models", default="gemma3", help="models HF generate_batch runs mixed on ('' = none)")
    ap.add_argument("--hf-requests", type=int, default=256, help="the first N mixed prompts for HF")
    ap.add_argument("--kv-memory", default="24GiB")
    ap.add_argument("--host-cache-memory", default="32GiB",
                    help="host memory for the Mamba checkpoints the device slots evict ('0': none)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: 33792 with the long workload, else 4096 (it sets the step token budget too)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke test of this script")
    ap.add_argument("--startup-only", action="store_true",
                    help="only time LLM start-up per model (run twice: empty, then warm Triton cache)")
    ap.add_argument("--trace-compiles", action="store_true", help="print each kernel built while serving")
    ap.add_argument("--step-trace", action="store_true",
                    help="per pass, host time of the runner's steps by kind (decode graph, mixed bucket, eager)")
    ap.add_argument("--profile", default="", metavar="WORKLOAD",
                    help="profile this workload's steady pass (caching on): top kernels and device busy time")
    add_output_args(ap, "serving")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.backend, args.kv_memory, args.max_num_seqs, args.host_cache_memory = "torch", "256MiB", 32, "256MiB"
    compiles = CompileCounter()
    if args.startup_only:
        for family in args.models.split(","):
            print(startup(family, args, device, dtype, compiles), flush=True)
        return
    bw, mm = (copy_bandwidth(device), matmul_rate(device)) if device.type == "cuda" else (50e9, 1e12)
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "commit": commit(),
            "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "matmul_tflops": mm / 1e12,
            "kv_memory": args.kv_memory, "host_cache_memory": args.host_cache_memory,
            "max_num_seqs": args.max_num_seqs, "backend": args.backend,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    rows: list[dict] = []
    for family in args.models.split(","):
        rows += bench_model(family, args, device, dtype, bw, mm, compiles)
        write_json(args, "serving", {"meta": meta, "rows": rows})        # after each model: partial runs keep theirs
    print_table(f"serving on {meta['device']} ({meta['commit']}; copy {bw / 1e9:.0f} GB/s, matmul "
                f"{mm / 1e12:.0f} TFLOP/s)",
                ["model", "workload", "cache", "pass", "wall s", "steps", "in tok/s", "out tok/s", "hit/reusable",
                 "floor s", "x floor", "compiled", "first/steady", "on vs off", "vs HF"], summarize(rows))


if __name__ == "__main__":
    main()
