"""The OpenAI request and response bodies the server speaks (pydantic models).

Only the fields llmlab can honour are declared; their ranges are those of the OpenAI API
reference (https://platform.openai.com/docs/api-reference/completions,
https://platform.openai.com/docs/api-reference/chat). A value outside them is refused
with a 400 whose body names the field, as OpenAI's own server does. ``top_k``,
``repetition_penalty`` and ``ignore_eos`` are vLLM's extensions of the same bodies.

Bounds that keep one client from costing the server more than its share: ``stop`` holds
at most :data:`MAX_STOP` strings (OpenAI's limit) of at most :data:`MAX_STOP_CHARS`
characters each (the stop check reads that many characters per token); ``seed`` is a
64-bit signed int (vLLM's bound; completion ``i`` uses ``seed + i``); no number may be
NaN or infinite (JSON has no such values, though Python's parser takes them).
:func:`sampling_kwargs` turns a request into :class:`~llmlab.engine.SamplingParams`
arguments, passing only the fields the client set. Taught in notebook 10.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SEED_MAX, SEED_MIN

MAX_STOP = 4                 # stop strings per request (the OpenAI API's limit)
MAX_STOP_CHARS = 256         # characters per stop string
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

# request fields passed to SamplingParams under the same name
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "ignore_eos")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    user: str | None = None
    # vLLM's guided decoding (llmlab.serve.tools turns them into SamplingParams.structured)
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(None, max_length=4096)
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                             Field(min_length=1, max_length=256)] | None = None
    guided_decoding_backend: Literal["auto", "llmlab", "llguidance"] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    """``POST /v1/completions``. ``logprobs``: how many most likely tokens to return
    beside each sampled one (0..5; the sampled token's own log-probability always)."""

    prompt: Union[str, list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``. ``logprobs`` is a switch here and ``top_logprobs``
    (0..20) the count, as in the chat API; ``max_completion_tokens`` is the newer name of
    ``max_tokens``. ``response_format``, ``tools`` and ``tool_choice``: structured outputs
    and tool calls (:mod:`llmlab.serve.tools`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


def sampling_kwargs(req: _Request, default_max_tokens: int) -> dict:
    """The :class:`SamplingParams` arguments ``req`` asks for: only the fields the client
    set (so an engine without a newer field still serves requests that leave it out),
    ``max_tokens`` defaulting to ``default_max_tokens``, and the logprobs count mapped
    from each API's own field (completions: ``logprobs``; chat: ``top_logprobs`` when
    ``logprobs`` is true)."""
    given = req.model_fields_set
    kw = {f: getattr(req, f) for f in _SAMPLING_FIELDS
          if f in given and getattr(req, f) is not None}
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            kw["max_tokens"] = req.max_completion_tokens
        if req.logprobs:
            kw["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        kw["logprobs"] = req.logprobs
    kw.setdefault("max_tokens", default_max_tokens)
    return kw


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs=None,
                      chat: bool = False, delta: bool = False) -> dict:
    """One entry of ``choices``: text completions carry ``text``; chat carries a
    ``message`` (or, streamed, a ``delta``)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    key = "delta" if delta else "message"
    body = {"role": "assistant", "content": text} if not delta else {"content": text}
    return {"index": index, key: body, "logprobs": logprobs, "finish_reason": finish_reason}


def response_body(rid: str, model: str, choices: list[dict], usage: dict | None,
                  chat: bool, chunk: bool = False) -> dict:
    """The envelope of a response or of one streamed chunk."""
    obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


__all__ = ["MAX_STOP", "MAX_STOP_CHARS", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "sampling_kwargs",
           "error_body", "completion_choice", "response_body", "usage", "new_id"]
