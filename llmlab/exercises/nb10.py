"""The exercises of notebook 10 (serving over HTTP).

- ``nb10.parse_sse`` (build): the client side of a streamed OpenAI response. Checked on
  hand-made event streams that exercise the format's rules, then on the raw lines of a
  real stream from the running server, whose text must equal the non-streamed answer.
- ``nb10.predict_capacity`` (predict): the request rate the continuous server sustains.
- ``nb10.explain_static_ttft`` (explain): why a static batch's TTFT explodes under load.
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

import json
import math
import random

from . import choice_verdict, exercise, right, wrong
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
    bad = _server_text(fn, base_url, model or "smollm2-135m")
    if bad:
        return wrong(bad, "compare your parser's events with the raw lines (print them).")
    return right(f"all {len(_cases())} hand-made streams parse, and on the server's real stream "
                 "your chunks add up to exactly the non-streamed greedy answer.")


# ---- predict: the rate the continuous server sustains ---------------------------------------

@exercise("nb10.predict_capacity", notebook=NB, kind="predict",
          title="predict: the largest request rate the continuous server sustains",
          solution=2.0,
          wrong_variants={"one at a time": (0.1, ("batch",)),
                          "no limit": (1000.0, ("tokens per second",))})
def _check_predict_capacity(answer, measured: float | None = None,
                            capacity: float | None = None) -> object:
    """``measured``: the largest swept rate sustained; ``capacity``: the estimate from
    batched tokens/s over tokens per request (the rates are swept in factors of 2)."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the answer should be a rate in requests per second > 0, got {answer!r}.")
    want = float(measured) if measured else float(capacity or 2.0)
    what = "the measured" if measured else "a typical 2-core CPU's"
    why = ("a server saturates when requests arrive faster than it finishes them: at full "
           "batch it makes about (tokens per second) / (tokens per request) requests per "
           "second; past that the queue, and the TTFT, grow without bound.")
    if want / 2 <= answer <= want * 2:
        return right(f"{answer:g} req/s is within a factor of 2 of {what} {want:g} req/s "
                     f"(the sweep doubles the rate each step). {why}")
    if answer < want:
        return wrong(f"{answer:g} req/s is well below {what} {want:g} req/s: continuous "
                     f"batching serves many requests at once. {why}",
                     "use the batched decode tokens/s, not one request's.")
    return wrong(f"{answer:g} req/s is well above {what} {want:g} req/s. {why}",
                 "divide the batched tokens per second by the tokens per request.")


# ---- explain: static TTFT ---------------------------------------------------------------

_STATIC_CHOICES = {
    "a": "the static scheduler is not slower per step; a step of the same batch costs the same "
         "in both engines.",
    "b": "a request that arrives while a static batch runs waits until the whole batch, its "
         "longest member included, has finished; only then is a new batch formed. Its TTFT "
         "includes that wait, which grows with the load (Orca, OSDI 2022, calls this "
         "request-level scheduling).",
    "c": "HTTP and SSE overheads are the same for both schedulers, and small next to a step.",
    "d": "static batching pads the batch but still admits requests between steps; it does not: "
         "its batch is fixed until every member finishes.",
}


@exercise("nb10.explain_static_ttft", notebook=NB, kind="explain",
          title="explain: why does the static scheduler's TTFT grow so fast with the rate?",
          solution="b",
          wrong_variants={"slower steps": ("a", ("same",)), "http": ("c", ("overheads",))})
def _check_explain_static_ttft(answer) -> object:
    return choice_verdict(answer, "b", _STATIC_CHOICES)


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
