"""Comparing two timed things honestly, and fitting a trend over all its points.

Every notebook sentence about a timed comparison goes through :func:`compare`: the ratio of
the two medians, a bootstrap interval for that ratio over the repeats, and a verdict that
is one of ``"faster"``, ``"slower"`` or ``"no difference at this noise"``. A tie is written
as a tie. A trend is a least-squares fit over every point, printed with its residual
(:func:`fit_linear`, :func:`fit_power`), never a line through two endpoints.

:func:`expect` is how a notebook states what its run was meant to show: in a student's run
an unresolved lesson prints a note instead of crashing; under the tests
(``LLMLAB_STRICT_LESSONS=1``) it fails.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

FASTER, SLOWER, TIE = "faster", "slower", "no difference at this noise"
MIN_RUNS = 3


def _seconds(x) -> np.ndarray:
    """A TimingResult (``.times_s``) or a sequence of numbers, as a float array."""
    xs = np.asarray(getattr(x, "times_s", x), dtype=float).ravel()
    if xs.size == 0:
        raise ValueError("compare needs at least one timing on each side, got none")
    if not np.all(np.isfinite(xs)) or np.any(xs <= 0):
        raise ValueError(f"timings must be finite and positive, got {xs.tolist()}")
    return xs


@dataclass(frozen=True)
class Comparison:
    """``ratio`` = median(baseline) / median(candidate): above 1 the candidate is faster.

    ``lo``/``hi`` bound that ratio (a bootstrap percentile interval at ``level``); the
    verdict is ``faster`` when the whole interval is above 1 + ``tolerance``, ``slower`` when
    it is below 1 / (1 + ``tolerance``), and a tie otherwise."""
    baseline: str
    candidate: str
    ratio: float
    lo: float
    hi: float
    n_baseline: int
    n_candidate: int
    baseline_median: float
    candidate_median: float
    level: float = 0.95
    tolerance: float = 0.0
    quantity: str = ""
    unit: str = "runs"

    @property
    def verdict(self) -> str:
        if self.lo > 1.0 + self.tolerance:
            return FASTER
        if self.hi < 1.0 / (1.0 + self.tolerance):
            return SLOWER
        return TIE

    @property
    def resolved(self) -> bool:
        """True when the run tells the two apart (the verdict is not a tie)."""
        return self.verdict != TIE

    def interval(self) -> str:
        return f"{self.ratio:.2f}× [{self.lo:.2f}–{self.hi:.2f}]"

    def sentence(self) -> str:
        """One clause for a notebook: which is faster (or, with a ``quantity``, how the
        candidate's value compares), by how much, with the interval; a tie says so."""
        runs = f"medians of {self.n_baseline} and {self.n_candidate} {self.unit}"
        direct = f"{self.level:.0%} interval {self.lo:.2f}–{self.hi:.2f}, {runs}"
        inverse = f"{self.level:.0%} interval {1 / self.hi:.2f}–{1 / self.lo:.2f}, {runs}"
        if self.quantity:
            told = ("" if self.resolved else ": no difference at this noise")
            return (f"the {self.quantity} of {self.candidate} is {1 / self.ratio:.2f}× that of "
                    f"{self.baseline}{told} ({inverse})")
        if self.verdict == FASTER:
            return f"{self.candidate} is {self.ratio:.2f}× as fast as {self.baseline} ({direct})"
        if self.verdict == SLOWER:
            return (f"{self.candidate} is slower than {self.baseline}: {1 / self.ratio:.2f}× "
                    f"its time ({inverse})")
        return (f"{self.candidate} and {self.baseline} do not differ at this noise (ratio "
                f"{self.ratio:.2f}, {direct})")

    def __str__(self) -> str:
        return self.sentence()


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, level: float = 0.95, resamples: int = 2000,
                    seed: int = 0, stat=np.median) -> tuple[float, float]:
    """A percentile bootstrap interval for stat(a) / stat(b), resampling each side on its own.

    The seed is fixed so that the same timings always render the same sentence."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level} must be between 0 and 1")
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, a.size, size=(resamples, a.size))
    ib = rng.integers(0, b.size, size=(resamples, b.size))
    ratios = stat(a[ia], axis=1) / stat(b[ib], axis=1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(ratios, [tail, 1.0 - tail])
    return float(lo), float(hi)


def compare(baseline, candidate, baseline_name: str = "the baseline",
            candidate_name: str = "the candidate", level: float = 0.95,
            tolerance: float = 0.0, resamples: int = 2000, seed: int = 0,
            quantity: str = "", unit: str = "runs") -> Comparison:
    """Compare two sets of timings (seconds, or any positive cost where lower is better).

    ``baseline`` and ``candidate`` are TimingResults or sequences of numbers, at least
    ``MIN_RUNS`` on each side (fewer cannot show the noise). ``tolerance`` widens the tie
    band (e.g. 0.05: within 5% counts as a tie). ``quantity`` names what was measured
    when it is not a run's time ("worst stall", "TPOT"): the sentence then gives the
    candidate's value as a multiple of the baseline's; ``unit`` names what the samples are
    ("runs", "requests")."""
    a, b = _seconds(baseline), _seconds(candidate)
    if min(a.size, b.size) < MIN_RUNS:
        raise ValueError(f"compare needs at least {MIN_RUNS} runs a side to see the noise, "
                         f"got {a.size} and {b.size}")
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    ratio = float(np.median(a) / np.median(b))
    lo, hi = bootstrap_ratio(a, b, level, resamples, seed)
    return Comparison(baseline_name, candidate_name, ratio, min(lo, ratio), max(hi, ratio),
                      int(a.size), int(b.size), float(np.median(a)), float(np.median(b)),
                      level, tolerance, quantity, unit)


@dataclass(frozen=True)
class Fit:
    """A least-squares fit over all points: ``y ≈ a + b·x`` (linear) or ``y ≈ c·x^k``
    (power, fitted in log-log). ``rms`` is the root-mean-square residual in y's units for
    the linear fit and the rms relative residual (in log space, ≈ a fraction) for the power."""
    kind: str
    a: float
    b: float
    rms: float
    n: int

    def predict(self, x):
        x = np.asarray(x, dtype=float)
        return self.a + self.b * x if self.kind == "linear" else math.exp(self.a) * x ** self.b

    @property
    def exponent(self) -> float:
        if self.kind != "power":
            raise ValueError("only a power fit has an exponent")
        return self.b

    def __str__(self) -> str:
        if self.kind == "linear":
            return f"{self.a:.3g} + {self.b:.3g}·x (fit over {self.n} points, rms residual {self.rms:.2g})"
        return (f"∝ x^{self.b:.2f} (fit over {self.n} points, rms residual "
                f"{self.rms:.1%} of y)")


def _xy(xs: Iterable, ys: Iterable) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(list(xs), float), np.asarray(list(ys), float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"a fit needs as many x as y and at least 2 points, got {x.size} and {y.size}")
    if np.unique(x).size < 2:
        raise ValueError("a fit needs at least two distinct x values")
    return x, y


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """``y ≈ a + b·x`` over every point, with the rms residual."""
    x, y = _xy(xs, ys)
    b, a = np.polyfit(x, y, 1)
    rms = float(np.sqrt(np.mean((y - (a + b * x)) ** 2)))
    return Fit("linear", float(a), float(b), rms, int(x.size))


def fit_power(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """``y ≈ c·x^k`` by a line in log-log over every point; ``rms`` is the relative residual."""
    x, y = _xy(xs, ys)
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("a power fit needs positive x and y")
    lx, ly = np.log(x), np.log(y)
    k, c = np.polyfit(lx, ly, 1)
    rms = float(np.sqrt(np.mean((ly - (c + k * lx)) ** 2)))
    return Fit("power", float(c), float(k), rms, int(x.size))


def strict_lessons() -> bool:
    """Under the tests (``LLMLAB_STRICT_LESSONS=1``) an unresolved lesson is an error."""
    return os.environ.get("LLMLAB_STRICT_LESSONS") == "1"


class LessonNotShown(AssertionError):
    """A notebook's run did not show what its text says (raised only in strict mode)."""


def expect(condition: bool, what: str) -> None:
    """State what this run was meant to show (returns nothing, so a cell that ends with it
    prints nothing more).

    In a student's run a failed expectation prints one line saying the effect was not
    resolved on this run (a noisy machine, a busy core), and the notebook goes on. Under
    the tests it raises :class:`LessonNotShown`, so the lesson's check lives in the tests."""
    ok = bool(condition)
    if not ok:
        if strict_lessons():
            raise LessonNotShown(f"this run did not show: {what}")
        print(f"Note: this run did not show {what}; the machine may be busy, so rerun the "
              "cell, and read the text above with that in mind.")
