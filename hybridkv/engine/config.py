"""``EngineConfig``: every engine setting in one frozen, validated, keyword-only object.

``LLM(model, **kwargs)`` builds one from its keyword arguments; ``LLM(model, config=EngineConfig(...))`` takes
one as it is; ``hybridkv serve`` builds one from its command line; tensor-parallel ranks receive rank 0's
(``for_ranks``). Defaults, validation and the rules that turn settings into numbers (device, dtype, KV
budget, block size, step token budget, the plan) live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.backends.base import KernelBackend
from hybridkv.backends.registry import available_backends
from hybridkv.engine.scheduler import DEFAULT_PREFILL_FLOOR, DEFAULT_PREFILL_SPREAD
from hybridkv.kv_groups.plan import HOST_STAGING_SLOTS, KVCachePlan, checkpoint_slots, plan_kv_cache
from hybridkv.models.config import HybridConfig
from hybridkv.utils import parse_bytes

logger = logging.getLogger("hybridkv.engine")

DEFAULT_MAX_LOGPROBS = 20
"""vLLM's default ``max_logprobs``: the most ``logprobs`` / ``prompt_logprobs`` a request may ask for."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an ``LLM`` loads its model and serves requests (the model itself is not part of it).

    ``device`` "auto" is CUDA when available; ``dtype`` "auto" is the checkpoint's dtype on CUDA and fp32 on
    the CPU. ``kv_cache_memory``: bytes or a size ("4GiB") for the KV cache and Mamba states (None: 80% of
    free GPU memory, or 10% of available RAM up to 4 GiB). ``host_cache_memory``: bytes or a size of host
    memory (pinned, on CUDA) for more prefix-cache checkpoints of recurrent states (Mamba, DeltaNet, ...): the
    device's checkpoint slots move what they evict there, and a hit copies it back (0: none; only with prefix
    caching and recurrent layers; per rank with tensor parallelism, as the KV budget). ``block_size`` None: 16,
    or what every chunked layer's chunk is a multiple of. ``max_model_len`` None: the model's max positions.
    ``max_num_batched_tokens`` None: max(2048, min(max_model_len, 8192)) tokens per step. ``prefill_spread``:
    while requests decode and some request streams, a step's prompt tokens are capped at the pending ones / this
    (at least ``prefill_floor``, and the step rounded up to its CUDA-graph bucket; 1: no cap), so a burst of
    arrivals spreads over several steps instead of stretching the streamed requests' next token
    (``Scheduler._spread``).
    ``tokenizer``: a directory, a tokenizer object (``encode`` / ``decode``), or None for the checkpoint's own.
    ``tensor_parallel_size`` > 1 shards the model (docs/parallelism.md); ``distributed_timeout`` (seconds)
    bounds every collective. ``cuda_graphs``, ``async_scheduling``, ``warmup``: None = on where the device
    allows (CUDA; asynchronous scheduling also needs tensor_parallel_size 1). ``max_logprobs``: the most
    ``logprobs`` / ``prompt_logprobs`` a request may ask (-1: the vocabulary)."""

    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    prefill_spread: int = DEFAULT_PREFILL_SPREAD
    prefill_floor: int = DEFAULT_PREFILL_FLOOR
    kv_cache_memory: int | str | None = None
    host_cache_memory: int | str = 0
    enable_prefix_caching: bool = True
    backend: str | KernelBackend = "auto"             # a registered name, or a backend object built by hand
    seed: int = 0
    tokenizer: str | Path | object | None = None
    tensor_parallel_size: int = 1
    distributed_timeout: float = 600.0
    cuda_graphs: bool | None = None
    async_scheduling: bool | None = None
    warmup: bool | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        tokenizer = self.tokenizer
        if tokenizer is not None and not isinstance(tokenizer, str | Path) and not (
                callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"tokenizer= takes a directory or an object with encode / decode, got "
                            f"{type(tokenizer).__name__}")
        errors = self._errors()
        if errors:
            raise ValueError(f"EngineConfig: {'; '.join(errors)}")

    def _errors(self) -> list[str]:
        errors: list[str] = []

        def positive(name: str, *, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if not _is_int(value) or value <= 0:
                errors.append(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")

        def flag(name: str, *, optional: bool = False) -> None:
            value = getattr(self, name)
            if not (isinstance(value, bool) or (optional and value is None)):
                errors.append(f"{name} must be a bool{' or None' if optional else ''}, got {value!r}")

        for name in ("block_size", "max_model_len", "max_num_batched_tokens"):
            positive(name, optional=True)
        positive("max_num_seqs")
        positive("prefill_spread")
        positive("prefill_floor")
        positive("tensor_parallel_size")
        flag("enable_prefix_caching")
        for name in ("cuda_graphs", "async_scheduling", "warmup"):
            flag(name, optional=True)
        if not _is_int(self.seed):
            errors.append(f"seed must be an int, got {self.seed!r}")
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            errors.append(f"max_logprobs must be -1 (the vocabulary) or >= 0, got {self.max_logprobs!r}")
        timeout = self.distributed_timeout
        if not isinstance(timeout, numbers.Real) or isinstance(timeout, bool) or not math.isfinite(timeout) \
                or timeout <= 0:
            errors.append(f"distributed_timeout must be a positive number of seconds, got {timeout!r}")
        dtype = self.dtype
        if not isinstance(dtype, torch.dtype) and not (
                dtype == "auto" or (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype))):
            errors.append(f"dtype must be 'auto', a torch dtype or its name (bfloat16, float32, ...), got {dtype!r}")
        if not isinstance(self.device, str):
            errors.append(f"device must be a string ('auto', 'cpu', 'cuda', 'cuda:1'), got {self.device!r}")
        elif self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                errors.append(f"device {self.device!r} is not a device (auto, cpu, cuda, cuda:1)")
        known = ("auto", *available_backends())
        if not isinstance(self.backend, KernelBackend) and self.backend not in known:
            errors.append(f"backend must be one of {', '.join(known)}, got {self.backend!r}")
        def byte_size(name: str, example: str, *, positive: bool) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | str):
                errors.append(f"{name} must be bytes (an int) or a size like '{example}'"
                              f"{', or None' if name == 'kv_cache_memory' else ''}, got {value!r}")
                return
            try:
                size = parse_bytes(value)
            except ValueError as err:
                errors.append(f"{name}: {err}")
                return
            if size < 0 or (positive and size == 0):
                errors.append(f"{name} must be {'positive' if positive else '>= 0'}, got {value!r}")

        if self.kv_cache_memory is not None:
            byte_size("kv_cache_memory", "4GiB", positive=True)
        byte_size("host_cache_memory", "32GiB", positive=False)
        return errors

    # -- derived settings ---------------------------------------------------------------------------
    def for_ranks(self) -> EngineConfig:
        """What a spawned tensor-parallel rank is given: the same settings without the tokenizer (rank 0
        alone decodes; a tokenizer object need not pickle)."""
        return dataclasses.replace(self, tokenizer=None)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, config: HybridConfig, device: torch.device) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            # Checkpoint dtype on GPUs; fp32 on the CPU, where bf16 matmuls are slow and less exact.
            return config.torch_dtype if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def kv_budget(self, device: torch.device) -> int:
        """Bytes for the KV cache and Mamba states: ``kv_cache_memory``, or a safe share of what is free (80%
        of free GPU memory, or 10% of available RAM, at most 4 GiB)."""
        if self.kv_cache_memory is not None:
            return parse_bytes(self.kv_cache_memory)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * 0.8)
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(int(available * 0.1), 4 << 30)

    def resolved_block_size(self, config: HybridConfig) -> int:
        return self.block_size if self.block_size is not None else config.default_block_size()

    def resolved_max_model_len(self, config: HybridConfig) -> int:
        return self.max_model_len or config.max_position_embeddings

    def step_tokens(self, max_model_len: int) -> int:
        """Tokens per scheduler step."""
        return self.max_num_batched_tokens or max(2048, min(max_model_len, 8192))

    def plan(self, config: HybridConfig, *, kv_dtype: torch.dtype, budget: int) -> KVCachePlan:
        """The KV-cache plan of ``config`` within ``budget`` bytes (per rank); with Mamba layers and prefix
        caching, its checkpoint slots as ``checkpoint_slots`` sizes them."""
        max_model_len = self.resolved_max_model_len(config)
        specs = config.kv_specs(block_size=self.resolved_block_size(config), kv_dtype=kv_dtype,
                                tensor_parallel_size=self.tensor_parallel_size)
        checkpoints = checkpoint_slots(specs, kv_memory=budget, max_num_seqs=self.max_num_seqs) \
            if self.enable_prefix_caching else 0
        host = parse_bytes(self.host_cache_memory)
        plan = plan_kv_cache(specs, max_model_len=max_model_len, kv_memory=budget, max_num_seqs=self.max_num_seqs,
                             step_tokens=self.step_tokens(max_model_len), num_checkpoint_slots=checkpoints,
                             host_checkpoint_memory=host)
        if host and not plan.num_host_checkpoint_slots:
            if not plan.mamba_groups:
                why = "no recurrent layers"
            elif not self.enable_prefix_caching:
                why = "no prefix caching"
            else:
                why = (f"{plan.num_checkpoint_slots} device checkpoint slots (more than {HOST_STAGING_SLOTS} needed) "
                       f"or a state larger than the host memory")
            logger.warning("host_cache_memory=%s is not used: it holds checkpoints of recurrent states that the "
                           "device's checkpoint slots evict, and this plan has %s", self.host_cache_memory, why)
        return plan
