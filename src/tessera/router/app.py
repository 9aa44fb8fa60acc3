"""The router's OpenAI-compatible HTTP front (FastAPI): the API Tessera serves, forwarded along the plan.

The same routes, errors and checks as `tessera serve` (`tessera.serve.api`: strict request types, OpenAI
error objects, the API key, the body limit): ``/v1/completions`` and ``/v1/chat/completions`` (streamed or
whole), ``/v1/models``, ``/health`` and ``/metrics``. Each request is checked here, then forwarded along the
route the table picks (`tessera.router.table`, `tessera.router.forward`). At most ``max_in_flight`` requests
are forwarded at once: beyond it the router answers 429 with ``Retry-After`` and the reason, before
touching an engine. While draining (after SIGTERM) it answers 503. Every response says the route it took
(``X-Tessera-Route``) and the engines it visited (``X-Tessera-Engines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tessera.router.forward import EngineLost, Upstream, client_timeout, forward
from tessera.router.table import Endpoint, NoRoute, RouteTable
from tessera.serve.api import (
    STREAM_HEADERS,
    APIKeyCheck,
    BodyLimit,
    JSONContentType,
    add_error_handlers,
    error_response,
)
from tessera.serve.config import MAX_BODY_BYTES
from tessera.serve.metrics import CONTENT_TYPE, label_value, metric
from tessera.serve.protocol import APIError, Busy, ChatRequest, CompletionRequest

RETRY_AFTER_S = 1
HEALTH_POLL_S = 1.0
KEEP_ALIVE_S = 4.0  # below the engines' own 5 s keep-alive, so the router never reuses a connection they close


@dataclass
class RouterStats:
    """What the router counted: requests per route and outcome, fallbacks, rejections."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (route, outcome) -> count
    fallbacks: Counter[str] = field(default_factory=Counter)  # route -> requests whose prefill hop was skipped
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> 429 / 503 answers
    in_flight: int = 0
    started: float = field(default_factory=time.monotonic)


@dataclass
class RouterOptions:
    """The router's settings: the model id it serves, the API key, body limit, how many requests it forwards
    at once, how long one forwarded request may take, and which route shares it uses (`tessera.plan.shares`:
    auto, throughput or latency) with the least time between two switches."""

    model_id: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_in_flight: int = 512
    timeout_s: float = 600.0
    shares: str = "auto"
    cooldown_s: float = 1.0


class Router:
    """The router's state: the route table, the HTTP client to the engines, counters, draining."""

    def __init__(self, table: RouteTable, options: RouterOptions,
                 engine_status: Callable[[], dict[str, dict[str, Any]]] | None = None):
        self.table, self.options = table, options
        self.stats = RouterStats()
        self.engine_status = engine_status  # a supervisor's restarts and exits per engine, if it has one
        self.draining = False
        self.ready = True  # False while a launcher is still starting the engines (503 until then)
        self.client: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None

    async def open(self) -> None:
        """Create the engine client and start polling the engines' health."""
        connector = aiohttp.TCPConnector(limit=self.options.max_in_flight * 2 + 16, limit_per_host=0,
                                         keepalive_timeout=KEEP_ALIVE_S)
        self.client = aiohttp.ClientSession(connector=connector, timeout=client_timeout(self.options.timeout_s),
                                            auto_decompress=False)
        await self.poll_health()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.client is not None:
            await self.client.close()

    async def poll_health(self) -> None:
        """Ask every engine's ``/health`` once and update its state (a supervisor's starting / restarting
        states stand while it is not healthy)."""
        async def one(e: Endpoint) -> None:
            try:
                async with self.client.get(f"{e.url}/health", timeout=client_timeout(HEALTH_POLL_S * 2)) as r:
                    ok = r.status == 200
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            status = self.engine_status().get(e.name, {}) if self.engine_status else {}
            if ok:
                e.state, e.detail = "up", ""
            else:
                e.state = status.get("state") if status.get("state") in ("starting", "restarting") else "down"
                e.detail = status.get("detail", "") or "not answering /health"

        await asyncio.gather(*(one(e) for e in self.table.endpoints.values()))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            with contextlib.suppress(Exception):  # a failed poll is retried on the next tick
                await self.poll_health()

    def admit(self) -> None:
        """Refuse a request the router cannot take now (starting or draining: 503; full: 429 with
        Retry-After)."""
        if not self.ready:
            self.stats.rejected["starting"] += 1
            raise APIError(503, "the engines are still starting; retry shortly", "server_error", code="not_ready")
        if self.draining:
            self.stats.rejected["draining"] += 1
            raise APIError(503, "the router is shutting down; retry after it restarts", "server_error",
                           code="draining")
        if self.stats.in_flight >= self.options.max_in_flight:
            self.stats.rejected["full"] += 1
            raise Busy(f"the router already forwards {self.stats.in_flight} requests, its limit "
                        f"(--max-in-flight {self.options.max_in_flight}); retry after {RETRY_AFTER_S} s",
                       code="router_full", retry_after_s=RETRY_AFTER_S)

    async def handle(self, path: str, body: dict[str, Any]) -> Response:
        """Forward one checked request; its response (JSON, an event stream, or an error)."""
        self.admit()
        try:
            hops = self.table.pick()
        except NoRoute as e:
            self.stats.rejected["no_route"] += 1
            raise APIError(503, str(e), "server_error", code="no_route") from None
        self.stats.in_flight += 1
        headers = {"X-Tessera-Route": hops.route, "X-Tessera-Engines": ",".join(hops.names)}
        if hops.fallback:
            self.stats.fallbacks[hops.route] += 1
            headers["X-Tessera-Fallback"] = "prefill engine down: prefilled on the decode engine"
        released = False

        def release(outcome: str) -> None:
            nonlocal released
            if not released:
                released = True
                self.stats.in_flight -= 1
                self.table.release(hops)
                self.stats.requests[(hops.route, outcome)] += 1

        try:
            upstream = await forward(self.client, hops, path, body, self.options.timeout_s,
                                     prefilled=lambda: self.table.release(hops, prefill_only=True))
        except EngineLost as e:
            release("error")
            return error_response(APIError(502, str(e), "server_error", code="engine_lost"))
        except BaseException:
            release("error")
            raise
        if upstream.prefill_fallback:
            headers["X-Tessera-Fallback"] = upstream.prefill_fallback
            self.stats.fallbacks[hops.route] += 1
        if upstream.stream is None:
            release("ok" if upstream.status == 200 else "error")
            return JSONResponse(upstream.body, status_code=upstream.status, headers=headers)
        return StreamingResponse(self._stream(upstream, release), media_type="text/event-stream",
                                 headers={**STREAM_HEADERS, **headers})

    @staticmethod
    async def _stream(upstream: Upstream, release: Callable[[str], None]):
        outcome = "cancelled"  # the client went away before the end
        try:
            async for chunk in upstream.stream:
                if b"data: [DONE]" in chunk and not upstream.lost:
                    outcome = "ok"  # a client may close as soon as it has [DONE]
                yield chunk
            outcome = "error" if upstream.lost else "ok"
        finally:
            release(outcome)


def create_router_app(router: Router) -> FastAPI:
    """The router's HTTP app."""
    opts = router.options
    app = FastAPI(title="Tessera router", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)

    app.add_middleware(JSONContentType)
    if opts.api_key is not None:
        app.add_middleware(APIKeyCheck, key=opts.api_key)
    app.add_middleware(BodyLimit, limit=opts.max_body_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, detail = router.table.health()
        if router.draining:
            status, detail = "draining", "shutting down: no new requests"
        elif not router.ready:
            status, detail = "starting", "starting the engines: " + (detail or "waiting for their first health check")
        body = {"status": status, "detail": detail,
                **({"shares": router.table.switch.mode} if router.table.switch is not None else {}),
                "engines": {e.name: {"state": e.state, "url": e.url, "in_flight": e.in_flight,
                                     **({"detail": e.detail} if e.detail else {})}
                            for e in router.table.endpoints.values()}}
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(router), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_card(opts.model_id, router.stats.started)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        _check_model(model, opts.model_id)
        return _card(opts.model_id, router.stats.started)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        _check_model(body.model, opts.model_id)
        return await router.handle("/v1/completions", body.model_dump(exclude_unset=True))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Response:
        _check_model(body.model, opts.model_id)
        return await router.handle("/v1/chat/completions", body.model_dump(exclude_unset=True))

    return app


def _card(model_id: str, started: float) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(time.time() - (time.monotonic() - started)),
            "owned_by": "tessera"}


def _check_model(model: str, served: str) -> None:
    if model != served:
        raise APIError(404, f"the model {model!r} is not served here; this router serves {served!r}",
                       "not_found_error", param="model", code="model_not_found")


def render_metrics(router: Router) -> str:
    """The router's Prometheus text: requests per route and outcome, fallbacks, rejections, requests in
    flight, the shares in use and their switches, and per engine whether it is up, its requests in flight, failures, exits and restarts."""
    lines: list[str] = []
    s = router.stats
    metric(lines, "tessera_router_requests_total", "counter", "Requests forwarded, per route and outcome (ok, error, "
           "cancelled: the client left before the end).",
           [(f'{{route="{label_value(r)}",outcome="{o}"}}', n) for (r, o), n in sorted(s.requests.items())])
    metric(lines, "tessera_router_fallbacks_total", "counter", "Requests of a prefill-decode route served whole by "
           "its decode engine because the prefill engine was down.",
           [(f'{{route="{label_value(r)}"}}', n) for r, n in sorted(s.fallbacks.items())])
    metric(lines, "tessera_router_rejected_total", "counter", "Requests refused before forwarding (full: 429; "
           "draining or no route open: 503).", [(f'{{reason="{r}"}}', n) for r, n in sorted(s.rejected.items())])
    metric(lines, "tessera_router_in_flight", "gauge", "Requests being forwarded now.", [("", s.in_flight)])
    switch = router.table.switch
    if switch is not None:
        metric(lines, "tessera_router_shares", "gauge", "1 for the route shares the router uses now (throughput: "
               "the plan's; latency: all on its fastest route).",
               [(f'{{shares="{m}"}}', 1 if switch.mode == m else 0) for m in ("throughput", "latency")])
        metric(lines, "tessera_router_share_switches_total", "counter", "Times the router switched between the "
               "throughput and the latency shares.", [("", switch.switch_count)])
    engines = router.table.endpoints.values()
    metric(lines, "tessera_engine_up", "gauge", "1 while the engine answers /health.",
           [(f'{{engine="{label_value(e.name)}"}}', 1 if e.up else 0) for e in engines])
    metric(lines, "tessera_engine_in_flight", "gauge", "Requests the router has on each engine now.",
           [(f'{{engine="{label_value(e.name)}"}}', e.in_flight) for e in engines])
    metric(lines, "tessera_engine_failures_total", "counter", "Requests that lost their engine (unreachable, or "
           "the connection dropped).", [(f'{{engine="{label_value(e.name)}"}}', e.failures) for e in engines])
    if router.engine_status is not None:
        status = router.engine_status()
        metric(lines, "tessera_engine_exits_total", "counter", "Times each engine's process ended.",
               [(f'{{engine="{label_value(n)}"}}', v.get("exits", 0)) for n, v in sorted(status.items())])
        metric(lines, "tessera_engine_restarts_total", "counter", "Times each engine was started again.",
               [(f'{{engine="{label_value(n)}"}}', v.get("restarts", 0)) for n, v in sorted(status.items())])
    return "\n".join(lines) + "\n"


__all__ = ["Router", "RouterOptions", "RouterStats", "create_router_app", "render_metrics"]
