"""What the HTTP server does with clients that are slow, idle or too many, for every Tessera HTTP server
(`tessera serve` and the router).

``HTTPLimits`` (`tessera.serve.config`, light enough for the CLI's start-up) holds the bounds; ``server_config`` is the uvicorn config that applies them:

- **headers**: a connection must complete its request line and headers within ``header_timeout_s`` of
  opening, or of its previous response on a keep-alive connection, or it is closed
  (``HeaderTimeoutProtocol``, uvicorn's httptools protocol with a header timer; httptools' compiled parser
  and writer spend a fraction of h11's CPU per request and per streamed event). Bytes trickling in do not
  restart the timer, so a client sending half a header slowly is closed as one sending nothing.
- **body**: a request's body must arrive whole within ``body_timeout_s`` of its headers, or the client is
  answered 408 with an OpenAI error object and the connection is closed (``BodyTimeout``, a pure ASGI
  middleware: streamed responses and the wait for a client's disconnect are untouched).
- **connections**: beyond ``max_connections`` open connections, a request is answered 503 and its
  connection closed (uvicorn's ``limit_concurrency``).
- **keep-alive**: an idle keep-alive connection is closed ``keep_alive_s`` after its last response.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tessera.serve.config import HTTPLimits, HTTPLimitsError
from tessera.serve.protocol import APIError

_CONFIG_SET = ("http", "limit_concurrency", "timeout_keep_alive")  # what server_config sets itself


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection that does not complete a request's headers within
    ``header_timeout_s`` of opening or of its previous response (``with_timeout`` makes the class for a
    given timeout)."""

    header_timeout_s: float = HTTPLimits.header_timeout_s

    @classmethod
    def with_timeout(cls, header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
        """This protocol class with header timeout ``header_timeout_s``, for uvicorn's ``http=``."""
        return type(cls.__name__, (cls,), {"header_timeout_s": header_timeout_s})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._upgraded = False  # handed to a WebSocket protocol: no longer ours to time

    # The timer runs exactly while the connection waits for a request's headers: from its opening, and from
    # each response's end, until httptools has parsed the next request's headers (uvicorn then starts a
    # cycle). It is synced after each of uvicorn's steps that can change that, and never restarted by data.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._sync_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_header_timer()

    def on_response_complete(self) -> None:
        self._disarm_header_timer()  # the wait for the next request starts now
        super().on_response_complete()
        self._sync_header_timer()

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True
        self._disarm_header_timer()
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return (not self._upgraded and self.transport is not None and not self.transport.is_closing()
                and (self.cycle is None or self.cycle.response_complete))

    def _sync_header_timer(self) -> None:
        if not self._waiting_for_headers():
            self._disarm_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers():
            self.transport.close()


class BodyTimeout:
    """ASGI middleware: a request whose body has not arrived whole within ``timeout_s`` of its headers is
    answered 408 (an OpenAI error object, ``Connection: close``), or, when its response has already
    started, ended (the app receives ``http.disconnect``)."""

    def __init__(self, app: Any, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    def _error(self) -> JSONResponse:
        err = APIError(408, f"the request body did not arrive whole within {self.timeout_s:g} s of its headers "
                            "(--body-timeout): send the body at once", code="request_timeout")
        return JSONResponse(err.body(), status_code=err.status, headers={"Connection": "close"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        expecting = True  # body bytes are still to come
        started = False  # a response has started
        ended = False  # timed out: the app gets http.disconnect from here on
        answered = False  # ... and the 408 was sent here: the app's own answer is dropped

        async def timed_receive():
            nonlocal expecting, ended, answered
            if ended:
                return {"type": "http.disconnect"}
            if not expecting:  # the body is whole: this is the wait for a disconnect, untimed
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                ended = True
                if not started:
                    answered = True
                    await self._error()(scope, receive, send)
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                expecting = False
            return message

        async def tracked_send(message) -> None:
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except Exception:
            if not answered:  # an app failing on the disconnect after the 408 was answered is moot
                raise


def _has_body(scope) -> bool:
    """Whether a request announces a body (a positive Content-Length, or a Transfer-Encoding)."""
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return not value.strip().isdigit() or int(value) > 0
    return False


def server_config(app: Any, limits: HTTPLimits, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config serving the ASGI app object ``app`` within ``limits`` (checked first): the app
    wrapped in `BodyTimeout`, the header timeout, the connection limit and the keep-alive timeout.
    ``kwargs`` are the rest of uvicorn's options (``log_level``, ...), not the ones set here."""
    limits.check()
    clash = sorted(set(_CONFIG_SET) & kwargs.keys())
    if clash:
        raise TypeError(f"server_config sets {', '.join(clash)} from the limits itself")
    # uvicorn answers 503 once len(connections) >= limit_concurrency, the new connection counted: + 1
    # lets exactly max_connections be served.
    return uvicorn.Config(BodyTimeout(app, limits.body_timeout_s),
                          http=HeaderTimeoutProtocol.with_timeout(limits.header_timeout_s),
                          limit_concurrency=limits.max_connections + 1,
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works
                          **kwargs)


__all__ = ["BodyTimeout", "HTTPLimits", "HTTPLimitsError", "HeaderTimeoutProtocol", "server_config"]
