"""Notebook 09's figures and widget callback, and the speculative cost model."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from llmlab.config import ModelConfig  # noqa: E402
from llmlab.models.registry import model_dir  # noqa: E402
from llmlab.profiling.roofline import Ceilings  # noqa: E402
from llmlab.speculative import cost_model_speedup, expected_tokens  # noqa: E402
from llmlab.viz.spec import (batching_model, explore_spec, plot_batching,  # noqa: E402
                             plot_speedup_vs_k, plot_timeline)


def _row(method, k, accepted, drafted, speedup):
    acc = sum(accepted) / max(sum(drafted), 1)
    return {"accept": acc, "speedup": speedup, "lo": speedup * 0.9, "hi": speedup * 1.1,
            "model": speedup * 1.2,
            "tok/fwd": (sum(accepted) + len(accepted) + 1) / (len(accepted) + 1),
            "accepted_per_step": accepted, "drafted_per_step": drafted}


GRID = {("ngram", 2): _row("ngram", 2, [2, 0, 1], [2, 2, 2], 1.3),
        ("ngram", 4): _row("ngram", 4, [4, 0, 3], [4, 0, 4], 1.6),
        ("early_exit", 2): _row("early_exit", 2, [1, 1, 0], [2, 2, 2], 0.8)}


def test_cost_model_numbers():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)       # 1 + 0.5 + 0.25
    assert expected_tokens(1.0, 3) == 4 and expected_tokens(0.0, 5) == 1
    assert cost_model_speedup(3.0, 4, 0.25) == pytest.approx(1.5)
    assert cost_model_speedup(3.0, 4, 0.0, verify=2.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="alpha=1.5 must be in"):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match="tokens_per_step=0.5 must be >= 1"):
        cost_model_speedup(0.5, 2, 0.1)


def test_timeline_draws_one_box_per_token_and_rejected_draft():
    ax = plot_timeline([2, 0, 3], [3, 2, 3])
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    # the prefill's token, every draft, and one target token per step
    assert len(boxes) == 1 + (3 + 2 + 3) + 3
    red = [b for b in boxes if b.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:red")]
    assert len(red) == (3 - 2) + 2 + 0
    assert ax.get_title().startswith("9 tokens in 4 target forwards")   # 1 + 3 + 1 + 4
    plt.close("all")
    with pytest.raises(ValueError, match="must match"):
        plot_timeline([1], [1, 2])
    with pytest.raises(ValueError, match=r"in \[0, drafted\]"):
        plot_timeline([3], [2])


def test_speedup_panels_and_widget_callback():
    axes = plot_speedup_vs_k([dict(v, method=m, k=k) for (m, k), v in GRID.items()])
    labels = [t.get_text() for t in axes[1].get_legend().get_texts()]
    assert sorted(labels) == sorted(f"{m}: {w}" for m in ("ngram", "early_exit")
                                    for w in ("measured", "cost model"))
    dashed = [ln for ln in axes[1].lines if ln.get_linestyle() == "--"]
    assert [list(ln.get_ydata()) for ln in dashed] == [[1.3 * 1.2, 1.6 * 1.2], [0.8 * 1.2]]
    choice = explore_spec(GRID, "ngram", 4)
    assert choice.speedup == 1.6 and choice.k == 4 and choice.figure is not None
    assert "ngram, k=4" in choice.figure._suptitle.get_text()
    quiet = explore_spec(GRID, "early_exit", 2, draw=False)
    assert quiet.figure is None and quiet.accept == pytest.approx(2 / 6)
    plt.close("all")
    with pytest.raises(ValueError, match="was not measured; allowed"):
        explore_spec(GRID, "ngram", 8)


def test_batching_erodes_the_modelled_speedup():
    cfg = ModelConfig.from_file(model_dir("smollm2-135m"))
    ceil = Ceilings(bandwidth_bytes_per_s=20e9, peak_flops_per_s=200e9)
    rows = batching_model(cfg, ceil, [1, 4, 16, 64, 256], k=4, alpha=0.8)
    speedups = [r["speedup"] for r in rows]
    assert all(a >= b for a, b in zip(speedups, speedups[1:]))
    assert speedups[0] > 2.5                      # memory-bound: verifying 5 tokens ~ 1 step
    assert rows[0]["verify_over_decode"] < 1.2
    assert rows[-1]["verify_over_decode"] > 4.0   # compute-bound: ~ k + 1 times one step
    assert speedups[-1] < 1.0
    axes = plot_batching(rows, ceil, 4, 0.8)
    assert len(axes[1].lines[0].get_xdata()) == 5
    assert [t.get_text() for t in axes[0].texts] == [f"B={b}" for b in (1, 4, 16, 64, 256)]
    plt.close("all")
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        batching_model(cfg, ceil, [1], k=0, alpha=0.5)


def test_timeline_stops_at_the_tokens_kept():
    """A last step that ran past the end-of-sequence token is drawn up to the tokens kept,
    and the title counts those (3 + 2 + 1 emitted, 5 kept)."""
    ax = plot_timeline([2, 1], [3, 2], num_tokens=5)
    assert ax.get_title().startswith("5 tokens in 3 target forwards")
    full = plot_timeline([2, 1], [3, 2])
    assert full.get_title().startswith("6 tokens")
    assert len(ax.patches) < len(full.patches)
