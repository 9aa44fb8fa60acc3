"""Engine processes: started, waited for until healthy, watched, restarted with back-off, stopped.

Each engine runs in a session of its own (vLLM starts helper processes: stopping the session's group stops
them all) with its output in a log file. The supervisor starts every engine at once and waits until each
answers ``/health``; afterwards a watcher thread notices an engine whose process ended, says so to its
listeners, and starts it again after a back-off (1 s, doubling up to 30 s, back to 1 s once an engine
has stayed up for a minute) until it is healthy again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tessera.engines.vllm import EngineLaunch
from tessera.errors import TesseraError

STATES = ("starting", "up", "down", "restarting", "stopped")
BACKOFF_S = (1.0, 30.0)  # first and longest wait before a restart
STABLE_S = 60.0  # up this long: the next failure waits the first back-off again
POLL_S = 0.5

Listener = Callable[[str, str, str], None]  # (engine name, new state, detail)


class EngineStartError(TesseraError):
    """An engine that ended or did not become healthy while starting (the message quotes its log's end)."""


@dataclass
class EngineStatus:
    """One engine's state as /health and /metrics report it."""

    name: str
    state: str = "starting"
    pid: int | None = None
    restarts: int = 0
    exits: int = 0
    detail: str = ""
    since: float = field(default_factory=time.monotonic)


def pin_this_process(cores: tuple[int, ...]) -> None:
    """Run every thread of this process (and what it starts from now on) on ``cores`` only."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


class EngineProcess:
    """One engine's process (in a session of its own, output to ``log``)."""

    def __init__(self, launch: EngineLaunch, log: Path):
        self.launch, self.log = launch, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> int:
        """Start the process; its pid."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"\n=== tessera: starting {self.launch.engine.name}: {self.launch.shell()}\n".encode())
            out.flush()
            cores = self.launch.host_cores
            self.proc = subprocess.Popen(list(self.launch.argv), env={**os.environ, **self.launch.env}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        return self.proc.pid

    @property
    def exit_code(self) -> int | None:
        """The exit status once the process has ended (None while it runs or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether the engine answers ``/health`` with 200."""
        try:
            return httpx.get(f"{self.launch.url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the engine's whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # helpers that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self, lines: int = 15) -> str:
        """The end of the engine's log (for error messages)."""
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class Supervisor:
    """Every engine of a deployment: started together, healthy before serving, restarted when one ends."""

    def __init__(self, launches: list[EngineLaunch], log_dir: Path, say: Callable[[str], None] = lambda s: None,
                 restart: bool = True):
        self.processes = {ln.engine.name: EngineProcess(ln, log_dir / f"{_file_name(ln.engine.name)}.log")
                          for ln in launches}
        self.status = {name: EngineStatus(name) for name in self.processes}
        self.say, self.restart = say, restart
        self.listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self, timeout_s: float = 900.0) -> float:
        """Start every engine and wait until each is healthy (progress lines every 15 s); the seconds it took.

        Raises:
            EngineStartError: an engine ended or was not healthy within ``timeout_s`` (all are stopped).
        """
        t0 = time.monotonic()
        for name, p in self.processes.items():
            self.status[name].pid = p.start()
            self.say(f"starting engine {name} on {p.launch.placement.node} at {p.launch.url} (pid {p.proc.pid}, log: "
                     f"{p.log})")
        waiting, said = set(self.processes), t0
        while waiting:
            for name in sorted(waiting):
                p = self.processes[name]
                if p.exit_code is not None:
                    self.stop()
                    raise EngineStartError(f"engine {name} exited with status {p.exit_code} while starting; the end "
                                           f"of its log ({p.log}):\n{p.tail()}")
                if p.healthy():
                    waiting.discard(name)
                    self._set(name, "up", f"healthy after {time.monotonic() - t0:.0f} s")
                    self.say(f"engine {name} is up ({time.monotonic() - t0:.0f} s)")
            if waiting and time.monotonic() - t0 > timeout_s:
                self.stop()
                raise EngineStartError(f"engines {', '.join(sorted(waiting))} not healthy after {timeout_s:.0f} s")
            if waiting and time.monotonic() - said > 15:
                said = time.monotonic()
                self.say(f"waiting for {', '.join(sorted(waiting))} ({said - t0:.0f} s)")
            if waiting:
                time.sleep(POLL_S)
        self._watcher = threading.Thread(target=self._watch, name="tessera-engines", daemon=True)
        self._watcher.start()
        return time.monotonic() - t0

    def kill(self, name: str) -> None:
        """Kill engine ``name`` at once (SIGKILL), as a crash would (tests and fault drills)."""
        self.processes[name].kill()

    def stop(self) -> None:
        """Stop watching and stop every engine."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(30)  # a restart under way ends first, or its new process would outlive stop()
        threads = [threading.Thread(target=p.stop, daemon=True) for p in self.processes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        for name in self.processes:
            self._set(name, "stopped", "")

    def _set(self, name: str, state: str, detail: str) -> None:
        with self._lock:
            s = self.status[name]
            if s.state == state and s.detail == detail:
                return
            s.state, s.detail, s.since = state, detail, time.monotonic()
        for listener in list(self.listeners):
            listener(name, state, detail)

    def _watch(self) -> None:
        backoff = {name: BACKOFF_S[0] for name in self.processes}
        due: dict[str, float] = {}

        def ended(name: str, now: float, detail: str) -> None:  # down; started again after its back-off
            self.status[name].exits += 1
            due[name] = now + backoff[name]
            backoff[name] = min(backoff[name] * 2, BACKOFF_S[1])
            self._set(name, "down", detail)

        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            for name, p in self.processes.items():
                s = self.status[name]
                if s.state == "up":
                    if p.exit_code is None:
                        if now - s.since > STABLE_S:
                            backoff[name] = BACKOFF_S[0]
                        continue
                    self.say(f"engine {name} exited with status {p.exit_code}"
                             + (f"; restarting in {backoff[name]:g} s" if self.restart else ""))
                    ended(name, now, f"exited with status {p.exit_code}")
                elif s.state == "down" and self.restart and now >= due.get(name, 0.0):
                    s.restarts += 1
                    s.pid = p.start()
                    self._set(name, "restarting", f"restart {s.restarts}")
                elif s.state == "restarting":
                    if p.exit_code is not None:
                        ended(name, now, f"exited with status {p.exit_code} while restarting")
                    elif p.healthy():
                        self._set(name, "up", f"back after restart {s.restarts}")
                        self.say(f"engine {name} is back up (restart {s.restarts})")


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


__all__ = ["STATES", "EngineProcess", "EngineStartError", "EngineStatus", "Supervisor"]
