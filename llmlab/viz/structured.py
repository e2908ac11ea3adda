"""Figures and the widget callback for notebook 12 (structured outputs).

``allowed_fractions`` follows a constrained output token by token and records the share
of the vocabulary the grammar allowed before each token; ``plot_allowed_fraction`` draws
it (one line per backend); ``plot_mask_costs`` draws the time of one mask per method
against a decode step; ``explore_schema(traces, name, log_scale)`` is the callback of the
notebook's widget over schemas.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np


def allowed_fractions(grammar, token_ids: list[int]) -> np.ndarray:
    """Per token of ``token_ids`` (an output the grammar accepts): the share of the
    vocabulary allowed just before it. Raises ValueError if a token is not allowed."""
    m = grammar.matcher()
    out = []
    for t in token_ids:
        mask = m.allowed_mask()
        out.append(float(mask.float().mean()))
        if not bool(mask[t]):
            raise ValueError(f"token {t} is not allowed at position {len(out) - 1}")
        m.advance(int(t))
    return np.asarray(out)


@dataclass
class SchemaTrace:
    """One schema's constrained output and its masks: ``tokens`` (the text of each
    token), ``fractions`` per backend name."""

    schema_name: str
    tokens: list[str]
    vocab_size: int
    fractions: dict[str, np.ndarray] = field(default_factory=dict)


def plot_allowed_fraction(trace: SchemaTrace, log_scale: bool = True, ax=None):
    """Share of the vocabulary allowed at each step of ``trace``, per backend; the token
    generated at each step labels the x axis."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2), dpi=80)
    x = np.arange(len(trace.tokens))
    styles = {"llmlab": ("o-", "tab:blue"), "llguidance": ("x--", "tab:orange")}
    for name, fr in trace.fractions.items():
        style, color = styles.get(name, (".-", None))
        ax.plot(x, np.maximum(fr, 1e-6), style, color=color, label=name, ms=4)
    ax.set_xticks(x)
    ax.set_xticklabels([t.replace("\n", "\\n") for t in trace.tokens], rotation=70,
                       fontsize=7, family="monospace")
    ax.set(ylabel="share of vocabulary allowed", title=f"{trace.schema_name}: the mask at "
           "each step of the output")
    if log_scale:
        ax.set_yscale("log")
        ax.set_ylim(1e-5 * 0.5, 1.5)
    else:
        ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def plot_mask_costs(rows: list[dict], step_s: float, ax=None):
    """Horizontal bars: median µs per mask of each method (``rows``: dicts with
    ``method``, ``median_s``, ``p10_s``, ``p90_s``), log scale, with the decode step's
    time as a vertical line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.6), dpi=80)
    names = [r["method"] for r in rows]
    med = np.array([r["median_s"] for r in rows]) * 1e6
    lo = med - np.array([r["p10_s"] for r in rows]) * 1e6
    hi = np.array([r["p90_s"] for r in rows]) * 1e6 - med
    y = np.arange(len(rows))
    ax.barh(y, med, xerr=[np.maximum(lo, 0), np.maximum(hi, 0)], color="tab:blue", alpha=0.8,
            capsize=3)
    ax.axvline(step_s * 1e6, color="tab:red", ls="--", label=f"one decode step ({step_s * 1e3:.0f} ms)")
    ax.set_yticks(y)
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="µs per mask (median, p10-p90)", title="building one token mask")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


def explore_schema(traces: dict[str, SchemaTrace], name: str, log_scale: bool = True):
    """The widget's callback: draw the trace of schema ``name``; returns a one-line
    summary (the median share allowed and the steps where exactly one token fits)."""
    if name not in traces:
        raise ValueError(f"schema {name!r}; allowed: {list(traces)}")
    tr = traces[name]
    plot_allowed_fraction(tr, log_scale)
    fr = next(iter(tr.fractions.values()))
    forced = int((fr <= 1.5 / tr.vocab_size).sum())
    return (f"{name}: median share allowed {np.median(fr):.2%}; {forced} of {len(fr)} steps "
            "left exactly one token")


__all__ = ["allowed_fractions", "SchemaTrace", "plot_allowed_fraction", "plot_mask_costs",
           "explore_schema"]
