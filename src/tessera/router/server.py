"""Running the router: uvicorn over the router's app on a listening socket, with the HTTP layer's limits
(`tessera.serve.connections`: header and body timeouts, a connection cap). SIGTERM or Ctrl-C drains: new
requests get 503, those in flight finish within the grace period; then the server exits 0 (a second signal
stops at once). The caller stops the engines afterwards."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
import uvloop

from tessera.router.app import Router, create_router_app
from tessera.serve.connections import HTTPLimits, server_config


class _RouterServer(uvicorn.Server):
    """uvicorn, with the first shutdown signal draining the router."""

    def __init__(self, config: uvicorn.Config, router: Router, grace_s: float, log: Callable[[str], None]):
        super().__init__(config)
        self.router, self.grace_s, self.log = router, grace_s, log

    def handle_exit(self, sig: int, frame) -> None:
        if self.router.draining:
            self.force_exit = True
            self.should_exit = True
            return
        self.router.draining = True
        threading.Thread(target=self._drain, name="tessera-router-drain", daemon=True).start()

    def _drain(self) -> None:
        t0 = time.monotonic()
        self.log(f"shutting down: finishing {self.router.stats.in_flight} requests in flight (at most "
                 f"{self.grace_s:g} s)")
        while self.router.stats.in_flight and time.monotonic() - t0 < self.grace_s:
            time.sleep(0.05)
        left = self.router.stats.in_flight
        self.log(f"drained in {time.monotonic() - t0:.2f} s" + (f"; {left} requests cut off" if left else ""))
        self.should_exit = True


def run_router(router: Router, sock: socket.socket, limits: HTTPLimits, grace_s: float,
               log: Callable[[str], None], ready: Callable[[], None] = lambda: None) -> int:
    """Serve ``router`` on the listening ``sock`` until a shutdown signal; the exit code (0). ``ready`` is
    called once it answers."""
    app = create_router_app(router)
    server = _RouterServer(server_config(app, limits, log_level="warning", timeout_graceful_shutdown=5), router,
                           grace_s, log)

    async def main() -> None:
        await router.open()
        try:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.02)
            if server.started:
                ready()
            await task
        finally:
            await router.close()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # about half the CPU per relayed event
            runner.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


__all__ = ["run_router"]
