"""The one helper every timed comparison in the notebooks goes through, and the trend fits."""
import numpy as np
import pytest

from llmlab.profiling import compare, expect, fit_linear, fit_power
from llmlab.profiling.compare import FASTER, SLOWER, TIE, LessonNotShown
from llmlab.profiling.timer import TimingResult


def noisy(median, spread, n, seed):
    rng = np.random.default_rng(seed)
    return list(median * (1 + spread * rng.standard_normal(n)))


def test_a_clear_speedup_is_faster_with_an_interval_around_the_ratio():
    c = compare(noisy(10.0, 0.02, 9, 1), noisy(5.0, 0.02, 9, 2), "eager", "compiled")
    assert c.verdict == FASTER and c.resolved
    assert 1.8 < c.lo <= c.ratio <= c.hi < 2.2
    assert "compiled is 2.0" in c.sentence() and "eager" in c.sentence()


def test_a_clear_slowdown_is_slower_and_says_by_how_much():
    c = compare(noisy(5.0, 0.02, 7, 3), noisy(7.5, 0.02, 7, 4), "one row", "two rows")
    assert c.verdict == SLOWER
    assert c.hi < 1
    assert "1.5" in c.sentence() and "slower" in c.sentence()
    # the interval is printed the way round of the headline number: around 1.5, not 0.67
    lo, hi = (float(x) for x in c.sentence().split("interval ")[1].split(",")[0].split("–"))
    assert lo <= 1 / c.ratio <= hi and lo > 1


def test_a_named_quantity_reads_as_a_multiple_of_the_baseline():
    c = compare(noisy(160, 0.03, 5, 11), noisy(110, 0.03, 5, 12), "whole prompts",
                "chunked prefill", quantity="worst stall")
    assert c.verdict == FASTER
    assert c.sentence().startswith("the worst stall of chunked prefill is 0.70× that of whole")
    tie = compare(noisy(10, 0.2, 5, 13), noisy(10, 0.2, 5, 14), "a", "b", quantity="TPOT")
    assert "no difference at this noise" in tie.sentence()


def test_overlapping_runs_are_a_tie_not_a_win_by_order():
    # the medians differ by 3% but the runs overlap: this noise cannot tell them apart
    c = compare(noisy(10.0, 0.15, 5, 5), noisy(9.7, 0.15, 5, 6))
    assert c.verdict == TIE and not c.resolved
    assert c.lo < 1 < c.hi
    assert "do not differ at this noise" in c.sentence()


def test_identical_timings_are_a_tie():
    xs = [1.0, 1.1, 0.9, 1.05, 0.95]
    assert compare(xs, list(xs)).verdict == TIE


def test_tolerance_turns_a_small_resolved_gain_into_a_tie():
    a, b = noisy(10.0, 0.002, 9, 7), noisy(9.8, 0.002, 9, 8)
    assert compare(a, b).verdict == FASTER
    assert compare(a, b, tolerance=0.05).verdict == TIE


def test_the_interval_is_reproducible_and_accepts_timing_results():
    a, b = TimingResult(noisy(3.0, 0.1, 6, 9)), TimingResult(noisy(2.0, 0.1, 6, 10))
    assert compare(a, b) == compare(a, b)
    assert compare(a, b).n_baseline == 6


@pytest.mark.parametrize("a,b,match", [([1.0, 2.0], [1.0, 2.0, 3.0], "at least 3"),
                                       ([], [1.0], "none"),
                                       ([1.0, -1.0, 2.0], [1.0, 2.0, 3.0], "positive"),
                                       ([1.0, float("nan"), 2.0], [1.0, 2.0, 3.0], "finite")])
def test_bad_timings_are_refused_by_name(a, b, match):
    with pytest.raises(ValueError, match=match):
        compare(a, b)


def test_a_linear_fit_uses_every_point_and_reports_its_residual():
    xs = [1, 2, 3, 4, 5]
    ys = [3.0, 5.0, 7.0, 9.0, 30.0]          # the last point is off the line
    f = fit_linear(xs, ys)
    endpoints_slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    assert f.b != pytest.approx(endpoints_slope)
    assert f.rms > 5 and f.n == 5
    assert fit_linear(xs, [3, 5, 7, 9, 11]).rms == pytest.approx(0, abs=1e-9)


def test_a_power_fit_finds_the_exponent():
    xs = np.array([16, 32, 64, 128, 256])
    f = fit_power(xs, 0.5 * xs ** 1.7)
    assert f.exponent == pytest.approx(1.7) and f.rms < 1e-9
    assert f.predict(512) == pytest.approx(0.5 * 512 ** 1.7)
    with pytest.raises(ValueError, match="positive"):
        fit_power([1, 2], [0, 1])
    with pytest.raises(ValueError, match="distinct"):
        fit_linear([2, 2, 2], [1, 2, 3])


def test_expect_notes_an_unshown_lesson_for_a_student_and_fails_under_the_tests(monkeypatch,
                                                                               capsys):
    monkeypatch.delenv("LLMLAB_STRICT_LESSONS", raising=False)
    expect(True, "anything")
    assert capsys.readouterr().out == ""
    expect(False, "the cache is faster")
    assert "did not show the cache is faster" in capsys.readouterr().out
    monkeypatch.setenv("LLMLAB_STRICT_LESSONS", "1")
    with pytest.raises(LessonNotShown, match="the cache is faster"):
        expect(False, "the cache is faster")
