"""Engine-vs-HF parity checks shared by the attention-family parity tests: ``LLM.generate`` with block size 4
and an 8-token step budget (every prompt a chunked prefill), twice (the second pass hits the cache when
caching is on), against HF's greedy tokens and full-sequence fp32 logits."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits

TOL = 1e-4


def tiny_llm(path: Path, **kwargs) -> LLM:
    return LLM(path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cpu", kv_cache_memory="8MiB",
               **kwargs)


def check_logprobs(out, prompt: list[int], tokens: list[int], full: torch.Tensor, where: str) -> None:
    """Each output token's logprob and its top-k against HF's log-softmax at that position."""
    logsm = full.log_softmax(-1)
    for i, lp in enumerate(out.outputs[0].logprobs):
        pos = len(prompt) - 1 + i
        assert lp.token_id == tokens[i], where
        assert abs(lp.logprob - logsm[pos, tokens[i]].item()) <= TOL, f"{where}: token {i}"
        for tok, value in lp.top:
            assert abs(value - logsm[pos, tok].item()) <= TOL, f"{where}: token {i}, top token {tok}"


def check_engine_matches_hf(path: Path, prompts: list[list[int]], expected: dict, *, new_tokens: int,
                            prefix_caching: bool, label: str = "") -> None:
    """Greedy tokens and logprobs equal HF's on both passes; hits only with caching; the whole-sequence
    reference forward of the third prompt within ``TOL`` of HF's logits. ``expected``: prompt -> (tokens,
    (len, vocab) logits)."""
    llm = tiny_llm(path, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    for rerun in range(2):          # the second pass finds every prompt's full blocks cached (when caching)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            where = f"{label}prompt of {len(prompt)}, pass {rerun}, prefix caching {prefix_caching}"
            assert out.error is None, out.error
            tokens, full = expected[tuple(prompt)]
            assert list(out.outputs[0].token_ids) == tokens, where
            check_logprobs(out, prompt, tokens, full, where)
    assert len(set(expected[tuple(prompts[1])][0])) >= 5, f"{label}degenerate greedy output"
    hits = llm.stats().prefix_hit_tokens
    assert hits > 0 if prefix_caching else hits == 0
    sequence = prompts[2] + expected[tuple(prompts[2])][0]
    assert (reference_logits(llm.model, sequence) - expected[tuple(prompts[2])][1]).abs().max().item() <= TOL


def check_prompt_logprobs(path: Path, prompt: list[int], expected: dict, *, label: str = "") -> None:
    """Every prompt token's log-probability (a prefill's every row, through the chunked prefill)."""
    llm = tiny_llm(path)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    logsm = expected[tuple(prompt)][1].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(lp.logprob - logsm[i - 1, prompt[i]].item()) <= TOL, f"{label}prompt token {i}"
