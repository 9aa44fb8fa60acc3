"""`tessera bench`'s client: a workload's requests sent to an OpenAI-compatible server as streamed
completions, open loop (each request leaves at its arrival time, whether or not earlier ones are done),
and what it measured: output tokens/s, TTFT and TPOT percentiles, SLO attainment.

A prompt of N tokens is N repetitions of a common word (one token each in the usual BPE vocabularies);
the server's reported usage gives the real counts. A server cannot be told to ignore end-of-sequence
through this API, so a request may generate fewer tokens than the workload asks; the counts reported
are the tokens actually generated.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.errors import TesseraError
from tessera.workload import ImagesWorkload, Workload, draw_requests, parse_workload

PROMPT_WORD = "hello"


class BenchError(TesseraError):
    """A benchmark that cannot run (bad URL, no server, a workload it cannot send)."""


@dataclass(frozen=True)
class Planned:
    """One request of the benchmark: when it leaves (seconds after the start) and its lengths."""

    index: int
    arrival_s: float
    input: int
    output: int


@dataclass
class Outcome:
    """What happened to one request (times in seconds after the benchmark's start)."""

    planned: Planned
    sent_s: float = 0.0
    first_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.end_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_s) / (self.output_tokens - 1)


@dataclass
class BenchReport:
    """The benchmark's results (``summary()`` is ``tessera bench --json``)."""

    url: str
    model: str
    workload: str
    outcomes: list[Outcome]
    duration_s: float
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        done = [o for o in self.outcomes if o.ok]
        ttft = [o.ttft_s for o in done if o.ttft_s is not None]
        tpot = [o.tpot_s for o in done if o.tpot_s is not None]
        latency = [o.end_s - o.sent_s for o in done if o.end_s is not None]
        out_tokens = sum(o.output_tokens for o in done)
        in_tokens = sum(o.prompt_tokens or 0 for o in done)
        slo = None
        if self.slo_ttft_s is not None or self.slo_tpot_s is not None:
            met = sum(1 for o in self.outcomes if self._meets(o))
            slo = {"ttft_s": self.slo_ttft_s, "tpot_s": self.slo_tpot_s,
                   "attainment": met / len(self.outcomes) if self.outcomes else None}
        seconds = self.duration_s
        return {"url": self.url, "model": self.model, "workload": self.workload,
                "requests": len(self.outcomes), "completed": len(done), "failed": len(self.outcomes) - len(done),
                "duration_s": seconds, "input_tokens": in_tokens, "output_tokens": out_tokens,
                "throughput": out_tokens / seconds if seconds > 0 else None,
                "request_throughput": len(done) / seconds if seconds > 0 else None,
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
                "latency_p50_s": _pct(latency, 50), "latency_p99_s": _pct(latency, 99),
                "slo": slo, "errors": self.errors[:5]}

    def _meets(self, o: Outcome) -> bool:
        if not o.ok:
            return False
        if self.slo_ttft_s is not None and (o.ttft_s is None or o.ttft_s > self.slo_ttft_s):
            return False
        tpot = o.tpot_s
        return self.slo_tpot_s is None or tpot is None or tpot <= self.slo_tpot_s


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def planned_requests(workload: Workload, seed: int = 0) -> list[Planned]:
    """The workload's requests: all at once (fixed) or Poisson arrivals with sampled lengths; the same
    draws as the simulator's arrivals for the same seed."""
    if isinstance(workload, ImagesWorkload):
        raise BenchError("tessera bench sends text completions; an images workload is for diffusion models "
                         "(use fixed:... or poisson:...)")
    return [Planned(i, t, a, b) for i, (t, a, b) in enumerate(draw_requests(workload, seed))]


def synthetic_prompt(tokens: int) -> str:
    """A prompt of about ``tokens`` tokens."""
    return " ".join([PROMPT_WORD] * tokens)


def base_url(url: str) -> str:
    """The server's root URL (``http://host:port``) from what a user gives (with or without ``/v1``)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--url {url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status}: {message}"


async def sse_objects(response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an OpenAI event stream (an httpx streaming response), up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _one(client, url: str, model: str, p: Planned, start: float, outcome: Outcome) -> None:
    delay = start + p.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    payload = {"model": model, "prompt": synthetic_prompt(p.input), "max_tokens": p.output, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
    outcome.sent_s = time.perf_counter() - start
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            if r.status_code != 200:
                outcome.error = _error_text(r.status_code, await r.aread())
                return
            async for obj in sse_objects(r):
                if "error" in obj:
                    outcome.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                    return
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    if choice.get("text"):
                        chunks += 1
                        if outcome.first_s is None:
                            outcome.first_s = time.perf_counter() - start
        outcome.end_s = time.perf_counter() - start
        outcome.output_tokens = usage["completion_tokens"] if usage else chunks
        outcome.prompt_tokens = usage["prompt_tokens"] if usage else None
    except Exception as e:  # noqa: BLE001 - every failure of one request is counted, not fatal
        outcome.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def _model(client, url: str) -> str:
    r = await client.get(f"{url}/v1/models")
    if r.status_code != 200:
        raise BenchError(f"{url}/v1/models: {_error_text(r.status_code, r.content)}")
    data = r.json().get("data") or []
    if not data:
        raise BenchError(f"{url}/v1/models lists no model; give --model")
    return data[0]["id"]


async def run_bench_async(url: str, workload: str, model: str | None = None, api_key: str | None = None,
                          seed: int = 0, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                          timeout_s: float = 600.0,
                          progress: Callable[[int, int, int], None] | None = None) -> BenchReport:
    """Send the workload to the server at ``url``; ``progress(done, failed, total)`` after each request."""
    import httpx

    root = base_url(url)
    plan = planned_requests(parse_workload(workload), seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        try:
            model = model or await _model(client, root)
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach a server at {root}: {e}") from None
        outcomes = [Outcome(p) for p in plan]
        done = failed = 0
        if progress:
            progress(0, 0, len(plan))

        async def tracked(p: Planned, o: Outcome) -> None:
            nonlocal done, failed
            await _one(client, root, model, p, start, o)
            done += 1
            failed += not o.ok
            if progress:
                progress(done, failed, len(plan))

        start = time.perf_counter()
        await asyncio.gather(*(tracked(p, o) for p, o in zip(plan, outcomes, strict=True)))
        duration = time.perf_counter() - start
    errors = list(dict.fromkeys(o.error for o in outcomes if o.error))
    return BenchReport(root, model, workload, outcomes, duration, slo_ttft_s, slo_tpot_s, errors)


def run_bench(*args, **kwargs) -> BenchReport:
    """:func:`run_bench_async` from synchronous code."""
    return asyncio.run(run_bench_async(*args, **kwargs))
