"""Notebook 14's long-context figures and the sinks sweep's helpers (no SmolLM2 runs)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab.bench.sinks import binned, load_sweep, sweep  # noqa: E402
from llmlab.viz.long_context import explore_sinks, plot_split_occupancy  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_split_occupancy_plot_marks_the_chosen_split():
    fig = plot_split_occupancy({"a": (1, 3, 32768), "b": (16, 8, 4096)}, blocks_per_sm=2)
    left, right = fig.axes
    assert len(left.lines) == 4 and "264 slots" in left.get_title()
    assert "model" in left.get_title() and "model" in right.get_title()
    with pytest.raises(ValueError, match="cases is empty"):
        plot_split_occupancy({})


def test_committed_sweep_and_its_widget():
    s = load_sweep()
    full = s["rows"][0]
    assert full["window"] is None and s["skip"] < s["tokens"]
    assert all(len(r["nll_bins"]) == -(-(s["tokens"] - 1) // s["bin"]) for r in s["rows"])
    w = min(r["window"] for r in s["rows"][1:])
    row = explore_sinks(s, w, 4)
    assert row["vs_full"] == pytest.approx(row["ppl"] / full["ppl"])
    assert len(plt.gcf().axes) == 2
    with pytest.raises(ValueError, match=r"window=3, sinks=4 is not in the sweep"):
        explore_sinks(s, 3, 4)


def test_the_committed_sweep_shows_the_collapse():
    # StreamingLLM's finding, on SmolLM2 and the workbook's text (measured by
    # `python -m llmlab.bench sinks`): a window alone is far worse than the full
    # cache at every window, and 4 sinks beside a window of 256 bring it within 10%
    s = load_sweep()
    full = s["rows"][0]["ppl"]
    by = {(r["window"], r["sinks"]): r["ppl"] for r in s["rows"][1:]}
    assert all(by[(w, 0)] > 1.5 * full for w, _ in by)
    assert all(by[(w, 4)] < by[(w, 0)] / 1.5 for w, _ in by)
    assert by[(256, 4)] <= 1.10 * full


def test_binned_and_sweep_refuse_what_they_cannot_score(tiny):
    assert binned(torch.arange(5.0), 2) == [0.5, 2.5, 4.0]
    with pytest.raises(ValueError, match="leave nothing to score"):
        sweep(tiny, list(range(10)), [8], [4])
