"""Real checkpoints of the attention families (and Mamba2) through the whole stack, against HF.

A tiny random HF model is written by ``save_pretrained`` (hub weight names, config.json), loaded by
``LLM(path)`` with 4-token blocks and an 8-token step budget (so prefills run in chunks), and must
reproduce HF exactly: the same 32 greedy tokens, on a prompt shorter than every window / chunk and on
one several times longer; the engine's per-step and per-prompt-token log-probabilities (sampled token
and top 5) and a single no-cache forward over the final sequence within 1e-4 of HF's full forward.
The HF oracle is an argmax loop over full forwards (no HF cache code involved).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from _parity import check_reference_forward
from transformers import PreTrainedModel

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits

TOL = 1e-4
NEW_TOKENS = 32
PROMPT_LENS = (3, 37)        # below every window (4-6) / chunk (8); 37 crosses them 4-9 times

# family -> (builder, seed, expect diverse output). Seeds picked so that greedy decoding does not
# collapse into one repeated token (a random model's attractor), which would test little.
CASES: dict[str, tuple[Callable[[int], PreTrainedModel], int, bool]] = {
    "llama4": (hf_models.llama4, 2, True),
    "llama4_multimodal": (hf_models.llama4_multimodal, 0, True),
    "mistral": (hf_models.mistral, 0, True),
    "gemma2": (hf_models.gemma2, 1, True),
    "gemma3": (hf_models.gemma3, 0, True),
    "gemma3_multimodal": (hf_models.gemma3_multimodal, 0, False),   # tied embeddings: repeats
    "mamba2": (hf_models.mamba2, 0, True),
}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, hf_models.VOCAB - 4, (n,), generator=gen).tolist() for n in PROMPT_LENS]


# The quick tier (``-m "not slow"``) keeps Llama-4 (chunked-local + global NoPE layers, MoE); the others are slow.
QUICK_CASES = ("llama4",)


@pytest.fixture(scope="module", params=[name if name in QUICK_CASES else pytest.param(name, marks=pytest.mark.slow)
                                        for name in CASES])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, PreTrainedModel, Path]:
    name = request.param
    build, seed, _ = CASES[name]
    model = build(seed)
    return name, model, hf_models.save(model, tmp_path_factory.mktemp(name))


def _check_logprobs(ours, full: torch.Tensor, position: int, token: int, where: str) -> None:
    """One TokenLogprob against HF's log-softmax row ``position`` (the sampled token and the top k)."""
    assert ours.token_id == token, where
    assert abs(ours.logprob - full[position, token].item()) <= TOL, where
    for tok, lp in ours.top:
        assert abs(lp - full[position, tok].item()) <= TOL, f"{where}: top token {tok}"
    ours_top = [tok for tok, _ in ours.top]
    ref_top = full[position].topk(len(ours_top)).indices.tolist()
    assert ours_top == ref_top or torch.allclose(full[position, ours_top], full[position, ref_top],
                                                 atol=TOL), where


def test_engine_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path]) -> None:
    name, hf, path = checkpoint
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu",
              kv_cache_memory="8MiB")
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.error is None, out.error
        tokens = list(out.outputs[0].token_ids)
        assert tokens == hf_models.hf_greedy(hf, prompt, NEW_TOKENS), f"{name}: prompt of {len(prompt)}"
        if CASES[name][2]:
            assert len(set(tokens)) >= 5, f"{name}: degenerate greedy output {tokens}"
        sequence = prompt + tokens
        full_ref = hf_models.full_logits(hf, sequence)
        full = full_ref.log_softmax(-1)
        for i, lp in enumerate(out.outputs[0].logprobs):
            _check_logprobs(lp, full, len(prompt) - 1 + i, tokens[i], f"{name}: new token {i}")
        assert out.prompt_logprobs[0] is None
        for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
            _check_logprobs(lp, full, i - 1, prompt[i], f"{name}: prompt token {i}")
        ours = reference_logits(llm.model, sequence)
        assert (ours - full_ref).abs().max().item() <= TOL


def test_reference_forward_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path]) -> None:
    """The loaded model alone (single no-cache prefill per step), independent of the engine."""
    name, hf, path = checkpoint
    check_reference_forward(hf, path, _prompts(), label=f"{name}: ")
