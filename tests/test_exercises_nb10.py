"""Notebook 10's exercises against a real server: the SSE-parser checker passes the
reference on a live stream, fails a parser that gets the live stream wrong, and starts a
server of its own when the given one was stopped; the server process helper starts, serves
and stops cleanly. The engine-loop build: a coroutine loop plugged into the server
(AsyncEngineLoop) serves what llmlab's own EngineLoop serves, aborts on a disconnect, and
a loop that raises stops the server with the reason; the sweep's bootstrap intervals and
figure."""
import math

import pytest

pytest.importorskip("fastapi")

from llmlab import exercises  # noqa: E402
from llmlab.serve.client import parse_sse  # noqa: E402
from llmlab.serve.process import ServerProcess  # noqa: E402
from llmlab.viz.http import (explore_rate, latencies, plot_gauges, plot_sweep,  # noqa: E402
                             read_gauges)
from llmlab.serve.client import StreamResult  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with ServerProcess("tiny-llama", scheduler="continuous") as srv:
        yield srv
    assert srv.proc.returncode == 0          # SIGINT gave a clean shutdown


def _stops_at_finish_reason(lines):
    """Treats the chunk that carries a finish_reason as the end, dropping its text: right on
    every hand-made case (none finishes), wrong on a real stream, whose last chunk has text
    and finish_reason together."""
    for chunk in parse_sse(lines):
        if any(ch.get("finish_reason") for ch in chunk.get("choices", [])):
            return
        yield chunk


@pytest.mark.slow
def test_parse_sse_checker_passes_the_reference_on_the_live_stream(server):
    v = exercises.check("nb10.parse_sse", parse_sse, base_url=server.base_url,
                        model="tiny-llama")
    assert v.passed and "real stream" in v.message, v.message


def test_parse_sse_checker_catches_a_parser_wrong_only_on_the_live_stream(server):
    ex = exercises.get("nb10.parse_sse")
    assert ex.check(_stops_at_finish_reason).passed           # no server: cases only
    v = ex.check(_stops_at_finish_reason, base_url=server.base_url, model="tiny-llama")
    assert not v.passed and "non-streamed answer" in v.message, v.message


def test_server_process_reports_its_state(server):
    assert server.running and server.base_url.startswith("http://127.0.0.1:")
    assert "running" in repr(server)


def _result(sent, chunks, tokens):
    r = StreamResult(sent, list(chunks), "x" * tokens, tokens, "length", None, True)
    return r


def _rows():
    rows = []
    for sched, ttft in (("static", 2.0), ("continuous", 0.5)):
        for rate in (1.0, 2.0):
            res = [_result(0.0, [ttft * (i + 1) / 4 + k * 0.1 for k in range(4)], 4)
                   for i in range(4)]
            rows.append({"scheduler": sched, "rate": rate, "results": res,
                         "ttft_p90_s": ttft * rate, "throughput_tok_s": 10 * rate,
                         "e2e_p90_s": 2 * ttft * rate})
    return rows


def test_explore_rate_gives_each_schedulers_percentiles():
    rows = _rows()
    view = explore_rate(rows, 2.0, "ttft", draw=False)
    got = latencies(rows[1], "ttft")              # static, rate 2
    assert list(got) == sorted(got) and len(got) == 4
    assert math.isclose(view.p50["static"], sorted(got)[1] + (sorted(got)[2] - sorted(got)[1]) / 2)
    assert view.p90["continuous"] < view.p90["static"]
    with pytest.raises(ValueError, match="swept"):
        explore_rate(rows, 3.0, draw=False)
    with pytest.raises(ValueError, match="allowed"):
        latencies(rows[0], "ttfb")


def test_sweep_and_gauge_figures_draw_one_line_per_scheduler():
    import matplotlib.pyplot as plt

    fig = plot_sweep(_rows(), 1.0)
    assert [ln.get_label() for ln in fig.axes[1].get_lines()] == ["static", "continuous"]
    assert [float(x) for x in fig.axes[1].get_lines()[0].get_xdata()] == [10.0, 20.0]
    plt.close(fig)
    samples = [(0.1 * i, {"llmlab_requests_running": i % 3, "llmlab_requests_waiting": 0,
                          "llmlab_kv_blocks_used": 2 * i}) for i in range(5)]
    fig = plot_gauges(samples)
    assert [float(y) for y in fig.axes[1].get_lines()[0].get_ydata()] == [0, 2, 4, 6, 8]
    plt.close(fig)


# -- the engine-loop build: AsyncEngineLoop, the checker's server, on the tiny model ----------

def _tiny_llm(seats=4):
    import llmlab
    from llmlab.engine import LLM

    return LLM(llmlab.load_model("tiny-llama", attention="sdpa"),
               llmlab.load_tokenizer("tiny-llama"), max_num_seqs=seats, block_size=4,
               max_model_len=256)


def _stream_text(url, prompt, max_tokens, stop_after=None):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text, n = "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            text, n = text + chunk.choices[0].text, n + 1
            if stop_after is not None and n >= stop_after:
                stream.close()
                break
    return text


def _serve_all(engine_loop, prompts):
    """Texts of ``prompts`` streamed concurrently from a server whose engine loop is
    ``engine_loop`` (None: llmlab's EngineLoop thread); and the LLM after the run."""
    from concurrent.futures import ThreadPoolExecutor

    from llmlab.serve import create_app
    from llmlab.serve.process import ThreadServer

    llm = _tiny_llm()
    with ThreadServer(create_app(llm, "tiny-llama", engine_loop=engine_loop)) as srv:
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: _stream_text(srv.base_url, p, 12), prompts))
    return texts, llm


def test_the_reference_engine_loop_serves_what_llmlabs_own_loop_serves():
    from llmlab.exercises.nb10 import engine_loop

    prompts = [f"Request number {i} says" for i in range(10)]       # more than the 4 seats
    mine, llm = _serve_all(engine_loop, prompts)
    theirs, _ = _serve_all(None, prompts)
    assert mine == theirs and all(len(t) > 0 for t in mine)
    assert not llm.engine.has_unfinished() and llm.engine.cache.manager.num_used_blocks == 0
    assert llm.served_by is None                     # the server's end released the LLM


def test_a_disconnect_reaches_the_coroutine_loop_as_an_abort():
    import time

    from llmlab.exercises.nb10 import engine_loop
    from llmlab.serve import create_app
    from llmlab.serve.process import ThreadServer

    llm = _tiny_llm()
    with ThreadServer(create_app(llm, "tiny-llama", engine_loop=engine_loop)) as srv:
        _stream_text(srv.base_url, "Once upon a time", 200, stop_after=2)
        deadline = time.monotonic() + 20
        while llm.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not llm.engine.has_unfinished()
        assert llm.engine.cache.manager.num_used_blocks == 0
        assert llm.engine.stats.num_preemptions == 0


def test_a_loop_that_raises_stops_the_server_and_says_why():
    import httpx

    from llmlab.serve import create_app
    from llmlab.serve.process import ThreadServer

    async def broken(engine, inbox):
        await inbox.get()
        raise ValueError("the loop's own bug")

    llm = _tiny_llm()
    app = create_app(llm, "tiny-llama", engine_loop=broken)
    app.state.server.loop.log_errors = False
    with ThreadServer(app) as srv:
        r = httpx.post(srv.base_url + "/v1/completions",
                       json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code in (500, 503) and "the loop's own bug" in r.text
        health = httpx.get(srv.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "the loop's own bug" in health.text
        again = httpx.post(srv.base_url + "/v1/completions",
                           json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert again.status_code == 503
    assert isinstance(app.state.server.loop.exception, ValueError)
    assert llm.served_by is None


def test_a_loop_that_is_not_a_coroutine_function_is_refused():
    from llmlab.serve import create_app

    with pytest.raises(TypeError, match="coroutine function"):
        create_app(_tiny_llm(), "tiny-llama", engine_loop=lambda engine, inbox: None)
    v = exercises.check("nb10.engine_loop", lambda engine, inbox: None)
    assert not v.passed and "async def" in v.message


def test_parse_sse_checker_starts_a_server_when_the_given_one_is_stopped():
    from llmlab.serve.process import free_port

    dead = f"http://127.0.0.1:{free_port()}"                  # nothing listens there
    v = exercises.check("nb10.parse_sse", parse_sse, base_url=dead, model="tiny-llama")
    assert v.passed and "was stopped" in v.message, v.message
    v = exercises.check("nb10.parse_sse", _stops_at_finish_reason, base_url=dead,
                        model="tiny-llama")
    assert not v.passed and "non-streamed answer" in v.message, v.message


def test_percentile_interval_covers_the_true_p90_and_narrows_with_more_samples():
    import random

    from llmlab.serve.client import percentile_interval

    true_p90 = math.log(10)                    # of Exp(1)
    widths, covered = [], 0
    for n in (20, 400):
        for seed in range(20):
            rng = random.Random(seed)
            lo, hi = percentile_interval([rng.expovariate(1) for _ in range(n)], 90, n=400)
            covered += lo <= true_p90 <= hi
            widths.append((n, hi - lo))
    assert covered >= 30                       # a 90% interval: about 36 of 40
    mean = lambda n: sum(w for m, w in widths if m == n) / 20  # noqa: E731
    assert mean(400) < mean(20) / 2
    assert all(math.isnan(x) for x in percentile_interval([], 90))


def test_sweep_figure_draws_intervals_and_goodput():
    import matplotlib.pyplot as plt

    rows = _rows()
    for r in rows:
        r["ttft_p90_lo"], r["ttft_p90_hi"] = 0.8 * r["ttft_p90_s"], 1.3 * r["ttft_p90_s"]
        r["goodput_req_s"] = r["rate"] / 2
    fig = plot_sweep(rows, 1.0)
    assert len(fig.axes) == 3
    labels = [ln.get_label() for ln in fig.axes[2].get_lines()]
    assert labels[:2] == ["static", "continuous"] and "every request" in labels
    assert [float(y) for y in fig.axes[2].get_lines()[0].get_ydata()] == [0.5, 1.0]
    assert len(fig.axes[0].collections) >= 2   # one set of error bars per scheduler
    plt.close(fig)


def test_sweep_figure_with_a_tpot_target_draws_both_targets_and_goodput():
    import matplotlib.pyplot as plt

    rows = _rows()
    for r in rows:
        r["tpot_p90_s"] = 0.01 * r["rate"]
        r["tpot_p90_lo"], r["tpot_p90_hi"] = 0.008 * r["rate"], 0.012 * r["rate"]
        r["goodput_req_s"] = r["rate"] / 4
    fig = plot_sweep(rows, 1.0, tpot_target_s=0.015)
    ttft, tpot, _, goodput = fig.axes
    assert "target 15 ms" in [ln.get_label() for ln in tpot.get_lines()]
    assert "target 1 s" in [ln.get_label() for ln in ttft.get_lines()]
    assert len(tpot.collections) >= 2          # error bars on the TPOT p90s
    assert "TPOT <= 15 ms" in goodput.get_title() and "TTFT <= 1 s" in goodput.get_title()
    assert [float(y) for y in goodput.get_lines()[0].get_ydata()] == [0.25, 0.5]
    plt.close(fig)


def _gauges(*states):
    return [(0.1 * i, {"llmlab_requests_running": r, "llmlab_requests_waiting": w,
                       "llmlab_kv_blocks_used": b}) for i, (r, w, b) in enumerate(states)]


def test_read_gauges_finds_the_still_stretches_and_the_drain():
    """The burst of notebook 10: the gauges stand still through a long packed-prefill step
    (one request running, fifteen waiting), then every seat is taken; seats freed by
    finished requests stand free through the next prefill step; then the queue drains."""
    story = read_gauges(_gauges((0, 0, 0), (1, 15, 7), (1, 15, 7), (1, 15, 7), (1, 15, 7),
                                (8, 8, 40), (8, 8, 44), (3, 8, 20), (3, 8, 20), (3, 8, 20),
                                (3, 8, 20), (8, 3, 50), (8, 0, 44), (5, 0, 30), (0, 0, 0)),
                        seats=8)
    assert story.first_s == pytest.approx(0.1) and story.full_s == pytest.approx(0.5)
    assert story.time_to_full_s == pytest.approx(0.4)
    assert [(round(x.start_s, 6), round(x.duration_s, 6), x.running, x.waiting)
            for x in story.stretches] == [(0.1, 0.4, 1, 15), (0.7, 0.4, 3, 8)]
    assert story.queue_empty_s == pytest.approx(1.2) and story.last_s == pytest.approx(1.4)
    assert (story.peak_running, story.peak_waiting, story.peak_blocks, story.end_blocks) == \
        (8, 15, 50, 0)
    assert read_gauges(_gauges((0, 0, 0), (1, 15, 7), (8, 8, 40)), seats=8).stretches == []
    full_at_once = read_gauges(_gauges((8, 4, 10), (7, 0, 9), (0, 0, 0)), seats=8)
    assert full_at_once.time_to_full_s == 0 and full_at_once.stretches == []
    assert full_at_once.queue_empty_s == pytest.approx(0.1) and full_at_once.last_s == 0.2
    never = read_gauges(_gauges((0, 0, 0), (3, 0, 5), (0, 0, 0)), seats=8)
    assert never.full_s is None and never.time_to_full_s is None and never.last_s == 0.2


def test_predict_load_is_judged_against_the_loads_offered():
    ex = exercises.get("nb10.predict_capacity")
    offered = (0.5, 0.75, 1.0, 1.5)
    assert ex.check(0.6, measured=0.5, offered=offered).passed
    assert ex.check(0.75, measured=0.5, offered=offered).passed       # up to the first miss
    v = ex.check(1.0, measured=0.5, offered=offered)
    assert not v.passed and "0.75x" in v.message and "missed" in v.message
    assert not ex.check(0.2, measured=0.5, offered=offered).passed
    assert ex.check(0.3, measured=0.0, offered=offered).passed        # none met: below 0.5
    assert not ex.check(0.9, measured=0.0, offered=offered).passed
    assert ex.check(2.5, measured=1.5, offered=offered).passed        # even the top load met
    v = ex.check(40.0, measured=0.5, offered=offered)
    assert not v.passed and "not requests per second" in v.message
