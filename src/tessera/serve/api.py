"""The OpenAI-compatible HTTP API over a running engine (FastAPI): the routes, the errors, the API key.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text, from ``serve.metrics``). What a request means is
``serve.serving.OpenAIServing``'s business; this module maps HTTP onto it. Errors are OpenAI error
objects (``serve.protocol.APIError``): 400 for a bad request (malformed JSON and schema errors included),
401 for a missing or wrong API key, 404 for a model this server does not serve or an unknown path, 413 for
a body over the limit (refused from its Content-Length, or as soon as a chunked body passes the limit,
before the rest is read), 503 while the server is not serving (starting, recovering from a lost worker,
draining, failed: see ``serve.lifecycle``). A client that goes away has its request cancelled: a stream
when it is closed, a whole response when its connection drops.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.serve.config import MAX_BODY_BYTES
from tessera.serve.engine import Engine
from tessera.serve.lifecycle import Lifecycle
from tessera.serve.metrics import CONTENT_TYPE, PrometheusMetrics
from tessera.serve.protocol import APIError, Busy, ChatRequest, CompletionRequest, invalid_request
from tessera.serve.serving import EventStream, OpenAIServing

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(target: Engine | Lifecycle, model_id: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The HTTP app serving a running engine (or the engine a lifecycle starts) as model ``model_id``; with
    ``api_key``, every /v1 request needs ``Authorization: Bearer <api_key>``; bodies over ``max_body_bytes``
    get 413."""
    lifecycle = Lifecycle.of(target)
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.add_middleware(JSONContentType)
    if api_key is not None:
        app.add_middleware(APIKeyCheck, key=api_key)
    app.add_middleware(BodyLimit, limit=max_body_bytes)  # outermost: before the key check reads anything
    _add_routes(app, _Current(lifecycle, model_id), PrometheusMetrics(lifecycle))
    return app


class _Current:
    """The serving layer over the lifecycle's engine, once it runs (503 before)."""

    def __init__(self, lifecycle: Lifecycle, model_id: str):
        self.lifecycle, self.model_id = lifecycle, model_id
        self._serving: OpenAIServing | None = None

    def __call__(self) -> OpenAIServing:
        engine = self.lifecycle.engine
        if engine is None:
            _, body = self.lifecycle.health()
            raise APIError(503, f"the server is not serving yet ({body['status']}: {body['detail']}); retry "
                                "shortly", "server_error", code="not_ready")
        if self._serving is None or self._serving.engine is not engine:
            self._serving = OpenAIServing(engine, self.model_id)
        return self._serving


def _add_routes(app: FastAPI, serving: _Current, metrics: PrometheusMetrics) -> None:
    """Register every endpoint on ``app``."""

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = serving.lifecycle.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving().model_list()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        return serving().retrieve_model(model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return _response(await serving().create_completion(body, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        return _response(await serving().create_chat_completion(body, request.is_disconnected))


def _response(result: dict[str, Any] | EventStream | None) -> Response:
    """The HTTP response of a served request: JSON, an event stream, or 499 when nobody is listening."""
    if result is None:
        return Response(status_code=499)
    if isinstance(result, EventStream):
        return StreamingResponse(result.events(), media_type="text/event-stream",
                                 background=BackgroundTask(result.release), headers=STREAM_HEADERS)
    return JSONResponse(result)


def error_response(err: APIError) -> JSONResponse:
    """An error as its OpenAI error object and HTTP status (a `Busy` one with its Retry-After)."""
    headers = {"Retry-After": str(err.retry_after_s)} if isinstance(err, Busy) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error, the framework's own included, with an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(invalid_request(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type_))


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 without reading the rest (a
    declared Content-Length at once; a chunked body as soon as it passes the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, scope, receive, send, size: str) -> None:
        err = APIError(413, f"the request body is {size}, over this server's limit of {self.limit} bytes "
                            "(--max-body-bytes): shorten the prompt", code="request_too_large")
        response = error_response(err)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None:
            if not length.isdigit():
                await error_response(APIError(400, "the Content-Length header is not a number"))(scope, receive, send)
            elif int(length) > self.limit:
                await self._refuse(scope, receive, send, f"{int(length)} bytes")
            else:
                await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True  # chunked: read up to the limit, then hand the body on
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._refuse(scope, receive, send, f"more than {self.limit} bytes")
                return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class JSONContentType:
    """ASGI middleware: a POST to /v1 must say its body is JSON (``Content-Type: application/json``, any
    charset); otherwise 415 with what it said and what to send, instead of a validation error about the
    body's shape."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and scope["path"].startswith("/v1"):
            given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"content-type"), None)
            media = (given or "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                said = "no Content-Type header" if given is None else f"Content-Type {given!r}"
                err = APIError(415, f"POST {scope['path']} takes a JSON body, but the request has {said}: send "
                                    "'Content-Type: application/json'", code="unsupported_media_type")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class APIKeyCheck:
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
                await error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


__all__ = ["STREAM_HEADERS", "APIKeyCheck", "BodyLimit", "JSONContentType", "add_error_handlers", "create_app",
           "error_response"]
