"""``LLM``: the Python API users know from vLLM, over hybridkv's engine.

    from hybridkv import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")            # or a HybridConfig (random weights) or a built model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybridkv.engine.engine import EngineStats, LLMEngine, RequestError
from hybridkv.engine.request import CompletionOutput, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.kv_groups.plan import KVCachePlan, plan_kv_cache
from hybridkv.loaders.hf_config import load_config
from hybridkv.models.config import HybridConfig
from hybridkv.models.hybrid import CONFIG_NAME, HybridModel, build_model, load_model
from hybridkv.utils import format_bytes, parse_bytes

logger = logging.getLogger("hybridkv")

Prompt = str | Sequence[int]


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: str | torch.dtype, config: HybridConfig, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # Checkpoint dtype on GPUs; fp32 on the CPU, where bf16 matmuls are slow and less exact.
        return config.torch_dtype if device.type == "cuda" else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _default_kv_memory(device: torch.device) -> int:
    """A safe share of what is free: 80% of free GPU memory, or 10% of available RAM (at most 4 GiB)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(available * 0.1), 4 << 30)


def _load(model: str | Path | HybridConfig | HybridModel, device: torch.device, dtype: str | torch.dtype,
          seed: int) -> tuple[HybridModel, object | None]:
    if isinstance(model, HybridModel):
        return model.to(device).eval(), None
    if isinstance(model, HybridConfig):
        return build_model(model, dtype=_resolve_dtype(dtype, model, device), device=device, seed=seed), None
    path = Path(model)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no {CONFIG_NAME})")
    import json

    raw = json.loads(config_file.read_text())
    if "hybridkv_config" in raw:
        config = HybridConfig.from_dict(raw)
        loaded = load_model(path, dtype=_resolve_dtype(dtype, config, device), device=device)
    else:   # an HF checkpoint: hub weight names, converted by the loaders package
        from hybridkv.loaders.checkpoint import load_hf_checkpoint

        config = load_config(path)
        loaded = load_hf_checkpoint(path, dtype=_resolve_dtype(dtype, config, device), device=device)
    from hybridkv.loaders.tokenizer import load_tokenizer

    return loaded, load_tokenizer(path)


class LLM:
    def __init__(self, model: str | Path | HybridConfig | HybridModel, *, dtype: str | torch.dtype = "auto",
                 device: str = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 kv_cache_memory: int | str | None = None, enable_prefix_caching: bool = True,
                 backend: str = "auto", seed: int = 0, tokenizer: object | None = None) -> None:
        dev = _resolve_device(device)
        self.model, found_tokenizer = _load(model, dev, dtype, seed)
        self.tokenizer = tokenizer or found_tokenizer
        config = self.model.config
        max_model_len = max_model_len or config.max_position_embeddings
        step_tokens = max_num_batched_tokens or max(2048, min(max_model_len, 8192))
        budget = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else _default_kv_memory(dev)
        specs = config.kv_specs(block_size=block_size, kv_dtype=next(self.model.parameters()).dtype)
        has_mamba = any(not s.is_attention for s in specs.values())
        self.plan: KVCachePlan = plan_kv_cache(
            specs, max_model_len=max_model_len, kv_memory=budget, max_num_seqs=max_num_seqs,
            step_tokens=step_tokens, num_checkpoint_slots=max_num_seqs if (has_mamba and enable_prefix_caching)
            else 0)
        logger.info("KV cache plan: %s (budget %s)", self.plan.summary(), format_bytes(budget))
        self.engine = LLMEngine(self.model, self.plan, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=step_tokens, enable_prefix_caching=enable_prefix_caching,
                                backend=backend, tokenizer=self.tokenizer, seed=seed)
        self._next_id = 0

    # -- prompts ------------------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; this model has none (pass token ids)")
            return self.tokenizer.encode(prompt), prompt
        return list(prompt), None

    def _submit(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                ) -> tuple[list[str], dict[str, int], dict[str, RequestOutput]]:
        """Add every (prompt, sample) as an engine request; bad prompts become error outputs at once.
        Returns prompt ids in input order, samples per accepted prompt, and the error outputs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        num_samples: dict[str, int] = {}
        errors: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, plist, strict=True):
            rid = str(self._next_id)
            self._next_id += 1
            ids.append(rid)
            try:
                tokens, text = self._encode(prompt)
                for i in range(p.n):
                    sample_params = p if p.n == 1 else _nth_sample(p, i)
                    self.engine.add_request(f"{rid}.{i}", tokens, sample_params, prompt=text)
                num_samples[rid] = p.n
            except RequestError as err:
                for i in range(p.n):
                    self.engine.abort(f"{rid}.{i}")
                errors[rid] = RequestOutput(request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
                                            prompt_token_ids=tuple(prompt) if not isinstance(prompt, str) else (),
                                            outputs=(), finished=True, error=str(err))
        return ids, num_samples, errors

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A prompt that cannot be served gets an
        output with ``error`` set; the others run normally."""
        ids, num_samples, errors = self._submit(prompts, sampling_params)
        samples: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in num_samples}
        start = time.perf_counter()
        with tqdm(total=len(num_samples), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        rid, i = out.request_id.rsplit(".", 1)
                        samples[rid][int(i)] = out
                        if len(samples[rid]) == num_samples[rid]:
                            bar.update(1)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for s in samples.values() for o in s.values())
        if use_tqdm and elapsed > 0:
            logger.info("generated %d tokens in %.2fs (%.1f tok/s)", generated, elapsed, generated / elapsed)
        return [errors[rid] if rid in errors else _merge(rid, samples[rid]) for rid in ids]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield each request's output after every step it advances (``finished`` marks the last);
        request ids are "<prompt index>.<sample index>"."""
        _, _, errors = self._submit(prompts, sampling_params)
        yield from errors.values()
        while self.engine.has_unfinished:
            yield from self.engine.step()

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _nth_sample(p: SamplingParams, i: int) -> SamplingParams:
    """The i-th of ``n`` samples: one sequence each, seeds offset so samples differ but stay reproducible."""
    from dataclasses import replace

    return replace(p, n=1, seed=None if p.seed is None else p.seed + i)


def _merge(rid: str, samples: dict[int, RequestOutput]) -> RequestOutput:
    first = samples[0]
    outputs = tuple(CompletionOutput(index=i, token_ids=o.outputs[0].token_ids, text=o.outputs[0].text,
                                     finish_reason=o.outputs[0].finish_reason, logprobs=o.outputs[0].logprobs)
                    for i, o in sorted(samples.items()))
    return RequestOutput(request_id=rid, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                         outputs=outputs, finished=True, prompt_logprobs=first.prompt_logprobs)
