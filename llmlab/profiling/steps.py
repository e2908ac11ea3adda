"""What an engine step costs, fitted from the engine's own step log.

Every :class:`~llmlab.engine.llm.StepRecord` holds a step's wall time, how many sequences
decoded one token in it (rows) and how many prompt tokens it fed. A least-squares fit of

    step time = fixed + per_row · decode rows + per_prompt_token · prompt tokens

over the steps of one or more runs splits a step into the part every step pays (reading
the weights, per-operator overheads: notebook 02's memory-bound floor) and the parts that
grow with the work in it. Notebook 05 uses it to say where a speedup comes from: fewer
steps, or fewer token positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """A fitted step-time model, in milliseconds."""

    fixed_ms: float
    per_row_ms: float              # per decoding sequence
    per_prompt_token_ms: float     # per prompt token (or chunk token) fed
    num_steps: int                 # steps the fit saw
    rms_ms: float                  # root-mean-square residual

    def predict_ms(self, decode_rows: int, prompt_tokens: int = 0) -> float:
        return self.fixed_ms + self.per_row_ms * decode_rows \
            + self.per_prompt_token_ms * prompt_tokens

    def fixed_share(self, decode_rows: int) -> float:
        """The fixed part's share of a pure decode step of ``decode_rows`` rows."""
        return self.fixed_ms / self.predict_ms(decode_rows)


def step_arrays(stats_list: Iterable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(milliseconds, decode rows, prompt tokens) of every step of the given EngineStats."""
    ms, rows, prompt = [], [], []
    for stats in stats_list:
        for r in stats.steps:
            ms.append((r.end_s - r.start_s) * 1e3)
            rows.append(r.decode_tokens)
            prompt.append(r.prefill_tokens)
    return np.array(ms, float), np.array(rows, float), np.array(prompt, float)


def fit_step_cost(stats_list: Iterable) -> StepCost:
    """Least-squares fit of step time = fixed + per_row · rows + per_prompt_token · prompt
    tokens over every step of ``stats_list`` (EngineStats of one or more runs).

    A coefficient that the steps cannot determine (no step fed a prompt token, or every
    decode step had the same number of rows) is fitted as 0, and the fixed part absorbs it.
    Raises ValueError when there are fewer steps than coefficients to fit.
    """
    ms, rows, prompt = step_arrays(stats_list)
    columns = [np.ones_like(ms)]
    varies = [bool(np.ptp(rows[prompt == 0]) > 0) if (prompt == 0).any() else False,
              bool(prompt.any())]
    for used, col in zip(varies, (rows, prompt)):
        if used:
            columns.append(col)
    if len(ms) < len(columns) + 1:
        raise ValueError(f"{len(ms)} steps are too few to fit {len(columns)} coefficients")
    design = np.stack(columns, axis=1)
    coef, *_ = np.linalg.lstsq(design, ms, rcond=None)
    full = iter(coef[1:])
    per_row = float(next(full)) if varies[0] else 0.0
    per_prompt = float(next(full)) if varies[1] else 0.0
    rms = float(np.sqrt(np.mean((design @ coef - ms) ** 2)))
    return StepCost(float(coef[0]), per_row, per_prompt, len(ms), rms)


def prompt_token_cost(stats_list: Iterable, decode: StepCost | None = None) -> float:
    """What one prompt token adds to a step, in ms: over the steps that fed prompt tokens,
    the median of (step time − the decode cost of the step's rows) / prompt tokens.

    The decode cost of r rows is ``decode.predict_ms(r)`` when a fit is given; else the
    median time of the same runs' pure decode steps with r rows (the nearest row count
    there is; a step with no decode rows still pays a one-row step's fixed cost), so the
    baseline comes from the same minutes of the same machine. The median keeps a few steps
    slowed by other processes from moving the answer. NaN when no step fed a prompt token.
    """
    ms, rows, prompt = step_arrays(stats_list)
    has = prompt > 0
    if not has.any():
        return float("nan")
    if decode is not None:
        base = decode.fixed_ms + decode.per_row_ms * rows[has]
    else:
        pure = ~has
        if not pure.any():
            raise ValueError("no pure decode step to take the decode cost from; pass a fit")
        counts = np.unique(rows[pure])
        medians = {c: float(np.median(ms[pure & (rows == c)])) for c in counts}
        base = np.array([medians[counts[np.argmin(np.abs(counts - max(r, 1)))]]
                         for r in rows[has]])
    return float(np.median((ms[has] - base) / prompt[has]))


__all__ = ["StepCost", "fit_step_cost", "prompt_token_cost", "step_arrays"]
