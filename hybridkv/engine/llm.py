"""``LLM``: the Python API users know from vLLM, over hybridkv's engine.

    from hybridkv import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")            # or a HybridConfig (random weights) or a built model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybridkv.engine.distributed import join_group, spawn_group, torchrun_world
from hybridkv.engine.engine import EngineStats, LLMEngine, RequestError
from hybridkv.engine.executor import TensorParallelExecutor, serve
from hybridkv.engine.model_runner import ModelRunner, out_of_memory_message
from hybridkv.engine.request import CompletionOutput, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.kv_groups.plan import KVCachePlan, checkpoint_slots, plan_kv_cache
from hybridkv.layers.parallel import SINGLE, TensorParallel
from hybridkv.loaders.hf_config import load_config
from hybridkv.models.config import HybridConfig
from hybridkv.models.hybrid import CONFIG_NAME, HybridModel, build_model, load_model, shard_model
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


@dataclass(frozen=True)
class _FullWeights:
    """An in-memory model handed to spawned ranks: its config and full tensors (shared memory, not copies)."""

    config: HybridConfig
    state: dict[str, torch.Tensor]
    dtype: torch.dtype


ModelArg = str | Path | HybridConfig | HybridModel


def _checkpoint_config(path: Path) -> tuple[HybridConfig, bool]:
    """(config, is hybridkv-native) of a checkpoint directory."""
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no {CONFIG_NAME})")
    raw = json.loads(config_file.read_text())
    if "hybridkv_config" in raw:
        return HybridConfig.from_dict(raw), True
    return load_config(path), False


def _model_config(model: ModelArg | _FullWeights) -> HybridConfig:
    if isinstance(model, HybridModel | _FullWeights):
        return model.config
    return model if isinstance(model, HybridConfig) else _checkpoint_config(Path(model))[0]


def _full_weights(model: HybridModel) -> _FullWeights:
    if model.tp.size > 1:
        raise ValueError("LLM: pass the unsharded model (or its config / checkpoint), not a tensor-parallel shard")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return _FullWeights(config=model.config, state=state, dtype=next(model.parameters()).dtype)


def _load(model: ModelArg | _FullWeights, device: torch.device, dtype: str | torch.dtype, seed: int,
          tp: TensorParallel = SINGLE, *, with_tokenizer: bool = True) -> tuple[HybridModel, object | None]:
    """This rank's model (the whole model at tensor_parallel_size 1) and the checkpoint's tokenizer."""
    if isinstance(model, HybridModel) and tp.size == 1:
        return model.to(device).eval(), None
    if isinstance(model, HybridModel | _FullWeights):
        full = model if isinstance(model, _FullWeights) else _full_weights(model)
        return shard_model(full.config, full.state, tp=tp, dtype=full.dtype, device=device), None
    if isinstance(model, HybridConfig):
        return build_model(model, dtype=_resolve_dtype(dtype, model, device), device=device, seed=seed, tp=tp), None
    path = Path(model)
    config, native = _checkpoint_config(path)
    if native:
        loaded = load_model(path, dtype=_resolve_dtype(dtype, config, device), device=device, tp=tp)
    else:   # an HF checkpoint: hub weight names, converted by the loaders package
        from hybridkv.loaders.checkpoint import load_hf_checkpoint

        loaded = load_hf_checkpoint(path, dtype=_resolve_dtype(dtype, config, device), device=device, tp=tp)
    if not with_tokenizer:
        return loaded, None
    from hybridkv.loaders.tokenizer import load_tokenizer

    return loaded, load_tokenizer(path)


def _spawned_rank(model: ModelArg | _FullWeights, kwargs: dict[str, object]) -> None:
    """Entry point of a rank spawned by rank 0: the same ``LLM`` construction, which joins the group from
    the environment, serves steps, and exits when rank 0 shuts down."""
    LLM(model, **kwargs)  # type: ignore[arg-type]


class LLM:
    """``tensor_parallel_size`` > 1 shards the model over that many ranks (docs/parallelism.md): rank 0 is
    this process and spawns the others, or, under ``torchrun``, every process constructs the same ``LLM``
    and the constructor does not return on ranks > 0 (they serve steps and exit when rank 0 shuts down).
    ``distributed_timeout`` (seconds) bounds every collective of a step: a dead or stuck rank is an error,
    not a hang. ``cuda_graphs``: replay captured decode steps (None = on when the device and backend allow it).
    ``async_scheduling``: prepare step N+1 on the host while the device runs step N (None = on CUDA without
    tensor parallelism; ``LLMEngine`` says what changes).
    With tensor parallelism ``llm.model`` is rank 0's shard; ``shutdown()`` (or ``with``) stops
    the other ranks (done at exit otherwise)."""

    def __init__(self, model: ModelArg, *, dtype: str | torch.dtype = "auto",
                 device: str = "auto", block_size: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 kv_cache_memory: int | str | None = None, enable_prefix_caching: bool = True,
                 backend: str = "auto", seed: int = 0, tokenizer: object | None = None,
                 tensor_parallel_size: int = 1, distributed_timeout: float = 600.0,
                 cuda_graphs: bool | None = None, async_scheduling: bool | None = None) -> None:
        dev = _resolve_device(device)
        self._executor: TensorParallelExecutor | None = None
        ctx = None
        if tensor_parallel_size != 1:
            _model_config(model).check_tensor_parallel(tensor_parallel_size)   # before starting any process
            if torchrun_world() is not None:
                ctx = join_group(tensor_parallel_size, dev, distributed_timeout)
            else:
                kwargs = dict(dtype=dtype, device=device, block_size=block_size, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                              backend=backend, seed=seed, tensor_parallel_size=tensor_parallel_size,
                              distributed_timeout=distributed_timeout)
                source = _full_weights(model) if isinstance(model, HybridModel) else model
                ctx = spawn_group(tensor_parallel_size, dev, distributed_timeout, _spawned_rank, (source, kwargs))
            dev = ctx.device

        def load() -> tuple[HybridModel, object | None]:
            return _load(model, dev, dtype, seed, ctx.tp if ctx else SINGLE,
                         with_tokenizer=ctx is None or ctx.is_driver)

        try:
            self.model, found_tokenizer = ctx.run_everywhere("loading the model", load) if ctx else load()
        except torch.OutOfMemoryError as e:
            raise MemoryError(out_of_memory_message("the model weights", None, dev)) from e
        self.tokenizer = tokenizer or found_tokenizer
        config = self.model.config
        if block_size is None:        # 16, or what every chunked layer's chunk is a multiple of (logged)
            block_size = config.default_block_size()
            logger.info("KV block size %d", block_size)
        max_model_len = max_model_len or config.max_position_embeddings
        step_tokens = max_num_batched_tokens or max(2048, min(max_model_len, 8192))
        budget = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else _default_kv_memory(dev)
        if ctx is not None:
            budget = ctx.min_over_ranks(budget)          # every rank plans the same pools

        def make_plan() -> KVCachePlan | None:
            if ctx is not None and not ctx.is_driver:
                return None                               # rank 0's plan is shared below
            specs = config.kv_specs(block_size=block_size, kv_dtype=next(self.model.parameters()).dtype,
                                    tensor_parallel_size=tensor_parallel_size)
            checkpoints = checkpoint_slots(specs, kv_memory=budget, max_num_seqs=max_num_seqs) \
                if enable_prefix_caching else 0
            return plan_kv_cache(
                specs, max_model_len=max_model_len, kv_memory=budget, max_num_seqs=max_num_seqs,
                step_tokens=step_tokens, num_checkpoint_slots=checkpoints)

        runner = None
        if ctx is None:
            self.plan: KVCachePlan = make_plan()
        else:
            self.plan = ctx.share(ctx.run_everywhere("planning the KV cache", make_plan))
            local = ctx.run_everywhere("allocating the KV cache",
                                       lambda: ModelRunner(self.model, self.plan, backend=backend))
            if not ctx.is_driver:
                serve(local, ctx)
                raise SystemExit(0)
            runner = self._executor = TensorParallelExecutor(local, ctx)
            weakref.finalize(self, runner.shutdown)
        per_rank = f" per rank, {tensor_parallel_size} ranks" if tensor_parallel_size > 1 else ""
        logger.info("KV cache plan: %s (budget %s%s)", self.plan.summary(), format_bytes(budget), per_rank)
        self.engine = LLMEngine(self.model, self.plan, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=step_tokens, enable_prefix_caching=enable_prefix_caching,
                                backend=backend, tokenizer=self.tokenizer, seed=seed, runner=runner,
                                cuda_graphs=cuda_graphs, async_scheduling=async_scheduling)
        self._next_id = 0

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (a no-op without them)."""
        if self._executor is not None:
            self._executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

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
        generated = 0
        with tqdm(total=len(num_samples), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step(only_finished=True):
                    rid, i = out.request_id.rsplit(".", 1)
                    samples[rid][int(i)] = out
                    generated += len(out.outputs[0].token_ids)
                    if len(samples[rid]) == num_samples[rid]:
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s", refresh=False)
        elapsed = time.perf_counter() - start
        logger.info("generated %d tokens in %.2fs (%.1f tok/s)", generated, elapsed, generated / max(elapsed, 1e-9))
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
