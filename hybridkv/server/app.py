"""The OpenAI-compatible HTTP app (FastAPI) over an engine client: ``EngineCoreClient`` (the engine in its own
process, as ``hybridkv serve`` runs it) or ``AsyncLLM`` (an in-process engine thread); routes, errors,
authentication.

Routes, as ``vllm serve`` has them: ``POST /v1/completions`` and ``/v1/chat/completions`` (``stream`` as
server-sent events, ``stream_options.include_usage``, ``n``, logprobs, vLLM's extra sampling fields),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /version``, ``POST /tokenize``,
``POST /detokenize``.

Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON,
bad parameters and prompts longer than the model allows, 401 without the API key (every route but
``/health``, ``/metrics`` and ``/version`` when one is set), 404 for an unknown model, 429 with
``Retry-After`` when ``max_waiting`` requests already wait, 503 with ``Retry-After`` once the engine is shutting
down or has failed, 500 for anything else (logged); no request takes the server down. A client that
disconnects aborts its request (streaming: the response task is cancelled; otherwise a task watches for the
disconnect), which frees its blocks and state slots at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv import __version__
from hybridkv.engine.async_llm import AsyncLLM, QueueFullError, RequestStream
from hybridkv.engine.core_client import EngineCoreClient
from hybridkv.engine.engine import RequestError
from hybridkv.engine.front import EngineDeadError
from hybridkv.engine.request import CompletionOutput, RequestOutput, TokenLogprob
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.server import protocol as api
from hybridkv.server.metrics import ServerMetrics, StatsLog, TokenTimer

logger = logging.getLogger("hybridkv.server")

_T = TypeVar("_T")
RETRY_AFTER_SECONDS = 1
_FIELD = re.compile(r"(?:^|; |: )([a-z_]+)(?: keys| values| strings| \(\d+\))? (?:must|has)")
"""The field a ``SamplingParams`` error names."""


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """``served_model_names``: the names ``model`` may take (the first is reported); ``api_key``: required as
    ``Authorization: Bearer KEY`` when set; ``stats_interval``: seconds between stats log lines (0: none)."""

    served_model_names: tuple[str, ...]
    model_root: str
    api_key: str | None = None
    stats_interval: float = 10.0


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type or _ERROR_TYPES.get(status, "BadRequestError")


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
                422: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def _error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    body = api.ErrorResponse(error=api.ErrorInfo(message=message, type=type or _ERROR_TYPES.get(status, "Error"),
                                                 param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def build_app(engine: AsyncLLM | EngineCoreClient, settings: ServerSettings) -> FastAPI:
    """The app serving ``engine`` (which the caller starts and shuts down)."""
    server = _Server(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(server.log_stats()) if settings.stats_interval > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(title="hybridkv", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    auth = [Depends(server.authenticate)]

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError) -> JSONResponse:
        server.metrics.reject(err.status)
        return _error_response(err.status, err.message, type=err.type, param=err.param, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        server.metrics.reject(400)
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            where = ".".join(loc)
            message = f"{where}: {first.get('msg', 'invalid value')}" if where else first.get("msg", "invalid request")
        return _error_response(400, message, param=loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def on_error(request: Request, err: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path, exc_info=err)
        return _error_response(500, f"internal error: {type(err).__name__}: {err}")

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return _error_response(503, engine.dead, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await server.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> api.ModelList:
        return api.ModelList(data=[api.ModelCard(id=name, root=settings.model_root, max_model_len=engine.max_model_len)
                                   for name in settings.served_model_names])

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: api.TokenizeRequest) -> api.TokenizeResponse:
        return await server.tokenize(body)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: api.DetokenizeRequest) -> api.DetokenizeResponse:
        return server.detokenize(body)

    return app


class _Server:
    """The routes' work, over one engine."""

    def __init__(self, engine: AsyncLLM | EngineCoreClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.metrics = ServerMetrics(self.model_name)
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}
        self._snapshot = None

    # -- plumbing ----------------------------------------------------------------------------------
    async def authenticate(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model")

    async def render_metrics(self) -> bytes:
        with contextlib.suppress(asyncio.TimeoutError, EngineDeadError):      # (then the last one read)
            self._snapshot = await asyncio.wait_for(self.engine.snapshot(), timeout=5.0)
        return self.metrics.render(self._snapshot)

    async def log_stats(self) -> None:
        stats = StatsLog()
        while True:
            try:
                line = stats.line(await self.engine.snapshot())
            except EngineDeadError:
                return
            if line is not None:
                logger.info("%s", line)
            await asyncio.sleep(self.settings.stats_interval)

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens kept), for logprobs; ``token_id:N`` without a tokenizer."""
        text = self._token_text.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.engine.decode([token_id], _KEEP_SPECIAL)
            if len(self._token_text) < 1 << 20:
                self._token_text[token_id] = text
        return text

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, the BOS token exactly once. A tokenizer that can work without the GIL does so in a
        worker thread: meanwhile this process's event loop streams its other requests' tokens (tokenizing a
        chat of a few hundred tokens in the loop would delay every stream by that long)."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        try:
            if getattr(self.tokenizer, "releases_gil", False):
                batch = self.tokenizer.encode_batch
                return (await asyncio.to_thread(batch, [text], add_special_tokens=add_special_tokens))[0]
            if add_special_tokens:
                from hybridkv.loaders.tokenizer import encode_prompt

                return encode_prompt(self.tokenizer, text)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as err:
            raise APIError(400, f"could not tokenize the prompt ({type(err).__name__}: {err})",
                           param="prompt") from err

    def render(self, messages: list[dict[str, Any]], *, chat_template: str | None, add_generation_prompt: bool,
               continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
               tools: list[dict[str, Any]] | None) -> str:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with "
                           "token ids", param="messages")
        try:
            return self.engine.render_chat(messages, chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               chat_template_kwargs=chat_template_kwargs, tools=tools)
        except Exception as err:       # jinja's TemplateError (raise_exception), a bad message, ...
            raise APIError(400, f"chat template: {type(err).__name__}: {err}", param="messages") from err

    def sampling_params(self, body: api._Sampling, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must be unset or equal to n (no beam or best-of search)", param="best_of")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs are returned without streaming only", param="prompt_logprobs")
        try:
            return SamplingParams(
                n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=0 if body.top_k is None else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p, seed=body.seed, max_tokens=max_tokens,
                min_tokens=body.min_tokens, stop=body.stop or (), stop_token_ids=body.stop_token_ids or (),
                include_stop_str_in_output=body.include_stop_str_in_output, ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=body.logit_bias or {}, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
                skip_special_tokens=body.skip_special_tokens)
        except ValueError as err:
            found = _FIELD.search(str(err))
            raise APIError(400, str(err).removeprefix("SamplingParams: "),
                           param=found.group(1) if found else None) from err

    def check_length(self, num_prompt: int, max_tokens: int | None, where: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt > limit or (max_tokens is not None and num_prompt + max_tokens > limit):
            asked = num_prompt + (max_tokens or 0)
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{asked} tokens ({num_prompt} in the {where}, {max_tokens or 0} in the completion). "
                                f"Please reduce the length of the {where} or completion.",
                           param="max_tokens" if num_prompt <= limit else where)

    def submit(self, prompts: Sequence[tuple[list[int], str | None]], params: SamplingParams, *, request_id: str,
               stream: bool, where: str) -> list[RequestStream]:
        """One stream per prompt; all or none (a refusal aborts those already submitted)."""
        streams: list[RequestStream] = []
        try:
            for i, (ids, text) in enumerate(prompts):
                prompt = {"prompt_token_ids": ids} | ({"prompt": text} if text is not None else {})
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.submit(prompt, params, request_id=rid, stream=stream))
        except BaseException as err:
            for s in streams:
                s.abort()
            if isinstance(err, RequestError):
                raise APIError(400, str(err), param=where) from err
            if isinstance(err, QueueFullError):
                raise APIError(429, f"the server is overloaded: {err}",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from err
            if isinstance(err, EngineDeadError):
                raise APIError(503, f"the engine is not serving: {err}",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from err
            raise
        return streams

    async def until_disconnect(self, request: Request, work: Awaitable[_T]) -> _T | None:
        """``work``'s result, or None (``work`` cancelled, its requests aborted) if the client disconnects."""
        task = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            gone = not task.done()
            if gone:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return None if gone else task.result()

    # -- /v1/completions ---------------------------------------------------------------------------
    async def completions(self, body: api.CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        _log_ignored(body)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.echo and (body.logprobs is not None or body.stream):
            raise APIError(400, "echo is supported without logprobs and without streaming", param="echo")
        params = self.sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs)
        raw = body.prompt
        items: list[str | list[int]] = [raw] if isinstance(raw, str) else \
            [raw] if raw and isinstance(raw[0], int) else list(raw)     # type: ignore[list-item]
        prompts = []
        for item in items:
            ids = await self.encode(item, add_special_tokens=body.add_special_tokens) if isinstance(item, str) else item
            self.check_length(len(ids), body.max_tokens, "prompt")
            prompts.append((ids, item if isinstance(item, str) else None))
        rid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        streams = self.submit(prompts, params, request_id=rid, stream=body.stream, where="prompt")
        created = int(time.time())
        if body.stream:
            return _sse(self._stream_completions(body, streams, rid, created))
        results = await self.until_disconnect(request, asyncio.gather(*(s.result() for s in streams)))
        if results is None:
            self.metrics.aborted.inc(len(streams))
            return Response(status_code=499)
        choices = []
        for p, (stream, out) in enumerate(zip(streams, results, strict=True)):
            self.metrics.finished(stream)
            _raise_failed(out)
            for c in out.outputs:
                text = c.text or ""
                if body.echo:
                    text = (stream.prompt if stream.prompt is not None else self._decode_prompt(stream)) + text
                choices.append(api.CompletionChoice(
                    index=p * body.n + c.index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=self._completion_logprobs(c.logprobs, 0) if body.logprobs is not None else None,
                    prompt_token_ids=list(stream.prompt_token_ids) if body.return_token_ids else None,
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                    prompt_logprobs=self._prompt_logprobs(out)))
        return _json(api.CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                            usage=_usage(streams)))

    def _prompt_logprobs(self, out: RequestOutput) -> api.PromptLogprobs | None:
        if out.prompt_logprobs is None:
            return None
        entries: api.PromptLogprobs = []
        for lp in out.prompt_logprobs:
            if lp is None:
                entries.append(None)
                continue
            entry = {str(t): {"logprob": v, "decoded_token": self.token_text(t)} for t, v in lp.top}
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "decoded_token": self.token_text(lp.token_id)}
            entries.append(entry)
        return entries

    def _decode_prompt(self, stream: RequestStream) -> str:
        return "" if self.tokenizer is None else self.engine.decode(stream.prompt_token_ids, _KEEP_SPECIAL)

    def _completion_logprobs(self, logprobs: Sequence[TokenLogprob] | None, offset: int) -> api.CompletionLogprobs:
        out = api.CompletionLogprobs()
        for lp in logprobs or ():
            text = self.token_text(lp.token_id)
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    async def _stream_completions(self, body: api.CompletionRequest, streams: list[RequestStream], rid: str,
                                  created: int) -> AsyncIterator[str]:
        options = body.stream_options or api.StreamOptions()
        offsets = [0] * (len(streams) * body.n)
        timers = [TokenTimer(self.metrics.itl) for _ in offsets]
        events = _ChunkEvents(rid, "text_completion", created, self.model_name)
        generated = 0
        async for p, out in _merged(streams, self):
            for c in out.outputs:
                index = p * body.n + c.index
                generated += len(c.token_ids)
                timers[index].tokens(len(c.token_ids))
                if body.logprobs is None and not body.return_token_ids:
                    choice = events.text_choice(index, c.text or "", c.finish_reason, c.stop_reason)
                else:
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self._completion_logprobs(c.logprobs, offsets[index])
                        offsets[index] += sum(len(t) for t in logprobs.tokens)
                    choice = api.CompletionChoice.model_construct(
                        index=index, text=c.text or "", logprobs=logprobs, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason, prompt_token_ids=None,
                        token_ids=list(c.token_ids) if body.return_token_ids else None,
                        prompt_logprobs=None).model_dump_json()
                yield events.event([choice], _running_usage(streams, generated)
                                   if options.continuous_usage_stats else None)
            if out.finished and out.error is not None:
                yield _error_event(out.error)
        if options.include_usage:
            yield events.event([], _usage(streams))
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions ----------------------------------------------------------------------
    async def chat(self, body: api.ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        _log_ignored(body)
        if body.tools and body.tool_choice not in (None, "none"):
            raise APIError(400, "tool calling is not supported (no tool-call parser): send tool_choice \"none\" to "
                                "only show the tools to the chat template", param="tool_choice")
        if body.tools and body.tool_choice is None:
            raise APIError(400, "tools need tool_choice \"none\" (tool calls are not parsed)", param="tool_choice")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format")
        if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling_params(body, max_tokens=max_tokens,
                                      logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        text = self.render(body.messages, chat_template=body.chat_template,
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
        ids = await self.encode(text)                     # the BOS token exactly once (the template may write it)
        self.check_length(len(ids), max_tokens, "messages")
        rid = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        streams = self.submit([(ids, text)], params, request_id=rid, stream=body.stream, where="messages")
        created = int(time.time())
        if body.stream:
            return _sse(self._stream_chat(body, streams[0], rid, created))
        out = await self.until_disconnect(request, streams[0].result())
        if out is None:
            self.metrics.aborted.inc()
            return Response(status_code=499)
        stream = streams[0]
        self.metrics.finished(stream)
        _raise_failed(out)
        choices = [api.ChatChoice(index=c.index, message=api.ChatMessage(role="assistant", content=c.text or ""),
                                  logprobs=self._chat_logprobs(c, body) if body.logprobs else None,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  token_ids=list(c.token_ids) if body.return_token_ids else None)
                   for c in out.outputs]
        return _json(api.ChatCompletionResponse(
            id=rid, created=created, model=self.model_name, choices=choices, usage=_usage(streams),
            prompt_token_ids=list(stream.prompt_token_ids) if body.return_token_ids else None,
            prompt_logprobs=self._prompt_logprobs(out)))

    def _chat_logprobs(self, c: CompletionOutput, body: api.ChatCompletionRequest) -> api.ChatLogprobs:
        k = body.top_logprobs or 0
        entries = []
        for lp in c.logprobs or ():
            text = self.token_text(lp.token_id)
            top = [api.TopLogprob.model_construct(token=(t_text := self.token_text(t)), logprob=v,
                                                  bytes=list(t_text.encode()))
                   for t, v in lp.top[:k]]
            entries.append(api.TokenLogprobEntry.model_construct(token=text, logprob=lp.logprob,
                                                                 bytes=list(text.encode()), top_logprobs=top))
        return api.ChatLogprobs.model_construct(content=entries)

    async def _stream_chat(self, body: api.ChatCompletionRequest, stream: RequestStream, rid: str,
                           created: int) -> AsyncIterator[str]:
        options = body.stream_options or api.StreamOptions()
        timers = [TokenTimer(self.metrics.itl) for _ in range(body.n)]
        events = _ChunkEvents(rid, "chat.completion.chunk", created, self.model_name)
        generated = 0

        def usage() -> api.Usage | None:
            return _running_usage([stream], generated) if options.continuous_usage_stats else None

        for i in range(body.n):
            yield events.event([events.delta_choice(i, "", None, None, role="assistant")], usage())
        async for _, out in _merged([stream], self):
            for c in out.outputs:
                generated += len(c.token_ids)
                timers[c.index].tokens(len(c.token_ids))
                if not body.logprobs and not body.return_token_ids:
                    choice = events.delta_choice(c.index, c.text or "", c.finish_reason, c.stop_reason)
                else:
                    choice = api.ChatStreamChoice.model_construct(
                        index=c.index, delta=api.DeltaMessage.model_construct(role=None, content=c.text or ""),
                        logprobs=self._chat_logprobs(c, body) if body.logprobs else None,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if body.return_token_ids else None).model_dump_json()
                yield events.event([choice], usage())
            if out.finished and out.error is not None:
                yield _error_event(out.error)
        if options.include_usage:
            yield events.event([], _usage([stream]))
        yield "data: [DONE]\n\n"

    # -- /tokenize, /detokenize --------------------------------------------------------------------
    async def tokenize(self, body: api.TokenizeRequest) -> api.TokenizeResponse:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            text = self.render(body.messages, chat_template=body.chat_template,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
            ids = await self.encode(text, add_special_tokens=body.add_special_tokens is not False)
        else:
            assert body.prompt is not None
            ids = await self.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        strs = None
        if body.return_token_strs:
            convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
            strs = list(convert(ids)) if callable(convert) else [self.token_text(t) for t in ids]
        return api.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                    token_strs=strs)

    def detokenize(self, body: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self.check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = self.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:4]}", param="tokens")
        return api.DetokenizeResponse(prompt=self.engine.decode(body.tokens, _KEEP_SPECIAL))


_KEEP_SPECIAL = SamplingParams(skip_special_tokens=False)


async def _merged(streams: list[RequestStream], server: _Server) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of every stream as they come; counts each request that finishes (metrics) and
    aborts what is left however the iteration ends (a client gone cancels it)."""
    done = 0
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                if out.finished:
                    done += 1
                    server.metrics.finished(streams[0])
                yield 0, out
            return
        waiting = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while waiting:
                ready, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in ready:
                    i = waiting.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    if out.finished:
                        done += 1
                        server.metrics.finished(streams[i])
                    yield i, out
                    waiting[asyncio.ensure_future(anext(streams[i]))] = i
        finally:
            for task in waiting:
                task.cancel()
    finally:
        if done < len(streams):
            server.metrics.aborted.inc(len(streams) - done)
        for s in streams:
            s.abort()


def _json(body: Any) -> Response:
    """A response body as pydantic serializes it (a non-finite float, e.g. a -inf logprob, becomes null)."""
    return Response(body.model_dump_json(), media_type="application/json")


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _ChunkEvents:
    """The server-sent events of one streamed response, written as the protocol's chunk models (``ChatCompletionChunk``,
    ``CompletionChunk``) serialize, from strings made once per response: building and serializing pydantic models
    for every token cost more than the rest of the chunk's way out. A choice with logprobs or token ids comes
    serialized by its model."""

    def __init__(self, rid: str, kind: str, created: int, model: str) -> None:
        self._head = f'data: {{"id":{_dumps(rid)},"object":{_dumps(kind)},"created":{created},' \
                     f'"model":{_dumps(model)},"choices":['

    def event(self, choices: list[str], usage: api.Usage | None) -> str:
        tail = "null" if usage is None else usage.model_dump_json()
        return f'{self._head}{",".join(choices)}],"usage":{tail}}}\n\n'

    @staticmethod
    def delta_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None, *,
                     role: str | None = None) -> str:
        """A ``ChatStreamChoice`` without logprobs and token ids."""
        return f'{{"index":{index},"delta":{{"role":{_dumps(role)},"content":{_dumps(text)}}},"logprobs":null,' \
               f'"finish_reason":{_dumps(finish_reason)},"stop_reason":{_dumps(stop_reason)},"token_ids":null}}'

    @staticmethod
    def text_choice(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        """A streamed ``CompletionChoice`` without logprobs and token ids."""
        return f'{{"index":{index},"text":{_dumps(text)},"logprobs":null,"finish_reason":{_dumps(finish_reason)},' \
               f'"stop_reason":{_dumps(stop_reason)},"prompt_token_ids":null,"token_ids":null,"prompt_logprobs":null}}'


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
"""Compact JSON with text kept as UTF-8, as pydantic writes it (for str, int and None)."""


def _error_event(message: str) -> str:
    body = api.ErrorResponse(error=api.ErrorInfo(message=message, type="InternalServerError", code=500))
    return f"data: {body.model_dump_json()}\n\n"


def _usage(streams: Sequence[RequestStream]) -> api.Usage:
    prompt = sum(len(s.prompt_token_ids) for s in streams)
    completion = sum(s.num_output_tokens for s in streams)
    cached = sum(s.num_cached_tokens or 0 for s in streams)
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})


def _running_usage(streams: Sequence[RequestStream], generated: int) -> api.Usage:
    prompt = sum(len(s.prompt_token_ids) for s in streams)
    return api.Usage.model_construct(prompt_tokens=prompt, completion_tokens=generated,
                                     total_tokens=prompt + generated, prompt_tokens_details=None)


def _raise_failed(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(500, f"the request failed: {out.error}")


def _log_ignored(body: api._Request) -> None:
    ignored = body.ignored_fields()
    if ignored:
        logger.warning("the request has fields that are not supported and were ignored: %s", ignored)

