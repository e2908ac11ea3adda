"""Notebook 03's figures, block-size explorer and exercise checks."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab.attention.flash import online_softmax_update  # noqa: E402
from llmlab.exercises import nb03  # noqa: E402
from llmlab.profiling.hbm import (H100, standard_attention_hbm, tile_footprint,  # noqa: E402
                                  tiled_attention_hbm)
from llmlab.viz.flash import (flash_explorer, plot_block_schedule, plot_peak_memory,  # noqa: E402
                              plot_traffic_model)


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
    assert r.measured_n == expected_n and r.measured_s > 0
    assert len(r.figure.axes) == 3
    big = flash_explorer(block_q=256, block_k=256, head_dim=128, n=1024, measure=False)
    assert not big.fits and big.measured_s is None
    assert "does NOT fit" in big.figure.axes[0].get_title()
    with pytest.raises(ValueError, match=r"block_k=24 must be a power of two >= 16"):
        flash_explorer(block_k=24, measure=False)


def test_check_rescale_accepts_right_and_rejects_wrong(capsys):
    assert nb03.check_rescale(online_softmax_update) is True

    def forgot_rescale(m, l, acc, s, v):
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[:, None])
        return m_new, l + p.sum(-1), acc + p @ v

    def placeholder(m, l, acc, s, v):
        raise NotImplementedError

    assert nb03.check_rescale(forgot_rescale) is False
    assert "exp(m - m_new)" in capsys.readouterr().out
    assert nb03.check_rescale(placeholder) is False
    assert nb03.check_rescale(lambda *a: None) is False
    assert "not yet" in capsys.readouterr().out


def test_check_block_and_tiles_answers(capsys):
    right = nb03.smallest_block_q_answer()
    assert right == 32
    assert nb03.check_smallest_block_q(32) is True
    assert nb03.check_smallest_block_q(16) is False
    assert nb03.check_smallest_block_q(64) is False
    assert nb03.check_smallest_block_q(None) is False
    assert nb03.check_skipped_tiles(28) is True
    assert nb03.check_skipped_tiles(36) is False
    assert nb03.check_skipped_tiles(...) is False
    out = capsys.readouterr().out
    assert out.count("✅") == 2 and out.count("❌") == 5
