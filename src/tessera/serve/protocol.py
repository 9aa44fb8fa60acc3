"""The wire shapes of the OpenAI-compatible API: the request bodies and the error object.

Request bodies are pydantic models that accept and ignore unknown fields, as clients send many optional
ones; what this server does not support is refused by the serving layer, not here. The fields they do
know are typed strictly (JSON ``true`` is not the integer 1, ``"2"`` is not a number) and a chat
message's role is one this server understands. Every error is
answered as an OpenAI error object, ``{"error": {"message", "type", "param", "code"}}``, carried by
``APIError`` with its HTTP status.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Int = StrictInt
Number = StrictFloat | StrictInt
ROLES = ("system", "user", "assistant")  # tools are not supported, so no "tool" messages


class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object of this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Busy(APIError):
    """429: the server is full now; the response says to retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, code: str = "server_full", retry_after_s: int = 1):
        super().__init__(429, message, "rate_limit_error", code=code)
        self.retry_after_s = retry_after_s


def invalid_request(errors: list[dict[str, Any]]) -> APIError:
    """The 400 error for a body that is not JSON or does not fit its schema, from pydantic's error list."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON "
                             f"({first.get('ctx', {}).get('error', 'decode error')})")
    param = ".".join(_location(first)) or None
    parts = [f"{'.'.join(_location(err)) or 'body'}: {err.get('msg', 'invalid')}" for err in errors[:3]]
    return APIError(400, "invalid request: " + "; ".join(parts), param=param)


def _location(error: dict[str, Any]) -> list[str]:
    """Where in the body an error is (without FastAPI's leading ``body``)."""
    return [str(p) for p in error.get("loc", ()) if p != "body"]


class StreamOptions(BaseModel):
    """``stream_options``: whether a stream ends with a usage chunk."""

    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share: the model and how to sample."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    temperature: Number | None = None  # OpenAI's default is 1 (sampling); 0 is greedy
    top_p: Number | None = None
    seed: Int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: Int | None = 1
    logprobs: Any = None


class CompletionRequest(SamplingRequest):
    """A ``/v1/completions`` body."""

    prompt: StrictStr | list[Int] | list[StrictStr]
    max_tokens: Int | None = 16
    echo: StrictBool | None = False
    best_of: Int | None = None
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    """One message of a chat: a role and text (or a list of content parts)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatRequest(SamplingRequest):
    """A ``/v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    top_logprobs: Int | None = None
    tools: list[Any] | None = None


__all__ = ["ROLES", "APIError", "ChatMessage", "ChatRequest", "CompletionRequest", "SamplingRequest", "StreamOptions",
           "invalid_request"]
