"""The OpenAI wire format: request models checked at the boundary, response and chunk bodies.

Requests are pydantic models in strict mode, so a string where a number belongs is a 400, not a
silent coercion. Fields OpenAI clients send by default (``user``, ``metadata``, ...) are allowed
and ignored; fields asking for a feature this server does not have (tools, logprobs, n > 1,
penalties) are refused by name rather than silently dropped, since ignoring them would hand the
client an answer to a different question.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specblock.runtime.metrics import DecodeStats


class APIError(Exception):
    """An OpenAI-style error: HTTP status plus the ``error`` object clients parse."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


#: Features a client may ask for that this server does not implement: field -> value meaning "off".
UNSUPPORTED = {
    "tools": None, "functions": None, "tool_choice": None, "logprobs": (None, False, 0), "top_logprobs": None,
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1), "echo": (None, False), "suffix": None, "audio": None, "prediction": None,
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)  # json.loads reads NaN

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported: one completion per request")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _no_unsupported(self) -> "_Common":
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                off = UNSUPPORTED[name]
                if value is not None and not (isinstance(off, tuple) and value in off):
                    raise ValueError(f"'{name}' is not supported by this server; drop it")
        return self

    @property
    def stops(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]  # normalised to a list by _stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _text_parts(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Content as a list of text parts (what newer clients send) becomes one string."""
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ValueError("only text content parts are supported")
                m = {**m, "content": "".join(p["text"] for p in content)}
            out.append(m)
        return out

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (a list of several would need n > 1)")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def limit(self) -> int | None:
        return self.max_tokens


def parse(cls: type[_Common], body: Any) -> _Common:
    """A request model or a 400 naming the field, as OpenAI's own API words it."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative(method: str, stats: DecodeStats) -> dict:
    """What speculation did for this request (metric definitions: runtime/metrics.py)."""
    return {"method": method, "iterations": stats.iterations, "tau": round(stats.tau, 4),
            "accepted_tokens": int(sum(stats.accepted)), "draft_share": round(stats.draft_share, 4)}


class Shape:
    """Bodies of one response, chat or completion, whole or chunked: one place for the format."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, use: dict, spec: dict) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(self.object), "choices": [choice], "usage": use, "speculative": spec}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = text or ""
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict, spec: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use, "speculative": spec}
