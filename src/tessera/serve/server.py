"""Running a server process: the HTTP server listens at once and the engine starts behind it; a shutdown
signal drains; an engine that cannot go on ends the process non-zero (see ``serve.lifecycle``).

``run_server`` blocks until the server exits and returns the process's exit code: 0 after a shutdown
signal (SIGTERM or Ctrl-C: stop admitting, finish what is in flight within the grace period, end the rest
with an error event), 1 when the engine could not start or lost its last worker (so that a supervisor
restarts it). A second signal while draining stops at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from tessera.errors import TesseraError
from tessera.serve.api import MAX_BODY_BYTES, create_app
from tessera.serve.config import ServeConfig
from tessera.serve.connections import HTTPLimits, server_config
from tessera.serve.lifecycle import Lifecycle

FLUSH_S = 0.3  # after the last error events, time for the event loop to write them before closing


@dataclass(frozen=True)
class ServerOptions:
    """How the HTTP side runs: the model id served, the API key, the body limit, the shutdown grace and the
    limits on slow, idle and too many clients (``serve.connections``)."""

    model_id: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_timeout_s: float = 10.0
    limits: HTTPLimits = HTTPLimits()


class _Server(uvicorn.Server):
    """uvicorn, with a shutdown signal draining the engine first (and not re-raised afterwards, so the
    process exits 0)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float, log: Callable[[str], None]):
        super().__init__(config)
        self.lifecycle, self.grace_s, self.log = lifecycle, grace_s, log
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining or self.lifecycle.engine is None:
            if self.draining and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self.draining = True
        threading.Thread(target=self._drain, name="tessera-drain", daemon=True).start()

    def _drain(self) -> None:
        self.log(f"shutting down: finishing the requests in flight (at most {self.grace_s:g} s)")
        drained = self.lifecycle.drain(self.grace_s)
        self.log(f"drained in {drained.seconds:.2f} s: {drained.finished} finished, {drained.aborted} ended early")
        time.sleep(FLUSH_S)
        self.should_exit = True


def run_server(cfg: ServeConfig, sock: socket.socket, options: ServerOptions, log: Callable[[str], None],
               announce: Callable[[str], None]) -> int:
    """Serve ``cfg`` on the listening ``sock`` until a shutdown signal or a fatal engine error; the exit code.
    ``log`` gets progress lines, ``announce`` the placement once serving."""
    from tessera.serve.launch import start_engine

    lifecycle = Lifecycle()
    app = create_app(lifecycle, options.model_id, options.api_key, options.max_body_bytes)
    config = server_config(app, options.limits, log_level="warning", timeout_graceful_shutdown=5)
    server = _Server(config, lifecycle, options.shutdown_timeout_s, log)
    code = [0]

    def fatal(error: BaseException) -> None:  # on the engine thread, after every request got its error
        lifecycle.failed("the engine lost its workers; the server is exiting for its supervisor to restart it")
        log(f"the engine cannot go on ({error}); exiting")
        code[0] = 1
        threading.Timer(FLUSH_S, lambda: setattr(server, "should_exit", True)).start()

    def start() -> None:
        try:
            engine, how = start_engine(cfg, log=log)
        except BaseException as e:  # noqa: BLE001 - the process exits non-zero with the message
            lifecycle.failed("the engine could not start")
            log(f"error: the engine could not start: "
                f"{e if isinstance(e, TesseraError) else f'{type(e).__name__}: {e}'}")
            code[0] = 1
            server.should_exit = True
            return
        if server.should_exit:  # stopped while starting
            engine.stop()
            return
        engine.on_fatal = fatal
        lifecycle.ready(engine)
        announce(how)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            threading.Thread(target=start, name="tessera-start", daemon=True).start()
        await task

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        if lifecycle.engine is not None:
            log("stopping the engine")
            lifecycle.engine.stop()
        sock.close()
    return code[0]


__all__ = ["ServerOptions", "run_server"]
