"""Notebook 03's figures and block-size explorer."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab.device import has_triton  # noqa: E402
from llmlab.profiling.flops import attention_flops  # noqa: E402
from llmlab.profiling.hbm import (H100, standard_attention_hbm, tile_footprint,  # noqa: E402
                                  tiled_attention_hbm)
from llmlab.viz.flash import (flash_explorer, gpu_attention_model,  # noqa: E402
                              plot_block_schedule, plot_gpu_model, plot_peak_memory, plot_times, plot_traffic_model,
                              plot_traffic_vs_sram)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_block_schedule_figure_counts_tiles():
    fig, grid = plot_block_schedule(40, 40, 8, 8, causal=True)
    assert grid.shape == (5, 5)
    assert "10 full, 5 masked, 10 skipped" in fig.axes[0].get_title()


def test_traffic_and_memory_figures_carry_the_model():
    ns = [256, 1024, 4096]
    fig, data = plot_traffic_model(ns, d=64, block_q=128, block_k=64)
    assert data["standard"] == [standard_attention_hbm(n, 64).total for n in ns]
    assert data["tiled"] == [tiled_attention_hbm(n, 64, 128, 64).total for n in ns]
    assert len(fig.axes[0].lines) == 2
    fig = plot_peak_memory(ns, {"naive": [1e6, 1e7, 1e8], "flash": [1e5, 2e5, 4e5]},
                           modelled_from=4096)
    assert "modelled" in fig.axes[0].get_title()


def test_explorer_numbers_and_measurement():
    r = flash_explorer(block_q=32, block_k=16, head_dim=64, n=2048, chip="H100", measure=True,
                       interpreter_n=40)
    fp = tile_footprint(32, 16, 64)
    assert r.footprint_bytes == fp.total and r.fits and r.smem_bytes == H100.smem_per_sm
    assert r.standard_bytes == standard_attention_hbm(2048, 64).total
    assert r.tiled_bytes == tiled_attention_hbm(2048, 64, 32, 16, causal=True).total
    expected_n = 2048 if torch.cuda.is_available() else 40
    assert r.measured_n == expected_n
    if has_triton():    # without Triton the panel says so (tests/test_exercises_nb03.py)
        assert r.measured_s > 0
        assert r.measured_spread[0] <= r.measured_s <= r.measured_spread[1]
    assert len(r.figure.axes) == 4
    big = flash_explorer(block_q=256, block_k=256, head_dim=128, n=1024, measure=False)
    assert not big.fits and big.measured_s is None
    assert "does NOT fit" in big.figure.axes[0].get_title()
    # a tile the table of builds lacks: the panel says so instead of failing
    assert isinstance(big.build, str) and "not in the table" in big.build
    with pytest.raises(ValueError, match=r"num_warps=3; allowed"):
        flash_explorer(num_warps=3, measure=False)


def test_explorer_shows_the_compiled_tile_from_the_table():
    from llmlab.kernels import report as R
    r = flash_explorer(block_q=128, block_k=128, head_dim=128, n=4096, chip="H100",
                       measure=False, num_warps=4)
    assert r.build == R.lookup("flash", "sm_90", "bf16", block_m=128, block_n=128, head_dim=128,
                               num_warps=4)
    panel = r.figure.axes[2]
    title = " ".join(panel.get_title().split())
    assert "compiled for H100 (sm_90) on this CPU machine, not run" in title
    assert "128x128 d128 w4" in title
    assert f"SPILLS {r.build.spill_bytes} B" in panel.get_xlabel()      # it spills
    assert [p.get_width() for p in panel.patches][0] == pytest.approx(r.build.registers / 255)
    w8 = flash_explorer(block_q=128, block_k=128, head_dim=128, chip="A100", measure=False,
                        num_warps=8)
    assert w8.build.arch == "sm_80" and w8.build.num_warps == 8
    assert "compiled for A100 (sm_80)" in w8.figure.axes[2].get_title()
    with pytest.raises(ValueError, match=r"block_k=24 must be a power of two >= 16"):
        flash_explorer(block_k=24, measure=False)


def test_block_schedule_axes_count_positions():
    fig, _ = plot_block_schedule(40, 24, 8, 16, causal=True)
    ax = fig.axes[0]
    assert "position" in ax.get_xlabel() and "Bc=16" in ax.get_xlabel()
    assert "position" in ax.get_ylabel() and "Br=8" in ax.get_ylabel()
    assert ax.get_xlim() == (0.0, 24.0)      # ticks run over key positions, not block indices


def test_times_plot_draws_median_and_spread():
    runs = {"a": [[1e-3, 2e-3, 3e-3, 2e-3, 2e-3], [4e-3, 5e-3, 9e-3, 5e-3, 5e-3]]}
    fig, medians = plot_times([256, 512], runs)
    assert medians == {"a": [2e-3, 5e-3]}
    ax = fig.axes[0]
    assert "median of 5 runs" in ax.get_title()
    bars = ax.containers[0]                  # the errorbar container: line, caps, bar lines
    segments = bars.lines[2][0].get_segments()
    assert [tuple(seg[:, 1]) for seg in segments] == [(1.0, 3.0), (4.0, 9.0)]   # ms, min..max


def test_traffic_vs_sram_falls_for_fa1_and_is_flat_for_fa2():
    fig, data = plot_traffic_vs_sram(8192, 64, [8, 32, 128, 228])
    fa1 = data["FlashAttention-1"]
    assert all(a > b for a, b in zip(fa1, fa1[1:]))
    assert len(set(data["FlashAttention-2 Br=128"])) == 1
    assert "a model" in fig.axes[0].get_title()


def test_gpu_model_is_labelled_and_flash_wins_at_length():
    ns = [1024, 8192, 32768]
    fig, m = plot_gpu_model(ns, d=64, heads=32, spec="H100")
    assert fig.axes[0].get_title().startswith("MODEL, not measured: H100")
    assert m == gpu_attention_model(ns, d=64, heads=32, spec="H100")
    flops = attention_flops(1, 32, 8192, 8192, 64, causal=True)
    std = standard_attention_hbm(8192, 64, heads=32)
    assert m["standard"][1] == pytest.approx(max(std.total / H100.hbm_bandwidth,
                                                 flops / H100.peak_bf16_flops))
    assert all(s > 2 * f for s, f in zip(m["standard"], m["flash"]))
