# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""End-to-end decode: hybridkv (``LLM``, backend triton / torch) vs HF transformers ``generate``, same weights.

    python benchmarks/gpu_decode.py [--families llama4,gemma3,mamba2,nemotronh,gpt_oss,lfm2,qwen3_next,qwen3_5,
                                     olmo_hybrid,gemma4]
                                    [--batches 1,8,32]
                                    [--backends triton,triton:eager] [--tiny] [--tag NAME] [--save]
    # writes gpu_decode.json, scenario NAME (default: "default"; ``_results.py``)

Models: random-init ~1B Llama-4-like (3 chunked-local RoPE : 1 global NoPE layers, MoE every other layer, shared
expert), Gemma-3-like (Gemma-3-1B shapes: 5 sliding(512) : 1 global, head_dim 256, one KV head), Mamba2 (Codestral's
layer shapes narrowed to hidden 2048 x 32 layers), NemotronH-like (Mamba2 + attention + relu² MLPs) and gpt-oss-like
(gpt-oss's layer kinds at hidden 2048: 16 layers alternating sliding 128 / full with sinks, q/k/v/o biases, YaRN, 32
q / 8 kv heads of 64, 32 biased experts of 2048 top-4 with the clamped SwiGLU: 1.04B active parameters per token,
6.75B in all) and LFM2 (LFM2-1.2B's shapes: 10 short convs and 6 q/k-normed attention layers, SwiGLU 8192, tied
65536-token vocabulary) and Qwen3-Next-like (Qwen3-Next's layer kinds at hidden 2048: 16 layers, 12 Gated DeltaNet
(16 q/k heads, 32 v heads of 128) and 4 gated attention (16 q / 2 kv heads of 256, a quarter rotated), 64 experts of
512 top-8 with a gated shared expert of 512, 151936-token vocabulary: ~1B active per token), Qwen3.5-MoE-like (the
same shapes, the DeltaNet's projections unfused), OLMo-Hybrid-like (16 layers at hidden 2048, 12 Gated DeltaNet (16
heads, key / value dims 96 / 192) and 4 post-norm attention layers (16 heads of 128), SwiGLU 8192) and Gemma-4-like
(Gemma-4 E2B's layer kinds at hidden 1536: 20 layers, 4 sliding (512, one KV head of 256) : 1 global (one KV head of
512, proportional RoPE), the last 8 reading earlier layers' KV with double-wide MLPs, per-layer inputs of 256; the
Triton attention kernel runs the global layers' head dim 512 too, so every layer is on triton and decode is captured).
``triton`` runs decode steps as CUDA graphs when they capture, ``triton:eager`` never;
``triton:sync`` turns asynchronous scheduling off (host work of a step no longer under the device's work of the step
before). The HF model (``Llama4ForCausalLM`` / ``Gemma3ForCausalLM`` / ...) is built from its config, saved with
``save_pretrained`` and loaded by hybridkv's HF loader, so both run the SAME weights, dtype (bf16) and batch.

Per batch size B: B random 512-token prompts, greedy, ``ignore_eos``. Decode tokens/s = B * steps / time of
the decode steps (prefill excluded: hybridkv steps are timed one by one, from one step's return to the next, HF
as generate(1 + N) - generate(1)). Host % = the host's schedule + step batch + metadata + commit time per step
as a share of the step (with asynchronous scheduling it runs while the device works); exposed host % = (step −
the captured graph replayed alone) / step: what the host adds to the device's time.
Batch-1 step time is compared with the HBM floor = (weight bytes + KV bytes read + Mamba state bytes read
and written per step) / copy bandwidth (measured here). A short torch.profiler trace of decode steps
at each ``--profile-batch`` size (default 1) gives GPU busy time vs wall time and the top kernels, which explains
the gap (launch-bound vs kernel-bound).
``--tiny`` runs tiny models on the CPU (a smoke test of the script; numbers meaningless, nothing written).
``--tag`` names the scenario: ``gpu_decode.json`` keeps every scenario's latest result under ``"scenarios"``
(``docs/performance.md`` lists the commands).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402
from gpu_attention import print_table  # noqa: E402


def hf_config(family: str, tiny: bool):
    import transformers

    if family == "llama4":
        kw = dict(hidden_size=2048, intermediate_size=2048, intermediate_size_mlp=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=32768,
                  num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                  attention_chunk_size=1024, max_position_embeddings=16384)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                      attention_chunk_size=16)
        n = kw["num_hidden_layers"]
        kw["no_rope_layers"] = [0 if (i + 1) % 4 == 0 else 1 for i in range(n)]
        kw["moe_layers"] = list(range(kw["interleave_moe_layer_step"] - 1, n, kw["interleave_moe_layer_step"]))
        cfg = transformers.Llama4TextConfig(**kw)
        cfg.architectures = ["Llama4ForCausalLM"]
        return cfg, transformers.Llama4ForCausalLM
    if family == "gemma3":
        kw = dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                  query_pre_attn_scalar=256, max_position_embeddings=16384)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, vocab_size=256, sliding_window=12,
                      query_pre_attn_scalar=16)
        cfg = transformers.Gemma3TextConfig(**kw)
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg, transformers.Gemma3ForCausalLM
    if family == "mamba2":      # Mamba-Codestral's layer shapes narrowed to ~1B (hidden 2048, 32 layers)
        kw = dict(hidden_size=2048, num_hidden_layers=32, num_heads=64, head_dim=64, state_size=128, n_groups=8,
                  expand=2, conv_kernel=4, chunk_size=256, vocab_size=32768, tie_word_embeddings=False)
        if tiny:
            kw.update(hidden_size=64, num_hidden_layers=4, num_heads=4, head_dim=32, state_size=16, n_groups=2,
                      chunk_size=16, vocab_size=256)
        cfg = transformers.Mamba2Config(**kw)
        cfg.architectures = ["Mamba2ForCausalLM"]
        return cfg, transformers.Mamba2ForCausalLM
    if family == "nemotronh":   # NemotronH-like: Mamba2 + attention (1 in 5 mixers) + relu² MLPs, ~1.3B
        kw = dict(hidden_size=2048, hybrid_override_pattern="M-M-M-M*-" * 4, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=8192, mlp_hidden_act="relu2",
                  mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                  chunk_size=256, vocab_size=32768, max_position_embeddings=16384, tie_word_embeddings=False)
        if tiny:
            kw.update(hidden_size=64, hybrid_override_pattern="M-M*-", num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=4,
                      mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=16, vocab_size=256)
        cfg = transformers.NemotronHConfig(**kw)
        cfg.architectures = ["NemotronHForCausalLM"]
        return cfg, transformers.NemotronHForCausalLM
    if family == "gpt_oss":     # active per token: 16 x (10.5M attention + 4 x 12.6M experts) + 67M head = 1.04B
        kw = dict(hidden_size=2048, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, vocab_size=32768, num_local_experts=32, num_experts_per_tok=4,
                  sliding_window=128, tie_word_embeddings=False)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=4, sliding_window=8)
        cfg = transformers.GptOssConfig(**kw)
        cfg.architectures = ["GptOssForCausalLM"]
        return cfg, transformers.GptOssForCausalLM
    if family == "lfm2":        # LFM2-1.2B's shapes: short convs (width 3) + attention at [2, 5, 8, 10, 12, 14]
        kw = dict(hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=65536, full_attn_idxs=[2, 5, 8, 10, 12, 14],
                  max_position_embeddings=16384, tie_word_embeddings=True)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, full_attn_idxs=[1, 3], block_multiple_of=16)
        cfg = transformers.Lfm2Config(**kw)
        cfg.architectures = ["Lfm2ForCausalLM"]
        return cfg, transformers.Lfm2ForCausalLM
    if family == "qwen3_next":  # Qwen3-Next's layer kinds at ~1B active: 3 Gated DeltaNet : 1 gated attention
        kw = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=151936,
                  max_position_embeddings=16384, tie_word_embeddings=False)
        if tiny:
            kw.update(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, vocab_size=256)
        cfg = transformers.Qwen3NextConfig(**kw)
        cfg.architectures = ["Qwen3NextForCausalLM"]
        return cfg, transformers.Qwen3NextForCausalLM
    if family == "qwen3_5":     # Qwen3.5-MoE: qwen3_next's shapes, the DeltaNet's projections unfused
        cfg, _ = hf_config("qwen3_next", tiny)
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
        cfg = transformers.Qwen3_5MoeTextConfig(**{k: getattr(cfg, k) for k in keys})
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
        return cfg, transformers.Qwen3_5MoeForCausalLM
    if family == "olmo_hybrid":  # OLMo-Hybrid-7B's layer kinds at hidden 2048: 16 layers, 3 DeltaNet : 1 attention
        kw = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                  max_position_embeddings=16384, pad_token_id=None)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      vocab_size=256, eos_token_id=None)
        cfg = transformers.OlmoHybridConfig(**kw)
        cfg.architectures = ["OlmoHybridForCausalLM"]
        return cfg, transformers.OlmoHybridForCausalLM
    if family == "gemma4":      # Gemma-4 E2B's layer kinds at ~1B: 4 sliding(512) : 1 global (head dim 512), the
        # last 8 layers reading KV of earlier ones (double-wide MLPs), per-layer inputs of 256, final softcap 30
        kw = dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=20, num_attention_heads=8,
                  num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144, sliding_window=512,
                  layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(20)],
                  num_kv_shared_layers=8, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
                  vocab_size_per_layer_input=262144, final_logit_softcapping=30.0, max_position_embeddings=16384)
        if tiny:
            kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, global_head_dim=32, vocab_size=256, sliding_window=12,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                   "full_attention"], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                      vocab_size_per_layer_input=256)
        cfg = transformers.Gemma4TextConfig(**kw)
        cfg.architectures = ["Gemma4ForCausalLM"]
        return cfg, transformers.Gemma4ForCausalLM
    raise ValueError(family)


def random_llm(family: str, **llm_kwargs):
    """A random-init bf16 model of ``family`` saved by HF and loaded by hybridkv (the weights HF would run), on
    CUDA with the triton backend; ``llm_kwargs`` go to ``LLM`` (``prefill_spread`` 1 unless given: the step
    benchmarks time steps of the shapes they ask, a prompt in one step)."""
    from hybridkv import LLM

    llm_kwargs.setdefault("prefill_spread", 1)
    config, cls = hf_config(family, False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = cls(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        del hf
        return LLM(tmp, dtype=torch.bfloat16, device="cuda", backend="triton", **llm_kwargs)


def state_bytes_per_step(config, family: str, batch: int) -> int:
    """Mamba state bytes a decode step reads and writes: fp32 SSM state + conv state (model dtype), x2 (LFM2: the
    short convs' conv state only)."""
    if family == "lfm2":
        convs = config.layer_types.count("conv")
        return 2 * batch * convs * config.hidden_size * (config.conv_L_cache - 1) * 2
    if family in ("qwen3_next", "qwen3_5", "olmo_hybrid"):  # DeltaNet: fp32 (v heads, dk, dv) + conv over q|k|v
        layers = config.layer_types.count("linear_attention")
        kd, vd = config.linear_num_key_heads * config.linear_key_head_dim, config.linear_num_value_heads * \
            config.linear_value_head_dim
        per_layer = vd * config.linear_key_head_dim * 4 + (2 * kd + vd) * (config.linear_conv_kernel_dim - 1) * 2
        return 2 * batch * layers * per_layer
    if family not in ("mamba2", "nemotronh"):
        return 0
    if family == "mamba2":
        layers, heads, hd, n, groups = (config.num_hidden_layers, config.num_heads, config.head_dim,
                                        config.state_size, config.n_groups)
    else:
        layers = config.hybrid_override_pattern.count("M")
        heads, hd, n, groups = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups
    conv_channels = heads * hd + 2 * groups * n
    per_layer = heads * hd * n * 4 + conv_channels * (config.conv_kernel - 1) * 2
    return 2 * batch * layers * per_layer


def active_weight_bytes(model: torch.nn.Module, config, batch: int) -> int:
    """Weight bytes a decode step must read: everything except the embedding table (one row per token) and
    the routed experts nobody picked (top-k of E: at most min(B * k, E) experts per MoE layer; exact at B = 1,
    an upper bound above, e.g. 32 where uniform routing of 32 x top-4 over 32 experts hits 31.6 on average)."""
    total = 0
    top_k = getattr(config, "num_experts_per_tok", 1)
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            if getattr(config, "tie_word_embeddings", False):
                total += nbytes  # read as the lm_head
            continue
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", -1)   # Qwen3-Next
        if ".experts." in name and p.dim() >= 2 and p.shape[0] == experts:
            e = p.shape[0]                        # stacked experts (and gpt-oss's stacked expert biases)
            total += nbytes * min(batch * top_k, e) // e
            continue
        total += nbytes
    return total


def kv_bytes_per_step(config, family: str, batch: int, ctx: int, elem: int = 2) -> int:
    """KV bytes one decode step reads when every request holds ``ctx`` tokens: the keys its new token sees
    (full: ctx; sliding W: min(ctx, W); chunked C: those of its own chunk, (ctx - 1) % C + 1)."""
    if family == "mamba2":
        return 0
    if family == "lfm2":
        per_tok = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * elem
        return batch * ctx * per_tok * config.layer_types.count("full_attention")
    if family in ("qwen3_next", "qwen3_5", "olmo_hybrid"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_tok = 2 * config.num_key_value_heads * head_dim * elem
        return batch * ctx * per_tok * config.layer_types.count("full_attention")
    if family == "gemma4":      # per layer its own KV shape; a KV-sharing layer reads its donor's keys again
        total = 0
        for i, kind in enumerate(config.layer_types):
            layer = config.per_layer_config[i]
            keys = min(ctx, config.sliding_window) if kind == "sliding_attention" else ctx
            total += batch * keys * 2 * layer.num_key_value_heads * layer.head_dim * elem
        return total
    kv, d = config.num_key_value_heads, config.head_dim
    per_tok = 2 * kv * d * elem
    if family == "nemotronh":
        return batch * ctx * per_tok * config.hybrid_override_pattern.count("*")
    total = 0
    for i in range(config.num_hidden_layers):
        if family == "llama4":
            local = config.no_rope_layers[i] == 1
            keys = (ctx - 1) % config.attention_chunk_size + 1 if local else ctx
        else:
            local = config.layer_types[i] == "sliding_attention"
            keys = min(ctx, config.sliding_window) if local else ctx
        total += batch * keys * per_tok
    return total


def copy_bandwidth(device) -> float:
    if device.type != "cuda":
        return float("nan")
    import triton

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=100, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def matmul_rate(device) -> float:
    """Measured bf16 dense matmul FLOP/s (8192^3): the prefill roofline."""
    if device.type != "cuda":
        return float("nan")
    import triton

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = triton.testing.do_bench(lambda: a @ a, warmup=10, rep=50, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def prefill_rate(llm, weight_bytes_per_token: int, n_tokens: int, device) -> dict:
    """One ``n_tokens`` prompt prefilled in one step: tokens/s and the linear layers' FLOP/s (2 FLOPs per
    active weight per token; attention and the scan are extra work not counted, so this is a lower bound)."""
    from hybridkv.engine.sampling_params import SamplingParams

    eng = llm.engine
    ids = np.random.default_rng(7).integers(10, eng.vocab_size, n_tokens).tolist()
    best = float("inf")
    for i in range(3):
        eng.add_request(f"prefill-{time.monotonic_ns()}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        sync(device)
        t0 = time.perf_counter()
        eng.step()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        while eng.has_unfinished:
            eng.step()
    flops = 2 * (weight_bytes_per_token / 2) * n_tokens
    return {"tokens": n_tokens, "ms": best * 1e3, "tok_s": n_tokens / best, "tflops": flops / best / 1e12}


def replay_ms(llm, batch: int) -> float | None:
    """Mean ms of the batch's captured decode graph replayed back to back on the step's own inputs (call it
    between two decode steps): the device's time for a step with no host work at all (None without CUDA
    graphs). What the replays write (Mamba states, the step's KV slots, the greedy tokens the next step reads)
    is restored afterwards."""
    eng = llm.engine
    graphs = getattr(eng.runner, "graphs", None)
    if graphs is None:
        return None
    graph = graphs._graphs[graphs.bucket_for(batch)][0]
    torch.cuda.synchronize()
    caches, bs = eng.runner.caches, llm.plan.block_size
    view = graphs.buffers.views[graphs.bucket_for(batch)]
    lay, dev64 = view.layout, view.dev64
    saved = [(s, s.clone()) for g in llm.plan.mamba_groups for name in g.layer_names for s in caches[name]]
    saved.append((graphs._tokens, graphs._tokens.clone()))       # the next step's pending input ids
    for a, gi in enumerate(lay.attention):        # (num_blocks, 2, block_size, kv_heads, dim) at the step's slots
        slots = lay.slots(dev64, a, batch)
        slots = slots[slots >= 0]
        blk, off = slots // bs, slots % bs
        saved += [((t, blk, off), t[blk, :, off].clone()) for name in llm.plan.groups[gi].layer_names
                  for t in caches[name]]
    t0 = time.perf_counter()
    for _ in range(30):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 30 * 1e3
    for target, copy in saved:
        if isinstance(target, tuple):
            t, blk, off = target
            t[blk, :, off] = copy
        else:
            target.copy_(copy)
    torch.cuda.synchronize()
    return ms


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_hybridkv(llm, prompts: list[list[int]], steps: int, device) -> dict:
    """Add the prompts, step the engine; time every step from the previous step's return (no sync in
    between: with asynchronous scheduling the host prepares a step while the device runs the one before,
    and ``step`` returns once the tokens of the step before are on the host); decode steps = those where
    every request gets one more token after its first."""
    from hybridkv.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    eng = llm.engine
    host = _HostTimer(eng)
    base = f"b{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        eng.add_request(f"{base}-{i}.0", p, params)
    reqs = list(eng._requests.values())[-len(prompts):]
    times, tokens = [], {}
    host_times = []
    replay = None
    sync(device)
    t0 = time.perf_counter()
    while eng.has_unfinished:
        host.total = 0.0
        outs = eng.step(only_finished=True)      # as LLM.generate: no streamed outputs to build
        t1 = time.perf_counter()
        dt, t0 = t1 - t0, t1
        if not outs and min(r.num_output_tokens for r in reqs) >= 2:
            if len(eng.scheduler.running) < len(prompts):
                raise RuntimeError(f"only {len(eng.scheduler.running)} of {len(prompts)} requests fit the cache at "
                                   "once: raise --kv-memory")
            times.append(dt)
            host_times.append(host.total)
            if replay is None and len(times) == steps // 2:       # mid-run: the graph's inputs are a real step's
                replay = replay_ms(llm, len(prompts)) or float("nan")
                t0 = time.perf_counter()
        for o in outs:
            tokens[o.request_id] = o.outputs[0].token_ids
    host.restore()
    ordered = [tokens[f"{base}-{i}.0"] for i in range(len(prompts))]
    return {"step_times": times, "host_times": host_times, "tokens": ordered, "replay_ms": replay}


class _HostTimer:
    """Adds up the host-side phases of a step (schedule, step batch, per-group metadata + transforms, KV
    commit) by wrapping those methods of one engine instance; ``restore`` unwraps them."""

    def __init__(self, eng) -> None:
        self.total = 0.0
        self._saved = []
        runner = eng.runner
        targets = [(eng.scheduler, "schedule"), (eng, "_step_batch"), (eng.coordinator, "commit_batch")]
        if hasattr(runner, "group_inputs"):
            targets.append((runner, "group_inputs"))
        for obj, name in targets:
            fn = getattr(obj, name)
            self._saved.append((obj, name))
            setattr(obj, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        return timed

    def restore(self) -> None:
        for obj, name in self._saved:
            delattr(obj, name)


def run_hf(model, prompts: list[list[int]], steps: int, device) -> dict:
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def gen(n):
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t0, out

    gen(2)  # warm-up
    t1, _ = gen(1)
    tn, out = gen(1 + steps)
    return {"decode_time": max(tn - t1, 1e-9), "tokens": out[:, ids.shape[1]:].tolist()}


def _profiled(eng, device, nsteps: int) -> dict:
    """GPU kernel time vs wall time over the engine's next ``nsteps`` steps, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(nsteps):
            eng.step()
        sync(device)
        wall = time.perf_counter() - t0
    while eng.has_unfinished:
        eng.step()
    kern = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:      # kernels only (CPU ops would double count)
            continue
        dev_t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        kern.append((e.key, dev_t, e.count))
    kern.sort(key=lambda x: -x[1])
    gpu_us = sum(k[1] for k in kern)
    launches = sum(k[2] for k in kern)
    return {"wall_ms_per_step": wall / nsteps * 1e3, "gpu_busy_ms_per_step": gpu_us / nsteps / 1e3,
            "kernels_per_step": launches / nsteps,
            "top_kernels": [{"name": k[0][:80], "us_per_step": k[1] / nsteps, "calls_per_step": k[2] / nsteps}
                            for k in kern[:16]]}


def profile_steps(llm, prompts: list[list[int]], device, nsteps: int = 8) -> dict:
    """``_profiled`` over ``nsteps`` decode steps of a batch of ``prompts``."""
    if device.type != "cuda":
        return {}
    from hybridkv.engine.sampling_params import SamplingParams

    eng = llm.engine
    for i, prompt in enumerate(prompts):
        eng.add_request(f"prof.{i}", prompt, SamplingParams(temperature=0.0, max_tokens=nsteps + 4, ignore_eos=True))
    budget = eng.scheduler.config.max_num_batched_tokens
    for _ in range(-(-sum(map(len, prompts)) // budget) + 2):     # the prefill chunks, then into decode
        eng.step()
    return _profiled(eng, device, nsteps)


def profile_prefill(llm, n_tokens: int, device) -> dict:
    """``_profiled`` over one step that prefills an ``n_tokens`` prompt (after an unprofiled warm-up one)."""
    if device.type != "cuda":
        return {}
    from hybridkv.engine.sampling_params import SamplingParams

    eng = llm.engine
    ids = np.random.default_rng(8).integers(10, eng.vocab_size, n_tokens).tolist()
    for i in range(2):
        eng.add_request(f"prof-prefill.{i}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        if i == 0:
            while eng.has_unfinished:
                eng.step()
    return _profiled(eng, device, 1)


_HF32: dict = {}


@torch.inference_mode()
def logits_check(family, backend, model, hf, cls, config, device, n: int) -> dict:
    """All-position logits of one n-token prompt: hybridkv (one prefill through ``reference_logits``) and HF
    in bf16, each against HF run in fp32 on the same (upcast) weights."""
    from hybridkv.engine.model_runner import reference_logits

    ids = np.random.default_rng(123).integers(10, config.vocab_size, n).tolist()
    if family not in _HF32:
        _HF32.clear()
        with torch.device(device):
            hf32 = cls(config).float().eval()
        hf32.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
        ref = hf32(torch.tensor([ids], device=device)).logits[0].float()
        hf16 = hf(torch.tensor([ids], device=device)).logits[0].float()
        _HF32[family] = (ref, hf16)
        del hf32
    ref, hf16 = _HF32[family]
    ours = reference_logits(model, ids, backend=backend).float()

    def err(x):
        return float((x - ref).norm() / ref.norm())

    def agree(x):
        return float((x.argmax(-1) == ref.argmax(-1)).float().mean())

    return {"family": family, "engine": f"hybridkv ({backend})", "len": n, "rel_err": err(ours),
            "argmax_agree": agree(ours), "hf_bf16_rel_err": err(hf16), "hf_bf16_argmax_agree": agree(hf16)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="llama4,gemma3")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--backends", default="triton,triton:eager",
                    help="comma list of backend[:mode[+mode]]; mode 'eager' turns CUDA graphs off, 'sync' "
                         "asynchronous scheduling")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--kv-memory", default="4GiB", help="KV cache + Mamba state budget (64 Mamba2 requests need more)")
    ap.add_argument("--prefill", type=int, default=8192, help="prompt length of the prefill rate (0: skip)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine's max_model_len (0: what the run needs, prompt + steps or --prefill, + 64)")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="the engine's max_num_seqs, which sets the largest CUDA-graph bucket (0: largest batch + 1)")
    ap.add_argument("--check-len", type=int, default=1500, help="prompt length of the logits check")
    ap.add_argument("--profile-batch", default="1", help="batch sizes of the kernel profiles (comma list)")
    ap.add_argument("--profile-prefill", action="store_true", help="also profile one --prefill step's kernels")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke test of this script")
    ap.add_argument("--tag", default="", help="scenario name: the result is that scenario of gpu_decode.json")
    add_output_args(ap, "gpu_decode")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        args.prompt, args.steps, args.check_len = min(args.prompt, 20), min(args.steps, 4), 40
        args.prefill = min(args.prefill, 64)
        args.backends = "torch"
    from hybridkv.engine.llm import LLM

    bw = copy_bandwidth(device)
    mm = matmul_rate(device)
    meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "commit": commit(),
            "command": " ".join(sys.argv), "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9,
            "matmul_tflops": mm / 1e12, "prompt_len": args.prompt, "decode_steps": args.steps,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    rows, profiles, tokens, logit_rows, prefill_rows = [], {}, {}, [], []
    batches = [int(b) for b in args.batches.split(",")]
    for family in args.families.split(","):
        config, cls = hf_config(family, args.tiny)
        torch.manual_seed(0)
        with torch.device(device):
            hf = cls(config).to(dtype).eval()
        n_params = sum(p.numel() for p in hf.parameters())
        tmp = tempfile.mkdtemp(prefix=f"hkv-{family}-")
        hf.save_pretrained(tmp)
        ctx_end = args.prompt + args.steps
        for variant in args.backends.split(","):
            backend, _, mode = variant.partition(":")       # "triton:eager+sync": no CUDA graphs, no async
            modes = set(mode.split("+"))
            llm = LLM(tmp, dtype=dtype, device=str(device), backend=backend,
                      max_model_len=args.max_model_len or max(ctx_end, args.prefill) + 64,
                      max_num_seqs=args.max_num_seqs or max(batches) + 1,
                      enable_prefix_caching=False,
                      max_num_batched_tokens=max(4096, args.prompt, args.prefill), kv_cache_memory=args.kv_memory,
                      prefill_spread=1,
                      cuda_graphs=False if "eager" in modes else None,
                      async_scheduling=False if "sync" in modes else None)
            graphs = "graphs" if getattr(llm.engine.runner, "graphs", None) is not None else "eager"
            graphs += ", async" if llm.engine.async_scheduling else ", sync"
            for B in batches:
                rng = np.random.default_rng(B)   # the same prompts for every backend
                prompts = [rng.integers(10, config.vocab_size, args.prompt).tolist() for _ in range(B)]
                run_hybridkv(llm, prompts[:1], 2, device)  # warm-up (compiles kernels)
                r = run_hybridkv(llm, prompts, args.steps, device)
                step = statistics.median(r["step_times"]) if r["step_times"] else float("nan")
                # KV read averaged over the timed steps (a chunked layer's count is a sawtooth in the context)
                kv = statistics.fmean(kv_bytes_per_step(config, family, B, ctx)
                                      for ctx in range(args.prompt + 1, args.prompt + args.steps + 1))
                floor = (active_weight_bytes(hf, config, B) + kv
                         + state_bytes_per_step(config, family, B)) / bw
                host = statistics.median(r["host_times"]) if r["host_times"] else float("nan")
                row = {"family": family, "params": n_params, "engine": f"hybridkv ({backend}, {graphs})", "batch": B,
                       "step_ms": step * 1e3, "tok_s": B / step, "floor_ms": floor * 1e3,
                       "x_floor": step / floor if floor == floor else float("nan"),
                       "host_ms": host * 1e3, "host_fraction": host / step,
                       # greedy tokens of every request: equal digests = identical outputs (two builds compared)
                       "tokens_sha1": hashlib.sha1(json.dumps(r["tokens"]).encode()).hexdigest()[:12]}
                replay = r["replay_ms"]
                if replay is not None and replay == replay:   # what the step adds to the device's time
                    row.update(replay_ms=replay, exposed_host_fraction=max(step * 1e3 - replay, 0.0) / (step * 1e3))
                if not args.no_hf and variant == args.backends.split(",")[0]:
                    h = run_hf(hf, prompts, args.steps, device)
                    hstep = h["decode_time"] / args.steps
                    match = np.mean([list(a[:8]) == list(b[:8]) for a, b in zip(r["tokens"], h["tokens"], strict=True)])
                    rows.append({"family": family, "params": n_params, "engine": "HF generate", "batch": B,
                                 "step_ms": hstep * 1e3, "tok_s": B / hstep, "floor_ms": floor * 1e3,
                                 "x_floor": hstep / floor if floor == floor else float("nan")})
                    row["speedup_vs_hf"] = hstep / step
                    row["greedy_first8_match_hf"] = float(match)
                tokens[(family, B, variant)] = r["tokens"]
                first = tokens.get((family, B, args.backends.split(",")[0]))
                if first is not None and first is not r["tokens"]:
                    row["greedy_first8_match_first_backend"] = float(np.mean(
                        [list(a[:8]) == list(b[:8]) for a, b in zip(r["tokens"], first, strict=True)]))
                rows.append(row)
                print(rows[-1], flush=True)
            if backend == "triton" or args.tiny:
                for pb in map(int, args.profile_batch.split(",")):
                    rng = np.random.default_rng(pb)
                    batch = [rng.integers(10, config.vocab_size, args.prompt).tolist() for _ in range(pb)]
                    profiles[f"{family}/{variant}/b{pb}"] = profile_steps(llm, batch, device)
            main_variant = not modes & {"eager", "sync"}      # prefill and logits: once per backend
            if main_variant and args.prefill:
                p = prefill_rate(llm, active_weight_bytes(hf, config, 1), args.prefill, device)
                p.update(family=family, engine=f"hybridkv ({backend})", matmul_tflops=mm / 1e12,
                         pct_matmul=100 * p["tflops"] * 1e12 / mm)
                prefill_rows.append(p)
                print(p, flush=True)
                if args.profile_prefill:
                    profiles[f"{family}/{variant}/prefill"] = profile_prefill(llm, args.prefill, device)
            if main_variant:
                logit_rows.append(logits_check(family, backend, llm.model, hf, cls, config, device,
                                               args.check_len))
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del hf
    result = {"meta": meta, "rows": rows, "profiles": profiles, "logits": logit_rows, "prefill": prefill_rows}
    if not args.tiny:
        write_json(args, "gpu_decode", result, scenario=args.tag or "default")
    print_table("logits of one prompt, all positions (rel. error vs HF in fp32; argmax agreement)",
                ["family", "engine", "len", "rel err", "argmax = fp32", "HF bf16 rel err", "HF bf16 argmax = fp32"],
                [[r["family"], r["engine"], r["len"], f"{r['rel_err']:.2e}", f"{r['argmax_agree']:.3f}",
                  f"{r['hf_bf16_rel_err']:.2e}", f"{r['hf_bf16_argmax_agree']:.3f}"] for r in logit_rows])
    if prefill_rows:
        print_table(f"prefill, one prompt per step (bf16 matmul rate {mm / 1e12:.0f} TFLOP/s)",
                    ["family", "engine", "tokens", "ms", "tok/s", "linear TFLOP/s", "% matmul"],
                    [[r["family"], r["engine"], r["tokens"], f"{r['ms']:.1f}", f"{r['tok_s']:.0f}",
                      f"{r['tflops']:.0f}", f"{r['pct_matmul']:.0f}"] for r in prefill_rows])
    for key, p in profiles.items():
        if p:
            what = "prefill" if key.endswith("/prefill") else "decode"
            print_table(f"{what} profile {key}: wall {p['wall_ms_per_step']:.2f} ms/step, GPU busy "
                        f"{p['gpu_busy_ms_per_step']:.2f} ms/step, {p['kernels_per_step']:.0f} kernels/step",
                        ["kernel", "µs/step", "calls/step"],
                        [[k["name"], f"{k['us_per_step']:.1f}", f"{k['calls_per_step']:.1f}"]
                         for k in p["top_kernels"]])
    print_table(f"decode on {meta['device']} (prompt {args.prompt}, {args.steps} steps; copy bw {bw / 1e9:.0f} GB/s)",
                ["family", "params", "engine", "B", "step ms", "tok/s", "floor ms", "x floor", "host %",
                 "exposed host %", "vs HF", "greedy = HF", "greedy = 1st backend"],
                [[r["family"], f"{r['params'] / 1e9:.2f}B", r["engine"], r["batch"], f"{r['step_ms']:.2f}",
                  f"{r['tok_s']:.0f}", f"{r['floor_ms']:.3f}", f"{r['x_floor']:.1f}",
                  f"{100 * r['host_fraction']:.1f}" if "host_fraction" in r else "",
                  f"{100 * r['exposed_host_fraction']:.1f}" if "exposed_host_fraction" in r else "",
                  f"{r.get('speedup_vs_hf', float('nan')):.2f}x", r.get("greedy_first8_match_hf", ""),
                  r.get("greedy_first8_match_first_backend", "")]
                 for r in rows])


if __name__ == "__main__":
    main()
