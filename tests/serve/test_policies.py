"""Every policy `tessera plan` solves for smollm2-135m on cpu:2 serves under `tessera serve --policy P`
(a real server process per policy, one greedy completion each), through the CLI."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tessera.plan.config import POLICIES

ENTRY = "from tessera.cli.main import main; main()"
START_TIMEOUT_S = 240


class _Server:
    """`tessera serve` in a subprocess on a free port; its stderr collected by a thread."""

    def __init__(self, policy: str):
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, "serve", "smollm2-135m", "--cluster", "cpu:2",
                                      "--policy", policy, "--port", "0", "--slots", "2", "--max-context", "128"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"serving smollm2-135m at (http://127\.0\.0\.1:\d+)/v1", self.log)
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"the server did not start:\n{self.log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# Serving differs by policy only in request-dist (one engine per replica, serve.replicas) and attention-ffn (its
# M = 1 split); the others serve the placement `tests/runtime/test_policies.py` runs and checks token for
# token, through the same engine `tests/serve/test_api.py` serves, so they are kept out of the default run.
_SERVE_SPECIFIC = {"request-dist", "attention-ffn"}


@pytest.mark.parametrize("policy", [p if p in _SERVE_SPECIFIC else pytest.param(p, marks=pytest.mark.slow)
                                    for p in POLICIES])
def test_every_policy_serves_a_correct_completion(policy):
    server = _Server(policy)
    try:
        url = server.url()
        # request-dist: two requests at once, one per replica (each has one slot); else one request
        bodies = _completions(url, 2 if policy == "request-dist" else 1)
        for body in bodies:
            assert body["choices"][0]["text"] == " Paris.", body
            assert body["usage"]["completion_tokens"] == 2
        assert re.search(rf"placement: (throughput: )?{policy}", server.log), server.log
        if policy == "request-dist":  # one engine per worker, one slot each, both busy
            assert "1 slot on cpu:0, 1 slot on cpu:1" in server.log, server.log
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            busy = dict(re.findall(r'tessera_device_busy_seconds_total\{device="(cpu:\d)"\} (\S+)', metrics))
            assert set(busy) == {"cpu:0", "cpu:1"} and all(float(v) > 0 for v in busy.values()), metrics
            assert "tessera_completed_requests_total 2" in metrics, metrics
    finally:
        server.close()
    assert server.proc.returncode is not None


def _completions(url: str, n: int) -> list[dict]:
    """``n`` greedy completions of the prompt sent at once."""
    replies: list[httpx.Response | None] = [None] * n

    def one(i: int) -> None:
        replies[i] = httpx.post(f"{url}/v1/completions", timeout=120,
                                json={"model": "smollm2-135m", "prompt": "The capital of France is",
                                      "max_tokens": 2, "temperature": 0})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in replies:
        assert r is not None and r.status_code == 200, r and r.text
    return [r.json() for r in replies]
