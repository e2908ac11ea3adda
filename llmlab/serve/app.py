"""The FastAPI application: OpenAI-compatible routes over one :class:`EngineLoop`.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (a JSON response, or
with ``"stream": true`` server-sent events, one ``data: {chunk}`` per new piece of
text, ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and ``GET
/metrics`` (Prometheus). The wire format is OpenAI's
(https://platform.openai.com/docs/api-reference/chat/create), so the ``openai`` client
works with ``base_url="http://host:port/v1"``, as with vLLM's server
(https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html). SSE itself
is the WHATWG "server-sent events" format
(https://html.spec.whatwg.org/multipage/server-sent-events.html).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, a wrong type or an out-of-range value (FastAPI's 422 is turned into
this), a prompt longer than the context, or parameters the engine refuses; 401 without
the API key (when the server has one); 404 for another model's name; 413 for a body over
``max_body_bytes``; 503 when the waiting queue is full, ``max_connections`` requests are
already in flight, the server is shutting down or its engine thread has died; 500 when
the engine fails on a request (that request only: see :mod:`llmlab.serve.loop`). A client
that disconnects has its request aborted.

Hostile clients: every field is range-checked before it reaches the engine; the limits
above are checked by a small ASGI layer (:class:`Guard`) before a body is read (the
count of requests in flight, the API key) or parsed (its size, and a deadline to send
it); tokenizing and the chat template run on a tokenizer thread, never on the event
loop, so a huge prompt does not stall the other clients. That thread owns its own copy
of the tokenizer: HF fast tokenizers must not be used from two threads at once
("Already borrowed"), and the engine thread uses the LLM's. Taught in notebook 10.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLM, SamplingParams
from ..engine.llm import chat_prompt
from ..prompts import check_token_ids
from .loop import AsyncEngineLoop, EngineLoop, Event, Handle, Refused
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, completion_choice,
                       error_body, new_id, response_body, sampling_kwargs, usage)
from .tools import (FieldError, new_call_id, structured_request, tool_call_deltas,
                    tool_call_message, tool_plan, ToolCallStreamParser)


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = \
            status, message, param, type_, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.type, self.code),
                            status_code=self.status)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
# how often a handler looks whether its client is still there (Server.next_event)
DISCONNECT_CHECK_S = 0.5


def _field_name(loc) -> str | None:
    """FastAPI's error location ("body", "messages", 0, "role") -> "messages[0].role".
    Pydantic appends the member type to a union's location ("prompt", "list[int]"):
    the field ends before it."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and name and (part in _TYPE_TAGS or "[" in part or "-" in part):
            break
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def _short(value, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message must not echo a
    megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", None)
    param = _field_name(err.get("loc", ()))
    # a union (``stop``: a string or a list) reports one error per member: the one that
    # is not "should be a valid <other type>" says what is wrong with the value given
    same = [e for e in errors if _field_name(e.get("loc", ())) == param]
    err = next((e for e in same if not str(e.get("msg", "")).startswith("Input should be a valid")),
               err)
    return APIError(400, f"{param}: {err.get('msg')} (got {_short(err.get('input'))})", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), None, kind).response()


class Server:
    """What the routes share: the model, the engine loop, the tokenizer thread and the
    metrics."""

    def __init__(self, llm: LLM, model_name: str, max_waiting: int = 256, engine_loop=None):
        self.llm, self.model_name = llm, model_name
        self.max_model_len = llm.engine.config.max_model_len
        self.max_num_seqs = llm.engine.config.max_num_seqs
        self.vocab_size = llm.model.config.vocab_size
        # the event-loop side's own tokenizer, used only on its own thread (see the
        # module docstring); the engine thread keeps llm.tokenizer
        self.tokenizer = copy.deepcopy(llm.tokenizer)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="llmlab-tokenizer")
        self.loop = EngineLoop(llm, max_waiting) if engine_loop is None else \
            AsyncEngineLoop(llm, engine_loop, max_waiting)
        lp = self.loop
        self.metrics = ServerMetrics(lambda: lp.num_running, lambda: lp.num_waiting,
                                     lambda: lp.kv_blocks_used,
                                     lambda: llm.engine.cache.manager.stats)
        lp.metrics = self.metrics

    def close(self) -> None:
        self.loop.stop()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def with_tokenizer(self, fn, *args):
        """``fn(tokenizer, *args)`` on the tokenizer thread, awaited (the event loop goes on
        serving the other clients meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, fn, self.tokenizer, *args)

    # -- a request's inputs ------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {_short(model)} is not served here; this server serves "
                           f"{self.model_name!r}", "model", code="model_not_found")

    async def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The chat template applied as :meth:`LLM.chat` applies it."""
        msgs = [m.model_dump() for m in req.messages]
        try:
            return await self.with_tokenizer(chat_prompt, msgs)
        except Exception as e:               # e.g. a lone surrogate the tokenizer cannot take
            raise APIError(400, f"messages: could not be templated and tokenized: "
                           f"{type(e).__name__}: {_short(str(e), 200)}", "messages") from None

    async def completion_prompt(self, req: CompletionRequest) -> tuple[str | None, list[int]]:
        if not isinstance(req.prompt, str):
            return None, list(req.prompt)
        try:
            ids = await self.with_tokenizer(lambda tok, text: list(tok(text)["input_ids"]),
                                            req.prompt)
        except Exception as e:
            raise APIError(400, f"prompt: could not be tokenized: {type(e).__name__}: "
                           f"{_short(str(e), 200)}", "prompt") from None
        return req.prompt, ids

    def params(self, req, ids: list[int], param: str) -> SamplingParams:
        """The request's SamplingParams, every value the engine could trip on checked
        here (a 400 naming the field), so that nothing a client sends can fail a step."""
        if not ids:
            raise APIError(400, f"{param} is empty", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens but the context "
                           f"is {self.max_model_len} tokens, with room for at least one new "
                           "token", param, code="context_length_exceeded")
        try:
            check_token_ids(ids, self.vocab_size)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        if req.n > self.max_num_seqs:
            raise APIError(400, f"n={req.n} completions exceed this server's "
                           f"max_num_seqs={self.max_num_seqs} (each takes a seat of the batch)",
                           "n")
        room = self.max_model_len - len(ids)
        kw = sampling_kwargs(req, min(16, room) if isinstance(req, CompletionRequest) else room)
        if kw["max_tokens"] > room:          # as vLLM and OpenAI: refused, not cut short
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) \
                is not None else "max_tokens"
            raise APIError(400, f"{name}={kw['max_tokens']} does not fit: the context is "
                           f"{self.max_model_len} tokens and the prompt takes {len(ids)}, so at "
                           f"most {room} may be generated", name, code="context_length_exceeded")
        try:
            structured = structured_request(req)
        except FieldError as e:
            raise APIError(400, str(e), e.param) from None
        if structured is not None:
            kw["structured"] = structured
        try:
            return SamplingParams(**kw)
        except TypeError as e:               # a field this engine's SamplingParams lacks
            name = next((k for k in kw if f"'{k}'" in str(e)), None)
            raise APIError(400, f"{name}: not supported by this engine", name) from None
        except ValueError as e:
            name = next((k for k in kw if str(e).startswith(f"{k}=")), None)
            raise APIError(400, str(e), name) from None

    # -- running it ----------------------------------------------------------------------
    async def submit(self, ids, params, text, http: Request, param: str) -> Handle:
        """Queue the request and wait until the engine accepts it (or says why not)."""
        try:
            h = self.loop.submit(ids, params, text)
        except Refused as e:
            raise APIError(503, str(e), None, "server_overloaded" if e.code == "queue_full"
                           else "server_error", e.code) from None
        ev = await self.next_event(h, http)
        if ev.kind == "rejected":
            raise APIError(400, ev.message, ev.param or param)
        if ev.kind == "error":
            raise _event_error(ev)
        return h

    async def next_event(self, h: Handle, http: Request | None,
                         every_s: float = DISCONNECT_CHECK_S) -> Event:
        """The next event of ``h``; aborts the request if the client disconnects. The
        client is looked for at most every ``every_s``, whether events are flowing (a
        request whose tokens come faster than that would otherwise run to its max_tokens
        for nobody) or not (a request waiting for a seat)."""
        while True:
            if http is not None and time.monotonic() - h.seen_client_at >= every_s:
                if await http.is_disconnected():
                    self.loop.abort(h)
                    raise asyncio.CancelledError("client disconnected") from None
                h.seen_client_at = time.monotonic()
            try:
                return await asyncio.wait_for(h.events.get(), every_s)
            except asyncio.TimeoutError:
                continue


def _event_error(ev: Event) -> APIError:
    """An ``error`` event as the HTTP error: 503 when the server is going away or its
    engine thread died (retry elsewhere or later), 500 when the engine failed on it."""
    if ev.code in ("shutting_down", "engine_dead"):
        return APIError(503, ev.message, None, "server_error", ev.code)
    return APIError(500, ev.message, None, "server_error", ev.code)


def _finite(x) -> float:
    """JSON has no infinities: -inf becomes -9999.0, the value OpenAI's API reports."""
    x = float(x)
    return x if math.isfinite(x) else -9999.0


def _logprobs(tokenizer, token_ids: list[int], logprobs, top_n: int, chat: bool):
    """The engine's per-token log-probabilities (a list, per token, of {token_id:
    logprob or an object with ``.logprob``}) in the API's shape: chat's ``content``
    list, or the completions API's parallel lists; ``top_n`` most likely per token."""
    if logprobs is None:
        return None
    text = tokenizer.decode
    rows = []
    for tok, top in zip(token_ids, logprobs):
        top = {int(k): _finite(getattr(v, "logprob", v)) for k, v in dict(top or {}).items()}
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:top_n]
        rows.append((text([tok]), top.get(tok, _finite(float("-inf"))),
                     [(text([k]), v) for k, v in ranked]))
    if chat:
        entry = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode())}  # noqa: E731
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(k, v) for k, v in top]}
                            for t, lp, top in rows]}
    return {"tokens": [t for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [dict(top) for _, _, top in rows], "text_offset": None}


def _sse(payload) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _top_n(req) -> int:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else 0
    return req.logprobs or 0


def _wants_logprobs(req) -> bool:
    return req.logprobs is not None and req.logprobs is not False


async def full_response(server: Server, req, out, rid: str, chat: bool) -> dict:
    """The non-streamed body from the engine's final :class:`RequestOutput`."""
    choices = []
    for c in out.outputs:
        lps = None
        if _wants_logprobs(req):
            lps = await server.with_tokenizer(_logprobs, c.token_ids,
                                              getattr(c, "logprobs", None), _top_n(req), chat)
        choices.append(completion_choice(c.index, c.text, c.finish_reason, lps, chat))
    used = usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
    return response_body(rid, server.model_name, choices, used, chat)


def _last_chunks(ev: Event, req, chunk) -> list[str]:
    """What a stream sends on its final event: the usage chunk if asked (``done``), or
    the error (``error``, ``rejected``); ``[DONE]`` follows either."""
    if ev.kind == "done":
        out = ev.output
        return [chunk([], usage(len(out.prompt_token_ids),
                                sum(len(c.token_ids) for c in out.outputs)))] \
            if req.include_usage else []
    return [_sse(error_body(ev.message, ev.param, "server_error", ev.code))]


async def stream_events(server: Server, h: Handle, req, rid: str, chat: bool):
    """The SSE body: a chunk per new piece of text, usage if asked, then ``[DONE]``.
    If the client goes away (the generator is closed or cancelled), the request is
    aborted and its KV blocks freed."""
    chunk = lambda choices, used=None: _sse(response_body(      # noqa: E731
        rid, server.model_name, choices, used, chat, chunk=True))
    try:
        if chat:
            for i in range(h.params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
        while True:
            ev = await h.events.get()
            if ev.kind == "token" and (ev.text or ev.finish_reason or ev.logprobs):
                lps = None
                if ev.logprobs is not None and _wants_logprobs(req):
                    lps = await server.with_tokenizer(_logprobs, [ev.token_id], [ev.logprobs],
                                                      _top_n(req), chat)
                yield chunk([completion_choice(ev.index, ev.text, ev.finish_reason, lps,
                                               chat=chat, delta=True)])
            elif ev.kind in ("done", "error", "rejected"):
                for last in _last_chunks(ev, req, chunk):
                    yield last
                break
        yield _sse("[DONE]")
    finally:
        if not h.closed:
            server.loop.abort(h)


async def _handle(server: Server, req, http: Request, chat: bool):
    server.check_model(req.model)
    param = "messages" if chat else "prompt"
    if not chat and req.echo:
        raise APIError(400, "echo: not supported by this server", "echo")
    text, ids = await (server.chat_prompt(req) if chat else server.completion_prompt(req))
    params = server.params(req, ids, param)
    plan = tool_plan(req) if chat else None
    h = await server.submit(ids, params, text, http, param)
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        events = (tool_stream_events(server, h, req, rid) if plan is not None and plan.constrained
                  else stream_events(server, h, req, rid, chat))
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        while (ev := await server.next_event(h, http)).kind == "token":
            pass
    finally:
        if not h.closed:
            server.loop.abort(h)
    if ev.kind != "done":
        raise _event_error(ev)
    body = await full_response(server, req, ev.output, rid, chat)
    return body if plan is None else tool_call_message(body, plan)


async def tool_stream_events(server: Server, h: Handle, req, rid: str):
    """The SSE body of a chat request whose output is a constrained tool call: per
    completion, OpenAI's ``delta.tool_calls`` chunks (the id, type and name first, then
    the arguments piece by piece, :class:`~llmlab.serve.tools.ToolCallStreamParser`),
    finish_reason ``"tool_calls"``, then ``[DONE]``."""
    chunk = lambda choices, used=None: _sse(response_body(      # noqa: E731
        rid, server.model_name, choices, used, True, chunk=True))
    parsers = [ToolCallStreamParser() for _ in range(h.params.n)]
    ids = [new_call_id() for _ in range(h.params.n)]
    try:
        for i in range(h.params.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": None},
                          "logprobs": None, "finish_reason": None}])
        while True:
            ev = await h.events.get()
            if ev.kind == "token":
                for delta in tool_call_deltas(parsers[ev.index], ev.text, ids[ev.index]):
                    yield chunk([{"index": ev.index, "delta": delta, "logprobs": None,
                                  "finish_reason": None}])
                if ev.finish_reason:
                    why = "tool_calls" if ev.finish_reason == "stop" else ev.finish_reason
                    yield chunk([{"index": ev.index, "delta": {}, "logprobs": None,
                                  "finish_reason": why}])
            elif ev.kind in ("done", "error", "rejected"):
                for last in _last_chunks(ev, req, chunk):
                    yield last
                break
        yield _sse("[DONE]")
    finally:
        if not h.closed:
            server.loop.abort(h)


# -- the limits checked before a route runs ----------------------------------------------------
class Guard:
    """ASGI middleware: the limits a route never sees a request beyond.

    In this order, each answered with OpenAI's error body: more than ``max_connections``
    requests in flight (503; each HTTP/1.1 connection carries one at a time, so this bounds
    the connections a route serves, and ``python -m llmlab.serve`` gives uvicorn the same
    limit for idle ones); no valid ``Authorization: Bearer <api_key>`` on a ``/v1`` route
    (401; ``/health`` and ``/metrics`` stay open, for load balancers and Prometheus); a
    body over ``max_body_bytes`` (413, from its Content-Length at once, else once that many
    bytes have come) or not sent within ``body_timeout_s`` (408). The body is read here,
    whole, and handed on: the route's JSON parser never sees more than the limit.
    """

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, max_connections: int,
                 body_timeout_s: float = 30.0):
        self.app, self.api_key = app, api_key
        self.max_body_bytes, self.max_connections = max_body_bytes, max_connections
        self.body_timeout_s = body_timeout_s
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.in_flight >= self.max_connections:
            return await _refuse(send, 503, f"{self.in_flight} requests are in flight, this "
                                 f"server's limit (max_connections={self.max_connections}); "
                                 "retry later", "server_overloaded", "too_many_connections")
        self.in_flight += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _guarded(self, scope, receive, send):
        if self.api_key is not None and scope["path"].startswith("/v1"):
            why = self._unauthorized(scope)
            if why is not None:
                return await _refuse(send, 401, why, "invalid_request_error", "invalid_api_key",
                                     [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._too_large(send, length.decode("latin-1")[:30])
        body, deadline = bytearray(), time.monotonic() + self.body_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await _refuse(send, 408, f"the request body did not arrive within "
                                     f"{self.body_timeout_s:g} s", "invalid_request_error",
                                     "request_timeout")
            if msg["type"] == "http.disconnect":
                return                       # the client is gone: nothing to answer
            body += msg.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await self._too_large(send, f"more than {self.max_body_bytes}")
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():                 # the body once, then the client's own messages
            nonlocal replayed                # (the route watches them for a disconnect)
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _unauthorized(self, scope) -> str | None:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        if not header:
            return ("no API key given: send it as a Bearer token in the Authorization header "
                    "(Authorization: Bearer YOUR_KEY)")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            return "incorrect API key provided"
        return None

    async def _too_large(self, send, got: str):
        await _refuse(send, 413, f"the request body ({got} bytes) is larger than this "
                      f"server's limit of {self.max_body_bytes} bytes (max_body_bytes)",
                      "invalid_request_error", "request_too_large")


async def _refuse(send, status: int, message: str, type_: str, code: str,
                  headers: list | None = None) -> None:
    body = json.dumps(error_body(message, None, type_, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


MAX_BODY_BYTES = 2**20       # 1 MiB: a full 8k-token context is ~60 kB of JSON
MAX_CONNECTIONS = 512


def create_app(llm: LLM, model_name: str, max_waiting: int = 256, *,
               api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               max_connections: int = MAX_CONNECTIONS, body_timeout_s: float = 30.0,
               engine_loop=None) -> FastAPI:
    """The application for one loaded :class:`~llmlab.engine.LLM`; its engine thread
    starts and stops with the application (uvicorn's lifespan).

    ``api_key``: when set, the ``/v1`` routes answer 401 unless the request carries
    ``Authorization: Bearer <api_key>`` (the ``openai`` client's ``api_key=``).
    ``max_body_bytes``: larger bodies get 413. ``max_connections``: requests in flight at
    once; more get 503. ``max_waiting``: requests waiting for a seat; more get 503.
    ``body_timeout_s``: a body not sent within it gets 408 (a slow client holds a
    connection, not the server). These limits are checked by :class:`Guard`, the app's outermost middleware.
    ``engine_loop``: a coroutine function ``run(engine, inbox)`` that replaces the engine
    thread (:class:`~llmlab.serve.loop.AsyncEngineLoop`; notebook 10's build).
    """
    for name, value in (("max_body_bytes", max_body_bytes), ("max_connections", max_connections)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be a non-empty string, or None (no authentication)")
    server = Server(llm, model_name, max_waiting, engine_loop)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        server.close()

    app = FastAPI(title="llmlab", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        return await _handle(server, req, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        return await _handle(server, req, http, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "llmlab",
                                            "max_model_len": server.max_model_len}]}

    @app.get("/health")
    async def health():
        ok, why = server.loop.health()
        if not ok:
            code = "engine_dead" if server.loop.death is not None else "unavailable"
            raise APIError(503, why, None, "server_error", code)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, ctype = server.metrics.render()
        return Response(body, media_type=ctype)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       max_connections=max_connections, body_timeout_s=body_timeout_s)
    return app


__all__ = ["create_app", "Server", "APIError", "Guard", "stream_events", "full_response",
           "MAX_BODY_BYTES", "MAX_CONNECTIONS"]
