"""Tiny models of every layer mix for the tensor-parallel tests, and a runner that records logits.

Each mix is shaped so that tensor parallelism at 2 exercises a distinct rule: kv heads split and replicated (kv 2
and kv 1), an odd vocabulary (padded vocab-parallel rows) with tied embeddings, MoE experts split inside, Mamba2
groups split (n_groups 2) and replicated (n_groups 1, so the gated norm's group spans both ranks), Mamba-1 channels,
µP section multipliers, short-conv channels. Windows and chunks are 4-8 tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hybridkv import LLM, SamplingParams
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba1, Mamba2, MoE, Rope, ShortConv

VOCAB = 61          # odd: the vocab-parallel embedding and head pad one row at tp 2


def llama4_like() -> HybridConfig:
    """3 chunked-local RoPE layers : 1 global NoPE layer with temperature tuning; sigmoid top-1 MoE with
    a shared expert on every other layer."""
    chunked = Attention(num_heads=4, num_kv_heads=2, head_dim=8, attention_chunk_size=8,
                        rope=Rope(interleaved=True, theta=500.0), qk_norm="rms_weightless")
    glob = Attention(num_heads=4, num_kv_heads=2, head_dim=8, rope=None, temperature_tuning=(0.25, 4.0))
    moe = MoE(num_experts=4, top_k=1, intermediate_size=16, router="sigmoid_input", shared_intermediate_size=24)
    dense = MLP(intermediate_size=48)
    layers = (Layer(mixer=chunked, ffn=dense), Layer(mixer=chunked, ffn=moe), Layer(mixer=chunked, ffn=dense),
              Layer(mixer=glob, ffn=moe))
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=layers, max_position_embeddings=256)


def sliding() -> HybridConfig:
    """Gemma-like: sliding window 5 / global alternating, one kv head (replicated), GeGLU, sandwich
    norms, attention and final softcaps, Gemma norms, tied embeddings with an odd vocabulary."""
    local = Attention(num_heads=4, num_kv_heads=1, head_dim=8, sliding_window=5, qk_norm="rms", softcap=20.0,
                      rope=Rope(theta=100.0))
    glob = Attention(num_heads=4, num_kv_heads=1, head_dim=8, qk_norm="rms", softcap=20.0)
    mlp = MLP(intermediate_size=48, activation="gelu_tanh")
    layers = tuple(Layer(mixer=m, ffn=mlp, sandwich_norm=True) for m in (local, glob, local, glob))
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=layers, norm="gemma_rms", final_softcap=5.0,
                        embedding_multiplier=32 ** 0.5, tie_word_embeddings=True, max_position_embeddings=256)


def mamba2_only() -> HybridConfig:
    """Mamba-Codestral-like: Mamba2 layers only, 2 groups (split over the ranks), norm before gate,
    fp32 residual stream."""
    m = Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8, norm_before_gate=True)
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=tuple(Layer(mixer=m) for _ in range(3)),
                        residual_in_fp32=True, max_position_embeddings=256)


def mamba_hybrid() -> HybridConfig:
    """NemotronH/Jamba-like: Mamba2 with one group (replicated; the gated norm spans the ranks) and
    µP section multipliers, full attention with one kv head, a Mamba-1 layer, relu² MLP, and a grouped
    sigmoid MoE with a correction bias, a latent space and a shared expert."""
    m2 = Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=1, chunk_size=8, proj_bias=True,
                zxbcdt_multipliers=(1.1, 0.9, 1.2, 0.8, 1.05))
    attn = Attention(num_heads=4, num_kv_heads=1, head_dim=8, rope=None, qkv_bias=True, o_bias=True)
    m1 = Mamba1(intermediate_size=32, state_size=8, dt_rank=4, dt_norm=True)
    moe = MoE(num_experts=8, top_k=2, intermediate_size=16, router="sigmoid_bias", num_groups=4, topk_groups=2,
              latent_size=16, shared_intermediate_size=24, routed_scaling_factor=2.0, activation="relu2",
              gated=False)
    layers = (Layer(mixer=m2), Layer(mixer=attn, ffn=MLP(intermediate_size=48, activation="relu2", gated=False)),
              Layer(mixer=m1, ffn=moe), Layer(mixer=m2, ffn=moe))
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=layers, max_position_embeddings=256)


def lfm2_like() -> HybridConfig:
    """LFM2-like: short convs with biases (channels split, the out_proj bias added once after the sum) beside
    full attention with q/k norms, SwiGLU MLPs."""
    conv = ShortConv(channels=32, conv_kernel=3, bias=True)
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm="rms", rope=Rope(theta=1000.0))
    mlp = MLP(intermediate_size=48)
    layers = tuple(Layer(mixer=m, ffn=mlp) for m in (conv, attn, conv, conv))
    return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=layers, max_position_embeddings=256)


MIXES: dict[str, Callable[[], HybridConfig]] = {
    "llama4_like": llama4_like, "sliding": sliding, "mamba2": mamba2_only, "mamba_hybrid": mamba_hybrid,
    "lfm2_like": lfm2_like,
}

ENGINE_ARGS = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                   kv_cache_memory=1 << 22)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int, n: int = 4, seed: int = 0, shared: int = 9) -> list[list[int]]:
    """Prompts with a shared prefix (prefix-cache hits, so Mamba state copies), 1-30 tokens beyond it."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, shared).tolist()
    return [prefix + rng.integers(3, vocab, int(rng.integers(1, 30))).tolist() for _ in range(n)]


@dataclass
class Run:
    tokens: list[list[int]]
    logits: list[torch.Tensor]                               # per step, as rank 0 returned them
    copies: list[tuple[int, int]] = field(default_factory=list)


def run(model: HybridConfig | Path | str, tp: int, batch: list[list[int]], *, seed: int = 1, **kw: object) -> Run:
    """Generate greedily through ``LLM(..., tensor_parallel_size=tp)``; record every step's logits and the
    Mamba state copies the engine asked for. Shuts the group down."""
    llm = LLM(model, seed=seed, tensor_parallel_size=tp, **(ENGINE_ARGS | kw))
    try:
        record = Run(tokens=[], logits=[])
        runner = llm.engine.runner
        execute, copy_states = runner.execute, runner.copy_states

        def spy_execute(step):
            out = execute(dataclasses.replace(step, needs_logits=True))     # greedy steps skip them otherwise
            record.logits.append(out.logits.detach().clone())
            return out

        def spy_copies(copies):
            record.copies.extend(copies)
            return copy_states(copies)

        runner.execute, runner.copy_states = spy_execute, spy_copies
        outs = llm.generate(batch, GREEDY, use_tqdm=False)
        record.tokens = [list(o.outputs[0].token_ids) for o in outs]
        return record
    finally:
        llm.shutdown()


def max_logit_diff(a: Run, b: Run) -> float:
    """Largest |logit difference| over every step (the runs must have scheduled the same steps)."""
    assert len(a.logits) == len(b.logits), "different step counts"
    assert all(x.shape == y.shape for x, y in zip(a.logits, b.logits, strict=True))
    return max((x.double() - y.double()).abs().max().item()
               for x, y in zip(a.logits, b.logits, strict=True) if x.numel())
