"""`tessera serve --engine vllm` end to end with real vLLM engines (the project's vLLM environment): the
route mix planned for A100:1,L40S:1 (36% of requests whole on the L40S, 64% prefilled on the L40S and decoded
on the A100) served on two cpu workers as three vLLM processes behind Tessera's router.

Checks what a user would: greedy tokens through either route equal one vLLM engine's alone, the KV really
crosses from the prefill engine to the decode engine, and killing the prefill engine mid-run loses no request
(they prefill on the decode engine), shows in /health and /metrics, and the engine is started again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PLAN = ROOT / "tests" / "fixtures" / "plans" / "smollm2-135m_A100_L40S_mix.json"
MODEL = "smollm2-135m"
START_TIMEOUT_S = 420

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment: `make vllm-env` creates it")

TOPICS = ["the capital of France", "how water boils", "the largest planet", "the sea at night", "primary colours",
          "the moon landing", "photosynthesis", "a quick brown fox", "making tea", "the speed of light",
          "Shakespeare", "hot and cold", "the Python language", "Mount Everest", "gold", "a small village"]
FILLER = ("People have discussed it for a long time, in schools, in books and at the dinner table, and it still "
          "makes them curious. ")


def _prompt(i: int, topic: str) -> str:
    # longer than two of the engines' 32-token KV blocks, so the prefill engine hands real KV on
    return f"Note {i} is about {topic}. " + FILLER * 5 + f"Here is one fact about {topic}:"


class Served:
    """The running `tessera serve --engine vllm` process: its URL, engines and output so far."""

    def __init__(self, proc: subprocess.Popen, url: str, log_dir: Path, lines: list[str]):
        self.proc, self.url, self.log_dir, self.lines = proc, url, log_dir, lines

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def engine_url(self, name: str) -> str:
        return self.health()["engines"][name]["url"]

    def engine_pid(self, name: str) -> int:
        pids = [int(m.group(1)) for line in self.lines
                if (m := re.search(rf"starting engine {re.escape(name)} .*\(pid (\d+),", line))]
        return pids[-1]


def _complete(url: str, prompt: str, max_tokens: int = 16, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    cmd = [sys.executable, "-m", "tessera", "serve", MODEL, "--cluster", "cpu:2", "--engine", "vllm", "--plan",
           str(PLAN), "--port", "0", "--no-prefix-caching", "--max-context", "512", "--log-dir", str(log_dir),
           "--vllm-python", str(VLLM_PYTHON), "--shares", "throughput"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "400"})
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            m = re.search(r"router listening at (http://\S+)", line)
            if m:
                url = m.group(1)
            if "through 3 vLLM engines" in line or time.monotonic() > deadline:
                break
        if url is None or proc.poll() is not None or not any("through 3 vLLM engines" in x for x in lines):
            raise AssertionError("tessera serve --engine vllm did not come up:\n" + "\n".join(lines[-40:]))
        reader = ThreadPoolExecutor(1)
        reader.submit(lambda: [lines.append(x.rstrip()) for x in proc.stdout])
        yield Served(proc, url, log_dir, lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_greedy_tokens_through_the_router_equal_one_engine_alone_on_both_routes(served):
    health = served.health()
    assert health["status"] == "ok" and set(health["engines"]) == {"whole@L40S", "prefill@L40S", "decode@A100"}
    alone = served.engine_url("whole@L40S")  # an engine without a connector, reached directly
    routes, differ = {}, []
    for i, topic in enumerate(TOPICS):  # one at a time
        via = _complete(served.url, _prompt(i, topic))
        direct = _complete(alone, _prompt(i, topic))
        assert via.status_code == 200 and direct.status_code == 200, via.text
        route = via.headers["x-tessera-route"]
        routes[route] = routes.get(route, 0) + 1
        if via.json()["choices"][0]["text"] != direct.json()["choices"][0]["text"]:
            differ.append((route, topic))
    assert differ == []
    # the planned shares (64% / 36%) by smooth weighted round robin: 10 and 6 of 16
    assert routes == {"prefill-decode": 10, "homogeneous (L40S)": 6}
    # the decode engine took each prefill-decode prompt's KV from the prefill engine instead of computing it
    decode_log = (served.log_dir / "decode_A100.log").read_text(errors="replace")
    assert decode_log.count("External Cache Hit") >= 10


def test_a_killed_prefill_engine_loses_no_request_and_is_started_again(served):
    prompts = [_prompt(100 + i, t) for i, t in enumerate(TOPICS[:8])]
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_complete, served.url, p, 24) for p in prompts]
        time.sleep(0.5)  # some are being prefilled now
        os.killpg(served.engine_pid("prefill@L40S"), signal.SIGKILL)
        done = [f.result() for f in running]
    assert [r.status_code for r in done] == [200] * len(done), [r.text for r in done if r.status_code != 200]
    deadline = time.monotonic() + 10
    while served.health()["engines"]["prefill@L40S"]["state"] == "up" and time.monotonic() < deadline:
        time.sleep(0.2)
    health = served.health()
    assert health["status"] == "degraded" and "prefill@L40S" in health["detail"]
    assert health["engines"]["prefill@L40S"]["state"] in ("down", "restarting")
    later = [_complete(served.url, _prompt(200 + i, "gold")) for i in range(3)]
    assert all(r.status_code == 200 for r in later)
    pd = [r for r in later if r.headers["x-tessera-route"] == "prefill-decode"]
    assert pd and all("x-tessera-fallback" in r.headers for r in pd)
    assert all(r.headers["x-tessera-engines"] == "decode@A100" for r in pd)
    metrics = served.metrics()
    assert 'tessera_engine_up{engine="prefill@L40S"} 0' in metrics
    assert re.search(r'tessera_router_fallbacks_total\{route="prefill-decode"\} [1-9]', metrics)
    assert 'tessera_engine_exits_total{engine="prefill@L40S"} 1' in metrics
    # started again after its 1 s back-off (healthy once vLLM has loaded, 40-80 s here: the supervisor's own
    # test and benchmarks/drill_vllm_failover.py wait for that; this test does not spend the suite's time on it)
    deadline = time.monotonic() + 30
    while 'tessera_engine_restarts_total{engine="prefill@L40S"} 1' not in served.metrics():
        assert time.monotonic() < deadline, served.health()
        time.sleep(0.5)
    assert served.health()["engines"]["prefill@L40S"]["state"] in ("restarting", "up")
