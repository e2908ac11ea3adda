"""Figures for notebook 14's long contexts: split-KV decode on a modeled H100, and SmolLM2's
perplexity with a sliding window, with and without attention sinks.

``plot_split_occupancy`` draws :func:`llmlab.attention.split_kv.split_occupancy` against
the number of splits (a model, labelled as one). ``plot_sinks_sweep`` draws measured
perplexities against the window size per sink count, and the loss along the text for one
configuration against the full cache; ``explore_sinks`` is the notebook widget's callback.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter, ScalarFormatter

from ..attention.split_kv import choose_num_splits, split_occupancy


def plot_split_occupancy(cases: dict[str, tuple[int, int, int]], num_sms: int = 132,
                         blocks_per_sm: int = 1, block_n: int = 64, max_splits: int = 256,
                         chip: str = "H100", ax=None):
    """SM slots busy and modeled step time against the number of splits.

    ``cases``: label -> (batch, kv_heads, context). One line per case in each panel; a
    marker at the split :func:`choose_num_splits` picks. Returns the Figure.
    """
    if not cases:
        raise ValueError("cases is empty: give at least one label -> (batch, kv_heads, context)")
    if ax is None:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    else:
        fig = ax[0].figure
    splits = [s for s in 2 ** np.arange(0, int(np.log2(max_splits)) + 1)]
    slots = num_sms * blocks_per_sm
    for label, (batch, kv_heads, context) in cases.items():
        occ = [split_occupancy(batch, kv_heads, context, int(s), num_sms, blocks_per_sm, block_n)
               for s in splits]
        line, = ax[0].plot(splits, [o.sm_busy * 100 for o in occ], marker="o", ms=3, label=label)
        ax[1].plot(splits, [o.step_time for o in occ], marker="o", ms=3, color=line.get_color())
        chosen = choose_num_splits(batch * kv_heads, max(-(-context // block_n), 1), num_sms,
                                   blocks_per_sm)
        best = split_occupancy(batch, kv_heads, context, chosen, num_sms, blocks_per_sm, block_n)
        ax[0].plot([chosen], [best.sm_busy * 100], "*", ms=12, color=line.get_color())
        ax[1].plot([chosen], [best.step_time], "*", ms=12, color=line.get_color())
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("splits of each sequence's keys")
        a.grid(alpha=0.3)
    ax[0].set_ylabel("% of program slots busy")
    ax[0].set_ylim(0, 105)
    ax[1].set_yscale("log")
    ax[1].set_ylabel("step time / unsplit step")
    ax[0].set_title(f"model: {chip}, {num_sms} SMs × {blocks_per_sm} programs = {slots} slots",
                    fontsize=9)
    ax[1].set_title("model: waves × keys per split + merge (★: FlashAttention-2's rule)",
                    fontsize=9)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _label(row: dict) -> str:
    return "full cache" if row["window"] is None else \
        f"window {row['window']}" + (f" + {row['sinks']} sinks" if row["sinks"] else " alone")


def plot_sinks_sweep(sweep: dict, window: int, sinks: int, live: list[dict] = (), ax=None):
    """Left: perplexity against the window, one line per sink count, the full cache as a
    dashed line, live measurements as black rings. Right: the loss along the text (bins of
    ``sweep["bin"]`` tokens) for (``window``, ``sinks``) and for the window alone, against
    the full cache. Returns the Figure."""
    rows = sweep["rows"]
    full = next(r for r in rows if r["window"] is None)
    pick = [r for r in rows if r["window"] == window and r["sinks"] == sinks]
    if not pick:
        have = sorted({(r["window"], r["sinks"]) for r in rows if r["window"] is not None})
        raise ValueError(f"window={window}, sinks={sinks} is not in the sweep; it has {have}")
    if ax is None:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
    else:
        fig = ax[0].figure
    windows = sorted({r["window"] for r in rows if r["window"] is not None})
    for s in sorted({r["sinks"] for r in rows if r["window"] is not None}):
        ys = [next(r["ppl"] for r in rows if r["window"] == w and r["sinks"] == s) for w in windows]
        ax[0].plot(windows, ys, marker="o", ms=4, label=f"{s} sinks", lw=2 if s == sinks else 1)
    ax[0].axhline(full["ppl"], ls="--", color="k", lw=1, label="full cache")
    ax[0].plot([window], [pick[0]["ppl"]], "*", ms=14, color="crimson", zorder=5)
    for r in live:
        ax[0].plot([r["window"] or windows[-1] * 1.3], [r["ppl"]], "o", ms=10, mfc="none",
                   mec="k", mew=1.5)
    ax[0].set_xscale("log", base=2)
    ax[0].set_yscale("log")
    ax[0].yaxis.set_major_formatter(ScalarFormatter())
    ax[0].yaxis.set_minor_formatter(NullFormatter())
    low, high = ax[0].get_ylim()
    ax[0].set_yticks([t for t in (10, 15, 20, 30, 50, 70, 100, 150, 200, 300, 500)
                      if low <= t <= high])
    ax[0].set_xticks(windows, [str(w) for w in windows])
    ax[0].set_xlabel("window (recent tokens kept)")
    ax[0].set_ylabel(f"perplexity, tokens {sweep['skip']}..{sweep['tokens'] - 1}")
    ax[0].legend(fontsize=8)
    ax[0].grid(alpha=0.3)
    ax[0].set_title("SmolLM2, measured (○ = this run)", fontsize=9)
    alone = next(r for r in rows if r["window"] == window and r["sinks"] == 0)
    x = (np.arange(len(full["nll_bins"])) + 0.5) * sweep["bin"]
    ax[1].plot(x, full["nll_bins"], color="k", lw=1, label="full cache")
    ax[1].plot(x, alone["nll_bins"], color="tab:blue", label=_label(alone))
    if sinks:
        ax[1].plot(x, pick[0]["nll_bins"], color="crimson", label=_label(pick[0]))
    ax[1].axvline(window + sinks, color="gray", ls=":", lw=1)
    ax[1].text(window + sinks, ax[1].get_ylim()[1], " eviction starts", fontsize=8, va="top",
               color="gray")
    ax[1].set_xlabel("position in the text (tokens)")
    ax[1].set_ylabel(f"mean loss per {sweep['bin']} tokens (nats)")
    ax[1].legend(fontsize=8)
    ax[1].grid(alpha=0.3)
    fig.tight_layout()
    return fig


def explore_sinks(sweep: dict, window: int, sinks: int, live: list[dict] = ()) -> dict:
    """The widget's callback: draws :func:`plot_sinks_sweep` and returns the chosen row with
    its ratio to the full cache (``"vs_full"``)."""
    plot_sinks_sweep(sweep, window, sinks, live)
    full = next(r for r in sweep["rows"] if r["window"] is None)
    row = next(r for r in sweep["rows"] if r["window"] == window and r["sinks"] == sinks)
    return {**row, "vs_full": row["ppl"] / full["ppl"]}


__all__ = ["plot_split_occupancy", "plot_sinks_sweep", "explore_sinks"]
