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

import httpx

from tessera.router.table import Endpoint, Hops
from tessera.serve.protocol import APIError

NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                  httpx.WriteError, httpx.PoolTimeout)


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


async def prefill(client: httpx.AsyncClient, endpoint: Endpoint, path: str, body: dict[str, Any],
                  timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """Run the prefill call; (the ``kv_transfer_params`` to pass on, None) or (None, why it failed)."""
    try:
        r = await client.post(endpoint.url + path, json=prefill_body(body, endpoint.connector), timeout=timeout)
    except CONNECT_ERRORS as e:  # taken as down at once; the health poll brings it back once it answers
        endpoint.failures += 1
        endpoint.state, endpoint.detail = "down", "connection lost"
        return None, f"prefill engine {endpoint.name} unreachable ({type(e).__name__})"
    except httpx.TimeoutException as e:  # a slow prefill is skipped too, not a 500
        return None, f"prefill engine {endpoint.name} did not answer within {timeout:g} s ({type(e).__name__})"
    if r.status_code != 200:
        return None, f"prefill engine {endpoint.name} answered {r.status_code}"
    try:
        params = r.json().get("kv_transfer_params")
    except ValueError:
        return None, f"prefill engine {endpoint.name} answered a body that is not JSON"
    return params or {}, None


async def forward(client: httpx.AsyncClient, hops: Hops, path: str, body: dict[str, Any], timeout: float,
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
    request = client.build_request("POST", target.url + path, json=body, timeout=timeout)
    try:
        response = await client.send(request, stream=stream)
    except CONNECT_ERRORS as e:
        target.failures += 1
        target.state, target.detail = "down", "connection lost"
        raise EngineLost(target, e) from None
    except httpx.TimeoutException as e:  # alive but too slow: an OpenAI error, not a 500
        err = APIError(504, f"engine {target.name} did not answer within {timeout:g} s ({type(e).__name__})",
                       "server_error", code="engine_timeout")
        return Upstream(504, err.body(), prefill_fallback=skipped)
    if not stream or response.status_code != 200:
        try:
            data = (await response.aread()) if stream else response.content
            payload = json.loads(data) if data else None
        except (ValueError, *CONNECT_ERRORS):
            payload = APIError(502, f"engine {target.name} answered {response.status_code} with a body that is "
                                    "not JSON", "server_error").body()
        finally:
            await response.aclose()
        return Upstream(response.status_code, payload, prefill_fallback=skipped)
    upstream = Upstream(200, prefill_fallback=skipped)
    upstream.stream = _relay(response, target, upstream)
    return upstream


async def _relay(response: httpx.Response, endpoint: Endpoint, upstream: Upstream) -> AsyncIterator[bytes]:
    """The engine's event stream as it arrives; if the engine is lost mid-stream, an error event and
    ``[DONE]``."""
    pending = b""  # whole events are passed on; a lost engine's half event is dropped
    try:
        async for chunk in response.aiter_raw():
            pending += chunk
            end = pending.rfind(b"\n\n")
            if end >= 0:
                yield pending[:end + 2]
                pending = pending[end + 2:]
        if pending:
            yield pending
    except (*CONNECT_ERRORS, httpx.ReadTimeout) as e:
        endpoint.failures += 1
        endpoint.state, endpoint.detail = "down", "connection lost while streaming"
        upstream.lost = True
        err = APIError(502, f"engine {endpoint.name} was lost while streaming ({type(e).__name__}); the output "
                            "so far is incomplete", "server_error", code="engine_lost")
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
    finally:
        await response.aclose()


__all__ = ["EngineLost", "Upstream", "forward", "prefill", "prefill_body"]
