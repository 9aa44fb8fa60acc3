"""Faults and abuse against a server in this process (the single-process engine behind the real HTTP app on
loopback): after each one the server still answers a request correctly. A failed step fails only its
requests; hostile sampling values, over-large bodies, loosely typed fields and unknown roles are refused
or served; /health says the state (starting, draining, error) without internal text; a drain ends the
streams still running with an error event and [DONE]. (64 concurrent requests: tests/serve/test_api.py.)"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from tessera.serve.backend import BackendLost, SyncSteps
from tessera.serve.lifecycle import SHUTDOWN_MESSAGE, Lifecycle

MODEL = "smollm2-135m"
CONTEXT = 64
ASK = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


class _Faulty(SyncSteps):
    """The real local backend, made to fail the next step of a phase (``fail``: "prefill" or "decode"), or
    every step as a lost backend (``lose``)."""

    def __init__(self, backend):
        self.backend = backend
        self.fail: str | None = None
        self.lose = False
        self.resets = 0

    def run(self, phase, inputs, owners=()):
        if self.lose:
            raise BackendLost("worker cpu:0 was lost (injected); 0 workers left")
        if self.fail is not None and phase.startswith(self.fail):
            self.fail = None
            raise RuntimeError("injected step failure")
        return self.backend.run(phase, inputs, owners)

    def forget(self, owners):
        self.backend.forget(owners)

    def reset(self):
        self.resets += 1

    def busy_s(self):
        return self.backend.busy_s()

    def close(self):
        self.backend.close()


class _Server:
    """An app over a lifecycle served by uvicorn on a free loopback port in a background thread."""

    def __init__(self, lifecycle: Lifecycle, max_body_bytes: int = 1 << 20):
        import uvicorn

        from tessera.serve.api import create_app

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = create_app(lifecycle, MODEL, None, max_body_bytes)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def local():
    """(engine over a fault-injecting local backend, its server, the greedy answer to ASK)."""
    from tessera.serve.config import ServeConfig
    from tessera.serve.launch import start_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine, _ = start_engine(ServeConfig(MODEL, "cpu:1", slots=8, max_context=CONTEXT, threads=1, local=True),
                             log=lambda s: None)
    engine.stop()  # restarted over the faulty wrapper of the same backend
    from tessera.serve.engine import Engine

    faulty = _Faulty(engine.backend)
    engine = Engine(faulty, engine.placements, engine.tokenizer, 8, engine.scheduler.buckets, CONTEXT,
                    log=lambda s: None).start()
    server = _Server(Lifecycle(engine), max_body_bytes=1 << 20)
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=60).json()["choices"][0]["text"]
        assert answer
        yield engine, server, answer
    finally:
        server.close()
        engine.stop()
        torch.set_num_threads(threads)


def _still_correct(server: _Server, answer: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == answer
    assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}


def test_a_failed_step_fails_only_its_requests(local):
    engine, server, answer = local
    failed_before, steps_before = engine.stats.failed, engine.stats.failed_steps
    engine.backend.fail = "prefill"  # the next prefill (one request's) fails
    r = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "injected" not in r.text and "other requests go on" in r.json()["error"]["message"]
    assert engine.stats.failed == failed_before + 1 and engine.backend.resets >= 1
    _still_correct(server, answer)
    # a decode step fails: the requests it ran fail, the others are served to their end
    engine.backend.fail = "decode"
    results = asyncio.run(_concurrent(server.url, [dict(ASK, prompt=f"Item {i} is", max_tokens=4) for i in range(4)]))
    failed = [b for status, b in results if status == 500]
    assert len(failed) >= 1 and all("decode step" in b["error"]["message"] for b in failed)
    assert all(b["usage"]["completion_tokens"] == 4 for status, b in results if status == 200)
    assert engine.stats.failed_steps == steps_before + 2 and engine.running
    _still_correct(server, answer)


async def _concurrent(url: str, bodies: list[dict]):
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))
    return [(r.status_code, r.json()) for r in responses]


@pytest.mark.parametrize("field", [{"top_p": 1e-300, "temperature": 1.0, "seed": 3},
                                   {"temperature": 1e-300, "seed": 3},
                                   {"temperature": 1e300, "top_p": 1e-300, "seed": 3}])
def test_extreme_sampling_values_are_served(local, field):
    engine, server, answer = local
    r = httpx.post(f"{server.url}/v1/completions", json={**ASK, **field}, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] >= 1
    _still_correct(server, answer)


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"), ({"seed": False}, "seed"),
    ({"temperature": True}, "temperature"), ({"stream": "yes"}, "stream"), ({"prompt": [True, 1]}, "prompt"),
    ({"n": True}, "n"),
])
def test_loosely_typed_fields_are_refused(local, change, param):
    engine, server, answer = local
    r = httpx.post(f"{server.url}/v1/completions", json={**ASK, **change}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)
    _still_correct(server, answer)


@pytest.mark.parametrize("role", ["tool", "root", "developer", ""])
def test_unknown_roles_are_refused(local, role):
    engine, server, answer = local
    body = {"model": MODEL, "messages": [{"role": role, "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "role" in r.json()["error"]["param"], r.text
    _still_correct(server, answer)


def test_a_body_over_the_limit_gets_413_without_stalling_health(local):
    engine, server, answer = local
    big = json.dumps({**ASK, "prompt": "x " * (6 << 20)}).encode()  # 12 MiB
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:  # declared length over the limit: refused before the body is sent
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(big))
        reply = b""
        while b"request_too_large" not in reply:  # headers and body may come in separate reads
            part = sock.recv(65536)
            if not part:
                break
            reply += part
        head = reply.decode()
        assert head.startswith("HTTP/1.1 413"), head
        assert "request_too_large" in head
    finally:
        sock.close()

    def chunks():  # chunked, no length: refused once past the limit
        for i in range(0, len(big), 1 << 16):
            yield big[i: i + (1 << 16)]

    t0 = time.monotonic()
    stalls = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            s = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            stalls.append(time.monotonic() - s)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        r = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"}, timeout=30)
    except httpx.HTTPError:  # the server may close while the client still sends: it answered 413 first
        r = None
    finally:
        done.set()
        prober.join()
    if r is not None:
        assert r.status_code == 413, r.text
    assert time.monotonic() - t0 < 10 and max(stalls) < 1.0, stalls
    # just under the limit is read (and refused by the context check, not the size)
    r = httpx.post(f"{server.url}/v1/completions", json={**ASK, "prompt": "x " * 100_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    _still_correct(server, answer)


def test_health_while_starting_and_after_a_fatal_error_shows_no_internal_text(local):
    engine, server, answer = local
    starting = Lifecycle()
    other = _Server(starting)
    try:
        h = httpx.get(f"{other.url}/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "starting"
        r = httpx.post(f"{other.url}/v1/completions", json=ASK, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        m = httpx.get(f"{other.url}/metrics", timeout=5).text
        assert "tessera_engine_up 0" in m and 'tessera_server_state{state="starting"} 1' in m
        starting.failed("the engine could not start")
        assert httpx.get(f"{other.url}/health", timeout=5).json() == {"status": "error",
                                                                       "detail": "the engine could not start"}
    finally:
        other.close()
    _still_correct(server, answer)


def test_a_lost_backend_ends_every_request_and_tells_the_server(local):
    """Last of the module's tests on the shared engine: it leaves the engine failed."""
    engine, server, answer = local
    fatal = []
    engine.on_fatal = fatal.append
    engine.backend.lose = True
    r = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=30)
    assert r.status_code == 500 and "exiting for its supervisor" in r.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(fatal) == 1 and isinstance(fatal[0], BackendLost)
    h = httpx.get(f"{server.url}/health", timeout=5)
    assert h.status_code == 503 and h.json()["status"] == "error"
    assert "BackendLost" not in h.text and "injected" not in h.text
    assert "tessera_engine_up 0" in httpx.get(f"{server.url}/metrics", timeout=5).text
    r = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=5)
    assert r.status_code == 503 and "restart" in r.json()["error"]["message"]


def test_a_drain_finishes_what_it_can_then_ends_each_stream_with_an_error():
    from tessera.serve.config import ServeConfig
    from tessera.serve.launch import start_engine

    threads = torch.get_num_threads()
    engine, _ = start_engine(ServeConfig(MODEL, "cpu:1", slots=4, max_context=CONTEXT, threads=1, local=True),
                             log=lambda s: None)
    torch.set_num_threads(threads)  # the engine's replay runs at the test's thread count
    lifecycle = Lifecycle(engine)
    server = _Server(lifecycle)
    try:
        streams: list[str] = []

        def stream(max_tokens: int) -> None:
            body = {**ASK, "max_tokens": max_tokens, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                streams.append(r.read().decode())

        workers = [threading.Thread(target=stream, args=(n,)) for n in (2, 50, 50, 50, 50, 50)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while engine.stats.tokens < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        drained = lifecycle.drain(0.5)
        assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "draining"
        assert httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=5).status_code == 503
        for w in workers:
            w.join(timeout=30)
        took = time.monotonic() - t0
        assert len(streams) == 6 and took < 5
        assert all(s.rstrip().endswith("data: [DONE]") for s in streams), streams
        ended = [s for s in streams if SHUTDOWN_MESSAGE in s]
        assert drained.aborted == len(ended) >= 1 and drained.finished + drained.aborted >= 5
        print(f"drained in {drained.seconds:.2f} s: {drained.finished} finished, {drained.aborted} ended early")
    finally:
        server.close()
        engine.stop()



def test_a_lost_worker_is_started_again_and_health_returns_to_ok():
    """--on-failure respawn: a killed worker's request goes on on the survivor (re-planned), then the engine
    starts the worker again between steps and re-plans back onto both; /health returns to ok."""
    from tessera.serve.config import ServeConfig
    from tessera.serve.launch import start_engine

    engine, _ = start_engine(ServeConfig(MODEL, "cpu:2", slots=4, max_context=CONTEXT, placement="alternate",
                                         threads=1, on_failure="respawn", transfer_timeout_s=10),
                             log=lambda s: None)
    server = _Server(Lifecycle(engine))
    try:
        answer = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=60).json()["choices"][0]["text"]
        runner = engine.backend.runner
        assert runner.members == [0, 1]
        runner.pool.kill(1)
        runner.pool.processes[1].join(10)
        r = httpx.post(f"{server.url}/v1/completions", json=ASK, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == answer  # served on the survivor
        deadline = time.monotonic() + 120
        while (h := httpx.get(f"{server.url}/health", timeout=5).json()) != {"status": "ok"}:
            assert h["status"] in ("degraded", "recovering") and time.monotonic() < deadline, h
            time.sleep(0.05)
        assert runner.members == [0, 1] and runner.pool.processes[1].is_alive() and not runner.pool.lost
        assert engine.stats.recoveries == 1 and engine.stats.restores == 1
        _still_correct(server, answer)  # on both workers again, the same tokens
        assert "tessera_restores_total 1" in httpx.get(f"{server.url}/metrics", timeout=5).text
    finally:
        server.close()
        engine.stop()
