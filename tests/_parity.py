"""Engine-vs-HF parity checks shared by the attention-family parity tests: ``LLM.generate`` with block size 4
and an 8-token step budget (every prompt a chunked prefill), twice (the second pass hits the cache when
caching is on), against HF's greedy tokens and full-sequence fp32 logits."""

from __future__ import annotations

from pathlib import Path

import _hf_models as hf_models
import torch
from transformers import PreTrainedModel

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders.checkpoint import load_hf_checkpoint

TOL = 1e-4


def hf_checkpoint(name: str, seed: int, directory: Path, prompts: list[list[int]], *, new_tokens: int
                  ) -> tuple[str, PreTrainedModel, Path, dict]:
    """The family ``name``'s tiny HF model (``seed``) saved in ``directory``, and HF's greedy tokens and logits per
    prompt: (name, the HF model, its checkpoint, prompt -> (tokens, (len, vocab) logits))."""
    hf = hf_models.FAMILIES[name](seed)
    path = hf_models.save(hf, directory)
    expected = {}
    for prompt in prompts:
        tokens = hf_models.hf_greedy(hf, prompt, new_tokens)
        expected[tuple(prompt)] = (tokens, hf_models.full_logits(hf, prompt + tokens))
    return name, hf, path, expected


def check_reference_forward(hf: PreTrainedModel, path: Path, prompts: list[list[int]], *, label: str = "") -> None:
    """The loaded model alone (one no-cache forward per prompt), independent of the engine, within ``TOL``."""
    model = load_hf_checkpoint(path, dtype=torch.float32, device="cpu")
    for prompt in prompts:
        diff = (reference_logits(model, prompt) - hf_models.full_logits(hf, prompt)).abs().max().item()
        assert diff <= TOL, f"{label}max |logit diff| {diff}"


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


def check_triton_graphs_match_hf(name: str, path: Path, prompts: list[list[int]], expected: dict, *, new_tokens: int,
                                 graphs_capture: bool = True) -> None:
    """On CUDA with the triton backend, eager steps and decode steps captured as CUDA graphs (``graphs_capture``:
    the graphs are built), with prefix caching, give HF's tokens and logprobs on both passes."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    for graphs in (False, True):
        llm = LLM(path, block_size=4, max_num_batched_tokens=8, dtype="float32", device="cuda", backend="triton",
                  kv_cache_memory="8MiB", enable_prefix_caching=True, cuda_graphs=graphs)
        if graphs_capture:
            assert (llm.engine.runner.graphs is not None) == graphs
        for rerun in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            for prompt, out in zip(prompts, outs, strict=True):
                where = f"{name}: prompt of {len(prompt)}, pass {rerun}, cuda graphs {graphs}"
                assert out.error is None, out.error
                tokens, full = expected[tuple(prompt)]
                assert list(out.outputs[0].token_ids) == tokens, where
                check_logprobs(out, prompt, tokens, full, where)
        assert llm.stats().prefix_hit_tokens > 0


def check_prompt_logprobs(path: Path, prompt: list[int], expected: dict, *, label: str = "") -> None:
    """Every prompt token's log-probability (a prefill's every row, through the chunked prefill)."""
    llm = tiny_llm(path)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    logsm = expected[tuple(prompt)][1].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(lp.logprob - logsm[i - 1, prompt[i]].item()) <= TOL, f"{label}prompt token {i}"
