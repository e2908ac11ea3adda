"""The pieces of a load generator for an OpenAI-compatible server (notebook 10).

* :func:`poisson_arrivals` — request start times of a Poisson process: independent
  exponential gaps with mean ``1 / rate``, the usual open-loop load model of serving
  benchmarks (e.g. vLLM's ``benchmark_serving``; Kwon et al., SOSP 2023,
  https://arxiv.org/abs/2309.06180, section 6).
* :class:`SSEDecoder` / :func:`parse_sse` — the ``data:`` payloads of a server-sent
  event stream (WHATWG HTML, https://html.spec.whatwg.org/multipage/server-sent-events.html).
* :func:`stream_completion` — one streamed request over httpx, timed: when it was
  sent, when each chunk of text arrived, how many tokens it got.
* :func:`percentile` and :func:`summarize` — p50 / p90 / p99 of TTFT, TPOT and
  end-to-end latency, throughput, and goodput: the requests per second that met a TTFT
  target and, if one is given, a TPOT target too (DistServe's definition);
  :func:`percentile_interval` — a bootstrap interval for a percentile.

Plain functions with no llmlab imports, so a notebook can import them, or a student
can write one and check it against the running server.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds from 0, increasing) of a Poisson process of ``rate``
    requests per second: the gaps are independent and exponential with mean 1/rate."""
    if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate={rate!r} must be a finite number > 0 (requests per second)")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} must be an int >= 0")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


class SSEDecoder:
    """Feed it the lines of an event stream one by one; it returns each event's data
    (its ``data:`` lines joined by newlines) when the blank line that ends the event
    arrives, else None. Comment lines (``:``) and other fields are ignored."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:                       # end of an event
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def parse_sse(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON payloads of an OpenAI stream, in order, up to ``data: [DONE]``."""
    dec = SSEDecoder()
    for line in lines:
        data = dec.feed(line)
        if data is None:
            continue
        if data == "[DONE]":
            return
        yield json.loads(data)


@dataclass
class StreamResult:
    """One streamed request, timed with ``time.perf_counter`` (seconds)."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)   # chunks that carried text
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False                                  # saw data: [DONE]

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else math.nan

    @property
    def e2e_s(self) -> float:
        return self.chunk_s[-1] - self.sent_s if self.chunk_s else math.nan

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan with fewer than two)."""
        n = self.completion_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else math.nan


def _take_chunk(res: StreamResult, chunk: dict, now: float) -> None:
    if "error" in chunk:
        res.error = chunk["error"].get("message", str(chunk["error"]))
        return
    for ch in chunk.get("choices") or []:
        text = ch.get("text")
        if text is None:
            text = (ch.get("delta") or {}).get("content") or ""
        if text:
            res.text += text
            res.chunk_s.append(now)
        if ch.get("finish_reason"):
            res.finish_reason = ch["finish_reason"]
            if not res.chunk_s:            # finished with no text at all: time it anyway
                res.chunk_s.append(now)
    if chunk.get("usage"):
        res.completion_tokens = chunk["usage"]["completion_tokens"]


async def stream_completion(client, url: str, body: dict) -> StreamResult:
    """POST ``body`` (with ``stream: true`` and usage asked for) to ``url`` with an
    ``httpx.AsyncClient``; read the SSE stream to its end. Never raises: a failure is
    in ``result.error``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    res = StreamResult(time.perf_counter())
    dec = SSEDecoder()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return res
            async for line in r.aiter_lines():
                data = dec.feed(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    res.done = True
                    break
                _take_chunk(res, json.loads(data), time.perf_counter())
    except Exception as e:                  # a network error is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of the finite values of ``xs``, interpolating
    linearly between the two nearest ranks (numpy's default); nan if there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r} must be in [0, 100]")
    v = sorted(x for x in xs if isinstance(x, (int, float)) and math.isfinite(x))
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def percentile_interval(xs: Iterable[float], q: float, level: float = 0.9, n: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval for the ``q``-th percentile of ``xs``: resample the finite
    values with replacement ``n`` times, take each resample's percentile, and return the
    central ``level`` share of those (Efron's percentile interval; Efron and Tibshirani,
    *An Introduction to the Bootstrap*, 1993). With 20 values a p90 rests on the two
    largest, and the interval says so by being wide. (nan, nan) if there are no values."""
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    v = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return math.nan, math.nan
    rng = random.Random(seed)
    stats = sorted(percentile(rng.choices(v, k=len(v)), q) for _ in range(n))
    tail = (1 - level) / 2
    return percentile(stats, 100 * tail), percentile(stats, 100 * (1 - tail))


def meets_targets(result: StreamResult, ttft_target_s: float,
                  tpot_target_s: float | None = None) -> bool:
    """Whether one request met its service-level objectives: completed, its TTFT within
    ``ttft_target_s`` and, when ``tpot_target_s`` is given, its TPOT within that too (a
    one-token answer has no time per output token and meets any TPOT target)."""
    if not result.ok or not result.ttft_s <= ttft_target_s:
        return False
    return tpot_target_s is None or math.isnan(result.tpot_s) or result.tpot_s <= tpot_target_s


def summarize(results: list[StreamResult], wall_s: float, ttft_target_s: float,
              tpot_target_s: float | None = None) -> dict:
    """Latency percentiles (seconds), throughput and goodput of one load run.

    ``throughput_tok_s``: generated tokens per second of wall time; ``lost``: requests
    that got no complete answer (an error, or a stream without ``[DONE]``).

    ``goodput_req_s``: completed requests that met the targets, per second of wall time;
    ``met_targets``: how many did; ``slo_attainment``: their share of all requests. With
    ``tpot_target_s`` a request must meet both the TTFT and the TPOT target (DistServe's
    definition: Zhong et al., OSDI 2024, https://arxiv.org/abs/2401.09670, which judges a
    rate by the share of requests meeting both, e.g. 90%); without it, TTFT only."""
    ok = [r for r in results if r.ok]
    out = {"requests": len(results), "completed": len(ok), "lost": len(results) - len(ok),
           "wall_s": wall_s}
    for name in ("ttft", "tpot", "e2e"):
        vals = [getattr(r, f"{name}_s") for r in ok]
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(vals, q)
    tokens = sum(r.completion_tokens for r in ok)
    out["throughput_tok_s"] = tokens / wall_s if wall_s > 0 else math.nan
    out["throughput_req_s"] = len(ok) / wall_s if wall_s > 0 else math.nan
    good = sum(1 for r in ok if meets_targets(r, ttft_target_s, tpot_target_s))
    out["met_targets"] = good
    out["slo_attainment"] = good / len(results) if results else math.nan
    out["goodput_req_s"] = good / wall_s if wall_s > 0 else math.nan
    out["ttft_target_s"], out["tpot_target_s"] = ttft_target_s, tpot_target_s
    return out


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Every sample of the server's ``/metrics``, parsed by prometheus_client's own parser:
    ``{"llmlab_requests_running": 3.0, 'llmlab_requests_finished_total{"finish_reason": "length"}': 8.0, ...}``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s).text
    return {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def watch_metrics(base_url: str, names: Iterable[str], stop, interval_s: float = 0.1
                  ) -> list[tuple[float, dict[str, float]]]:
    """Scrape ``names`` every ``interval_s`` until ``stop()`` is true (run it in a thread
    while a load runs); -> ``[(seconds since the first scrape, {name: value}), ...]``."""
    names, out, t0 = list(names), [], time.perf_counter()
    while True:
        m = scrape_metrics(base_url)
        out.append((time.perf_counter() - t0, {n: m.get(n, math.nan) for n in names}))
        if stop():
            return out
        time.sleep(interval_s)


__all__ = ["poisson_arrivals", "SSEDecoder", "parse_sse", "StreamResult", "stream_completion",
           "percentile", "percentile_interval", "meets_targets", "summarize", "scrape_metrics",
           "watch_metrics"]
