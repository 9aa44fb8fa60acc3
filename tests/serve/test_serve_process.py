"""`tessera serve` as a process, where the process boundary matters (loopback, free ports): it listens
first and /health answers 503 while it starts; a worker killed while it starts, and another killed during
a stream, are re-planned onto the survivors and the stream ends with the same text as without the fault;
the last worker killed ends every stream with an error event and the process exits non-zero; SIGTERM
under load drains within the grace period and exits 0. The two servers start side by side."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m"
ASK = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


class _Process:
    """A `tessera serve` subprocess on a free loopback port, its stderr in a file."""

    def __init__(self, tmp: Path, name: str, *args: str):
        self.log = tmp / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        tessera = str(Path(sys.executable).parent / "tessera")
        self.proc = subprocess.Popen([tessera, "serve", MODEL, "--port", "0",
                                      "--threads", "1", "--slots", "4", "--max-context", "64", *args],
                                     stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=env)
        self.url: str | None = None

    def text(self) -> str:
        return self.log.read_text()

    def wait_url(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while self.url is None:
            m = re.search(r"listening at (http://127\.0\.0\.1:\d+)", self.text())
            if m:
                self.url = m.group(1)
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.02)
        return self.url

    def workers(self) -> list[int]:
        """Pids of its worker processes (spawned children), in start order."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids += [int(p) for p in (task / "children").read_text().split()]
        out = []
        for pid in sorted(pids):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"multiprocessing.spawn" in cmd:
                out.append(pid)
        return out

    def wait_serving(self, timeout: float = 240) -> float:
        """Seconds until /health answers 200 (every answer before is a quick 503 with a state)."""
        t0 = time.monotonic()
        while True:
            r = httpx.get(f"{self.url}/health", timeout=5)
            if r.status_code == 200:
                return time.monotonic() - t0
            assert r.status_code == 503 and r.json()["status"] in ("starting", "recovering"), r.text
            assert "Error" not in r.text
            assert time.monotonic() - t0 < timeout, self.text()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _stream(url: str, body: dict, into: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        into.append(r.read().decode())


def _text(stream: str) -> str:
    out = []
    for line in stream.splitlines():
        if line.startswith("data: {"):
            data = json.loads(line[6:])
            if data.get("choices"):
                out.append(data["choices"][0]["text"])
    return "".join(out)


def _health_when(url: str, want: str, timeout: float) -> float:
    t0 = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).json()["status"] != want:
        assert time.monotonic() - t0 < timeout, want
        time.sleep(0.01)
    return time.monotonic() - t0


def test_worker_loss_at_start_up_and_while_serving_then_the_last_one_exits_non_zero(tmp_path):
    # a lost peer is declared after 10 s, not 30 (the survivors wait that long before the re-plan)
    workers = _Process(tmp_path, "workers", "--cluster", "cpu:3", "--placement", "alternate", "--transfer-timeout", "10")
    local = _Process(tmp_path, "local", "--local", "--shutdown-timeout", "1")
    try:
        url = workers.wait_url()
        local.wait_url()
        h = httpx.get(f"{url}/health", timeout=5)  # listening while it traces and starts workers
        assert h.status_code == 503 and h.json()["status"] == "starting"
        deadline = time.monotonic() + 180
        while len(workers.workers()) < 3:  # kill one as soon as it is spawned: lost while starting
            assert time.monotonic() < deadline and workers.proc.poll() is None, workers.text()
            time.sleep(0.01)
        os.kill(workers.workers()[2], signal.SIGKILL)
        print(f"serving after a start-up loss in {workers.wait_serving():.1f} s (from the kill)")
        assert "(while starting)" in workers.text() or "re-planning" in workers.text()
        health = httpx.get(f"{url}/health", timeout=5).json()  # serving on 2 of its 3 workers: degraded, and why
        assert health["status"] == "degraded" and "lost cpu:2" in health["detail"], health
        plain = httpx.post(f"{url}/v1/completions", json=ASK, timeout=120).json()["choices"][0]["text"]

        streams: list[str] = []
        t = threading.Thread(target=_stream, args=(url, ASK, streams))
        t.start()
        deadline = time.monotonic() + 60
        while "tessera_generated_tokens_total" not in (m := httpx.get(f"{url}/metrics", timeout=5).text) or \
                _value(m, "tessera_generated_tokens_total") < 12 + 3:  # the stream is 3 tokens in
            assert time.monotonic() < deadline
            time.sleep(0.01)
        killed = time.monotonic()
        os.kill(workers.workers()[1], signal.SIGKILL)
        to_recovering = _health_when(url, "recovering", 10)
        to_ok = _wait_ok(url, 120)
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["status"] == "degraded" and "lost cpu:1" in health["detail"], health
        t.join(timeout=120)
        assert _text(streams[0]) == plain, streams  # the stream went on with the same tokens
        assert streams[0].rstrip().endswith("data: [DONE]") and '"error"' not in streams[0]
        m = httpx.get(f"{url}/metrics", timeout=5).text
        assert _value(m, "tessera_recoveries_total") == 1 and _value(m, "tessera_failed_requests_total") == 0
        print(f"worker killed mid-stream: recovering after {to_recovering:.2f} s, 200 again after "
              f"{time.monotonic() - killed:.2f} s (health poll {to_ok:.2f} s), 0 streams failed")

        last: list[str] = []
        before = _value(httpx.get(f"{url}/metrics", timeout=5).text, "tessera_generated_tokens_total")
        t = threading.Thread(target=_stream, args=(url, {**ASK, "max_tokens": 40}, last))
        t.start()
        deadline = time.monotonic() + 60
        while _value(httpx.get(f"{url}/metrics", timeout=5).text, "tessera_generated_tokens_total") < before + 3:
            assert time.monotonic() < deadline  # the stream is 3 tokens in: the kill lands mid-stream
            time.sleep(0.01)
        os.kill(workers.workers()[0], signal.SIGKILL)
        t.join(timeout=60)
        assert workers.proc.wait(60) != 0
        assert '"error"' in last[0] and last[0].rstrip().endswith("data: [DONE]"), last
        assert "Traceback" not in workers.text(), workers.text()

        _sigterm_under_load(local)
    finally:
        workers.stop()
        local.stop()


def _wait_ok(url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() - t0 < timeout
        time.sleep(0.02)
    return time.monotonic() - t0


def _value(metrics: str, name: str) -> float:
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))


def _sigterm_under_load(server: _Process) -> None:
    server.wait_serving()
    url = server.url
    streams: list[str] = []
    threads = [threading.Thread(target=_stream, args=(url, {**ASK, "max_tokens": 50}, streams)) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while _value(httpx.get(f"{url}/metrics", timeout=5).text, "tessera_generated_tokens_total") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(30)
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=10)
    assert code == 0, server.text()
    # the grace period (1 s) cut the streams still running (an error event, then [DONE]) instead of letting
    # them finish their 50 tokens: what the drain promises, whatever the host's speed
    assert len(streams) == 6 and all(s.rstrip().endswith("data: [DONE]") for s in streams), streams
    ended = sum("shutting down" in s for s in streams)
    assert ended >= 1
    assert "Traceback" not in server.text() and "BrokenPipe" not in server.text(), server.text()
    print(f"SIGTERM with 6 streams in flight: exit 0 after {took:.2f} s, {ended} streams ended with an error "
          "event and [DONE]")


def test_only_loopback_is_quiet_without_an_api_key():
    from tessera.cli.sockets import is_loopback as _loopback

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert _loopback(s)

    class _Bound:  # what getsockname() gives for other binds; the suite itself listens on loopback only
        def __init__(self, address):
            self.address = address

        def getsockname(self):
            return self.address

    for address in (("127.0.0.2", 80), ("::1", 80, 0, 0)):
        assert _loopback(_Bound(address))
    for address in (("0.0.0.0", 80), ("::", 80, 0, 0), ("192.168.1.7", 80), ("fe80::1%eth0", 80, 0, 2)):
        assert not _loopback(_Bound(address)), address  # --host 0.0.0.0 and the like: warned about
