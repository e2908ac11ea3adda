"""Check functions for the notebooks' exercises (one module per notebook: ``nbNN``).

Each check prints "right" or "not yet" with a useful message and returns a bool; it never
raises, even on an untouched ``# YOUR CODE HERE`` placeholder. The shared pieces are here.
"""
from __future__ import annotations

from typing import Callable, Iterable


def say(ok: bool, good: str, bad: str) -> bool:
    """Print the verdict (``good`` when right, ``bad`` otherwise) and return ``ok``."""
    print(("✅ right: " + good) if ok else ("❌ not yet: " + bad))
    return ok


def unanswered(answer) -> bool:
    """True for the placeholders a notebook starts with (``None`` or ``...``)."""
    return answer is None or answer is ...


def call_cases(fn: Callable, cases: Iterable[tuple], returns: str) -> tuple[list | None, str]:
    """Call the student's ``fn(*args)`` for each ``args`` in ``cases``.

    Returns (results, "") or, when it raised or returned None, (None, a message saying so;
    ``returns`` names what it should return, e.g. "an int").
    """
    try:
        got = [fn(*args) for args in cases]
    except Exception as exc:  # the student's code raised
        return None, f"your function raised {type(exc).__name__}: {exc}"
    if any(g is None for g in got):
        return None, f"your function returns None; return {returns}"
    return got, ""
