"""Forwarding one OpenAI request along its hops: straight to the engine that serves it whole, or a
prefill call on the prefill engine and then the decode call on the decode engine.

The prefill call is the same request with ``max_tokens`` 1, not streamed: the prefill engine computes the
prompt and hands its KV on through the connector (``example``: by the prompt's tokens, so nothing passes
between the calls; ``nixl``: the prefill response's ``kv_transfer_params`` go into the decode call, as
vLLM's own disaggregated-serving proxy does). The decode call is the client's request as sent. A prefill
engine that cannot be reached or fails leaves the request to its decode engine alone (it computes the
prompt itself). An engine lost while it streams ends the stream with an error event and ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from tessera.router.table import Endpoint, Hops
from tessera.serve.protocol import APIError

NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}
# aiohttp, not httpx, talks to the engines: it relays a streamed token with a fraction of httpx's CPU (its
# parser is compiled, and httpcore's pool scans every connection per request), CPU the engines on the same
# cores need. A connection that cannot be opened or that breaks marks the engine down; a read that takes
# longer than the timeout (an engine alive but slow) does not.
CONNECT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
SLOW_ERRORS = (TimeoutError,)


def client_timeout(seconds: float) -> aiohttp.ClientTimeout:
    """Each connect and each read within ``seconds`` (no bound on a whole stream, as it may be long)."""
    return aiohttp.ClientTimeout(total=None, connect=seconds, sock_connect=seconds, sock_read=seconds)


def _is_slow(e: BaseException) -> bool:
    """A timeout while reading (the engine is alive), not one while connecting (it is not)."""
    return isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError)


class EngineLost(Exception):
    """An engine that could not be reached, or dropped the connection mid-request."""

    def __init__(self, endpoint: Endpoint, error: BaseException):
        super().__init__(f"engine {endpoint.name} at {endpoint.url} was lost: {type(error).__name__}"
                         + (f": {error}" if str(error) else ""))
        self.endpoint = endpoint


@dataclass
class Upstream:
    """The decode (or whole) engine's answer: its status and either its whole JSON body or a byte stream."""

    status: int
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None
    prefill_fallback: str | None = None  # why a planned prefill hop was skipped
    lost: bool = False  # the engine was lost while streaming (the stream ended with an error event)


def prefill_body(body: dict[str, Any], connector: str | None) -> dict[str, Any]:
    """The prefill call of a client request: one token, not streamed (the connector's parameters added)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "n")}
    out["max_tokens"] = 1
    out["stream"] = False
    if connector == "nixl":
        out["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    return out


async def prefill(client: aiohttp.ClientSession, endpoint: Endpoint, path: str, body: dict[str, Any],
                  timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """Run the prefill call; (the ``kv_transfer_params`` to pass on, None) or (None, why it failed)."""
    try:
        async with client.post(endpoint.url + path, json=prefill_body(body, endpoint.connector),
                               timeout=client_timeout(timeout)) as r:
            status, data = r.status, await r.read()
    except (*CONNECT_ERRORS, *SLOW_ERRORS) as e:
        if _is_slow(e):  # a slow prefill is skipped too, not a 500
            return None, f"prefill engine {endpoint.name} did not answer within {timeout:g} s ({type(e).__name__})"
        endpoint.failures += 1  # taken as down at once; the health poll brings it back once it answers
        endpoint.state, endpoint.detail = "down", "connection lost"
        return None, f"prefill engine {endpoint.name} unreachable ({type(e).__name__})"
    if status != 200:
        return None, f"prefill engine {endpoint.name} answered {status}"
    try:
        params = json.loads(data).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None, f"prefill engine {endpoint.name} answered a body that is not JSON"
    return params or {}, None


async def forward(client: aiohttp.ClientSession, hops: Hops, path: str, body: dict[str, Any], timeout: float,
                  prefilled: Callable[[], None] = lambda: None) -> Upstream:
    """Send ``body`` along ``hops`` (to ``path``, e.g. ``/v1/completions``); the decode engine's answer.
    ``prefilled`` is called once the prefill hop is over (whether it worked or not).

    A decode engine that does not answer within ``timeout`` gives a 504 ``engine_timeout`` error.

    Raises:
        EngineLost: the decode engine could not be reached or dropped the connection before answering.
    """
    body = dict(body)
    skipped = None
    if hops.prefill is not None:
        try:
            params, skipped = await prefill(client, hops.prefill, path, body, timeout)
        finally:
            prefilled()
        if params:
            body["kv_transfer_params"] = params
    target = hops.decode
    stream = bool(body.get("stream"))
    try:
        response = await client.post(target.url + path, json=body, timeout=client_timeout(timeout))
        if stream and response.status == 200:
            upstream = Upstream(200, prefill_fallback=skipped)
            upstream.stream = _relay(response, target, upstream)
            return upstream
        try:
            data = await response.read()
        finally:
            response.release()
    except (*CONNECT_ERRORS, *SLOW_ERRORS) as e:
        if _is_slow(e):  # alive but too slow: an OpenAI error, not a 500
            err = APIError(504, f"engine {target.name} did not answer within {timeout:g} s ({type(e).__name__})",
                           "server_error", code="engine_timeout")
            return Upstream(504, err.body(), prefill_fallback=skipped)
        target.failures += 1
        target.state, target.detail = "down", "connection lost"
        raise EngineLost(target, e) from None
    try:
        payload = json.loads(data) if data else None
    except ValueError:
        payload = APIError(502, f"engine {target.name} answered {response.status} with a body that is not JSON",
                           "server_error").body()
    return Upstream(response.status, payload, prefill_fallback=skipped)


async def _relay(response: aiohttp.ClientResponse, endpoint: Endpoint, upstream: Upstream) -> AsyncIterator[bytes]:
    """The engine's event stream as it arrives; if the engine is lost mid-stream, an error event and
    ``[DONE]``."""
    pending = b""  # whole events are passed on; a lost engine's half event is dropped
    try:
        async for chunk in response.content.iter_any():
            pending += chunk
            end = pending.rfind(b"\n\n")
            if end >= 0:
                yield pending[:end + 2]
                pending = pending[end + 2:]
        if pending:
            yield pending
    except (*CONNECT_ERRORS, *SLOW_ERRORS) as e:
        endpoint.failures += 1
        endpoint.state, endpoint.detail = "down", "connection lost while streaming"
        upstream.lost = True
        err = APIError(502, f"engine {endpoint.name} was lost while streaming ({type(e).__name__}); the output "
                            "so far is incomplete", "server_error", code="engine_lost")
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
    finally:
        response.release()


__all__ = ["EngineLost", "Upstream", "forward", "prefill", "prefill_body"]
