"""``LLM``: the Python API users know from vLLM, over hybridkv's engine.

    from hybridkv import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")            # or a HybridConfig (random weights) or a built model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=32))

Prompts are text, token ids, or vLLM's prompt dicts (``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}``).
Every call owns its requests: whatever way it ends (return, exception, ``KeyboardInterrupt``, a stream closed
or dropped early), what it left unfinished is aborted and freed; calls may interleave (a paused stream keeps
its outputs queued while ``generate`` runs) and run on several threads at once (``engine/front.py``: a lone
call steps the engine in its own thread, as fast as without the front; concurrent calls share the steps).
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.distributed import join_group, spawn_group, torchrun_world
from hybridkv.engine.engine import EngineStats, LLMEngine, RequestError
from hybridkv.engine.executor import TensorParallelExecutor, serve
from hybridkv.engine.front import EngineFront, Submission
from hybridkv.engine.model_runner import ModelRunner, out_of_memory_message
from hybridkv.engine.request import OutputKind, RequestMetrics, RequestOutput
from hybridkv.engine.sampling_params import SamplingParams, sample_seed
from hybridkv.engine.warmup import warm_up
from hybridkv.kv_groups.plan import KVCachePlan
from hybridkv.layers.parallel import SINGLE, TensorParallel
from hybridkv.loaders.hf_config import load_config, read_config_json
from hybridkv.models.config import HybridConfig
from hybridkv.models.hybrid import CONFIG_NAME, HybridModel, build_model, load_model, shard_model
from hybridkv.utils import format_bytes

logger = logging.getLogger("hybridkv")

Prompt = str | Sequence[int] | Mapping[str, Any]
"""Text, token ids, or a vLLM prompt dict: ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (both: the ids
are used, the text is reported)."""
Params = SamplingParams | Sequence[SamplingParams] | None


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
    return load_config(config_file), "hybridkv_config" in read_config_json(config_file)


def _model_config(model: ModelArg | _FullWeights) -> HybridConfig:
    if isinstance(model, HybridModel | _FullWeights):
        return model.config
    return model if isinstance(model, HybridConfig) else _checkpoint_config(Path(model))[0]


def _full_weights(model: HybridModel) -> _FullWeights:
    if model.tp.size > 1:
        raise ValueError("LLM: pass the unsharded model (or its config / checkpoint), not a tensor-parallel shard")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return _FullWeights(config=model.config, state=state, dtype=next(model.parameters()).dtype)


def _load(model: ModelArg | _FullWeights, device: torch.device, config: EngineConfig, tp: TensorParallel = SINGLE,
          *, with_tokenizer: bool = True) -> tuple[HybridModel, object | None]:
    """This rank's model (the whole model at tensor_parallel_size 1) and the checkpoint's tokenizer."""
    if isinstance(model, HybridModel) and tp.size == 1:
        return model.to(device).eval(), None
    if isinstance(model, HybridModel | _FullWeights):
        full = model if isinstance(model, _FullWeights) else _full_weights(model)
        return shard_model(full.config, full.state, tp=tp, dtype=full.dtype, device=device), None
    if isinstance(model, HybridConfig):
        return build_model(model, dtype=config.resolved_dtype(model, device), device=device, seed=config.seed,
                           tp=tp), None
    path = Path(model)
    model_config, native = _checkpoint_config(path)
    dtype = config.resolved_dtype(model_config, device)
    if native:
        loaded = load_model(path, dtype=dtype, device=device, tp=tp)
    else:   # an HF checkpoint: hub weight names, converted by the loaders package
        from hybridkv.loaders.checkpoint import load_hf_checkpoint

        loaded = load_hf_checkpoint(path, dtype=dtype, device=device, tp=tp)
    if not with_tokenizer:
        return loaded, None
    from hybridkv.loaders.tokenizer import load_tokenizer

    return loaded, load_tokenizer(path)


def _spawned_rank(model: ModelArg | _FullWeights, config: EngineConfig) -> None:
    """Entry point of a rank spawned by rank 0: the same ``LLM`` construction, which joins the group from
    the environment, serves steps, and exits when rank 0 shuts down."""
    LLM(model, config=config)


class LLM:
    """``LLM(model, **settings)`` or ``LLM(model, config=EngineConfig(...))`` (settings given with a config
    replace its fields): every setting, its default and its check are ``EngineConfig``'s.

    ``tensor_parallel_size`` > 1 shards the model over that many ranks (docs/parallelism.md): rank 0 is
    this process and spawns the others, or, under ``torchrun``, every process constructs the same ``LLM``
    and the constructor does not return on ranks > 0 (they serve steps and exit when rank 0 shuts down).
    With tensor parallelism ``llm.model`` is rank 0's shard; ``shutdown()`` (or ``with``) stops the other ranks
    (done at exit otherwise).

    Thread-safe: calls from several threads share the engine's steps (``EngineFront``); each gets its own
    outputs. ``AsyncLLM(llm)`` serves the same engine to coroutines."""

    def __init__(self, model: ModelArg, *, config: EngineConfig | None = None, **settings: Any) -> None:
        if config is None:
            config = EngineConfig(**settings)
        elif settings:
            config = replace(config, **settings)
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        dev = config.resolved_device()
        given_tokenizer = _resolve_tokenizer(config.tokenizer) if config.tokenizer is not None else None
        self._executor: TensorParallelExecutor | None = None
        ctx = None
        tp_size = config.tensor_parallel_size
        if tp_size != 1:
            _model_config(model).check_tensor_parallel(tp_size)   # before starting any process
            if torchrun_world() is not None:
                ctx = join_group(tp_size, dev, config.distributed_timeout)
            else:
                source = _full_weights(model) if isinstance(model, HybridModel) else model
                ctx = spawn_group(tp_size, dev, config.distributed_timeout, _spawned_rank,
                                  (source, config.for_ranks()))
            dev = ctx.device

        def load() -> tuple[HybridModel, object | None]:
            return _load(model, dev, config, ctx.tp if ctx else SINGLE, with_tokenizer=ctx is None or ctx.is_driver)

        try:
            self.model, found_tokenizer = ctx.run_everywhere("loading the model", load) if ctx else load()
        except torch.OutOfMemoryError as e:
            raise MemoryError(out_of_memory_message("the model weights", None, dev)) from e
        self.tokenizer = given_tokenizer if given_tokenizer is not None else found_tokenizer
        model_config = self.model.config
        if config.block_size is None:        # 16, or what every chunked layer's chunk is a multiple of (logged)
            logger.info("KV block size %d", config.resolved_block_size(model_config))
        budget = config.kv_budget(dev)
        if ctx is not None:
            budget = ctx.min_over_ranks(budget)          # every rank plans the same pools
        kv_dtype = next(self.model.parameters()).dtype

        def make_plan() -> KVCachePlan | None:
            if ctx is not None and not ctx.is_driver:
                return None                               # rank 0's plan is shared below
            return config.plan(model_config, kv_dtype=kv_dtype, budget=budget)

        runner = None
        if ctx is None:
            self.plan: KVCachePlan = make_plan()
        else:
            self.plan = ctx.share(ctx.run_everywhere("planning the KV cache", make_plan))
            local = ctx.run_everywhere("allocating the KV cache",
                                       lambda: ModelRunner(self.model, self.plan, backend=config.backend))
            if not ctx.is_driver:
                serve(local, ctx)
                raise SystemExit(0)
            runner = self._executor = TensorParallelExecutor(local, ctx)
            weakref.finalize(self, runner.shutdown)
        per_rank = f" per rank, {tp_size} ranks" if tp_size > 1 else ""
        logger.info("KV cache plan: %s (budget %s%s)", self.plan.summary(), format_bytes(budget), per_rank)
        self.engine = LLMEngine(self.model, self.plan, max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.step_tokens(self.plan.max_model_len),
                                prefill_spread=config.prefill_spread, prefill_floor=config.prefill_floor,
                                enable_prefix_caching=config.enable_prefix_caching, backend=config.backend,
                                tokenizer=self.tokenizer, seed=config.seed, runner=runner,
                                cuda_graphs=config.cuda_graphs, async_scheduling=config.async_scheduling,
                                max_logprobs=config.max_logprobs)
        if config.warmup or (config.warmup is None and dev.type == "cuda"):
            warm_up(self.engine)
        self.front = EngineFront(self.engine)
        self._ids = itertools.count()             # prompt ids (next() on a count is atomic)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (a no-op without them)."""
        if self._executor is not None:
            self._executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> object | None:
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    # -- prompts ------------------------------------------------------------------------------------
    def parse_prompt(self, item: object) -> ParsedPrompt:
        """One prompt of a call: its token ids (checked by the engine) and text, or why it is not one."""
        return parse_prompt(item, self.tokenizer)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """One conversation as the prompt text its chat template makes (``chat`` says which template)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none (pass tokenizer=)")
        from hybridkv.loaders.tokenizer import render_chat

        return render_chat(self.tokenizer, messages, chat_template=chat_template,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           tools=tools, **dict(chat_template_kwargs or {}))

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[object]:
        """A single prompt (text, a dict, or token ids: a sequence whose first item is an int) or a list."""
        if isinstance(prompts, str | Mapping):
            return [prompts]
        if isinstance(prompts, np.ndarray):
            return [prompts] if prompts.ndim == 1 else list(prompts)
        items = list(prompts)
        return [prompts] if items and isinstance(items[0], numbers.Integral) else items

    def _submit(self, prompts: list[ParsedPrompt], params: Params, *, stream: bool) -> _Call:
        """Submit every (prompt, sample) as an engine request owned by a new call; a prompt that cannot be
        served becomes an error output at once. Nothing stays submitted if this raises."""
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        call = _Call(stream=stream)
        kind = OutputKind.CUMULATIVE if stream else OutputKind.FINAL
        submissions: list[Submission] = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = str(next(self._ids))
            call.ids.append(rid)
            try:
                subs = sample_submissions(self.front.validate, rid, prompt, p, kind)
            except RequestError as err:
                call.errors[rid] = _error_output(rid, prompt, str(err))
                continue
            call.num_samples[rid] = len(subs)
            submissions += subs
        call.live.update(s.request_id for s in submissions)
        if submissions:
            self.front.submit(submissions, call)
        return call

    def _wait(self, call: _Call) -> None:
        """Until ``call`` has outputs to read or nothing left to wait for (this thread may drive the engine)."""
        self.front.drive(lambda: bool(call.outputs) or not call.live)

    def _release(self, call: _Call) -> None:
        """Abort what ``call`` left unfinished (its blocks, slots and rows come back)."""
        live, call.live = sorted(call.live), set()
        self.front.abort(live)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. A prompt that cannot be served, or a request
        that fails while running, gets an output with ``error`` set; the others run normally."""
        return self._run([self.parse_prompt(p) for p in self._as_list(prompts)], sampling_params, use_tqdm)

    def _run(self, prompts: list[ParsedPrompt], sampling_params: Params, use_tqdm: bool) -> list[RequestOutput]:
        call = self._submit(prompts, sampling_params, stream=False)
        samples: dict[str, dict[int, RequestOutput]] = {rid: {} for rid in call.num_samples}
        start = time.perf_counter()
        generated = 0
        try:
            with tqdm(total=len(call.num_samples), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while call.live or call.outputs:
                    if not call.outputs:
                        self._wait(call)
                    while call.outputs:
                        out = call.outputs.popleft()
                        rid, i = out.request_id.rsplit(".", 1)
                        samples[rid][int(i)] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        if len(samples[rid]) == call.num_samples[rid]:
                            bar.update(1)
                            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s",
                                                refresh=False)
        finally:
            self._release(call)
        elapsed = time.perf_counter() - start
        logger.info("generated %d tokens in %.2fs (%.1f tok/s)", generated, elapsed, generated / max(elapsed, 1e-9))
        return [call.errors[rid] if rid in call.errors else merge_samples(rid, samples[rid]) for rid in call.ids]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None
                        ) -> Iterator[RequestOutput]:
        """Yield each request's output after every step it advances (``finished`` marks the last); request
        ids are "<call-unique prompt id>.<sample index>" (a rejected prompt's error output: the prompt id).
        Closing the generator (``break`` then dropping it, ``close()``, an exception) aborts what is left."""
        call = self._submit([self.parse_prompt(p) for p in self._as_list(prompts)], sampling_params, stream=True)
        try:
            yield from call.errors.values()
            while call.live or call.outputs:
                if not call.outputs:
                    self._wait(call)
                while call.outputs:
                    yield call.outputs.popleft()
        finally:
            self._release(call)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: Params = None, use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or to a list of
        them: each rendered with ``chat_template`` (a Jinja source) or the checkpoint's template (from
        tokenizer_config.json / chat_template.jinja, rendered as transformers does), then encoded with the
        BOS token exactly once. A conversation the template refuses gets an output with ``error`` set."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer; this model has none (pass tokenizer=)")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conversation in conversations:
            try:
                text = self.render_chat(conversation, chat_template=chat_template,  # type: ignore[arg-type]
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        chat_template_kwargs=chat_template_kwargs, tools=tools)
            except Exception as err:        # jinja's TemplateError (raise_exception), a bad message, ...
                prompts.append(ParsedPrompt(error=f"chat template: {type(err).__name__}: {err}"))
                continue
            prompts.append(self.parse_prompt(text))
        return self._run(prompts, sampling_params, use_tqdm)

    def stats(self) -> EngineStats:
        return self.engine.stats()


@dataclass(frozen=True, kw_only=True)
class ParsedPrompt:
    """A prompt as given to a call: its token ids as given (the engine checks them) and text, or its error."""

    token_ids: object = None
    text: str | None = None
    error: str | None = None


def parse_prompt(item: object, tokenizer: object | None) -> ParsedPrompt:
    """One prompt (text, token ids or a prompt dict): its token ids (unchecked) and text, text encoded with
    ``tokenizer``; or why it is not one."""
    try:
        if isinstance(item, str):
            return ParsedPrompt(token_ids=_encode(tokenizer, item), text=item)
        if isinstance(item, Mapping):
            unknown = sorted(map(str, set(item) - {"prompt", "prompt_token_ids"}))
            if unknown:
                raise RequestError(f"unsupported prompt keys {unknown} (known: 'prompt', 'prompt_token_ids')")
            text = item.get("prompt")
            if text is not None and not isinstance(text, str):
                raise RequestError(f"'prompt' must be a string, got {type(text).__name__}")
            if "prompt_token_ids" in item:
                return ParsedPrompt(token_ids=item["prompt_token_ids"], text=text)
            if text is None:
                raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            return ParsedPrompt(token_ids=_encode(tokenizer, text), text=text)
        if isinstance(item, Sequence | np.ndarray) and not isinstance(item, bytes):
            return ParsedPrompt(token_ids=item, text=None)
        raise RequestError(f"a prompt is a string, a list of token ids or a prompt dict, got "
                           f"{type(item).__name__}")
    except RequestError as err:
        return ParsedPrompt(error=str(err), text=item if isinstance(item, str) else None)
    except Exception as err:       # the tokenizer failed on this text: this prompt's error, not the call's
        return ParsedPrompt(error=f"could not encode the prompt ({type(err).__name__}: {err})",
                            text=item if isinstance(item, str) else None)


def _encode(tokenizer: object | None, text: str) -> list[int]:
    if tokenizer is None:
        raise RequestError("a text prompt needs a tokenizer; this model has none (pass token ids)")
    from hybridkv.loaders.tokenizer import encode_prompt

    return encode_prompt(tokenizer, text)


def sample_submissions(validate: Callable[[Sequence[int], SamplingParams], None], rid: str, prompt: ParsedPrompt,
                       params: object, kind: OutputKind) -> list[Submission]:
    """The engine requests "<rid>.<i>" of ``prompt``'s ``n`` samples, each checked by ``validate``
    (``RequestError``)."""
    if prompt.error is not None:
        raise RequestError(prompt.error)
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    validate(prompt.token_ids, _nth_sample(params, 0))      # (the samples differ in their seeds only)
    return [Submission(request_id=f"{rid}.{i}", token_ids=prompt.token_ids, params=_nth_sample(params, i),
                       prompt=prompt.text, output_kind=kind) for i in range(params.n)]


@dataclass(eq=False)
class _Call:
    """One ``generate`` / ``generate_stream`` / ``chat`` call: its prompt ids, the engine requests it still
    waits for, and the outputs routed to it (a ``Sink`` of the engine front)."""

    stream: bool
    ids: list[str] = field(default_factory=list)
    num_samples: dict[str, int] = field(default_factory=dict)
    errors: dict[str, RequestOutput] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    outputs: deque[RequestOutput] = field(default_factory=deque)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
            self.outputs.append(out)


def _resolve_tokenizer(tokenizer: str | Path | object) -> object:
    if not isinstance(tokenizer, str | Path):
        if not callable(getattr(tokenizer, "encode", None)) or not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer= takes a directory or an object with encode / decode, got "
                            f"{type(tokenizer).__name__}")
        return tokenizer
    from hybridkv.loaders.tokenizer import load_tokenizer

    loaded = load_tokenizer(tokenizer)
    if loaded is None:
        raise FileNotFoundError(f"{tokenizer}: no tokenizer files (tokenizer.json, tekken.json, tokenizer.model*)")
    return loaded


def _error_output(rid: str, prompt: ParsedPrompt, error: str) -> RequestOutput:
    ids = prompt.token_ids
    valid = isinstance(ids, Sequence | np.ndarray) and not isinstance(ids, str | bytes) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)
    return RequestOutput(request_id=rid, prompt=prompt.text, prompt_token_ids=tuple(int(t) for t in ids) if valid
                         else (), outputs=(), finished=True, error=error)


def _nth_sample(p: SamplingParams, i: int) -> SamplingParams:
    """The i-th of ``n`` samples: one sequence, its seed derived from ``(seed, i)`` (``sample_seed``)."""
    if p.n == 1:
        return p
    return replace(p, n=1, seed=None if p.seed is None else sample_seed(p.seed, i))


def merge_samples(rid: str, samples: dict[int, RequestOutput]) -> RequestOutput:
    """A prompt's samples as one output: the first error of any, metrics from the first arrival to the last
    finish, the prefix-cache hit of the sample that reused most."""
    first = samples[0]
    ordered = [o for _, o in sorted(samples.items())]
    outputs = tuple(replace(o.outputs[0], index=i) for i, o in enumerate(ordered))
    errors = [f"sample {i}: {o.error}" if len(ordered) > 1 else o.error
              for i, o in enumerate(ordered) if o.error is not None]
    metrics = [o.metrics for o in ordered if o.metrics is not None]

    def earliest(name: str) -> float | None:
        values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
        return min(values) if values else None

    def latest(name: str) -> float | None:
        values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
        return max(values) if values else None

    merged = RequestMetrics(arrival_time=min(m.arrival_time for m in metrics), first_scheduled_time=earliest(
        "first_scheduled_time"), first_token_time=earliest("first_token_time"), last_token_time=latest(
        "last_token_time"), finished_time=latest("finished_time")) if metrics else None
    cached = [o.num_cached_tokens for o in ordered if o.num_cached_tokens is not None]
    return RequestOutput(request_id=rid, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                         outputs=outputs, finished=True, prompt_logprobs=first.prompt_logprobs,
                         error=errors[0] if errors else None, metrics=merged,
                         num_cached_tokens=max(cached) if cached else None)
