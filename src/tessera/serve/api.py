"""The OpenAI-compatible HTTP API over a running engine (FastAPI).

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text). Each request's engine events (called on the engine
thread) are handed to the event loop with ``call_soon_threadsafe`` into an asyncio queue of its own.
Errors are OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
request (malformed JSON and schema errors included), 401 for a missing or wrong API key, 404 for a
model this server does not serve. A client that goes away (a stream closed early, or a non-streamed
request whose connection drops) has its request cancelled, which frees its slot before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.serve.engine import Engine, Generation, GenerationParams, Histogram, RequestError

RATE_WINDOW_S = 60.0  # tokens/s is measured over (about) the last minute of scrapes
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


# --------------------------------------------------------------------------------------------------------
# Request bodies (unknown fields are accepted and ignored, as clients send many optional ones)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None  # OpenAI's default is 1 (sampling); 0 is greedy
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    logprobs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None


# --------------------------------------------------------------------------------------------------------
# Engine events -> asyncio


class _Events:
    """One request's engine events, delivered to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def sink(self, kind: str, payload: Any) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


class _Served:
    """What a completions or chat request became: the engine's generation and its event queue."""

    def __init__(self, gen: Generation, events: _Events, prompt_tokens: int):
        self.gen, self.events, self.prompt_tokens = gen, events, prompt_tokens
        self.finished = False

    def usage(self) -> dict[str, int]:
        done = len(self.gen.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}


# --------------------------------------------------------------------------------------------------------


class _Metrics:
    """Prometheus text built from the engine's counters at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.start = time.monotonic()
        self.samples: deque[tuple[float, int]] = deque([(self.start, 0)])

    def tokens_per_second(self, now: float, tokens: int) -> float:
        while len(self.samples) > 1 and self.samples[1][0] <= now - RATE_WINDOW_S:
            self.samples.popleft()
        t0, n0 = self.samples[0]
        self.samples.append((now, tokens))
        return (tokens - n0) / (now - t0) if now > t0 else 0.0

    def render(self) -> str:
        e = self.engine
        stats = e.stats
        tokens = stats.tokens
        queued, in_flight = e.queue_depth()
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, values: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {_num(v)}" for labels, v in values)

        metric("tessera_generated_tokens_total", "counter", "Tokens generated.", [("", tokens)])
        metric("tessera_completed_requests_total", "counter", "Requests that finished (stop or length).",
               [("", stats.completed)])
        metric("tessera_engine_steps_total", "counter", "Engine steps run.", [("", stats.steps)])
        metric("tessera_tokens_per_second", "gauge", "Tokens generated per second over the last minute of "
               "scrapes (since the server started on the first scrape).",
               [("", self.tokens_per_second(time.monotonic(), tokens))])
        _histogram(lines, "tessera_ttft_seconds", "Time to first token of each request.", stats.ttft)
        _histogram(lines, "tessera_tpot_seconds", "Time per output token after the first, per request.", stats.tpot)
        metric("tessera_queue_depth", "gauge", "Requests waiting for a slot, and in flight.",
               [('{state="queued"}', queued), ('{state="in_flight"}', in_flight)])
        metric("tessera_active_plan", "gauge", "The objective whose step plans the engine runs (1 = active).",
               [(f'{{objective="{o}"}}', 1 if e.objective == o else 0) for o in ("latency", "throughput")])
        metric("tessera_plan_switches_total", "counter", "Plan switches made by the online monitor.",
               [("", e.monitor.switch_count)])
        metric("tessera_step_seconds_total", "counter", "Seconds spent running steps, per objective.",
               [(f'{{objective="{o}"}}', s) for o, s in sorted(dict(stats.step_s).items())])
        metric("tessera_device_busy_seconds_total", "counter", "Seconds each device spent computing kernels.",
               [(f'{{device="{_label(d)}"}}', s) for d, s in sorted(e.backend.busy_s().items())])
        metric("tessera_engine_up", "gauge", "1 while the engine thread runs.", [("", 0 if e.error else 1)])
        return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_: str, hist: Histogram) -> None:
    """A Prometheus histogram (cumulative buckets, sum, count) of ``hist`` as it is now."""
    counts, total_s = list(hist.counts), hist.sum  # the engine thread may add to it meanwhile
    lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
    total = 0
    for b, c in zip((*hist.bounds, math.inf), counts, strict=True):
        total += c
        lines.append(f'{name}_bucket{{le="{_num(b)}"}} {total}')
    lines += [f"{name}_sum {_num(total_s)}", f"{name}_count {total}"]


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _label(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _APIKey:
    """ASGI middleware: every /v1 request needs ``Authorization: Bearer <key>`` (a pure ASGI layer, so
    streamed responses and client disconnects pass through untouched)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                message = ("no API key given: send the header 'Authorization: Bearer <key>'" if not given
                           else "incorrect API key provided")
                response = error_response(401, message, "invalid_request_error", None, "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------------------


def create_app(engine: Engine, model_id: str, api_key: str | None = None) -> FastAPI:
    """The HTTP app serving ``engine`` as model ``model_id``; with ``api_key``, every /v1 request needs
    ``Authorization: Bearer <api_key>``."""
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    metrics = _Metrics(engine)
    tokenizer = engine.tokenizer
    vocab = len(tokenizer)

    # ---- errors as OpenAI error objects -------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON "
                                  f"({first.get('ctx', {}).get('error', 'decode error')})")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        parts = []
        for err in errors[:3]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return error_response(400, "invalid request: " + "; ".join(parts), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_)

    if api_key is not None:
        app.add_middleware(_APIKey, key=api_key)

    # ---- helpers ------------------------------------------------------------------------------------
    def check_model(model: str) -> None:
        if model != model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_id!r}",
                           param="model", code="model_not_found")

    def check_common(body: _Sampling) -> None:
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (got {body.n}): one choice per request", param="n")
        if body.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")

    def params(body: _Sampling, max_tokens: int) -> GenerationParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 <= temperature < math.inf:
            raise APIError(400, f"temperature must be 0 (greedy) or more (got {temperature})", param="temperature")
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
        if body.seed is not None and not -(2**63) <= body.seed < 2**64:
            raise APIError(400, f"seed must fit in 64 bits (got {body.seed})", param="seed")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = body.seed
        if seed is None and temperature > 0:
            seed = secrets.randbelow(2**31)
        return GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop=tuple(s for s in stop if s))

    def check_length(prompt_ids: list[int], max_tokens: int, what: str) -> None:
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})", param="max_tokens")
        if len(prompt_ids) + max_tokens > engine.max_context:
            raise APIError(400, f"this model's context is {engine.max_context} tokens; the {what} has "
                                f"{len(prompt_ids)} tokens and max_tokens is {max_tokens}: shorten the {what} or "
                                "lower max_tokens", param=what, code="context_length_exceeded")

    def submit(prompt_ids: list[int], gp: GenerationParams) -> _Served:
        if engine.error is not None:
            raise APIError(503, f"the engine has stopped ({engine.error}); restart the server", "server_error")
        events = _Events(asyncio.get_running_loop())
        try:
            gen = engine.submit(prompt_ids, gp, events.sink)
        except RequestError as e:
            raise APIError(400, str(e)) from None
        return _Served(gen, events, len(prompt_ids))

    def failure(message: str) -> APIError:
        if engine.error is not None:
            return APIError(500, message, "server_error")
        return APIError(400, message)

    async def collect(served: _Served, request: Request) -> tuple[str, str] | None:
        """The whole text and finish reason of a non-streamed request; None (and the request cancelled)
        when its client went away."""
        text: list[str] = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(served.events.queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    kind, payload = "", None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return None
                if kind == "token":
                    text.append(payload)
                elif kind == "done":
                    served.finished = True
                    return "".join(text), payload
                elif kind == "error":
                    served.finished = True
                    raise failure(str(payload))
        finally:
            if not served.finished:
                engine.cancel(served.gen)

    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def stream(served: _Served, chunk, include_usage: bool, first: dict[str, Any] | None
                     ) -> AsyncIterator[str]:
        """SSE chunks: ``chunk(delta_text, finish_reason)`` builds each; an error becomes an error event."""
        try:
            if first is not None:
                yield sse(first)
            while True:
                kind, payload = await served.events.queue.get()
                if kind == "token":
                    yield sse(chunk(payload, None))
                elif kind == "done":
                    served.finished = True
                    yield sse(chunk(None, payload))
                    break
                else:
                    served.finished = True
                    err = failure(str(payload))
                    yield sse({"error": {"message": err.message, "type": err.type, "param": None, "code": None}})
                    break
            if include_usage:
                final = chunk(None, None)
                final["choices"] = []
                final["usage"] = served.usage()
                yield sse(final)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is cancelled or closed): free the slot
            if not served.finished:
                engine.cancel(served.gen)

    def stream_response(served: _Served, body: AsyncIterator[str]) -> StreamingResponse:
        async def settle() -> None:  # a client gone before the stream started never ran its generator
            if not served.finished:
                engine.cancel(served.gen)

        return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(settle),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- endpoints ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": f"{type(engine.error).__name__}: {engine.error}"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "tessera",
                "max_model_len": engine.max_context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported: the response holds the completion only", param="echo")
        if body.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1 (got {body.best_of})", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request (got a list of {len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer(prompt).input_ids
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        check_length(prompt_ids, max_tokens, "prompt")
        served = submit(prompt_ids, params(body, max_tokens))
        rid = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_id,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return stream_response(served, stream(served, chunk, include, None))
        result = await collect(served, request)
        if result is None:
            return Response(status_code=499)  # nobody is listening
        text, finish = result
        out = chunk(text, finish)
        out["usage"] = served.usage()
        return JSONResponse(out)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        check_common(body)
        if body.top_logprobs:
            raise APIError(400, "logprobs are not supported", param="top_logprobs")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}]: only text content parts are supported (got "
                                            f"{part.get('type')!r})", param=f"messages.{i}.content")
                    texts.append(part["text"])
                content = "".join(texts)
            messages.append({"role": m.role, "content": content or ""})
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, f"{model_id} has no chat template: use /v1/completions", param="messages")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's own message says what is wrong
            raise APIError(400, f"the chat template rejects these messages: {e}", param="messages") from None
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        elif body.max_tokens is not None:
            max_tokens = body.max_tokens
        else:
            max_tokens = max(1, engine.max_context - len(prompt_ids))
        check_length(prompt_ids, max_tokens, "messages")
        served = submit(prompt_ids, params(body, max_tokens))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            delta = {} if text is None else {"content": text}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            first = chunk(None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            return stream_response(served, stream(served, chunk, include, first))
        result = await collect(served, request)
        if result is None:
            return Response(status_code=499)
        text, finish = result
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": model_id,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "logprobs": None, "finish_reason": finish}],
                             "usage": served.usage()})

    return app


__all__ = ["APIError", "create_app"]
