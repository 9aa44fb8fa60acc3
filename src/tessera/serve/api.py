"""The OpenAI-compatible HTTP API over a running engine (FastAPI): the routes, the errors, the API key.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text, from ``serve.metrics``). What a request means is
``serve.serving.OpenAIServing``'s business; this module maps HTTP onto it. Errors are OpenAI error
objects (``serve.protocol.APIError``): 400 for a bad request (malformed JSON and schema errors included),
401 for a missing or wrong API key, 404 for a model this server does not serve or an unknown path. A
client that goes away has its request cancelled: a stream when it is closed, a whole response when its
connection drops.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.serve.engine import Engine
from tessera.serve.metrics import CONTENT_TYPE, PrometheusMetrics
from tessera.serve.protocol import APIError, ChatRequest, CompletionRequest, invalid_request
from tessera.serve.serving import EventStream, OpenAIServing

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(engine: Engine, model_id: str, api_key: str | None = None) -> FastAPI:
    """The HTTP app serving ``engine`` as model ``model_id``; with ``api_key``, every /v1 request needs
    ``Authorization: Bearer <api_key>``."""
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    if api_key is not None:
        app.add_middleware(_APIKey, key=api_key)
    _add_routes(app, OpenAIServing(engine, model_id), PrometheusMetrics(engine))
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing, metrics: PrometheusMetrics) -> None:
    """Register every endpoint on ``app``."""

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = serving.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.model_list()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        return serving.retrieve_model(model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return _response(await serving.create_completion(body, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        return _response(await serving.create_chat_completion(body, request.is_disconnected))


def _response(result: dict[str, Any] | EventStream | None) -> Response:
    """The HTTP response of a served request: JSON, an event stream, or 499 when nobody is listening."""
    if result is None:
        return Response(status_code=499)
    if isinstance(result, EventStream):
        return StreamingResponse(result.events(), media_type="text/event-stream",
                                 background=BackgroundTask(result.release), headers=STREAM_HEADERS)
    return JSONResponse(result)


def _error(err: APIError) -> JSONResponse:
    """An error as its OpenAI error object and HTTP status."""
    return JSONResponse(err.body(), status_code=err.status)


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error, the framework's own included, with an OpenAI error object."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(invalid_request(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(APIError(exc.status_code, str(exc.detail), type_))


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
                await _error(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


__all__ = ["create_app"]
