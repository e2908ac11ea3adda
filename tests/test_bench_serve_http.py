"""The load generator's plain pieces (llmlab.serve.client) and the serve-http bench's
decisions, without a server: Poisson arrivals, SSE parsing, percentiles, summaries,
the sustained rate, and the command line."""
import asyncio
import json
import math
import statistics

import httpx
import pytest

from llmlab.bench.serve_http import parse_args, request_bodies, sustained_rate
from llmlab.serve.client import (SSEDecoder, StreamResult, parse_sse, percentile,
                                 meets_targets, poisson_arrivals, stream_completion,
                                 summarize)
from llmlab.traces import load_trace


def test_poisson_arrivals_have_exponential_gaps_of_the_right_mean():
    t = poisson_arrivals(4.0, 4000, seed=1)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    assert all(g > 0 for g in gaps) and t == sorted(t)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # exponential: the standard deviation equals the mean (a fixed spacing would give 0)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)
    assert poisson_arrivals(4.0, 10, seed=1) == t[:10]          # reproducible by seed
    assert poisson_arrivals(4.0, 10, seed=2) != t[:10]


@pytest.mark.parametrize("rate, n, match", [(0, 3, "rate=0"), (-1.0, 3, "rate=-1.0"),
                                             (float("inf"), 3, "rate=inf"), (1.0, -1, "n=-1")])
def test_poisson_arrivals_reject_bad_values(rate, n, match):
    with pytest.raises(ValueError, match=match):
        poisson_arrivals(rate, n)


def test_sse_decoder_joins_data_lines_and_ignores_comments():
    dec = SSEDecoder()
    got = [dec.feed(x) for x in [": keep-alive", "data: {\"a\":", "data:1}", "", "", "event: x",
                                 "data: [DONE]", ""]]
    assert [g for g in got if g is not None] == ['{"a":\n1}', "[DONE]"]


def test_parse_sse_stops_at_done():
    lines = ['data: {"i": 0}', "", 'data: {"i": 1}', "", "data: [DONE]", "", 'data: {"i": 2}', ""]
    assert [c["i"] for c in parse_sse(lines)] == [0, 1]


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_linear_interpolation(q):
    xs = [3.0, 1.0, 7.5, 2.0, 9.0, 4.0, float("nan")]
    v = sorted(x for x in xs if x == x)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    assert percentile(xs, q) == pytest.approx(v[lo] + (v[hi] - v[lo]) * (pos - lo))
    assert math.isnan(percentile([], q))
    with pytest.raises(ValueError, match="q=101"):
        percentile(xs, 101)


def _result(sent, chunks, tokens, ok=True):
    return StreamResult(sent, list(chunks), "x", tokens, "length" if ok else None,
                        None if ok else "HTTP 503: full", ok)


def test_stream_result_times_and_summary():
    a = _result(0.0, [0.5, 0.7, 0.9], 5)           # TTFT 0.5, e2e 0.9, TPOT 0.4/4
    b = _result(1.0, [3.0, 3.5], 2)                # TTFT 2.0, TPOT 0.5
    lost = _result(2.0, [], 0, ok=False)
    assert (a.ttft_s, a.e2e_s, a.tpot_s) == (0.5, 0.9, pytest.approx(0.1))
    assert math.isnan(_result(0, [1.0], 1).tpot_s)
    s = summarize([a, b, lost], wall_s=4.0, ttft_target_s=1.0)
    assert (s["requests"], s["completed"], s["lost"]) == (3, 2, 1)
    assert s["ttft_p50_s"] == pytest.approx(1.25) and s["ttft_p90_s"] == pytest.approx(1.85)
    assert s["throughput_tok_s"] == pytest.approx(7 / 4)
    assert s["goodput_req_s"] == pytest.approx(1 / 4)      # only a met the 1 s target


def test_goodput_with_a_tpot_target_counts_requests_meeting_both():
    """DistServe's goodput: a request counts when its TTFT and its TPOT both meet their
    targets; without a TPOT target the summary is the TTFT-only one it was."""
    fast = _result(0.0, [0.2, 0.3, 0.4], 3)         # TTFT 0.2, TPOT 0.1: meets both
    stutter = _result(0.0, [0.2, 1.2, 2.2], 3)      # TTFT 0.2, TPOT 1.0: misses TPOT
    late = _result(0.0, [2.0, 2.1, 2.2], 3)         # TTFT 2.0, TPOT 0.1: misses TTFT
    single = _result(0.0, [0.3], 1)                 # one token: no TPOT, meets any TPOT target
    lost = _result(0.0, [], 0, ok=False)
    runs = [fast, stutter, late, single, lost]
    assert [meets_targets(r, 1.0, 0.5) for r in runs] == [True, False, False, True, False]
    assert [meets_targets(r, 1.0) for r in runs] == [True, True, False, True, False]
    both = summarize(runs, wall_s=2.0, ttft_target_s=1.0, tpot_target_s=0.5)
    assert both["met_targets"] == 2 and both["goodput_req_s"] == pytest.approx(1.0)
    assert both["slo_attainment"] == pytest.approx(2 / 5)          # of all requests, lost too
    assert (both["ttft_target_s"], both["tpot_target_s"]) == (1.0, 0.5)
    ttft_only = summarize(runs, wall_s=2.0, ttft_target_s=1.0)
    assert ttft_only["met_targets"] == 3 and ttft_only["goodput_req_s"] == pytest.approx(1.5)
    assert ttft_only["tpot_target_s"] is None
    assert math.isnan(summarize([], 1.0, 1.0, 0.5)["slo_attainment"])


def test_sustained_rate_is_the_largest_rate_within_the_target():
    rows = [{"rate": r, "ttft_p90_s": t, "lost": lost}
            for r, t, lost in [(1, 0.2, 0), (2, 1.5, 0), (4, 0.5, 0), (8, 3.0, 0)]]
    assert sustained_rate(rows, 1.0) == 4          # 2 missed (noise), 8 misses
    assert sustained_rate(rows, 5.0) == 8
    rows[2]["lost"] = 1
    assert sustained_rate(rows, 1.0) == 1          # a lost request fails the rate
    assert sustained_rate(rows, 0.1) == 0.0
    rows[0]["ttft_p90_s"] = float("nan")           # nothing completed: not sustained
    assert sustained_rate(rows, 1.0) == 0.0


def test_stream_completion_reads_a_stream_and_reports_errors():
    chunks = [{"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]},
              {"choices": [], "usage": {"completion_tokens": 2}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        if seen["body"]["prompt"] == "full":
            return httpx.Response(503, json={"error": {"message": "queue full"}})
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go(prompt):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://x") as c:
            return await stream_completion(c, "/v1/completions", {"prompt": prompt})

    ok = asyncio.run(go("hi"))
    assert seen["body"]["stream"] is True and seen["body"]["stream_options"]["include_usage"]
    assert (ok.text, ok.completion_tokens, ok.finish_reason, ok.ok) == ("Hello", 2, "length", True)
    assert len(ok.chunk_s) == 2 and ok.ttft_s >= 0
    bad = asyncio.run(go("full"))
    assert not bad.ok and bad.error.startswith("HTTP 503")


def test_bench_arguments_are_checked():
    args = parse_args(["--rates", "2,0.5", "--requests", "3"])
    assert args.rates == [0.5, 2.0] and args.schedulers == ["static", "continuous"]
    for argv, match in [(["--rates", "a,b"], "--rates='a,b'"), (["--rates", "0,1"], "must all be > 0"),
                        (["--schedulers", "fifo"], "allowed: \\['static', 'continuous'\\]"),
                        (["--requests", "0"], "--requests=0"), (["--ttft-target", "0"], "--ttft-target=0")]:
        with pytest.raises(ValueError, match=match):
            parse_args(argv)


def test_request_bodies_cap_the_trace_outputs():
    trace = load_trace("cpu", 5)
    bodies = request_bodies(trace, 10)
    assert [b["max_tokens"] for b in bodies] == [min(r.output_tokens, 10) for r in trace]
    assert all(b["temperature"] == 0 and b["ignore_eos"] for b in bodies)
    assert [b["prompt"] for b in bodies] == [r.prompt for r in trace]


def test_sustained_by_target_reads_every_target_and_leaves_undefined_ratios_undefined():
    from llmlab.bench.serve_http import sustained_by_target
    rows = [{"scheduler": "continuous", "rate": r, "ttft_p90_s": t, "lost": 0}
            for r, t in ((1, 0.3), (2, 0.6), (4, 1.5))]
    rows += [{"scheduler": "static", "rate": r, "ttft_p90_s": t, "lost": 0}
             for r, t in ((1, 1.2), (2, 3.0), (4, 9.0))]
    got = sustained_by_target(rows, ("continuous", "static"), (2.0, 0.5, 1.0, 2.0))
    assert [g["p90 TTFT target s"] for g in got] == [0.5, 1.0, 2.0]
    assert [g["continuous req/s"] for g in got] == [1, 2, 4]
    assert [g["static req/s"] for g in got] == [0.0, 0.0, 1]
    assert got[0]["continuous / static"] is None and got[2]["continuous / static"] == 4.0
