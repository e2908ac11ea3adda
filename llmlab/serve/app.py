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
this), a prompt longer than the context, or parameters the engine refuses; 404 for
another model's name; 503 when the waiting queue is full; 500 when the engine fails
on a request. A client that disconnects has its request aborted. Taught in notebook 10.
"""
from __future__ import annotations

import asyncio
import json
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLM, SamplingParams
from .loop import EngineLoop, Event, Handle, QueueFull
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, completion_choice,
                       error_body, new_id, response_body, sampling_kwargs, usage)


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


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", None)
    param = _field_name(err.get("loc", ()))
    got = err.get("input")
    return APIError(400, f"{param}: {err.get('msg')} (got {got!r})", param)


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
    """What the routes share: the model, the engine loop and the metrics."""

    def __init__(self, llm: LLM, model_name: str, max_waiting: int = 256):
        self.llm, self.model_name = llm, model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.engine.config.max_model_len
        self.loop = EngineLoop(llm, max_waiting)
        lp = self.loop
        self.metrics = ServerMetrics(lambda: lp.num_running, lambda: lp.num_waiting,
                                     lambda: lp.kv_blocks_used)
        lp.metrics = self.metrics

    # -- a request's inputs ------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves "
                           f"{self.model_name!r}", "model", code="model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The chat template applied as :meth:`LLM.chat` applies it."""
        return self.llm.chat_prompt([m.model_dump() for m in req.messages])

    def completion_prompt(self, req: CompletionRequest) -> tuple[str | None, list[int]]:
        if isinstance(req.prompt, str):
            return req.prompt, list(self.tokenizer(req.prompt)["input_ids"])
        return None, list(req.prompt)

    def params(self, req, ids: list[int], param: str) -> SamplingParams:
        if not ids:
            raise APIError(400, f"{param} is empty", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens but the context "
                           f"is {self.max_model_len} tokens, with room for at least one new "
                           "token", param, code="context_length_exceeded")
        default = 16 if isinstance(req, CompletionRequest) else self.max_model_len - len(ids)
        kw = sampling_kwargs(req, default)
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
        except QueueFull as e:
            code = "shutting_down" if "shutting down" in str(e) else "queue_full"
            raise APIError(503, str(e), None, "server_overloaded", code) from None
        ev = await self.next_event(h, http)
        if ev.kind == "rejected":
            name = "max_tokens" if "max_tokens" in ev.message else param
            raise APIError(400, ev.message, name)
        if ev.kind == "error":
            raise APIError(503 if "shutting down" in ev.message else 500, ev.message, None,
                           "server_error")
        return h

    async def next_event(self, h: Handle, http: Request | None) -> Event:
        """The next event of ``h``; aborts the request if the client disconnects."""
        while True:
            try:
                return await asyncio.wait_for(h.events.get(), 0.5)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    self.loop.abort(h)
                    raise asyncio.CancelledError("client disconnected") from None


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


def full_response(server: Server, req, out, rid: str, chat: bool) -> dict:
    """The non-streamed body from the engine's final :class:`RequestOutput`."""
    choices = []
    for c in out.outputs:
        lps = (_logprobs(server.tokenizer, c.token_ids, getattr(c, "logprobs", None),
                         _top_n(req), chat) if _wants_logprobs(req) else None)
        choices.append(completion_choice(c.index, c.text, c.finish_reason, lps, chat))
    used = usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
    return response_body(rid, server.model_name, choices, used, chat)


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
                lps = (_logprobs(server.tokenizer, [ev.token_id], [ev.logprobs], _top_n(req),
                                 chat) if ev.logprobs is not None and _wants_logprobs(req)
                       else None)
                yield chunk([completion_choice(ev.index, ev.text, ev.finish_reason, lps,
                                               chat=chat, delta=True)])
            elif ev.kind == "done":
                if req.include_usage:
                    out = ev.output
                    yield chunk([], usage(len(out.prompt_token_ids),
                                          sum(len(c.token_ids) for c in out.outputs)))
                break
            elif ev.kind in ("error", "rejected"):
                yield _sse(error_body(ev.message, None, "server_error"))
                break
        yield _sse("[DONE]")
    finally:
        if not h.closed:
            server.loop.abort(h)


async def _handle(server: Server, req, http: Request, chat: bool):
    server.check_model(req.model)
    param = "messages" if chat else "prompt"
    text, ids = server.chat_prompt(req) if chat else server.completion_prompt(req)
    if not chat and req.echo:
        raise APIError(400, "echo: not supported by this server", "echo")
    params = server.params(req, ids, param)
    h = await server.submit(ids, params, text, http, param)
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        return StreamingResponse(stream_events(server, h, req, rid, chat),
                                 media_type="text/event-stream")
    try:
        while (ev := await server.next_event(h, http)).kind == "token":
            pass
    finally:
        if not h.closed:
            server.loop.abort(h)
    if ev.kind != "done":
        raise APIError(500, ev.message, None, "server_error")
    return full_response(server, req, ev.output, rid, chat)


def create_app(llm: LLM, model_name: str, max_waiting: int = 256) -> FastAPI:
    """The application for one loaded :class:`~llmlab.engine.LLM`; its engine thread
    starts and stops with the application (uvicorn's lifespan)."""
    server = Server(llm, model_name, max_waiting)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        server.loop.stop()

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
        if not server.loop.alive:
            raise APIError(503, "the engine thread is not running", None, "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, ctype = server.metrics.render()
        return Response(body, media_type=ctype)

    return app


__all__ = ["create_app", "Server", "APIError", "stream_events", "full_response"]
