"""``hybridkv demo``: the whole system on a small built-in model, checked against the reference.

A random-weight decoder with all four layer kinds (Mamba2, sliding window, chunked local, full) serves
a batch of requests that share a system prefix, through continuous batching with chunked prefill,
prefix caching and a cache small enough to force preemption. Every generated token is then checked
against the no-cache reference forward (the whole sequence as one prefill in a fresh cache). Exit code
1 on any mismatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from hybridkv.engine import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits
from hybridkv.models.config import MLP, Attention, HybridConfig, Layer, Mamba2, MoE, Rope
from hybridkv.utils import format_bytes

DEMO_WINDOW = 16
DEMO_CHUNK = 32


def demo_config() -> HybridConfig:
    """Eight layers, two of each kind; Llama-4-style chunked RoPE layers and a NoPE global layer."""
    mamba = Mamba2(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=16)
    sliding = Attention(num_heads=4, num_kv_heads=2, head_dim=32, sliding_window=DEMO_WINDOW)
    chunked = Attention(num_heads=4, num_kv_heads=2, head_dim=32, attention_chunk_size=DEMO_CHUNK,
                        rope=Rope(interleaved=True), qk_norm="rms_weightless")
    full = Attention(num_heads=4, num_kv_heads=2, head_dim=32, rope=None, temperature_tuning=(0.1, 16.0))
    mlp = MLP(intermediate_size=256)
    moe = MoE(num_experts=4, top_k=1, intermediate_size=128, router="sigmoid_input", shared_intermediate_size=128)
    mixers = (mamba, sliding, chunked, full, mamba, sliding, chunked, full)
    layers = tuple(Layer(mixer=m, ffn=moe if i % 4 == 2 else mlp) for i, m in enumerate(mixers))
    return HybridConfig(vocab_size=512, hidden_size=128, layers=layers, max_position_embeddings=256,
                        dtype="float32", architecture="HybridkvDemo")


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    matched: int
    total: int
    tokens: int
    seconds: float


def run_demo(*, num_requests: int = 12, max_tokens: int = 24, kv_cache_memory: int = 1_200_000,
             seed: int = 0, console: Console | None = None) -> DemoResult:
    console = console or Console()
    config = demo_config()
    llm = LLM(config, device="cpu", block_size=8, max_num_seqs=8, max_num_batched_tokens=48,
              kv_cache_memory=kv_cache_memory, seed=seed)
    plan = llm.plan
    console.print(f"[bold]hybridkv demo[/bold]: {len(config.layers)}-layer hybrid (Mamba2, sliding window "
                  f"{DEMO_WINDOW}, chunked local {DEMO_CHUNK}, full NoPE), random weights, CPU, torch kernels")
    console.print(f"KV plan: {plan.summary()}")

    rng = np.random.default_rng(seed)
    system = rng.integers(0, config.vocab_size, 40).tolist()
    prompts = [system + rng.integers(0, config.vocab_size, int(rng.integers(4, 80))).tolist()
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)

    peak = {g.group_id: 0.0 for g in plan.groups}
    mean = dict.fromkeys(peak, 0.0)
    outputs: dict[str, tuple[int, ...]] = {}
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished:
        for out in engine.step(only_finished=True):
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps += 1
        for gid, used in engine.coordinator.usage().items():
            peak[gid] = max(peak[gid], used)
            mean[gid] += used
    seconds = time.perf_counter() - start
    stats = engine.stats()

    table = Table(title="per-group cache usage over the run")
    for column in ("group", "kind", "layers", "mean use", "peak use"):
        table.add_column(column, justify="right" if "use" in column else "left")
    for g in plan.groups:
        table.add_row(str(g.group_id), g.spec.describe(), ", ".join(g.layer_names),
                      f"{mean[g.group_id] / max(steps, 1):.0%}", f"{peak[g.group_id]:.0%}")
    console.print(table)
    tokens = sum(len(t) for t in outputs.values())
    console.print(f"served {num_requests} requests in {steps} steps: {stats.prompt_tokens} prompt + {tokens} "
                  f"generated tokens in {seconds:.2f}s ({tokens / seconds:.1f} generated tok/s); "
                  f"{stats.preemptions} preemptions; prefix cache hits {stats.prefix_hit_tokens}/"
                  f"{stats.prefix_query_tokens} tokens; pool {plan.num_blocks} blocks x "
                  f"{format_bytes(plan.page_bytes)}, {plan.num_state_slots} state slots")

    matched = 0
    for i, prompt in enumerate(prompts):
        got = list(outputs[str(i)])
        ref = reference_logits(llm.model, prompt + got)[len(prompt) - 1:-1].argmax(-1).tolist()
        if ref == got:
            matched += 1
        else:
            first = next(j for j, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b)
            console.print(f"[red]request {i}: token {first} is {got[first]}, the reference says {ref[first]}")
    colour = "green" if matched == num_requests else "red"
    console.print(f"[{colour}]reference check: {matched}/{num_requests} requests identical to the no-cache "
                  f"forward[/{colour}]")
    return DemoResult(matched=matched, total=num_requests, tokens=tokens, seconds=seconds)
