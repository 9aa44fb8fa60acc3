"""`OpenAIServing` without HTTP, over the single-process reference engine: the same completions as the HTTP
path, whole and streamed; bad requests refused with their OpenAI error objects before anything reaches the
engine; a request nobody listens to any more is cancelled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tessera.serve.protocol import APIError, ChatRequest, CompletionRequest, invalid_request
from tessera.serve.serving import EventStream, OpenAIServing

MODEL = "smollm2-135m"
CONTEXT = 64


@pytest.fixture(scope="module")
def engine():
    from tessera.serve.config import ServeConfig
    from tessera.serve.launch import start_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine, _ = start_engine(ServeConfig(MODEL, "cpu:1", slots=2, max_context=CONTEXT, threads=1, local=True))
    try:
        yield engine
    finally:
        engine.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def serving(engine):
    return OpenAIServing(engine, MODEL)


def _idle(engine, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.queue_depth() == (0, 0):
            return True
        time.sleep(0.02)
    return False


async def _events(stream: EventStream) -> list[dict | str]:
    """Every event of a stream: the JSON of each, and ``[DONE]`` as it is."""
    out: list[dict | str] = []
    async for event in stream.events():
        assert event.startswith("data: ") and event.endswith("\n\n")
        data = event[len("data: "):-2]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def test_a_completion_matches_the_http_path(engine, serving):
    whole = asyncio.run(serving.create_completion(CompletionRequest(**GREEDY)))
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-") and whole["model"] == MODEL
    choice = whole["choices"][0]
    assert choice["text"].startswith(" Paris") and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 6
    from tessera.serve.api import create_app

    http = TestClient(create_app(engine, MODEL)).post("/v1/completions", json=GREEDY)
    assert http.status_code == 200
    body = http.json()
    assert body["choices"] == whole["choices"] and body["usage"] == whole["usage"]
    assert set(body) == set(whole)


def test_a_streamed_completion_carries_the_same_text_then_usage(serving):
    request = CompletionRequest(**GREEDY, stream=True, stream_options={"include_usage": True})
    whole = asyncio.run(serving.create_completion(CompletionRequest(**GREEDY)))

    async def stream():
        result = await serving.create_completion(request)
        assert isinstance(result, EventStream)
        return await _events(result)

    events = asyncio.run(stream())
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert len({c["id"] for c in events[:-1]}) == 1


def test_a_chat_streams_the_text_it_answers_whole(serving):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
            "max_tokens": 5, "temperature": 0}
    whole = asyncio.run(serving.create_chat_completion(ChatRequest(**chat)))
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]

    async def stream():
        return await _events(await serving.create_chat_completion(ChatRequest(**chat, stream=True)))

    events = asyncio.run(stream())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == message["content"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("fields,status,param,code", [
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"n": 2}, 400, "n", None),
    ({"logprobs": 3}, 400, "logprobs", None),
    ({"echo": True}, 400, "echo", None),
    ({"best_of": 2}, 400, "best_of", None),
    ({"suffix": "!"}, 400, "suffix", None),
    ({"prompt": ["a", "b"]}, 400, "prompt", None),
    ({"prompt": [10**9]}, 400, "prompt", None),
    ({"prompt": []}, 400, "prompt", None),
    ({"max_tokens": 0}, 400, "max_tokens", None),
    ({"max_tokens": CONTEXT}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "word " * 100}, 400, "prompt", "context_length_exceeded"),
    ({"temperature": -1}, 400, "temperature", None),
    ({"top_p": 0}, 400, "top_p", None),
    ({"seed": 2**64}, 400, "seed", None),
], ids=["unknown-model", "n-2", "logprobs", "echo", "best-of-2", "suffix", "two-prompts", "bad-token-id",
        "empty-prompt", "max-tokens-0", "prompt-plus-output-too-long", "prompt-too-long", "negative-temperature",
        "top-p-0", "seed-65-bits"])
def test_bad_completions_get_their_openai_errors(engine, serving, fields, status, param, code):
    with pytest.raises(APIError) as caught:
        asyncio.run(serving.create_completion(CompletionRequest(**{**GREEDY, **fields})))
    err = caught.value
    assert (err.status, err.param, err.code) == (status, param, code)
    body = err.body()["error"]
    assert body == {"message": err.message, "type": "invalid_request_error", "param": param, "code": code}
    assert body["message"]
    assert engine.queue_depth() == (0, 0)  # nothing was submitted


@pytest.mark.parametrize("fields,param,code", [
    ({"tools": [{"type": "function"}]}, "tools", None),
    ({"top_logprobs": 2}, "top_logprobs", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", None),
    ({"max_tokens": CONTEXT}, "messages", "context_length_exceeded"),
], ids=["tools", "top-logprobs", "image-part", "too-long"])
def test_bad_chats_get_their_openai_errors(engine, serving, fields, param, code):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}
    with pytest.raises(APIError) as caught:
        asyncio.run(serving.create_chat_completion(ChatRequest(**chat)))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)
    assert engine.queue_depth() == (0, 0)


def test_schema_errors_become_invalid_request_errors():
    with pytest.raises(ValidationError) as missing:
        CompletionRequest.model_validate({"model": MODEL})
    err = invalid_request(missing.value.errors())
    assert (err.status, err.param) == (400, "prompt") and err.message.startswith("invalid request: prompt: ")
    with pytest.raises(ValidationError) as malformed:
        CompletionRequest.model_validate_json('{"model": ')
    err = invalid_request(malformed.value.errors())
    assert err.param is None and err.message.startswith("the request body is not valid JSON (")


def test_models_and_health(serving):
    assert serving.model_list()["data"] == [serving.model_card()]
    assert serving.retrieve_model(MODEL)["max_model_len"] == CONTEXT
    with pytest.raises(APIError, match="does not exist"):
        serving.retrieve_model("other")
    assert serving.health() == (200, {"status": "ok"})


def test_a_request_nobody_listens_to_is_cancelled(engine, serving):
    completed = engine.stats.completed
    long = {**GREEDY, "max_tokens": 40}

    async def gone() -> bool:
        return True

    assert asyncio.run(serving.create_completion(CompletionRequest(**long), gone)) is None
    assert _idle(engine)

    async def first_then_close():
        stream = await serving.create_completion(CompletionRequest(**long, stream=True))
        events = stream.events()
        first = await anext(events)
        await events.aclose()
        return first

    assert json.loads(asyncio.run(first_then_close())[6:])["object"] == "text_completion"
    assert _idle(engine)
    assert engine.stats.completed == completed  # neither ran to its end
