"""gpt-oss through the whole stack against HF transformers: a tiny random ``GptOssForCausalLM`` (attention sinks
of magnitude 1-3, sliding window 4 on alternate layers, YaRN RoPE, biased router and experts, the clamped
SwiGLU biting) written by ``save_pretrained``, loaded by ``LLM(path)`` with 4-token blocks and an 8-token step
budget (prefills run in chunks), in fp32:

- the same 32 greedy tokens as HF on a prompt shorter than the window and on ones many windows long;
- per-step log-probabilities (sampled token and top 5) within 1e-4 of HF's full forward, and a no-cache
  forward over the final sequence within 1e-4 of HF's logits;
- with prefix caching on (a second pass over the same prompts and a prompt extending another hit the cache,
  which the engine's counters show) and off (no hit), the same tokens and log-probabilities.

The HF oracle is an argmax loop over full forwards (eager attention, no HF cache code involved).
"""

from __future__ import annotations

from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from _parity import check_engine_matches_hf, check_prompt_logprobs, check_reference_forward
from transformers import PreTrainedModel

NEW_TOKENS = 32
SEED = 0           # greedy output stays diverse (no single-token attractor) for these prompts


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    base = [torch.randint(3, hf_models.VOCAB - 4, (n,), generator=gen).tolist() for n in (3, 37)]
    return base + [base[1] + torch.randint(3, hf_models.VOCAB - 4, (9,), generator=gen).tolist()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path, dict]:
    """The HF model, its checkpoint, and HF's greedy tokens and log-softmax rows per prompt."""
    hf = hf_models.gpt_oss(SEED)
    path = hf_models.save(hf, tmp_path_factory.mktemp("gpt_oss"))
    expected = {}
    for prompt in _prompts():
        tokens = hf_models.hf_greedy(hf, prompt, NEW_TOKENS)
        full = hf_models.full_logits(hf, prompt + tokens)
        expected[tuple(prompt)] = (tokens, full)
    return hf, path, expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_engine_matches_hf(checkpoint: tuple[PreTrainedModel, Path, dict], prefix_caching: bool) -> None:
    _, path, expected = checkpoint
    check_engine_matches_hf(path, _prompts(), expected, new_tokens=NEW_TOKENS, prefix_caching=prefix_caching)


def test_prompt_logprobs_match_hf(checkpoint: tuple[PreTrainedModel, Path, dict]) -> None:
    """Every prompt token's log-probability (a prefill's every row, through the chunked prefill)."""
    _, path, expected = checkpoint
    check_prompt_logprobs(path, _prompts()[1], expected)


def test_reference_forward_matches_hf(checkpoint: tuple[PreTrainedModel, Path, dict]) -> None:
    """The loaded model alone (one no-cache forward), independent of the engine."""
    hf, path, _ = checkpoint
    check_reference_forward(hf, path, _prompts())
