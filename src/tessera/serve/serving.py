"""The OpenAI API's semantics over a running engine, without HTTP: what the routes of ``serve.api`` call.

``OpenAIServing`` (over an engine and the model id it is served as) checks a completions or chat request,
turns it into a prompt and sampling parameters (a chat through the tokenizer's chat template), submits it
to the engine and answers it: the whole response object, or an ``EventStream`` of server-sent events.
Each request's engine events (called on the engine thread) are handed to the event loop with
``call_soon_threadsafe`` into an asyncio queue of its own. Anything wrong with a request is an
``APIError``: 400 for a bad request, 404 for a model this server does not serve, 503 when the engine takes
no requests (shutting down, or failed), and 500 when the server failed while serving the request (a
failed step, a lost backend, a shutdown that could not wait for it). A request nobody listens to any more (a
stream closed early, or a whole response whose client went away) is cancelled, which frees its slot
before the next step.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tessera.serve.engine import (
    Engine,
    EngineBusy,
    EngineUnavailable,
    Generation,
    GenerationParams,
    QueueTimeout,
    RequestError,
    ServerFault,
)
from tessera.serve.protocol import (
    APIError,
    Busy,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
)

DISCONNECT_POLL_S = 0.25  # how often a whole (non-streamed) request checks that its client is still there

Disconnected = Callable[[], Awaitable[bool]]  # whether the client of a request has gone away


async def _never() -> bool:
    """A client that never goes away."""
    return False


class _Events:
    """One request's engine events, delivered to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def sink(self, kind: str, payload: Any) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


def _failure(engine: Engine, message: str) -> APIError:
    """The error for a request the engine ended with ``message``: the server's if it says so (a ServerFault),
    else the request's."""
    if isinstance(message, QueueTimeout):
        return APIError(503, str(message), "server_error", code="queue_timeout")
    if isinstance(message, ServerFault) or engine.error is not None:
        return APIError(500, str(message), "server_error")
    return APIError(400, str(message))


class Served:
    """A request submitted to the engine: its generation, its event queue and its prompt's length."""

    def __init__(self, engine: Engine, gen: Generation, events: _Events, prompt_tokens: int):
        self.engine, self.gen, self.events, self.prompt_tokens = engine, gen, events, prompt_tokens
        self.finished = False

    def usage(self) -> dict[str, int]:
        """The OpenAI usage object: prompt, completion and total tokens so far."""
        done = len(self.gen.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    async def release(self) -> None:
        """Cancel the request unless it has finished (nobody is listening to it any more)."""
        if not self.finished:
            self.engine.cancel(self.gen)

    async def collect(self, disconnected: Disconnected = _never) -> tuple[str, str] | None:
        """The whole text and finish reason; None (and the request cancelled) when its client went away."""
        text: list[str] = []
        checked = time.monotonic()
        try:
            while True:
                kind, payload = await self._next(DISCONNECT_POLL_S)
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await disconnected():
                        return None
                if kind == "token":
                    text.append(payload)
                elif kind in ("done", "error"):
                    self.finished = True
                    if kind == "error":
                        raise _failure(self.engine, payload)
                    return "".join(text), payload
        finally:
            await self.release()

    async def _next(self, timeout: float) -> tuple[str, Any]:
        """The next engine event, or ``("", None)`` when none came within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self.events.queue.get(), timeout)
        except TimeoutError:
            return "", None


class _Response:
    """The response objects of one request: its id, creation time and model."""

    prefix = ""

    def __init__(self, model_id: str):
        self.id, self.created, self.model = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time()), model_id

    def head(self, object_: str) -> dict[str, Any]:
        """The fields every object of this response starts with."""
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None) -> dict[str, Any]:
        """A stream chunk carrying ``text`` (or nothing) and the finish reason (or None)."""
        raise NotImplementedError

    def opening(self) -> dict[str, Any] | None:
        """The chunk a stream opens with, if any."""
        return None

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        return {**self.chunk(None, None), "choices": [], "usage": usage}

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        raise NotImplementedError


class CompletionResponse(_Response):
    """The ``text_completion`` objects of a ``/v1/completions`` request."""

    prefix = "cmpl"

    def chunk(self, text: str | None, finish: str | None) -> dict[str, Any]:
        """A ``text_completion`` with one choice of ``text``."""
        return {**self.head("text_completion"),
                "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        """The ``text_completion`` with the whole text and the usage."""
        return {**self.chunk(text, finish), "usage": usage}


class ChatResponse(_Response):
    """The ``chat.completion`` objects of a ``/v1/chat/completions`` request."""

    prefix = "chatcmpl"

    def chunk(self, text: str | None, finish: str | None) -> dict[str, Any]:
        """A ``chat.completion.chunk`` whose delta carries ``text``."""
        delta = {} if text is None else {"content": text}
        return {**self.head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def opening(self) -> dict[str, Any]:
        """The chunk naming the assistant's role."""
        first = self.chunk(None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return first

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        """The ``chat.completion`` with the assistant's message and the usage."""
        return {**self.head("chat.completion"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}],
                "usage": usage}


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream:
    """A streamed response: one chunk per piece of text, the finish, usage if asked for, then ``[DONE]``."""

    def __init__(self, served: Served, response: _Response, include_usage: bool):
        self.served, self.response, self.include_usage = served, response, include_usage

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events; an engine error becomes an error event. Closing it early cancels the
        request."""
        served, response = self.served, self.response
        try:
            first = response.opening()
            if first is not None:
                yield sse(first)
            while True:
                kind, payload = await served.events.queue.get()
                if kind == "token":
                    yield sse(response.chunk(payload, None))
                    continue
                served.finished = True
                yield sse(response.chunk(None, payload) if kind == "done"
                          else _failure(served.engine, payload).body())
                break
            if self.include_usage:
                yield sse(response.usage_chunk(served.usage()))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is cancelled or closed): free the slot
            await served.release()

    async def release(self) -> None:
        """Cancel the request unless it finished (a client gone before the stream started never ran it)."""
        await self.served.release()


class OpenAIServing:
    """Completions and chat completions of the OpenAI API over ``engine``, serving it as ``model_id``."""

    def __init__(self, engine: Engine, model_id: str):
        self.engine, self.model_id = engine, model_id
        self.created = int(time.time())
        self.tokenizer = engine.tokenizer
        self.vocab = len(self.tokenizer)

    # ---- health and models ------------------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, str]]:
        """The HTTP status and body of a health check (see ``serve.lifecycle``)."""
        from tessera.serve.lifecycle import Lifecycle

        return Lifecycle(self.engine).health()

    def model_card(self) -> dict[str, Any]:
        """The OpenAI model object of the served model."""
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "tessera",
                "max_model_len": self.engine.max_context}

    def model_list(self) -> dict[str, Any]:
        """The list of models served (one)."""
        return {"object": "list", "data": [self.model_card()]}

    def retrieve_model(self, model: str) -> dict[str, Any]:
        """The model object of ``model``, if it is the one served."""
        self.check_model(model)
        return self.model_card()

    def check_model(self, model: str) -> None:
        """Refuse (404) a model other than the one served."""
        if model != self.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    # ---- completions ------------------------------------------------------------------------------------
    async def create_completion(self, body: CompletionRequest, disconnected: Disconnected = _never
                                ) -> dict[str, Any] | EventStream | None:
        """Serve a ``/v1/completions`` request: the whole ``text_completion``, a stream of chunks, or None when
        the client went away before it finished."""
        self._check_completion(body)
        prompt_ids = await asyncio.to_thread(self.completion_prompt, body.prompt)  # off the event loop
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        served = self._submit_request(body, prompt_ids, max_tokens, "prompt")
        return await self._respond(body, served, CompletionResponse(self.model_id), disconnected)

    def _check_completion(self, body: CompletionRequest) -> None:
        """Refuse what a completions request may ask for but this server does not do."""
        self._check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported: the response holds the completion only", param="echo")
        if body.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1 (got {body.best_of})", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def completion_prompt(self, prompt: str | list[int] | list[str]) -> list[int]:
        """The token ids of a completions prompt: a text, a list of one text, or token ids in the vocabulary."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request (got a list of {len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt).input_ids
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})",
                               param="prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return prompt_ids

    # ---- chat completions -------------------------------------------------------------------------------
    async def create_chat_completion(self, body: ChatRequest, disconnected: Disconnected = _never
                                     ) -> dict[str, Any] | EventStream | None:
        """Serve a ``/v1/chat/completions`` request: the whole ``chat.completion``, a stream of chunks, or None
        when the client went away before it finished."""
        self._check_chat(body)
        prompt_ids = await asyncio.to_thread(self.chat_prompt, body.messages)
        served = self._submit_request(body, prompt_ids, self._chat_max_tokens(body, prompt_ids), "messages")
        return await self._respond(body, served, ChatResponse(self.model_id), disconnected)

    def _check_chat(self, body: ChatRequest) -> None:
        """Refuse what a chat request may ask for but this server does not do."""
        self._check_common(body)
        if body.top_logprobs:
            raise APIError(400, "logprobs are not supported", param="top_logprobs")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The token ids of a chat: its text messages through the tokenizer's chat template, ready for the
        assistant's reply."""
        chat = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(messages)]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, f"{self.model_id} has no chat template: use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's own message says what is wrong
            raise APIError(400, f"the chat template rejects these messages: {e}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _chat_max_tokens(self, body: ChatRequest, prompt_ids: list[int]) -> int:
        """The chat's token limit: ``max_completion_tokens``, else ``max_tokens``, else the rest of the context."""
        if body.max_completion_tokens is not None:
            return body.max_completion_tokens
        if body.max_tokens is not None:
            return body.max_tokens
        return max(1, self.engine.max_context - len(prompt_ids))

    # ---- shared -----------------------------------------------------------------------------------------
    def _check_common(self, body: SamplingRequest) -> None:
        """Refuse another model, more than one choice, and logprobs."""
        self.check_model(body.model)
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (got {body.n}): one choice per request", param="n")
        if body.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")

    def sampling(self, body: SamplingRequest, max_tokens: int) -> GenerationParams:
        """The engine's generation parameters for a request (OpenAI's defaults: temperature 1, top_p 1; a
        fresh seed when sampling without one)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 <= temperature < math.inf:
            raise APIError(400, f"temperature must be 0 (greedy) or more (got {temperature})", param="temperature")
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
        if body.seed is not None and not -(2**63) <= body.seed < 2**64:
            raise APIError(400, f"seed must fit in 64 bits (got {body.seed})", param="seed")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = body.seed
        if seed is None and temperature > 0:
            seed = secrets.randbelow(2**31)
        return GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop=tuple(s for s in stop if s))

    def check_length(self, prompt_ids: list[int], max_tokens: int, what: str) -> None:
        """Refuse a token limit below 1, or a ``what`` (prompt or messages) and limit beyond the context."""
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})", param="max_tokens")
        context = self.engine.max_context
        if len(prompt_ids) + max_tokens > context:
            raise APIError(400, f"this model's context is {context} tokens; the {what} has {len(prompt_ids)} "
                                f"tokens and max_tokens is {max_tokens}: shorten the {what} or lower max_tokens",
                           param=what, code="context_length_exceeded")

    def submit(self, prompt_ids: list[int], params: GenerationParams) -> Served:
        """Submit a prompt to the engine, its events delivered to the running event loop."""
        events = _Events(asyncio.get_running_loop())
        try:
            gen = self.engine.submit(prompt_ids, params, events.sink)
        except RequestError as e:
            raise APIError(400, str(e)) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), "server_error") from None
        except EngineBusy as e:
            raise Busy(str(e), code="queue_full") from None
        return Served(self.engine, gen, events, len(prompt_ids))

    def _submit_request(self, body: SamplingRequest, prompt_ids: list[int], max_tokens: int, what: str) -> Served:
        """Check the request's length and sampling, then submit it."""
        self.check_length(prompt_ids, max_tokens, what)
        return self.submit(prompt_ids, self.sampling(body, max_tokens))

    async def _respond(self, body: SamplingRequest, served: Served, response: _Response, disconnected: Disconnected
                       ) -> dict[str, Any] | EventStream | None:
        """The stream of a streamed request; else its whole response (None if its client went away)."""
        if body.stream:
            return EventStream(served, response, bool(body.stream_options and body.stream_options.include_usage))
        result = await served.collect(disconnected)
        return None if result is None else response.whole(*result, served.usage())


def _message_text(message: ChatMessage, index: int) -> str:
    """A chat message's text: its content, or its text parts joined (any other part is refused)."""
    content = message.content
    if not isinstance(content, list):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{index}]: only text content parts are supported (got "
                                f"{part.get('type')!r})", param=f"messages.{index}.content")
        texts.append(part["text"])
    return "".join(texts) or ""


__all__ = ["DISCONNECT_POLL_S", "ChatResponse", "CompletionResponse", "EventStream", "OpenAIServing", "Served",
           "sse"]
