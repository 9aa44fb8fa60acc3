"""Stub engines: tiny stand-ins for the HTTP surface of vLLM's OpenAI server, to test the router's own logic
(routing, the prefill and decode calls, relaying streams, losing an engine) without vLLM. Nothing here
models vLLM's behaviour beyond the shapes the router reads; the end-to-end test against real vLLM engines is
separate.

A `StubEngine` is a FastAPI app served by uvicorn on an ephemeral loopback port in a thread of its own:

- ``GET /health``: 200 with an empty body (as vLLM answers).
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: record the body (``bodies``, with the path),
  then answer a completion whose text is ``"echo:" + prompt`` (the last message's content for chat), with
  ``kv_transfer_params`` = `KV_PARAMS` when the body asked ``kv_transfer_params.do_remote_decode`` (what a
  NIXL prefill engine hands back). With ``"stream": true`` the answer is an SSE stream of ``events``
  ``data: {...}`` chunks (``tok0``, ``tok1``, ...) and ``data: [DONE]``, ``delay_s`` apart; a whole answer
  comes after ``answer_delay_s`` (an engine too slow for the router's timeout).
- ``stop(abort=True)`` drops every open connection at once (a crash, as the router sees it: a stream cut
  off mid-body) and closes the port; ``stop(abort=False)`` shuts down as uvicorn does on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

KV_PARAMS = {"remote_engine_id": "x", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1", "remote_port": 5600,
             "do_remote_prefill": True, "do_remote_decode": False}
START_TIMEOUT_S = 20.0


class StubEngine:
    """One stub engine (see the module docstring); ``start()`` returns once it accepts requests."""

    def __init__(self, name: str, events: int = 3, delay_s: float = 0.0, answer_delay_s: float = 0.0):
        self.name, self.events, self.delay_s, self.answer_delay_s = name, events, delay_s, answer_delay_s
        self.bodies: list[tuple[str, dict[str, Any]]] = []  # (path, body) of every completion request
        self.streams_started = threading.Event()  # set when a stream has sent its first event
        self.loop: asyncio.AbstractEventLoop | None = None
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._run, name=f"stub-{name}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def bodies_at(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.bodies if p == path]

    def start(self) -> StubEngine:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"stub engine {self.name} did not start")
            time.sleep(0.01)
        return self

    def stop(self, abort: bool = True) -> None:
        """Stop serving; with ``abort``, drop the open connections first (streams end mid-body)."""
        if not self._thread.is_alive():
            return
        if abort and self.loop is not None:
            done = threading.Event()

            def drop() -> None:
                for conn in list(self.server.server_state.connections):
                    transport = getattr(conn, "transport", None)
                    if transport is not None:
                        transport.abort()
                done.set()

            with contextlib.suppress(RuntimeError):  # the loop already closed
                self.loop.call_soon_threadsafe(drop)
                done.wait(5)
            self.server.force_exit = True
        self.server.should_exit = True
        self._thread.join(10)
        assert not self._thread.is_alive(), f"stub engine {self.name} did not stop"

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self._sock])

        asyncio.run(main())

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._complete("/v1/completions", await request.json())

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._complete("/v1/chat/completions", await request.json())

        return app

    async def _complete(self, path: str, body: dict[str, Any]) -> Response:
        self.bodies.append((path, body))
        chat = path.endswith("chat/completions")
        if chat:
            messages = body.get("messages") or [{}]
            prompt = messages[-1].get("content", "")
        else:
            prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            prompt = json.dumps(prompt)
        model = body.get("model", "")
        if body.get("stream"):
            return StreamingResponse(self._events(model, chat), media_type="text/event-stream")
        if self.answer_delay_s:
            await asyncio.sleep(self.answer_delay_s)
        text = "echo:" + prompt
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        answer: dict[str, Any] = {"id": f"{self.name}-1", "object": "chat.completion" if chat else "text_completion",
                                  "created": 0, "model": model, "choices": [choice],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                                  "served_by": self.name}
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = dict(KV_PARAMS)
        return JSONResponse(answer)

    async def _events(self, model: str, chat: bool):
        for i in range(self.events):
            if i and self.delay_s:
                await asyncio.sleep(self.delay_s)
            delta = {"delta": {"content": f"tok{i}"}} if chat else {"text": f"tok{i}"}
            chunk = {"id": f"{self.name}-s", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": model,
                     "choices": [{"index": 0, **delta, "finish_reason": "length" if i == self.events - 1 else None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            self.streams_started.set()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        yield "data: [DONE]\n\n"


__all__ = ["KV_PARAMS", "StubEngine"]
