"""The wire shapes of the OpenAI-compatible API: the request bodies and the error object.

Request bodies are pydantic models that accept and ignore unknown fields, as clients send many optional
ones; what this server does not support is refused by the serving layer, not here. Every error is
answered as an OpenAI error object, ``{"error": {"message", "type", "param", "code"}}``, carried by
``APIError`` with its HTTP status.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object of this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share: the model and how to sample."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None  # OpenAI's default is 1 (sampling); 0 is greedy
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    logprobs: Any = None


class CompletionRequest(SamplingRequest):
    """A ``/v1/completions`` body."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message of a chat: a role and text (or a list of content parts)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingRequest):
    """A ``/v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None


__all__ = ["APIError", "ChatMessage", "ChatRequest", "CompletionRequest", "SamplingRequest", "StreamOptions",
           "invalid_request"]
