"""`serve.connections` against a real uvicorn server on loopback: idle and half-sent connections are closed
after the header timeout while the server keeps answering, a body shorter than its Content-Length gets a
408 OpenAI error after the body timeout, prompt keep-alive clients and long streams are not cut, requests
beyond the connection limit get 503, and limits that cannot work are refused naming their option."""

from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tessera.errors import TesseraError
from tessera.serve.connections import HeaderTimeoutProtocol, HTTPLimits, HTTPLimitsError, server_config
from tessera.serve.server import ServerOptions

FAST = HTTPLimits(header_timeout_s=0.5, body_timeout_s=0.5)
MARGIN_S = 2.0  # scheduling slack on a loaded machine; the timeouts themselves are 0.5 s
STREAM_CHUNKS, STREAM_GAP_S = 6, 0.25  # a stream of 1.5 s: three times each timeout


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"got": await request.json()}

    async def ticks():
        for i in range(STREAM_CHUNKS):
            yield f"data: {i}\n\n"
            await asyncio.sleep(STREAM_GAP_S)
        yield "data: [DONE]\n\n"

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        return StreamingResponse(ticks(), media_type="text/event-stream")

    @app.post("/stream")
    async def stream_after_body(request: Request) -> StreamingResponse:
        await request.json()
        return StreamingResponse(ticks(), media_type="text/event-stream")

    return app


class _Served:
    """An app (the test app by default) served under ``limits`` by uvicorn (``server_config``) on a free
    loopback port."""

    def __init__(self, limits: HTTPLimits, app=None):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = sock.getsockname()
        self.url = f"http://127.0.0.1:{self.address[1]}"
        self.server = uvicorn.Server(server_config(app or _app(), limits, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=10)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def served() -> Iterator[_Served]:
    s = _Served(FAST)
    yield s
    s.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (reading it gives end of file or a reset), having sent nothing."""
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        return True
    assert data == b"", f"the server answered {data[:200]!r}"
    return True


def _wait_closed(socks: list[socket.socket], timeout: float, between=None) -> list[float]:
    """Seconds until the server closed each of ``socks`` (all within ``timeout``); ``between`` runs while
    waiting."""
    t0 = time.monotonic()
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks):
            left = t0 + timeout - time.monotonic()
            assert left > 0, f"{len(socks) - len(closed)} of {len(socks)} connections still open after {timeout} s"
            for key, _ in sel.select(timeout=min(left, 0.1)):
                if _closed(key.fileobj):
                    closed[key.fileobj] = time.monotonic() - t0
                    sel.unregister(key.fileobj)
            if between is not None:
                between()
    return [closed[s] for s in socks]


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response with a Content-Length read off ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside a response body"
        body += chunk
    return status, headers, body


def _get(path: str = "/health", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n{extra}\r\n".encode()


def test_idle_connections_are_closed_while_the_server_answers(served):
    socks = [served.connect() for _ in range(50)]
    answers: list[int] = []

    def health() -> None:
        answers.append(httpx.get(f"{served.url}/health", timeout=5).status_code)

    try:
        seconds = _wait_closed(socks, FAST.header_timeout_s + MARGIN_S, between=health)
    finally:
        for s in socks:
            s.close()
    assert min(seconds) >= FAST.header_timeout_s * 0.5, seconds  # closed by the timer, not at once
    health()
    assert answers and set(answers) == {200}, answers


def test_a_half_sent_header_is_closed_even_while_trickling(served):
    sock = served.connect()
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        t0 = time.monotonic()

        def trickle() -> None:  # more header bytes do not restart the timer
            with contextlib.suppress(OSError):
                sock.send(b"x")

        _wait_closed([sock], FAST.header_timeout_s + MARGIN_S, between=trickle)
        assert time.monotonic() - t0 >= FAST.header_timeout_s * 0.5
    finally:
        sock.close()


def test_a_short_body_gets_a_408_error_object(served):
    sock = served.connect()
    try:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"a\": 1234")
        t0 = time.monotonic()
        status, headers, body = _read_response(sock)
        seconds = time.monotonic() - t0
        assert status == 408
        assert headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
        assert error["type"] == "invalid_request_error"
        assert FAST.body_timeout_s * 0.5 <= seconds <= FAST.body_timeout_s + MARGIN_S
        _wait_closed([sock], MARGIN_S)
    finally:
        sock.close()


def test_tesseras_api_answers_a_short_chunked_body_408():
    """The real app, its body limit reading a chunked body through the timed receive (no engine: /health
    answers 503 while starting)."""
    from tessera.serve.api import create_app
    from tessera.serve.lifecycle import Lifecycle

    tessera = _Served(FAST, create_app(Lifecycle(), "m"))
    sock = tessera.connect()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
        status, headers, body = _read_response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        _wait_closed([sock], MARGIN_S)
        assert httpx.get(f"{tessera.url}/health", timeout=5).status_code == 503
    finally:
        sock.close()
        tessera.close()


def test_a_body_in_parts_within_the_timeout_is_served(served):
    sock = served.connect()
    try:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10\r\n\r\n{\"a\": ")
        time.sleep(0.1)
        sock.sendall(b"123}")
        status, _, body = _read_response(sock)
        assert status == 200 and json.loads(body) == {"got": {"a": 123}}
    finally:
        sock.close()


def test_a_prompt_keep_alive_client_is_not_cut(served):
    sock = served.connect()
    try:
        t0 = time.monotonic()
        for _ in range(4):  # a connection older than the header timeout: the timer re-armed after each response
            sock.sendall(_get())
            status, headers, body = _read_response(sock)
            assert status == 200 and json.loads(body) == {"status": "ok"}
            assert headers.get("connection") != "close"
            time.sleep(FAST.header_timeout_s / 2)
        assert time.monotonic() - t0 > FAST.header_timeout_s * 1.5
        sock.sendall(_get(extra="Connection: close\r\n"))
        assert _read_response(sock)[0] == 200
    finally:
        sock.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_header_timeout(served):
    sock = served.connect()
    try:
        sock.sendall(_get())
        assert _read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # half of the next request
        _wait_closed([sock], FAST.header_timeout_s + MARGIN_S)
    finally:
        sock.close()


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_stream_longer_than_the_timeouts_is_not_cut(served, method):
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as client:
        body = {"json": {"q": 1}} if method == "POST" else {}
        with client.stream(method, f"{served.url}/stream", **body) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert text == "".join(f"data: {i}\n\n" for i in range(STREAM_CHUNKS)) + "data: [DONE]\n\n"
        assert time.monotonic() - t0 >= STREAM_CHUNKS * STREAM_GAP_S * 0.9
        assert client.get(f"{served.url}/health").status_code == 200  # the same connection, kept alive


def test_requests_beyond_max_connections_get_503():
    limited = _Served(HTTPLimits(header_timeout_s=10, max_connections=2))
    idle: list[socket.socket] = []

    def status() -> int:
        with limited.connect() as sock:
            sock.sendall(_get(extra="Connection: close\r\n"))
            return _read_response(sock)[0]

    def until(expected: int) -> None:
        deadline = time.monotonic() + 5
        while (got := status()) != expected:
            assert time.monotonic() < deadline, f"still {got}, not {expected}"
            time.sleep(0.02)

    try:
        idle.append(limited.connect())
        assert status() == 200  # two connections: within the limit
        idle.append(limited.connect())
        until(503)  # a third
        for s in idle:
            s.close()
        until(200)
    finally:
        for s in idle:
            s.close()
        limited.close()


@pytest.mark.parametrize(("limits", "option"), [
    (HTTPLimits(header_timeout_s=0), "--header-timeout"),
    (HTTPLimits(header_timeout_s=-1.5), "--header-timeout"),
    (HTTPLimits(body_timeout_s=0), "--body-timeout"),
    (HTTPLimits(body_timeout_s=float("nan")), "--body-timeout"),
    (HTTPLimits(max_connections=0), "--max-connections"),
    (HTTPLimits(keep_alive_s=0), "keep_alive_s"),
])
def test_limits_that_cannot_work_are_refused(limits, option):
    with pytest.raises(HTTPLimitsError, match=option) as info:
        limits.check()
    assert isinstance(info.value, TesseraError)
    with pytest.raises(HTTPLimitsError, match=option):
        server_config(_app(), limits)


def test_the_server_config_carries_the_limits():
    assert ServerOptions("m").limits == HTTPLimits()
    HTTPLimits().check()
    config = server_config(_app(), HTTPLimits(header_timeout_s=3, keep_alive_s=2, max_connections=7),
                           log_level="warning")
    assert issubclass(config.http, HeaderTimeoutProtocol) and config.http.header_timeout_s == 3
    assert HeaderTimeoutProtocol.header_timeout_s == HTTPLimits().header_timeout_s  # the base is untouched
    assert config.timeout_keep_alive == 2 and config.limit_concurrency == 8
    with pytest.raises(TypeError, match="limit_concurrency"):
        server_config(_app(), HTTPLimits(), limit_concurrency=3)
