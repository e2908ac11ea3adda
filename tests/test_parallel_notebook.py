"""Notebook 07's helpers: communication accounting, the scaling model, figures, exercise checks."""
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab.config import ModelConfig  # noqa: E402
from llmlab.models import resolve  # noqa: E402
from llmlab.parallel.comm import (A100_NVLINK, A100_PCIE, LLAMA2_70B, allreduce_per_token,  # noqa: E402
                                  fit_latency_bandwidth, ring_allreduce_s, tp_decode_model)
from llmlab.parallel.workers import StepAccount  # noqa: E402
from llmlab.viz.tp import (plot_allreduce, plot_step_account, plot_time_per_token,  # noqa: E402
                           plot_tp_scaling, plot_tp_split)

SMOL = ModelConfig.from_file(resolve("smollm2-135m"))


def test_allreduce_accounting_for_smollm2():
    a = allreduce_per_token(SMOL, 3)
    assert (a.message_bytes, a.allreduces_per_token, a.per_layer_bytes) == (576 * 4, 61, 2 * 576 * 4)
    assert a.per_token_bytes == 61 * 576 * 4
    assert a.ring_sent_bytes_per_rank == round(2 * 2 / 3 * 61 * 576 * 4)
    assert allreduce_per_token(SMOL, 1).ring_sent_bytes_per_rank == 0


def test_scaling_model_is_memory_bound_and_pays_for_links():
    assert ring_allreduce_s(1e6, 1, 300, 2) == 0
    # bandwidth term: 2(tp-1)/tp · bytes / link; latency term: 2(tp-1) hops
    assert ring_allreduce_s(8e6, 8, 100, 0) == pytest.approx(2 * 7 / 8 * 8e6 / 100e9)
    nv = [tp_decode_model(t, A100_NVLINK) for t in (1, 2, 4, 8)]
    pcie = [tp_decode_model(t, A100_PCIE) for t in (1, 2, 4, 8)]
    assert not nv[0].fits and all(e.fits for e in nv[1:])  # 140 GB of bf16 weights
    assert nv[0].memory_s > 100 * nv[0].compute_s          # batch-1 decode is memory-bound
    assert nv[0].memory_s == pytest.approx(2 * nv[1].memory_s, rel=1e-3)
    assert [e.total_s for e in nv] == sorted([e.total_s for e in nv], reverse=True)
    assert all(p.comm_s > n.comm_s for p, n in zip(pcie[1:], nv[1:]))
    with pytest.raises(ValueError, match="tp=3"):
        tp_decode_model(3)


def test_figures_and_the_widget_callback():
    fig = plot_tp_split(SMOL, 3)
    assert len(fig.axes) == 7 and "3 query + 1 KV heads" in fig._suptitle.get_text()
    plt.close(fig)
    with pytest.raises(ValueError, match="valid degrees"):
        plot_tp_split(SMOL, 2)
    fig = plot_tp_scaling(tp=4, link_GBps=25)
    title = fig.axes[0].get_title()
    assert title.startswith("MODEL") and "tp=4" in title and "25 GB/s" in title
    plt.close(fig)
    with pytest.raises(ValueError, match="allowed: \\[1, 2, 4, 8\\]"):
        plot_tp_scaling(tp=3)
    rows = [{"bytes": 256, "us": 100.0, "us_q1": 90.0, "us_q3": 130.0},
            {"bytes": 4096, "us": 150.0, "us_q1": 140.0, "us_q3": 160.0}]
    fig = plot_allreduce({2: rows}, 2304, "cpu", fit={2: (97.0, 0.08)})
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert fig.axes[0].get_ylim()[0] == 0 and any(lab.startswith("fit: 97 µs") for lab in labels)
    plt.close(fig)
    fig = plot_time_per_token(["a", "b"], [[0.010, 0.011, 0.012], [0.020, 0.025, 0.021]], "cpu")
    assert "median of 3" in fig.axes[0].texts[0].get_text() and "11 ms" in fig.axes[0].texts[0].get_text()
    plt.close(fig)


def test_fit_latency_bandwidth_recovers_a_line():
    rows = [{"bytes": b, "us": 50.0 + b / 2000.0} for b in (256, 4096, 65536, 1 << 20)]
    latency, gbps = fit_latency_bandwidth(rows)
    assert latency == pytest.approx(50.0, rel=1e-6) and gbps == pytest.approx(2.0, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        fit_latency_bandwidth(rows[:1])
    flat = [{"bytes": b, "us": us} for b, us in ((256, 110.0), (4096, 90.0), (65536, 100.0))]
    assert fit_latency_bandwidth(flat) == (pytest.approx(100.0), math.inf)  # all latency


def test_step_account_parts_and_their_figure():
    one = StepAccount(1, 0, 1, [0.050, 0.054, 0.052, 0.060, 0.051], [0.0] * 5, 0, 0.040, 1560, 271, 3e-6)
    three = StepAccount(3, 0, 1, [0.25, 0.26, 0.24, 0.30, 0.27], [0.20, 0.21, 0.19, 0.25, 0.22], 62,
                        0.015, 1641, 271, 3e-6)
    assert one.median_s == pytest.approx(0.052) and one.other_s == pytest.approx(0.012)
    assert three.inside_collectives_s == pytest.approx(0.21)
    assert three.other_s == pytest.approx(0.26 - 0.21 - 0.015)
    assert three.other_ops == 1641 - 62 - 271
    fig = plot_step_account(["tp=1", "tp=3"], [one, three], allreduce_us=1000.0, device="cpu")
    ax = fig.axes[0]
    widths = [p.get_width() for p in ax.patches]
    # tp=3's collectives: 62 calls at 1 ms = 62 ms at the isolated cost, the rest waiting
    assert 62.0 in [pytest.approx(w) for w in widths]
    assert sum(w for w in widths) == pytest.approx((0.052 + 0.26) * 1e3)
    assert "waiting" in " ".join(ax.get_legend_handles_labels()[1])
    plt.close(fig)
    with pytest.raises(ValueError, match="one label per account"):
        plot_step_account(["a"], [one, three])
    # without an isolated cost, clocked arrivals split the collectives: before / after
    two = StepAccount(2, 0, 1, [0.05] * 5, [0.03] * 5, 30, 0.012, 390, 90, 1e-6,
                      [0.012] * 3, [0.01, 0.02, 0.01, 0.01, 0.01])
    assert two.arrival_wait_median_s == pytest.approx(0.01) and one.arrival_wait_median_s == 0.0
    fig = plot_step_account(["tp=2"], [two], what="thirty MLPs")
    ax = fig.axes[0]
    widths = [p.get_width() for p in ax.patches]
    assert 10.0 in [pytest.approx(w) for w in widths] and 20.0 in [pytest.approx(w) for w in widths]
    assert "before the last rank arrived" in " ".join(ax.get_legend_handles_labels()[1])
    assert ax.get_title().startswith("thirty MLPs")
    plt.close(fig)
