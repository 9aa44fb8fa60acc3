"""The life of a server from listening to exit, as /health and /metrics tell it.

A server listens first and starts its engine behind it: ``starting`` until the engine runs, then
``serving``; ``recovering`` while the engine re-plans onto the workers that survived a lost one, then
``degraded`` while it serves on them (fewer workers than it started with: 200, naming what was lost);
``draining`` after a shutdown signal (no new requests; those in flight finish within the grace period,
then each remaining one ends with an error); ``error`` when the engine cannot go on (the server exits
non-zero for its supervisor to restart it) or could not start. /health answers 200 while serving (``ok``,
or ``degraded``), else 503 with the state, and never internal exception text.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tessera.serve.engine import Engine

STATES = ("starting", "serving", "recovering", "degraded", "draining", "error", "stopped")
SHUTDOWN_MESSAGE = "the server is shutting down; retry on another replica or after it restarts"


@dataclass
class Drained:
    """How a shutdown drain went: requests that finished within the grace period, and those ended early."""

    finished: int
    aborted: int
    seconds: float


class Lifecycle:
    """The server's state (one of ``STATES``) and its engine once started."""

    def __init__(self, engine: Engine | None = None):
        self.engine = engine
        self._state = "starting" if engine is None else "serving"
        self.detail = "loading the model and starting the workers" if engine is None else ""
        self.changed = threading.Event()  # set when the state changes (start-up done, failed, drained)

    @classmethod
    def of(cls, target: Engine | Lifecycle) -> Lifecycle:
        """``target`` itself, or a serving lifecycle over an engine already running."""
        return target if isinstance(target, Lifecycle) else cls(target)

    def ready(self, engine: Engine) -> None:
        """The engine runs: serve."""
        self.engine = engine
        self._state, self.detail = "serving", ""
        self.changed.set()

    def failed(self, detail: str) -> None:
        """The server cannot serve (start-up failed, or the engine lost its backend)."""
        self._state, self.detail = "error", detail
        self.changed.set()

    @property
    def state(self) -> str:
        """The state now (the engine's own, recovering or failed, takes precedence while serving)."""
        engine = self.engine
        if engine is not None and self._state in ("serving", "draining"):
            if engine.error is not None:
                return "error"
            if engine.status in ("recovering", "draining") or engine.status == "degraded" and self._state == "serving":
                return engine.status
        return self._state

    def health(self) -> tuple[int, dict[str, str]]:
        """The HTTP status and body of a health check."""
        state = self.state
        if state == "serving":
            return 200, {"status": "ok"}
        if state == "degraded":
            return 200, {"status": "degraded", "detail": f"serving on the workers that survived: {self.engine.degraded}"}
        detail = {"starting": self.detail or "starting",
                  "recovering": "a worker was lost; re-planning onto the survivors",
                  "draining": "shutting down: finishing the requests in flight",
                  "error": self.detail or "the engine lost its workers; the server is exiting",
                  "stopped": "stopped"}[state]
        return 503, {"status": state, "detail": detail}

    def drain(self, timeout_s: float, poll_s: float = 0.02) -> Drained:
        """Stop admitting, wait at most ``timeout_s`` for the requests in flight, then end the rest with an
        error (their streams get an error event and [DONE])."""
        t0 = time.monotonic()
        self._state = "draining"
        engine = self.engine
        if engine is None:
            return Drained(0, 0, 0.0)
        engine.close_admission()
        before_done, before_failed = engine.stats.completed, engine.stats.failed
        while not engine.idle() and engine.running and time.monotonic() - t0 < timeout_s:
            time.sleep(poll_s)
        aborted = 0
        if not engine.idle() and engine.running:
            queued, in_flight = engine.queue_depth()
            aborted = queued + in_flight
            engine.abort(SHUTDOWN_MESSAGE)
            while not engine.idle() and engine.running and time.monotonic() - t0 < timeout_s + 5:
                time.sleep(poll_s)
        self.changed.set()
        return Drained(engine.stats.completed - before_done, max(aborted, engine.stats.failed - before_failed),
                       time.monotonic() - t0)


__all__ = ["SHUTDOWN_MESSAGE", "STATES", "Drained", "Lifecycle"]
