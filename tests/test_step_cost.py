"""llmlab.profiling.steps: the step-time fit notebook 05 reads its speedups from."""
import pytest

from llmlab.engine.llm import EngineStats, StepRecord
from llmlab.profiling.steps import fit_step_cost, prompt_token_cost


def _stats(steps):
    s = EngineStats()
    t = 0.0
    for i, (ms, rows, prompt) in enumerate(steps):
        s.steps.append(StepRecord(i, t, t + ms / 1e3, rows + (prompt > 0), prompt, rows,
                                  prompt + rows, 0, 0, []))
        t += ms / 1e3
    return s


def test_fit_recovers_the_fixed_part_and_the_slopes():
    fixed, row, tok = 30.0, 2.5, 0.9
    steps = [(fixed + row * r + tok * p, r, p)
             for r in (1, 2, 3, 4, 6) for p in (0, 0, 17, 64)]
    cost = fit_step_cost([_stats(steps[:10]), _stats(steps[10:])])
    assert cost.num_steps == len(steps)
    assert cost.fixed_ms == pytest.approx(fixed) and cost.per_row_ms == pytest.approx(row)
    assert cost.per_prompt_token_ms == pytest.approx(tok) and cost.rms_ms < 1e-9
    assert cost.predict_ms(4, 10) == pytest.approx(fixed + 4 * row + 10 * tok)
    assert cost.fixed_share(6) == pytest.approx(fixed / (fixed + 6 * row))


def test_a_slope_the_steps_cannot_show_is_zero():
    cost = fit_step_cost([_stats([(40.0, 4, 0), (41.0, 4, 0), (39.0, 4, 0)])])
    assert cost.per_row_ms == 0.0 and cost.per_prompt_token_ms == 0.0
    assert cost.fixed_ms == pytest.approx(40.0)
    with pytest.raises(ValueError, match="too few"):
        fit_step_cost([_stats([(40.0, 4, 0)])])


def test_prompt_token_cost_is_the_median_extra_per_token():
    fixed, row = 30.0, 2.0
    decode = fit_step_cost([_stats([(fixed + row * r, r, 0) for r in (1, 2, 3, 1, 2)])])
    steps = [(fixed + row * 1 + 0.5 * 64, 1, 64), (fixed + row * 2 + 0.5 * 64, 2, 64),
             (fixed + 500.0, 1, 64)]                 # one step slowed by something else
    assert prompt_token_cost([_stats(steps)], decode) == pytest.approx(0.5)
    assert prompt_token_cost([_stats([(30.0, 1, 0)])], decode) != prompt_token_cost(
        [_stats([(30.0, 1, 0)])], decode)           # NaN: no prompt step


def test_prompt_token_cost_can_take_its_baseline_from_the_same_runs():
    steps = [(40.0, 1, 0), (44.0, 2, 0), (40.0, 1, 0), (40.0 + 0.5 * 64, 1, 64),
             (44.0 + 0.5 * 100, 2, 100), (40.0 + 0.5 * 222, 0, 222)]
    assert prompt_token_cost([_stats(steps)]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no pure decode"):
        prompt_token_cost([_stats([(70.0, 1, 64)])])
