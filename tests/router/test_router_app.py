"""Tessera's router (`tessera.router`) served by `run_router` on loopback in front of stub engines
(`tests.router.stub_engines`, stand-ins for vLLM's HTTP surface): a whole route passes the client's body
through unchanged; a prefill-decode route sends the prefill engine a one-token, unstreamed call (with NIXL's
``kv_transfer_params`` for the ``nixl`` connector, none for ``example``) and the decode engine the client's
body (with the prefill answer's ``kv_transfer_params`` for ``nixl``); streams are relayed in order; an
engine lost mid-stream ends the stream with an ``engine_lost`` error event and ``[DONE]`` and shows in
/health and /metrics, and a client gone mid-stream releases its request; a stopped, unreachable or too
slow prefill engine leaves requests to the decode engine (``X-Tessera-Fallback``, counted); a decode engine
too slow for the timeout gets a 504 OpenAI error; no open route answers 503 naming the engines down; a
supervisor's states and counts show in /health and /metrics; ``max_in_flight`` answers 429 with
Retry-After; wrong models, wrongly typed bodies and missing API keys are refused before any engine sees
them; a router not ready answers 503; SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest

import tessera.router.app as app_module
import tessera.router.server as server_module
from tessera.engines.process import EngineStatus
from tessera.plan.deployment import DECODE, PREFILL, WHOLE, PlannedEngine, PlannedRoute
from tessera.router.app import Router, RouterOptions, render_metrics
from tessera.router.forward import NIXL_PREFILL_PARAMS
from tessera.router.launch import free_ports, router_for
from tessera.router.server import run_router
from tessera.serve.connections import HTTPLimits
from tests.router.stub_engines import KV_PARAMS, StubEngine

MODEL = "stub-model"
DEADLINE_S = 15.0  # for state changes the router notices by polling (every second); generous for a loaded host


def _engine(name: str, role: str) -> PlannedEngine:
    return PlannedEngine(name=name, roles=(role,), targets=("cpu",), devices=("cpu:0",), nodes=("node0",),
                         max_num_seqs=8, kv_tokens=4096, block_size=16, memory_fraction=0.5)


ENGINES = {"whole": _engine("whole", WHOLE), "prefill": _engine("prefill", PREFILL), "decode": _engine("decode", DECODE)}
WHOLE_ONLY = (PlannedRoute("whole", 1.0, ("whole",)),)
PD_ONLY = (PlannedRoute("pd", 1.0, ("prefill", "decode")),)
PD_AND_WHOLE = (PlannedRoute("pd", 0.6, ("prefill", "decode")), PlannedRoute("whole", 0.4, ("whole",)))


class _RecordingServer(server_module._RouterServer):
    """The router's uvicorn server, remembered by its router so a test can send it the shutdown signal."""

    made: dict[int, server_module._RouterServer] = {}

    def __init__(self, config, router, grace_s, log):
        super().__init__(config, router, grace_s, log)
        self.made[id(router)] = self


@dataclass
class Deployed:
    """Stub engines with the router in front, served by `run_router` on a loopback port."""

    router: Router
    stubs: dict[str, StubEngine]
    url: str = ""
    log: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None
    http: httpx.Client | None = None  # one client per test (a client per request costs a TLS context)

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, path: str, body: dict, **headers: str) -> httpx.Response:
        return self.http.post(path, json=body, headers=headers)

    def stream(self, path: str, body: dict):
        return self.http.stream("POST", path, json=body)

    def health(self) -> dict:
        return self.get("/health").json()

    def metrics(self) -> str:
        return self.get("/metrics").text

    def signal_exit(self) -> None:
        _RecordingServer.made[id(self.router)].handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.signal_exit()
            self.thread.join(10)
            if self.thread.is_alive():  # a second signal stops at once
                self.signal_exit()
                self.thread.join(10)
            assert not self.thread.is_alive(), "the router did not stop"
        if self.http is not None:
            self.http.close()
        for stub in self.stubs.values():
            stub.stop()


def wait_for(check: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> object:
    """Poll ``check`` until it gives something true (its value), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def deploy(monkeypatch) -> Iterator[Callable[..., Deployed]]:
    """``deploy(routes, connector=None, stubs={name: StubEngine kwargs}, ready=True, **router options)``: the
    routes' engines as stubs and the router over them, serving; all stopped afterwards."""
    monkeypatch.setattr(server_module, "_RouterServer", _RecordingServer)
    made: list[Deployed] = []

    def make(routes: tuple[PlannedRoute, ...], connector: str | None = None, stubs: dict | None = None,
             ready: bool = True, **options) -> Deployed:
        names = sorted({h for r in routes for h in r.hops})
        started = {n: StubEngine(n, **(stubs or {}).get(n, {})) for n in names}
        d = Deployed(None, started)  # type: ignore[arg-type]
        made.append(d)
        for stub in started.values():
            stub.start()
        engines = {n: (ENGINES[n], started[n].url, None if n == "whole" else connector) for n in names}
        d.router = router_for(routes, engines, RouterOptions(MODEL, **options))
        d.router.ready = ready
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        d.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        d.http = httpx.Client(base_url=d.url, timeout=20)
        answering = threading.Event()
        d.thread = threading.Thread(target=run_router, args=(d.router, sock, HTTPLimits(), 5.0, d.log.append,
                                                             answering.set), daemon=True)
        d.thread.start()
        wait_for(lambda: answering.is_set() or not d.thread.is_alive(), "the router to start")
        assert answering.is_set(), f"the router did not start: {d.log}"
        wait_for(lambda: d.get("/health").status_code in (200, 503), "the router to answer /health")
        return d

    yield make
    for d in reversed(made):
        d.stop()


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 7, "temperature": 0.5, **extra}


def data_lines(response: httpx.Response) -> list[str]:
    """The payloads of a streamed response's ``data:`` lines, as they arrive."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def sample(metrics: str, name: str, labels: str = "") -> float | None:
    """The value of the sample ``name{labels}`` in Prometheus text (None if absent)."""
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", metrics, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_a_whole_route_forwards_the_clients_body_unchanged(deploy):
    d = deploy(WHOLE_ONLY)
    body = completion(top_k=3, seed=11)  # top_k: a field the router does not know, passed on as is
    r = d.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "echo:hello there"
    assert r.json()["served_by"] == "whole"
    assert r.headers["X-Tessera-Route"] == "whole"
    assert r.headers["X-Tessera-Engines"] == "whole"
    assert "X-Tessera-Fallback" not in r.headers
    assert d.stubs["whole"].bodies == [("/v1/completions", body)]

    chat = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hi"}], "max_tokens": 4}
    r = d.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo:hi"
    assert d.stubs["whole"].bodies_at("/v1/chat/completions") == [chat]
    assert sample(d.metrics(), "tessera_router_requests_total", '{route="whole",outcome="ok"}') == 2


def test_prefill_then_decode_with_nixl_passes_kv_transfer_params_on(deploy):
    d = deploy(PD_ONLY, connector="nixl")
    body = completion(stream=True, stream_options={"include_usage": True})
    with d.stream("/v1/completions", body) as r:
        assert r.status_code == 200
        assert r.headers["X-Tessera-Route"] == "pd"
        assert r.headers["X-Tessera-Engines"] == "prefill,decode"
        events = data_lines(r)
    assert events[-1] == "[DONE]"

    [prefilled] = d.stubs["prefill"].bodies_at("/v1/completions")
    assert prefilled["max_tokens"] == 1 and prefilled["stream"] is False
    assert "stream_options" not in prefilled
    assert prefilled["kv_transfer_params"] == NIXL_PREFILL_PARAMS
    assert prefilled["kv_transfer_params"]["do_remote_decode"] is True
    assert {k: prefilled[k] for k in ("model", "prompt", "temperature")} == \
           {k: body[k] for k in ("model", "prompt", "temperature")}

    [decoded] = d.stubs["decode"].bodies_at("/v1/completions")
    assert decoded == {**body, "kv_transfer_params": KV_PARAMS}  # the client's body and the prefill's params


def test_prefill_then_decode_with_the_example_connector_passes_nothing_between(deploy):
    d = deploy(PD_ONLY, connector="example")
    body = completion()
    r = d.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "decode"
    assert r.headers["X-Tessera-Engines"] == "prefill,decode"
    [prefilled] = d.stubs["prefill"].bodies_at("/v1/completions")
    assert prefilled == {**body, "max_tokens": 1, "stream": False}
    assert d.stubs["decode"].bodies == [("/v1/completions", body)]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    r = d.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    [prefilled] = d.stubs["prefill"].bodies_at("/v1/chat/completions")
    assert prefilled == {"model": MODEL, "messages": chat["messages"], "max_tokens": 1, "stream": False}
    assert d.stubs["decode"].bodies_at("/v1/chat/completions") == [chat]


def test_a_stream_is_relayed_in_order_ending_in_done(deploy):
    d = deploy(WHOLE_ONLY, stubs={"whole": {"events": 6, "delay_s": 0.02}})
    with d.stream("/v1/completions", completion(stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["X-Tessera-Route"] == "whole"
        events = data_lines(r)
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f"tok{i}" for i in range(6)]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with d.stream("/v1/chat/completions", chat) as r:
        events = data_lines(r)
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == [f"tok{i}" for i in range(6)]
    assert events[-1] == "[DONE]"
    m = d.metrics()
    assert sample(m, "tessera_router_requests_total", '{route="whole",outcome="ok"}') == 2
    assert sample(m, "tessera_router_in_flight") == 0


def test_a_decode_engine_lost_mid_stream_ends_the_stream_with_an_error_event(deploy):
    d = deploy(PD_AND_WHOLE, connector="example", stubs={"decode": {"events": 100, "delay_s": 0.05}})
    with d.stream("/v1/completions", completion(stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["X-Tessera-Engines"] == "prefill,decode"
        lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
        first = next(lines)
        assert json.loads(first)["choices"][0]["text"] == "tok0"
        d.stubs["decode"].stop(abort=True)  # the engine crashes while it streams
        rest = list(lines)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])
    assert error["error"]["code"] == "engine_lost"
    assert "decode" in error["error"]["message"]
    assert all("choices" in json.loads(e) for e in rest[:-2])  # whole events before it, none cut in half
    assert len(rest) < 100

    health = d.health()
    assert health["status"] in ("degraded", "down")
    assert "decode" in health["detail"]
    assert health["engines"]["decode"]["state"] == "down"
    m = d.metrics()
    assert sample(m, "tessera_engine_failures_total", '{engine="decode"}') >= 1
    assert sample(m, "tessera_engine_up", '{engine="decode"}') == 0
    assert sample(m, "tessera_engine_up", '{engine="whole"}') == 1
    assert sample(m, "tessera_router_requests_total", '{route="pd",outcome="error"}') == 1
    assert sample(m, "tessera_engine_in_flight", '{engine="decode"}') == 0
    assert sample(m, "tessera_router_in_flight") == 0

    # the route through the lost engine is closed; requests take the one still open
    for _ in range(3):
        r = d.post("/v1/completions", completion())
        assert r.status_code == 200, r.text
        assert r.headers["X-Tessera-Route"] == "whole"
    assert d.health()["status"] == "degraded"


def test_a_client_gone_mid_stream_releases_its_request(deploy):
    d = deploy(PD_ONLY, connector="example", stubs={"decode": {"events": 100, "delay_s": 0.05}})
    with d.stream("/v1/completions", completion(stream=True)) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines)
        assert sample(d.metrics(), "tessera_router_in_flight") == 1
    # the response closed unread: the router drops the request and the engine's stream
    wait_for(lambda: sample(d.metrics(), "tessera_router_in_flight") == 0, "the request to be released")
    m = d.metrics()
    assert sample(m, "tessera_engine_in_flight", '{engine="decode"}') == 0
    assert sample(m, "tessera_engine_in_flight", '{engine="prefill"}') == 0
    assert sample(m, "tessera_engine_failures_total", '{engine="decode"}') == 0  # not the engine's fault
    assert d.health()["status"] == "ok"


def test_no_route_open_answers_503_naming_the_engines_down(deploy):
    d = deploy(WHOLE_ONLY)
    d.stubs["whole"].stop()
    wait_for(lambda: d.health()["status"] == "down", "the router to see the engine down")
    assert d.get("/health").status_code == 503
    r = d.post("/v1/completions", completion())
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_route" and "whole (down" in r.json()["error"]["message"]
    assert sample(d.metrics(), "tessera_router_rejected_total", '{reason="no_route"}') == 1


def test_a_supervisors_states_and_counts_show_in_health_and_metrics():
    """No server: one health poll of an engine that does not answer while its supervisor restarts it."""
    (port,) = free_ports(1)  # nothing listens there
    supervisor = SimpleNamespace(status={"whole": EngineStatus("whole", state="restarting", restarts=2, exits=2,
                                                               detail="restart 2")}, listeners=[])
    router = router_for(WHOLE_ONLY, {"whole": (ENGINES["whole"], f"http://127.0.0.1:{port}/", None)},
                        RouterOptions(MODEL), supervisor=supervisor)  # type: ignore[arg-type]
    endpoint = router.table.endpoints["whole"]
    assert endpoint.url == f"http://127.0.0.1:{port}"

    async def poll_once() -> None:
        await router.open()
        await router.close()

    asyncio.run(poll_once())
    assert (endpoint.state, endpoint.detail) == ("restarting", "restart 2")
    assert router.table.health() == ("down", "whole is restarting (restart 2)")
    m = render_metrics(router)
    assert sample(m, "tessera_engine_up", '{engine="whole"}') == 0
    assert sample(m, "tessera_engine_restarts_total", '{engine="whole"}') == 2
    assert sample(m, "tessera_engine_exits_total", '{engine="whole"}') == 2

    # the supervisor's state changes reach the router at once, between health polls
    [changed] = supervisor.listeners
    changed("whole", "up", "back after restart 2")
    assert endpoint.up and router.table.health() == ("ok", "")
    changed("whole", "down", "exited with status -9")
    assert router.table.health() == ("down", "whole is down (exited with status -9)")
    changed("elsewhere", "down", "")  # an engine the router does not front: ignored


def test_a_stopped_prefill_engine_leaves_requests_to_the_decode_engine(deploy):
    d = deploy(PD_ONLY, connector="nixl")
    d.stubs["prefill"].stop()
    health = wait_for(lambda: (h := d.health())["status"] == "degraded" and h, "the router to see prefill down")
    assert "prefill is down" in health["detail"] and "pd prefill on their decode engine" in health["detail"]
    body = completion()
    for _ in range(3):
        r = d.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.headers["X-Tessera-Route"] == "pd"
        assert r.headers["X-Tessera-Engines"] == "decode"
        assert "prefill engine down" in r.headers["X-Tessera-Fallback"]
    assert d.stubs["decode"].bodies == [("/v1/completions", body)] * 3  # whole requests, no KV params
    assert sample(d.metrics(), "tessera_router_fallbacks_total", '{route="pd"}') == 3


def test_a_prefill_engine_lost_before_the_router_notices_is_skipped(deploy, monkeypatch):
    monkeypatch.setattr(app_module, "HEALTH_POLL_S", 3600.0)  # no health poll after the first
    d = deploy(PD_ONLY, connector="nixl")
    d.stubs["prefill"].stop()
    body = completion()
    r = d.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.headers["X-Tessera-Engines"] == "prefill,decode"  # the route as picked
    assert "prefill engine prefill unreachable" in r.headers["X-Tessera-Fallback"]
    assert d.stubs["decode"].bodies == [("/v1/completions", body)]
    m = d.metrics()
    assert sample(m, "tessera_router_fallbacks_total", '{route="pd"}') == 1
    assert sample(m, "tessera_engine_failures_total", '{engine="prefill"}') == 1
    assert sample(m, "tessera_engine_in_flight", '{engine="prefill"}') == 0


def test_a_prefill_engine_too_slow_for_the_timeout_is_skipped(deploy):
    d = deploy(PD_ONLY, connector="nixl", stubs={"prefill": {"answer_delay_s": 10.0}}, timeout_s=1.0)
    body = completion()
    r = d.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "decode"
    assert "prefill engine prefill" in r.headers["X-Tessera-Fallback"]
    assert d.stubs["decode"].bodies == [("/v1/completions", body)]
    assert sample(d.metrics(), "tessera_engine_in_flight", '{engine="prefill"}') == 0


def test_a_decode_engine_too_slow_for_the_timeout_gets_an_openai_error(deploy):
    d = deploy(WHOLE_ONLY, stubs={"whole": {"answer_delay_s": 10.0}}, timeout_s=1.0)
    r = d.post("/v1/completions", completion())
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "engine_timeout"
    assert "whole" in r.json()["error"]["message"]
    m = d.metrics()
    assert sample(m, "tessera_router_requests_total", '{route="whole",outcome="error"}') == 1
    assert sample(m, "tessera_router_in_flight") == 0


def test_max_in_flight_answers_429_with_retry_after(deploy):
    d = deploy(WHOLE_ONLY, stubs={"whole": {"events": 5, "delay_s": 0.3}}, max_in_flight=1)
    with d.stream("/v1/completions", completion(stream=True)) as first:
        assert first.status_code == 200
        lines = (line for line in first.iter_lines() if line.startswith("data: "))
        next(lines)  # the first request is being forwarded
        busy = d.post("/v1/completions", completion())
        assert busy.status_code == 429
        assert busy.headers["Retry-After"] == "1"
        error = busy.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "router_full"
        assert "--max-in-flight 1" in error["message"]
        assert list(lines)[-1] == "data: [DONE]"
    r = d.post("/v1/completions", completion())
    assert r.status_code == 200, r.text
    assert len(d.stubs["whole"].bodies) == 2  # the refused request never reached the engine
    assert sample(d.metrics(), "tessera_router_rejected_total", '{reason="full"}') == 1


def test_bad_requests_are_refused_before_any_engine_sees_them(deploy):
    d = deploy(PD_AND_WHOLE, connector="example")
    r = d.post("/v1/completions", completion(model="other-model"))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "other-model" in r.json()["error"]["message"]

    r = d.post("/v1/completions", completion(max_tokens="3"))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = d.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "stream": "yes"})
    assert r.status_code == 400
    body = json.dumps(completion()).encode()
    for headers, said in (({}, "no Content-Type header"), ({"Content-Type": "text/plain"}, "'text/plain'"),
                          ({"Content-Type": "application/x-www-form-urlencoded"}, "x-www-form-urlencoded")):
        r = d.http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert said in r.json()["error"]["message"] and "send 'Content-Type: application/json'" in r.text
    assert all(stub.bodies == [] for stub in d.stubs.values())
    r = d.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200

    models = d.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert d.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert d.get("/v1/models/other-model").status_code == 404


def test_an_api_key_is_required_on_v1(deploy):
    d = deploy(WHOLE_ONLY, api_key="sesame")
    r = d.post("/v1/completions", completion())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert d.post("/v1/completions", completion(), Authorization="Bearer wrong").status_code == 401
    assert d.stubs["whole"].bodies == []
    r = d.post("/v1/completions", completion(), Authorization="Bearer sesame")
    assert r.status_code == 200, r.text
    assert d.get("/health").status_code == 200  # health needs no key


def test_a_router_not_ready_answers_503_and_health_starting(deploy):
    d = deploy(WHOLE_ONLY, ready=False)
    r = d.post("/v1/completions", completion())
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    health = d.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "starting"
    assert d.stubs["whole"].bodies == []
    d.router.ready = True
    assert d.post("/v1/completions", completion()).status_code == 200
    assert d.health()["status"] == "ok"


def test_sigterm_drains_requests_in_flight_and_refuses_new_ones(deploy):
    d = deploy(WHOLE_ONLY, stubs={"whole": {"events": 6, "delay_s": 0.3}})
    with d.stream("/v1/completions", completion(stream=True)) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines)
        d.signal_exit()
        wait_for(lambda: d.router.draining, "draining")
        refused = d.post("/v1/completions", completion())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert d.health()["status"] == "draining"
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and len(rest) == 6  # tok1..tok5 and [DONE]: finished, not cut off
    d.thread.join(10)
    assert not d.thread.is_alive()
    assert any("drained" in line for line in d.log)
