"""Notebook 10's exercises against a real server: the SSE-parser checker passes the
reference on a live stream and fails a parser that gets the live stream wrong; the
server process helper starts, serves and stops cleanly."""
import math

import pytest

pytest.importorskip("fastapi")

from llmlab import exercises  # noqa: E402
from llmlab.serve.client import parse_sse  # noqa: E402
from llmlab.serve.process import ServerProcess  # noqa: E402
from llmlab.viz.http import explore_rate, latencies, plot_gauges, plot_sweep  # noqa: E402
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
