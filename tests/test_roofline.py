"""Roofline: the analytic costs of prefill and decode, the measured ceilings, the
notebook-02 widget callback and figure, and the compute-bound-batch exercise's answer."""
import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from llmlab.config import ModelConfig  # noqa: E402
from llmlab.models import resolve  # noqa: E402
from llmlab.profiling.flops import model_flops_per_token, weight_bytes  # noqa: E402
from llmlab.profiling.roofline import (Ceilings, Cost, RooflinePoint, decode_cost,  # noqa: E402
                                       forward_cost, measure_bandwidth, measure_ceilings,
                                       measure_matmul_flops, prefill_cost)

CEIL = Ceilings(bandwidth_bytes_per_s=10e9, peak_flops_per_s=100e9, device="test")


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_file(resolve("smollm2-135m"))


def test_decode_flops_match_the_per_token_counter(cfg):
    # one decode step with logits = the per-token counter at the same context
    for ctx in (0, 100, 1000):
        assert decode_cost(cfg, 1, ctx).flops == model_flops_per_token(cfg, ctx + 1)
    assert decode_cost(cfg, 8, 100).flops == 8 * decode_cost(cfg, 1, 100).flops


def test_prefill_is_compute_heavy_and_decode_memory_bound(cfg):
    w = weight_bytes(cfg, 4)
    d1 = decode_cost(cfg, 1, 32)
    # batch 1 decode reads every weight once for ~2 FLOPs per weight: about 0.5 FLOP/byte
    assert d1.bytes >= w and 0.4 < d1.intensity < 0.6
    p = prefill_cost(cfg, 1, 512)
    assert p.intensity > 50 * d1.intensity
    # batching decode moves it toward the compute roof, but the per-sequence KV reads cap it
    ints = [decode_cost(cfg, b, 512).intensity for b in (1, 4, 16, 64, 256)]
    assert ints == sorted(ints) and ints[-1] < 2 * ints[-2]
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert decode_cost(cfg, 2, 512).bytes - decode_cost(cfg, 1, 512).bytes > 513 * kv


def test_causal_prefill_attention_is_counted_exactly(cfg):
    a = forward_cost(cfg, 1, 10, logits_tokens=1)
    steps = [forward_cost(cfg, 1, 1, past) for past in range(10)]
    lm = 2 * cfg.hidden_size * cfg.vocab_size
    assert a.flops == sum(s.flops for s in steps) - 9 * lm


def test_ceilings_and_points():
    assert CEIL.ridge_point == 10
    assert CEIL.attainable(1) == 10e9 and CEIL.attainable(1000) == 100e9
    pt = RooflinePoint(Cost(flops=2_000_000_000, bytes=1_000_000_000, label="x"), seconds=0.5)
    assert pt.intensity == 2 and pt.flops_per_s == 4e9 and pt.bytes_per_s == 2e9
    assert pt.share_of_roof(CEIL) == pytest.approx(0.2)


def test_measured_ceilings_are_plausible():
    bw = measure_bandwidth(16 * 2**20, repeats=2)
    read = measure_bandwidth(16 * 2**20, repeats=2, read_only=True)
    fl = measure_matmul_flops(256, repeats=2)
    assert 1e8 < bw < 1e13 and 1e8 < read < 1e13 and 1e8 < fl < 1e16
    c = measure_ceilings(copy_bytes=8 * 2**20, matmul_n=128, repeats=1)
    assert c.ridge_point > 0 and c.device


def test_bad_arguments(cfg):
    with pytest.raises(ValueError, match="nbytes=1000 is too small"):
        measure_bandwidth(1000)
    with pytest.raises(ValueError, match="nbytes=1000 is too small"):
        measure_bandwidth(1000, read_only=True)
    with pytest.raises(ValueError, match="n=8 is too small"):
        measure_matmul_flops(8)
    with pytest.raises(ValueError, match="new_tokens=0"):
        forward_cost(cfg, 1, 0)


def test_explore_draws_both_panels(cfg, capsys):
    from llmlab.viz.roofline import explore

    fig = explore(4, 512, cfg, CEIL)
    assert len(fig.axes) == 2
    out = capsys.readouterr().out
    assert "batch 4, 512 tokens: KV cache 90.0 MiB" in out and "memory-bound" in out
    line_labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert {"batch 1", "batch 4", "batch 16", "weights"} <= set(line_labels)
    explore(256, 64, cfg, CEIL)
    assert "compute-bound" in capsys.readouterr().out
    with pytest.raises(ValueError, match="batch=0 must be a positive int"):
        explore(0, 10, cfg, CEIL)
    with pytest.raises(ValueError, match="seq_len=99999 must be in 1..8192"):
        explore(1, 99999, cfg, CEIL)


def test_plot_roofline_draws_the_spread():
    from llmlab.viz.roofline import plot_roofline

    pt = RooflinePoint(Cost(flops=2_000_000_000, bytes=1_000_000_000, label="x"), seconds=0.5)
    ax = plot_roofline(CEIL, [pt], spreads=[(0.25, 1.0)])
    bars = [c for c in ax.containers if hasattr(c, "lines")]
    assert len(bars) == 1
    (_, caps, (segments,)) = bars[0].lines
    (x0, y0), (x1, y1) = segments.get_segments()[0]
    # 2 GFLOP in 1.0 s .. 0.25 s: the bar spans 2 .. 8 GFLOP/s around the median's 4
    assert sorted((y0, y1)) == pytest.approx([2.0, 8.0])
    with pytest.raises(ValueError, match="spreads has 2 entries for 1 points"):
        plot_roofline(CEIL, [pt], spreads=[(0.1, 0.2), (0.1, 0.2)])


def test_compute_bound_batch_checker_agrees_with_the_model(cfg):
    from llmlab.exercises import nb02

    right = nb02.smallest_compute_bound_batch(cfg, 512, 10.0)
    assert right is not None and right > 20       # the batch/2 guess is too optimistic
    assert decode_cost(cfg, right, 512).intensity >= 10.0 > decode_cost(cfg, right - 1, 512).intensity
    assert nb02._check_compute_bound_batch(right, cfg).passed
    assert not nb02._check_compute_bound_batch(right - 1, cfg).passed


def test_matmul_row_times_and_the_batch_sweep_figure(tmp_path):
    from llmlab.profiling import fit_linear
    from llmlab.viz.roofline import matmul_row_times, plot_batch_sweep

    w = torch.randn(64, 32)
    got = matmul_row_times(w, [1, 2, 4], repeats=3)
    assert sorted(got) == [1, 2, 4] and all(len(v) == 3 and min(v) > 0 for v in got.values())
    with pytest.raises(ValueError, match="rows"):
        matmul_row_times(w, [0])
    steps = {1: [0.030, 0.031, 0.032], 2: [0.033, 0.034, 0.035], 4: [0.050, 0.052, 0.051]}
    fit = fit_linear([2, 4], [0.034, 0.051])
    fig = plot_batch_sweep(steps, got, fit, title="t")
    assert len(fig.axes) == 2 and "fit over batch" in fig.axes[0].get_legend().get_texts()[-1].get_text()
    fig.savefig(tmp_path / "sweep.png")
