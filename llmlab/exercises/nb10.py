"""The exercises of notebook 10 (serving over HTTP).

- ``nb10.parse_sse`` (build, warm-up): the client side of a streamed OpenAI response.
  Checked on hand-made event streams that exercise the format's rules, then on the raw
  lines of a real stream from a server, whose text must equal the non-streamed answer.
- ``nb10.engine_loop`` (build): the server's engine loop, as a coroutine on the server's
  event loop: requests from the HTTP handlers join the running batch between two steps,
  each step's tokens go to their requests' streams, and a client that goes away has its
  request aborted. Checked in a real server (uvicorn in a thread of this process) running
  the student's loop on SmolLM2, with concurrent real ``openai`` clients.
- ``nb10.predict_capacity`` (predict): the largest load (a multiple of the burst's rate)
  at which the continuous server meets its TTFT and TPOT targets.
- ``nb10.explain_static_ttft`` (explain): why a static batch makes newcomers wait for
  their first token, even under a light load.
- ``nb10.poisson_arrivals`` (build, stretch): the open-loop load generator's clock,
  judged statistically (mean gap, exponential shape, reproducibility).

``parse_sse(lines)`` takes an iterable of text lines (with or without their trailing
newline) and yields each event's JSON payload as a dict, stopping at ``data: [DONE]``.
The rules it needs, from the WHATWG HTML standard's server-sent events section: an event
is its ``data:`` lines up to a blank line, joined by newlines; one space after the colon
is optional; lines starting with ``:`` are comments; other fields (``event:``, ``id:``)
do not carry the payload.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import choice_verdict, exercise, right, wrong
from . import forbid as exercises_forbid
from ..serve.client import parse_sse, poisson_arrivals

NB = "10_serving_over_http"


# ---- build: an SSE parser -------------------------------------------------------------

def _chunk(text: str, i: int) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": text,
            "finish_reason": None}], "n": i}


def _cases() -> list[tuple[str, list[str], list[dict]]]:
    """(what, lines, payloads expected): each case isolates one rule of the format."""
    a, b, c = _chunk("Hello", 0), _chunk(",", 1), _chunk(" world", 2)
    plain = [f"data: {json.dumps(x)}" for x in (a, b, c)]
    return [
        ("three events, then data: [DONE]",
         [x for line in plain for x in (line, "")] + ["data: [DONE]", ""], [a, b, c]),
        ("lines ending in \\r\\n, comment lines (': keep-alive') and event:/id: fields",
         [": keep-alive\r\n", "event: message\r\n", f"data: {json.dumps(a)}\r\n", "id: 1\r\n",
          "\r\n", ": ping\r\n", "\r\n", f"data: {json.dumps(b)}\r\n", "\r\n", "data: [DONE]\r\n",
          "\r\n"], [a, b]),
        ("one event whose JSON spans two data: lines (joined with a newline)",
         ['data: {"choices": [{"index": 0, "text": "Hi",', 'data:  "finish_reason": null}]}', "",
          "data: [DONE]", ""], [{"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]}]),
        ("data: without the optional space after the colon",
         [f"data:{json.dumps(a)}", "", "data:[DONE]", ""], [a]),
        ("anything after data: [DONE] is not read",
         [f"data: {json.dumps(a)}", "", "data: [DONE]", "", "data: not json", ""], [a]),
    ]


def _run_case(fn, lines: list[str]) -> list:
    return list(fn(iter(lines)))          # a one-pass iterator, like a network stream


def _server_text(fn, base_url: str, model: str) -> str | None:
    """Stream a greedy completion from the server, parse its raw lines with ``fn``; return
    a problem, or None when the streamed text equals the non-streamed answer."""
    import httpx

    body = {"model": model, "prompt": "The three primary colors are", "max_tokens": 12,
            "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = list(fn(r.iter_lines()))
    got = "".join(ch.get("text") or "" for e in events for ch in e.get("choices", []))
    if got != want:
        return (f"on the server's real stream your parser's chunks add up to {got!r}, but the "
                f"non-streamed answer is {want!r}.")
    return None


def _check_cases(fn) -> object | None:
    for what, lines, want in _cases():
        try:
            got = _run_case(fn, lines)
        except json.JSONDecodeError as e:
            return wrong(f"case '{what}': json.loads failed ({e}).",
                         "stop at data: [DONE]; join an event's data: lines with '\\n'; "
                         "skip comment and other field lines.")
        if got != want:
            return wrong(f"case '{what}': expected {len(want)} payload(s) {want}, got {got}.",
                         "an event ends at a blank line; only data: lines carry it.")
    return None


def _per_line(lines):           # each data line parsed alone: breaks multi-line events
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _needs_space(lines):        # only "data: " with a space: misses "data:{...}"
    buf = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith("data: "):
            buf.append(line[6:])
        elif not line and buf:
            data, buf = "\n".join(buf), []
            if data == "[DONE]":
                return
            yield json.loads(data)


def _no_done(lines):            # never stops: json.loads("[DONE]") fails
    buf = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith("data:"):
            buf.append(line[5:].lstrip(" "))
        elif not line and buf:
            data, buf = "\n".join(buf), []
            yield json.loads(data)


def _every_field(lines):        # takes any field's value as data: event:/id: lines break it
    buf = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line and not line.startswith(":"):
            buf.append(line.partition(":")[2].lstrip(" "))
        elif not line and buf:
            data, buf = "\n".join(buf), []
            if data == "[DONE]":
                return
            yield json.loads(data)


@exercise("nb10.parse_sse", notebook=NB, kind="build",
          title="parse a server-sent event stream into the JSON chunks of an OpenAI response",
          solution=parse_sse,
          wrong_variants={"one JSON per line": (_per_line, ("two data: lines",)),
                          "space required": (_needs_space, ("optional space",)),
                          "no [DONE]": (_no_done, ("[DONE]",)),
                          "every field is data": (_every_field, ("event:",))})
def _check_parse_sse(fn, base_url: str | None = None, model: str | None = None) -> object:
    if not callable(fn):
        return wrong(f"expected a function parse_sse(lines), got {type(fn).__name__}.")
    problem = _check_cases(fn)
    if problem is not None:
        return problem
    if base_url is None:
        return right(f"all {len(_cases())} hand-made streams parse. (Pass base_url= to also "
                     "check a real stream from the server.)")
    bad, note = _live_text(fn, base_url, model or "smollm2-135m")
    if bad:
        return wrong(bad + note, "compare your parser's events with the raw lines (print them).")
    return right(f"all {len(_cases())} hand-made streams parse, and on the server's real stream "
                 f"your chunks add up to exactly the non-streamed greedy answer.{note}")


def _live_text(fn, base_url: str, model: str) -> tuple[str | None, str]:
    """:func:`_server_text` on the server at ``base_url``; if nothing answers there (the
    notebook stopped that server), on a server the check starts for itself. -> (problem
    or None, a note saying which server it was)."""
    import httpx

    try:
        httpx.get(base_url.rstrip("/") + "/health", timeout=5.0)
    except httpx.TransportError:
        from ..engine import LLM
        from ..serve import create_app
        from ..serve.process import ThreadServer

        llm = LLM(*_loop_model(model), max_num_seqs=2, max_model_len=LOOP_CONTEXT)
        with ThreadServer(create_app(llm, model)) as server:
            problem = _server_text(fn, server.base_url, model)
        return problem, (f" (Nothing answers at {base_url} any more, that server was stopped, "
                         "so the check started a server of its own for the real stream.)")
    return _server_text(fn, base_url, model), ""


# ---- build: the engine loop ------------------------------------------------------------------

async def engine_loop(engine, inbox):
    """The reference: requests join between steps, tokens go to their streams, a client
    that goes away is aborted, and each step runs off the event loop."""
    live = {}                                        # request id -> its stream
    while True:
        commands = [] if engine.has_unfinished() else [await inbox.get()]   # idle: wait
        while not inbox.empty():                     # between two steps: take all that came
            commands.append(inbox.get_nowait())
        for kind, stream in commands:
            if kind == "add":
                request = engine.add_request(stream.prompt_token_ids, stream.params,
                                             stream.prompt)
                if stream.accept(request):
                    live[request.request_id] = stream
            elif stream.request is not None and live.pop(stream.request.request_id, None):
                engine.abort_request(stream.request.request_id)   # frees its seat and blocks
                stream.finish(engine.output(stream.request))
        if not engine.has_unfinished():
            continue
        produced = await asyncio.to_thread(engine.step)   # the event loop serves meanwhile
        finished = {}
        for seq, token_id in produced:
            stream = live.get(seq.request.request_id)
            if stream is not None:
                stream.send(seq, token_id)
                if seq.request.finished:
                    finished[seq.request.request_id] = stream
        for request_id, stream in finished.items():
            del live[request_id]
            stream.finish(engine.output(stream.request))


async def _engine_loop_placeholder(engine, inbox):   # what the shipped notebook holds
    raise NotImplementedError


def _take(engine, live, kind, stream, aborts=True):
    if kind == "add":
        request = engine.add_request(stream.prompt_token_ids, stream.params, stream.prompt)
        if stream.accept(request):
            live[request.request_id] = stream
    elif aborts and stream.request is not None and live.pop(stream.request.request_id, None):
        engine.abort_request(stream.request.request_id)
        stream.finish(engine.output(stream.request))


def _route(engine, live, produced):
    finished = {}
    for seq, token_id in produced:
        stream = live.get(seq.request.request_id)
        if stream is not None:
            stream.send(seq, token_id)
            if seq.request.finished:
                finished[seq.request.request_id] = stream
    for request_id, stream in finished.items():
        del live[request_id]
        stream.finish(engine.output(stream.request))


async def _admits_when_idle(engine, inbox):     # static batching: a batch runs to its end
    live = {}
    while True:
        commands = [await inbox.get()]
        while not inbox.empty():
            commands.append(inbox.get_nowait())
        for kind, stream in commands:
            _take(engine, live, kind, stream)
        while engine.has_unfinished():
            _route(engine, live, await asyncio.to_thread(engine.step))


async def _ignores_disconnects(engine, inbox):  # an abort is never acted on
    live = {}
    while True:
        commands = [] if engine.has_unfinished() else [await inbox.get()]
        while not inbox.empty():
            commands.append(inbox.get_nowait())
        for kind, stream in commands:
            _take(engine, live, kind, stream, aborts=False)
        if engine.has_unfinished():
            _route(engine, live, await asyncio.to_thread(engine.step))


async def _steps_on_the_event_loop(engine, inbox):   # engine.step() called in the coroutine
    live = {}
    while True:
        commands = [] if engine.has_unfinished() else [await inbox.get()]
        while not inbox.empty():
            commands.append(inbox.get_nowait())
        for kind, stream in commands:
            _take(engine, live, kind, stream)
        if engine.has_unfinished():
            _route(engine, live, engine.step())
            await asyncio.sleep(0)


async def _wraps_llmlabs_loop(engine, inbox):   # forwards every request to llmlab's EngineLoop
    from ..engine import LLM
    from ..serve.loop import EngineLoop

    own = EngineLoop(LLM(engine.model, engine.tokenizer))
    own.start()

    async def pipe(stream, theirs):
        while True:
            event = await theirs.events.get()
            stream.post(event)
            if event.kind in ("done", "rejected", "error"):
                return

    forwarded, pipes = {}, set()
    while True:
        kind, stream = await inbox.get()
        if kind == "add":
            forwarded[stream] = own.submit(stream.prompt_token_ids, stream.params, stream.prompt)
            pipes.add(asyncio.ensure_future(pipe(stream, forwarded[stream])))
        elif stream in forwarded:
            own.abort(forwarded.pop(stream))


LOOP_MODEL = "smollm2-135m"
LOOP_SEATS = 4
LOOP_CONTEXT = 1024          # tokens: a small KV pool, quick to allocate
# (name, API, prompt, max_tokens, ignore_eos): A streams first and long; B, C (chat,
# streamed) and D (not streamed) are sent once A's first token has arrived
_LOOP_REQUESTS = (
    ("A", "completion", "The history of the Roman Empire began", 32, True),
    ("B", "chat", "What is the capital of France?", 16, False),
    ("C", "chat", "Name three colors of the rainbow.", 16, False),
    ("D", "completion-whole", "The three primary colors are", 12, False),
)
_DISCONNECT = ("E", "completion", "Once upon a time, in a small village,", 96, True)


@functools.lru_cache(maxsize=1)
def _loop_model(model: str):
    import llmlab

    return llmlab.load_model(model), llmlab.load_tokenizer(model)


@functools.lru_cache(maxsize=1)
def _loop_reference(model: str) -> dict[str, str]:
    """Greedy text of each request, offline, from llmlab's LLM (what its own server says)."""
    from ..engine import LLM, SamplingParams

    llm = LLM(*_loop_model(model), max_num_seqs=LOOP_SEATS, max_model_len=LOOP_CONTEXT)
    prompts, params = [], []
    for name, api, prompt, n, ignore_eos in _LOOP_REQUESTS:
        if api == "chat":
            text, ids = llm.chat_prompt([{"role": "user", "content": prompt}])
            prompt = {"prompt": text, "prompt_token_ids": ids}
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos))
    outs = llm.generate(prompts, params, use_tqdm=False)          # one batch
    return {r[0]: out.outputs[0].text for r, out in zip(_LOOP_REQUESTS, outs)}


class _StepLog:
    """Wraps ``engine.step`` (on the instance) to note each step: start, end, the requests
    it ran, and the thread it ran on."""

    def __init__(self, engine):
        self.records: list[tuple[float, float, tuple, int]] = []
        step = engine.step

        def logged():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                self.records.append((t0, time.perf_counter(), tuple(engine.step_request_ids),
                                     threading.get_ident()))

        engine.step = logged

    def ids_after(self, t: float) -> list[int]:
        return list(dict.fromkeys(i for t0, _, ids, _ in list(self.records) if t0 >= t
                                  for i in ids))


def _send(client, model, spec, times, stop_after=None):
    """One request through the openai client; ``times`` gets each text chunk's arrival.
    -> its text. ``stop_after``: close the stream after that many chunks (a client that
    goes away)."""
    name, api, prompt, n, ignore_eos = spec
    extra = {"ignore_eos": True} if ignore_eos else None
    if api == "chat":
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=n,
            temperature=0, stream=True, extra_body=extra)
        pick = lambda c: c.choices[0].delta.content if c.choices else None  # noqa: E731
    elif api == "completion":
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                           temperature=0, stream=True, extra_body=extra)
        pick = lambda c: c.choices[0].text if c.choices else None  # noqa: E731
    else:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                        temperature=0, extra_body=extra)
        times.append(time.perf_counter())
        return out.choices[0].text
    text = ""
    for chunk in stream:
        piece = pick(chunk)
        if piece:
            times.append(time.perf_counter())
            text += piece
            if stop_after is not None and len(times) >= stop_after:
                stream.close()
                break
    return text


def _engine_loop_problem(loop, server, steps, client, model, got):
    """Run the requests against the server (their texts go to ``got``); -> a failing
    Verdict, or None."""
    def died():
        if loop.exception is not None:       # the student's loop raised: say what it raised
            raise loop.exception
        if loop.death is not None:
            return wrong(f"your engine loop ended ({loop.death}), so the server stopped "
                         "serving.", "the loop must run for as long as the server does: "
                         "`while True`, waiting on the inbox when the engine is idle.")
        return None

    times = {name: [] for name, *_ in _LOOP_REQUESTS}
    specs = {spec[0]: spec for spec in _LOOP_REQUESTS}
    with ThreadPoolExecutor(len(_LOOP_REQUESTS)) as pool:
        futures = {"A": pool.submit(_send, client, model, specs["A"], times["A"])}
        deadline = time.monotonic() + 60
        while not times["A"] and not futures["A"].done() and time.monotonic() < deadline:
            time.sleep(0.005)
        t_join = time.perf_counter()
        for name in ("B", "C", "D"):
            futures[name] = pool.submit(_send, client, model, specs[name], times[name])
            time.sleep(0.05)
        errors = {}
        for name, fut in futures.items():
            try:
                got[name] = fut.result(timeout=120)
            except Exception as e:           # the client's error: a status, a timeout
                errors[name] = f"{type(e).__name__}: {e}"
    bad = died()
    if bad is not None:
        return bad
    if errors:
        name, err = next(iter(errors.items()))
        return wrong(f"request {name} failed: {err[:300]}",
                     "each added request needs stream.accept(request), then stream.send(seq, "
                     "token_id) for its tokens and stream.finish(engine.output(request)) "
                     "once request.finished.")
    loop_thread = server.thread.ident
    on_loop = [t1 - t0 for t0, t1, _, th in steps.records if th == loop_thread]
    if on_loop:
        ms = 1e3 * sorted(on_loop)[len(on_loop) // 2]
        return wrong(f"your loop ran engine.step() on the event loop's own thread ({len(on_loop)} "
                     f"steps, median {ms:.0f} ms each): it blocks the event loop, and while a "
                     "step runs no handler reads a request, sends a token or notices a "
                     "disconnect.",
                     "await the step in a worker thread: `await asyncio.to_thread(engine.step)`.")
    first = steps.records[0][2] if steps.records else ()
    a_id = first[0] if first else None
    together = [ids for _, _, ids, _ in steps.records if a_id in ids and len(ids) > 1]
    if not together:
        a_end, b_first = times["A"][-1], (times["B"] or [math.inf])[0]
        when = (f"{b_first - a_end:.2f} s after A's last token" if b_first >= a_end else
                f"{a_end - b_first:.2f} s before A's last token")
        return wrong(f"requests B, C and D arrived while A was generating but never shared a "
                     f"step with it: B's first token came {b_first - t_join:.2f} s after it was "
                     f"sent, {when}. Your loop admits new requests only when the engine is "
                     "idle: that is static batching.",
                     "take what the inbox holds before every step, not only when nothing runs.")
    return _disconnect_problem(loop, steps, client, model, died)


def _disconnect_problem(loop, steps, client, model, died):
    engine = loop.engine
    base_blocks = engine.cache.manager.num_used_blocks
    before = set(steps.ids_after(-math.inf))
    times: list[float] = []
    try:
        _send(client, model, _DISCONNECT, times, stop_after=2)
    except Exception as e:
        bad = died()
        return bad or wrong(f"the request that goes away failed before it did: "
                            f"{type(e).__name__}: {e}")
    t_gone = time.perf_counter()
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    bad = died()
    if bad is not None:
        return bad
    e_ids = [i for i in steps.ids_after(-math.inf) if i not in before]
    e_id = e_ids[0] if e_ids else None
    after = sum(1 for t0, _, ids, _ in list(steps.records) if t0 > t_gone + 0.05 and e_id in ids)
    if after > 30 or engine.has_unfinished():
        return wrong(f"client E read 2 tokens, then disconnected; its request still ran {after} "
                     f"more steps (of {_DISCONNECT[3]} tokens asked), holding a seat and its KV "
                     "blocks for nobody. Your loop ignores disconnects.",
                     "on (\"abort\", stream): engine.abort_request(stream.request.request_id), "
                     "then stream.finish(engine.output(stream.request)).")
    blocks = engine.cache.manager.num_used_blocks
    if blocks != base_blocks:
        return wrong(f"after client E disconnected and every request ended, {blocks} KV blocks "
                     f"are in use, {base_blocks} before: the aborted request's blocks were not "
                     "freed.", "engine.abort_request(request_id) frees them.")
    return None


@exercise("nb10.engine_loop", notebook=NB, kind="build",
          title="the server's engine loop: requests join between steps, a disconnect aborts",
          solution=engine_loop, placeholder=_engine_loop_placeholder,
          wrong_variants={
              "admits only when idle": (_admits_when_idle, ("static batching",)),
              "ignores disconnects": (_ignores_disconnects, ("ignores disconnects",)),
              "steps on the event loop": (_steps_on_the_event_loop, ("blocks the event loop",)),
              "wraps llmlab's EngineLoop": (_wraps_llmlabs_loop, ("llmlab's own",)),
          })
def _check_engine_loop(fn, model: str = LOOP_MODEL) -> object:
    import openai

    from ..engine import LLM, LLMEngine
    from ..serve import create_app
    from ..serve.loop import EngineLoop
    from ..serve.process import ThreadServer

    if not inspect.iscoroutinefunction(fn):
        return wrong(f"expected a coroutine function, `async def engine_loop(engine, inbox)`; "
                     f"got {fn!r}.", "it runs as a task on the server's event loop: define it "
                     "with async def.")
    llm = LLM(*_loop_model(model), max_num_seqs=LOOP_SEATS, max_model_len=LOOP_CONTEXT)
    steps = _StepLog(llm.engine)
    app = create_app(llm, model, engine_loop=fn)
    loop = app.state.server.loop
    loop.log_errors = False                  # what it raised is the verdict's to say
    with exercises_forbid(EngineLoop.__init__, EngineLoop.start, LLMEngine.run):
        with ThreadServer(app) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                                   max_retries=0, timeout=60)
            got: dict[str, str] = {}
            problem = _engine_loop_problem(loop, server, steps, client, model, got)
    if problem is not None:
        return problem
    want = _loop_reference(model)            # llmlab's answers, outside the forbid block
    for name, *_ in _LOOP_REQUESTS:
        if got[name] != want[name]:
            return wrong(f"request {name}'s text differs from llmlab's greedy answer: yours "
                         f"{got[name]!r}, llmlab's {want[name]!r}.",
                         "send each (seq, token_id) of a step to the stream of seq.request, "
                         "once, and finish a stream only when its request is finished.")
    n = len(steps.records)
    widest = max(len(ids) for _, _, ids, _ in steps.records)
    return right(f"{len(_LOOP_REQUESTS)} concurrent openai clients got llmlab's greedy text "
                 f"exactly; B, C and D joined A's running batch (up to {widest} requests in a "
                 f"step, {n} steps, all off the event loop), and a client that went away had "
                 "its request aborted and its KV blocks freed.")


# ---- predict: the rate the continuous server sustains ---------------------------------------

TYPICAL_LOAD = (0.5, 0.75)     # the largest load met, and the next offered, on a typical run


@exercise("nb10.predict_capacity", notebook=NB, kind="predict",
          title="predict: the largest load, as a multiple of the burst's rate, at which the "
                "continuous server meets its targets",
          solution=0.6,
          wrong_variants={"one at a time": (0.125, ("batch",)),
                          "requests per second": (45.0, ("multiple",)),
                          "past saturation": (1.5, ("saturates",))})
def _check_predict_capacity(answer, measured: float | None = None,
                            offered: tuple[float, ...] | None = None) -> object:
    """``answer``: a load as a multiple of the rate the burst finished (1 = that rate).
    ``measured``: the largest offered load at which at least 90% of the continuous server's
    requests met both targets (0 when none did); ``offered``: the loads of the sweep.

    Right when the answer is at least half the measured load and not above the next offered
    load, the first one measured to miss (twice the measured one when it was the top load;
    at most the lowest offered when none met). Without a measurement, a typical run: 0.5
    met, 0.75 missed."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the answer should be a load > 0 (a multiple of the burst's rate), got "
                     f"{answer!r}.")
    why = ("A server saturates when requests arrive faster than it finishes them: at 1x the "
           "burst's rate it is busy all the time, and random arrivals bunch up, so a queue "
           "forms below that already; past it the queue, and the TTFT, grow with every arrival.")
    if answer > 4:
        return wrong(f"{answer:g} is a load far above the burst's rate; the answer is a "
                     "multiple of that rate (1 = the burst's rate), not requests per second.",
                     "divide your rate by the burst's requests per second.")
    if measured is None:
        met, nxt, what = TYPICAL_LOAD[0], TYPICAL_LOAD[1], "a typical run here"
    else:
        loads = sorted(offered or ())
        met, what = float(measured), "this run"
        above = [x for x in loads if x > met]
        nxt = above[0] if above else None       # None: even the top load met the targets
    if not met:
        low = min(offered) if offered else 0.5
        if answer <= low:
            return right(f"{answer:g}x: in this run no offered load met the targets, not even "
                         f"{low:g}x, so the answer lies below it. {why}")
        return wrong(f"{answer:g}x: in this run no offered load met the targets, not even "
                     f"{low:g}x. {why}", "read the attainment column: which loads reach 90%?")
    missed = (f"missed them at {nxt:g}x" if nxt is not None else
              "offered no higher load")
    if met / 2 <= answer <= (nxt if nxt is not None else 2 * met):
        return right(f"{answer:g}x: {what} met the targets at {met:g}x and {missed}. {why}")
    if answer < met / 2:
        return wrong(f"{answer:g}x is well below the {met:g}x at which {what} met the targets: "
                     "continuous batching serves a full batch of requests at once, and the "
                     "burst's rate already counts them all.",
                     "the burst measured the full batch's rate; a lighter load than that "
                     "leaves the server idle part of the time.")
    if nxt is None:
        return wrong(f"{answer:g}x is more than twice the top load of the sweep, {met:g}x, the "
                     f"largest {what} offered (it met the targets there). {why}",
                     "at 1x the server is never idle: how long does the queue get?")
    return wrong(f"{answer:g}x is above {nxt:g}x, where {what} already missed the targets "
                 f"(met at {met:g}x). {why}", "at 1x the server is never idle: how long does "
                 "the queue get?")


# ---- explain: static TTFT ---------------------------------------------------------------

_STATIC_OPTIONS = {
    "a": "a request that comes while a batch runs waits for that whole batch to end before "
         "its prefill",
    "b": "each step of a static batch costs more, since the batch is padded to its longest "
         "prompt",
    "c": "HTTP and server-sent events cost more per request under the static scheduler's "
         "batches",
    "d": "the static server admits newcomers between steps, but only once the running ones "
         "have finished their prefill",
}

_STATIC_EXPLANATIONS = {
    "a": "a static batch is formed once and runs until its longest member has made all its "
         "tokens; a request that arrives meanwhile, even to an almost idle server, waits for "
         "the rest of that batch, up to max_tokens steps, before its own prefill. Orca (Yu et "
         "al., OSDI 2022) calls this request-level scheduling; iteration-level scheduling "
         "admits it at the next step.",
    "b": "padding makes a static step somewhat dearer, but one step is tens of milliseconds: "
         "it cannot make the TTFT many times longer. The wait is for whole batches.",
    "c": "the HTTP and SSE path is the same code for both schedulers, and small next to a "
         "step; only the engine's schedule differs.",
    "d": "that is the continuous scheduler; the static one admits no one until every member "
         "of its batch has finished.",
}


@exercise("nb10.explain_static_ttft", notebook=NB, kind="explain",
          title="explain: at the lowest rate, why do the static scheduler's requests wait "
                "longer for their first token than the continuous one's?",
          solution="a", choices=_STATIC_OPTIONS,
          wrong_variants={"padding": ("b", ("step",)), "http": ("c", ("same code",)),
                          "continuous": ("d", ("continuous",))})
def _check_explain_static_ttft(answer) -> object:
    return choice_verdict(answer, "a", _STATIC_EXPLANATIONS)


# ---- build (stretch): Poisson arrivals ------------------------------------------------------

def _uniform_gaps(rate, n, seed=0):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.uniform(0, 2 / rate)
        out.append(t)
    return out


def _gap_is_rate(rate, n, seed=0):          # mean gap = rate instead of 1/rate
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1 / rate)
        out.append(t)
    return out


def _fixed_gaps(rate, n, seed=0):
    return [(i + 1) / rate for i in range(n)]


def _ks_exponential(gaps: list[float], rate: float) -> float:
    """Kolmogorov-Smirnov distance between the gaps and Exp(rate)."""
    g = sorted(gaps)
    n = len(g)
    return max(max((i + 1) / n - (1 - math.exp(-rate * x)), (1 - math.exp(-rate * x)) - i / n)
               for i, x in enumerate(g))


@exercise("nb10.poisson_arrivals", notebook=NB, kind="build", stretch=True,
          title="stretch: arrival times of a Poisson process of a given rate",
          solution=poisson_arrivals,
          wrong_variants={"uniform gaps": (_uniform_gaps, ("exponential",)),
                          "mean gap = rate": (_gap_is_rate, ("mean gap",)),
                          "fixed gaps": (_fixed_gaps, ("exponential",))})
def _check_poisson(fn, n: int = 4000) -> object:
    if not callable(fn):
        return wrong(f"expected a function poisson_arrivals(rate, n, seed), got {fn!r}.")
    rate = 4.0
    times = [float(t) for t in fn(rate, n, 1)]
    if len(times) != n:
        return wrong(f"asked for {n} arrival times, got {len(times)}.")
    if any(b < a for a, b in zip(times, times[1:])) or times[0] < 0:
        return wrong("arrival times must start at >= 0 and never decrease.", "add up the gaps.")
    if [float(t) for t in fn(rate, n, 1)] != times:
        return wrong("the same seed gave different times: a benchmark must be repeatable.",
                     "use random.Random(seed), not the global generator.")
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    mean = sum(gaps) / n
    if abs(mean - 1 / rate) > 4 / (rate * math.sqrt(n)):   # ~4 standard errors
        return wrong(f"the mean gap is {mean:.4f} s; at {rate:g} requests/s it should be "
                     f"{1 / rate:.4f} s.", "the mean gap of a Poisson process is 1/rate.")
    ks = _ks_exponential(gaps, rate)
    if ks > 1.63 / math.sqrt(n):                           # the KS test's 1% critical value
        return wrong(f"the gaps are not exponential: KS distance {ks:.3f} > "
                     f"{1.63 / math.sqrt(n):.3f} (1% level).",
                     "draw each gap with random.expovariate(rate).")
    return right(f"mean gap {mean:.4f} s (1/rate = {1 / rate:.4f}), KS distance to Exp({rate:g}) "
                 f"{ks:.3f}, repeatable with a seed.")
