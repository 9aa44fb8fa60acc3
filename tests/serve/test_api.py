"""`tessera serve` and `tessera bench`: the official openai client against the HTTP API over cpu workers,
token-identical to the single-process reference; 64 concurrent requests; OpenAI-style errors; a client
that disconnects frees its slot; /metrics; bench's JSON; clear CLI errors."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from tessera.cli.main import app

MODEL = "smollm2-135m"
KEY = "test-key"
CONTEXT = 256


class _Server:
    """An engine served by uvicorn on a free port in a background thread."""

    def __init__(self, engine, api_key: str | None):
        import uvicorn

        from tessera.serve.api import create_app

        self.engine = engine
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, MODEL, api_key), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0,
                                    timeout=300)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()


@pytest.fixture(scope="module")
def servers():
    """(tessera: 2 cpu workers, alternate placement, API key; reference: the same buckets in one process)."""
    from tessera.serve.config import ServeConfig
    from tessera.serve.launch import start_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference runs with the workers' thread count
    started: list[_Server] = []
    try:
        engine, _ = start_engine(ServeConfig(MODEL, "cpu:2", slots=8, max_context=CONTEXT, placement="alternate",
                                             threads=1))
        started.append(_Server(engine, KEY))
        reference, _ = start_engine(ServeConfig(MODEL, "cpu:2", slots=8, max_context=CONTEXT, threads=1,
                                                local=True))
        started.append(_Server(reference, None))
        yield started[0], started[1]
    finally:
        for s in started:
            s.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served(servers):
    return servers[0]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _idle(engine, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.queue_depth() == (0, 0):
            return True
        time.sleep(0.05)
    return False


def test_models_lists_the_model_as_given(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client.models.retrieve(MODEL).id == MODEL


def _completion(client, prompt: str, stream: bool) -> tuple[str, str | None]:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    if not stream:
        r = client.completions.create(**kw)
        assert r.model == MODEL and r.object == "text_completion"
        usage = r.usage
        assert usage.completion_tokens >= 1 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(**kw, stream=True):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _chat(client, question: str, stream: bool) -> tuple[str, str | None]:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish, roles = "", None, []
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens >= 1 and not chunk.choices
            continue
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_match_the_single_process_run(servers, stream):
    served, reference = servers
    got = _completion(served.client, "The capital of France is", stream)
    assert got == _completion(reference.client, "The capital of France is", stream)
    assert got[0].startswith(" Paris") and got[1] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_matches_the_single_process_run(servers, stream):
    served, reference = servers
    got = _chat(served.client, "What is the capital of France?", stream)
    assert got == _chat(reference.client, "What is the capital of France?", stream)
    assert got[0] and got[1] in ("stop", "length")


def _count_prompt(n: int) -> str:
    return f"{n}, {n}, {n}, {n},"


def test_64_concurrent_requests_all_complete_unmixed(servers):
    """Each request repeats its own number (spaced 13 apart): a reply carrying another request's number
    would be a mix-up. A few are also compared with the single-process reference, one at a time."""
    served, reference = servers
    numbers = [100 + 13 * i for i in range(64)]

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(headers=_auth(), timeout=300, limits=limits) as client:
            async def one(n: int) -> dict:
                r = await client.post(f"{served.url}/v1/completions",
                                      json={"model": MODEL, "prompt": _count_prompt(n), "max_tokens": 4,
                                            "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()

            return await asyncio.gather(*(one(n) for n in numbers))

    replies = asyncio.run(run())
    assert len({r["id"] for r in replies}) == 64
    texts = []
    for n, r in zip(numbers, replies, strict=True):
        choice = r["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and r["usage"]["completion_tokens"] >= 1
        texts.append(choice["text"])
        said = re.findall(r"\d+", choice["text"])
        assert said and abs(int(said[0]) - n) <= 2, (n, choice["text"])
    for i in (0, 31, 63):
        ref = reference.client.completions.create(model=MODEL, prompt=_count_prompt(numbers[i]), max_tokens=4,
                                                  temperature=0)
        assert texts[i] == ref.choices[0].text
    assert _idle(served.engine)


def _post(url: str, body, headers: dict[str, str] | None = None, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(_auth() if headers is None else headers)})


@pytest.mark.parametrize("body,headers,status,code,param", [
    (b'{"model": "smollm2-135m", "prompt": "Hi", ', None, 400, None, None),
    (b"[1, 2]", None, 400, None, None),
    ({"model": MODEL}, None, 400, None, "prompt"),
    ({"model": "gpt-4o", "prompt": "Hi"}, None, 404, "model_not_found", "model"),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": 0}, None, 400, None, "max_tokens"),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": -5}, None, 400, None, "max_tokens"),
    ({"model": MODEL, "prompt": "word " * 300, "max_tokens": 4}, None, 400, "context_length_exceeded", "prompt"),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": CONTEXT}, None, 400, "context_length_exceeded", "prompt"),
    ({"model": MODEL, "prompt": "Hi", "n": 2}, None, 400, None, "n"),
    ({"model": MODEL, "prompt": "Hi", "echo": True}, None, 400, None, "echo"),
    ({"model": MODEL, "prompt": [10**9]}, None, 400, None, "prompt"),
    ({"model": MODEL, "prompt": "Hi", "temperature": -1}, None, 400, None, "temperature"),
    ({"model": MODEL, "prompt": "Hi", "top_p": 0}, None, 400, None, "top_p"),
    ({"model": MODEL, "prompt": "Hi"}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key", None),
    ({"model": MODEL, "prompt": "Hi"}, {}, 401, "invalid_api_key", None),
], ids=["malformed-json", "not-an-object", "no-prompt", "unknown-model", "max-tokens-0", "max-tokens-negative",
        "prompt-too-long", "prompt-plus-output-too-long", "n-2", "echo", "bad-token-id", "negative-temperature",
        "top-p-0", "wrong-key", "no-key"])
def test_bad_requests_get_openai_errors(served, body, headers, status, code, param):
    r = _post(served.url, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code and error["param"] == param
    assert served.engine.error is None and _idle(served.engine, 5)


def _stream_all(url: str, n: int, max_tokens: int, headers: dict[str, str]) -> list[tuple[int, str, dict]]:
    """``n`` streamed completions sent at once: (status, body text, headers) of each."""
    async def run():
        async with httpx.AsyncClient(headers=headers, timeout=300, limits=httpx.Limits(max_connections=None)) as c:
            async def one(i: int):
                body = {"model": MODEL, "prompt": f"Item {i} is", "max_tokens": max_tokens, "stream": True,
                        "temperature": 0}
                async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                    return r.status_code, (await r.aread()).decode(), dict(r.headers)

            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(run())


def test_a_full_queue_answers_429_with_retry_after_and_every_admitted_stream_completes(servers):
    _, reference = servers  # one process, 8 slots
    reference.engine.max_queued = 16
    try:
        results = _stream_all(reference.url, 64, 8, {})
    finally:
        reference.engine.max_queued = None
    refused = [(body, headers) for status, body, headers in results if status == 429]
    served = [body for status, body, _ in results if status == 200]
    assert len(refused) + len(served) == 64 and refused and len(served) >= 8 + 16
    for body, headers in refused:
        error = json.loads(body)["error"]
        assert headers["retry-after"] == "1" and error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert "--max-queue 16" in error["message"]
    for body in served:  # every admitted stream runs to its end
        assert body.rstrip().endswith("data: [DONE]") and '"error"' not in body
    metrics = httpx.get(f"{reference.url}/metrics", timeout=10).text
    assert f"tessera_refused_requests_total {len(refused)}" in metrics
    assert _idle(reference.engine)


def test_a_request_that_waits_past_the_queue_deadline_gets_503(servers):
    _, reference = servers
    reference.engine.queue_timeout_s = 0.3
    try:
        results = _stream_all(reference.url, 24, 24, {})  # the slots stay busy for longer than 0.3 s
    finally:
        reference.engine.queue_timeout_s = None
    expired = [body for status, body, _ in results if status == 200 and "queue_timeout" in body]
    done = [body for status, body, _ in results if status == 200 and '"error"' not in body]
    assert expired and done and len(expired) + len(done) == 24
    assert all("past the queue's deadline (--queue-timeout 0.3 s)" in body for body in expired)
    assert _idle(reference.engine)


def test_a_body_not_declared_json_gets_415_naming_the_content_type(served):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    for content_type, said in ((None, "no Content-Type header"), ("text/plain", "Content-Type 'text/plain'")):
        headers = {**_auth(), **({"Content-Type": content_type} if content_type else {})}
        r = httpx.post(served.url + "/v1/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type" and said in r.json()["error"]["message"]
    assert served.engine.error is None and _idle(served.engine, 5)


def test_the_server_keeps_serving_after_bad_requests(served):
    assert _post(served.url, b"{nope").status_code == 400
    assert _post(served.url, {"model": MODEL, "messages": []}, path="/v1/chat/completions").status_code == 400
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()
    r = served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 2
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}


def test_a_client_that_disconnects_frees_its_slot(served):
    engine = served.engine
    completed = engine.stats.completed
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    with httpx.Client(headers=_auth(), timeout=120) as client, \
            client.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: dropping a half-read iterator closes the connection
        tokens = 0
        for line in lines:  # a few tokens in: the request is streaming
            if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                tokens += 1
                if tokens == 3:
                    break
        assert tokens == 3 and engine.queue_depth() == (0, 1)  # still streaming, the client still there
    assert _idle(engine, 15), engine.queue_depth()
    # a non-streamed request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body, headers=_auth(), timeout=2)
    assert _idle(engine, 15), engine.queue_depth()
    assert engine.stats.completed == completed  # neither ran to its end
    r = served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_metrics_and_health(served):
    served.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    r = httpx.get(f"{served.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("tessera_generated_tokens_total", "tessera_tokens_per_second", "tessera_ttft_seconds_bucket",
                 "tessera_ttft_seconds_count", "tessera_tpot_seconds_bucket",
                 'tessera_queue_depth{state="queued"}',
                 'tessera_queue_depth{state="in_flight"}', "tessera_active_plan", "tessera_plan_switches_total",
                 'tessera_device_busy_seconds_total{device='):
        assert name in text, name
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["tessera_generated_tokens_total"] >= 2
    plans = [values[f'tessera_active_plan{{objective="{o}"}}'] for o in ("latency", "throughput")]
    assert sorted(plans) == [0, 1]
    assert values['tessera_ttft_seconds_bucket{le="+Inf"}'] == values["tessera_ttft_seconds_count"] >= 1
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{served.url}/metrics").status_code == 200  # no key needed outside /v1


def test_bench_reports_json(served):
    r = CliRunner().invoke(app, ["bench", "--url", f"{served.url}/v1", "--workload", "fixed:in=8,out=4,requests=4",
                                 "--api-key", KEY, "--slo-ttft", "120", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["model"] == MODEL and s["requests"] == 4 and s["completed"] == 4 and s["failed"] == 0
    assert 4 <= s["output_tokens"] <= 16 and s["input_tokens"] >= 32 and s["throughput"] > 0
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        assert s[key] is not None and s[key] > 0, key
    assert s["ttft_p50_s"] <= s["ttft_p99_s"]
    assert s["slo"] == {"ttft_s": 120.0, "tpot_s": None, "attainment": 1.0}


def test_bench_arrivals_are_the_simulators():
    from tessera.serve.bench import planned_requests
    from tessera.sim.requests import arrivals
    from tessera.workload import parse_workload

    for spec in ("fixed:in=8,out=4,requests=3", "poisson:rate=4,lengths=azure-conv,requests=20"):
        w = parse_workload(spec)
        assert [(p.arrival_s, p.input, p.output) for p in planned_requests(w, 3)] == \
               [(r.arrival_s, r.input, r.output) for r in arrivals(w, 3)]


@pytest.mark.parametrize("args,message", [
    (["bench", "--url", "http://127.0.0.1:9", "--workload", "images:steps=4,resolution=64"], "images workload"),
    (["bench", "--url", "127.0.0.1:9", "--workload", "fixed:in=1,out=1"], "http://"),
    (["bench", "--url", "http://127.0.0.1:9", "--workload", "fixed:in=1"], "fixed needs out"),
    (["bench", "--url", "http://127.0.0.1:9", "--workload", "fixed:in=1,out=1,requests=1"], "cannot reach"),
    (["serve", MODEL, "--cluster", "A100:1", "--port", "0"], "local cpu workers"),
    (["serve", MODEL, "--slots", "0", "--port", "0"], "--slots must be at least 1"),
    (["serve", MODEL, "--max-context", "1", "--port", "0"], "--max-context"),
    (["serve", MODEL, "--placement", "diagonal", "--port", "0"], "--placement must be one of"),
    (["serve", MODEL, "--policy", "fastest", "--port", "0"], "unknown policy"),
    (["serve", MODEL, "--port", "70000"], "--port"),
    (["serve", MODEL, "--window-ms", "0", "--port", "0"], "--window-ms"),
    (["serve", "no-such-model", "--port", "0"], "no-such-model"),
], ids=["bench-images", "bench-url", "bench-workload", "bench-no-server", "serve-gpu-cluster", "serve-slots",
        "serve-context", "serve-placement", "serve-policy", "serve-port", "serve-window", "serve-model"])
def test_cli_errors_are_clear(args, message):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "error:" in r.stderr and message in r.stderr, r.stderr
    assert "Traceback" not in r.output


def test_serve_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", MODEL, "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
