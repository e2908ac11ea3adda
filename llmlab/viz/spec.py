"""Figures and the widget callback for notebook 09 (speculative decoding).

``plot_timeline`` draws one generation step by step: each verify step's drafts (accepted or
rolled back) and the target's own token. ``plot_speedup_vs_k`` draws measured acceptance
and speedup per method and k against the cost model. ``explore_spec(grid, method, k)`` is
the callback of the notebook's widget over method × k. ``batching_model`` and
``plot_batching`` put speculation's verify step on notebook 02's roofline and show why
batching erodes the gain (a model, labelled as one).
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ..config import ModelConfig
from ..profiling.roofline import Ceilings, forward_cost
from ..speculative import cost_model_speedup, expected_tokens

_COLORS = {"accepted": "tab:green", "rejected": "tab:red", "target": "tab:blue"}


def plot_timeline(accepted_per_step: list[int], drafted_per_step: list[int],
                  max_steps: int | None = None, ax=None, title: str = "",
                  num_tokens: int | None = None):
    """One generation, a row per target forward (the prefill first): the drafts it verified
    (green: accepted, red: rejected and rolled back) and the one token the target adds (blue,
    hatched: the correction at the first rejection; filled: the bonus after all drafts, or
    the token of a plain decode step where nothing was drafted). The x axis is the
    position in the output, so each row starts where the previous one's tokens ended.
    ``num_tokens``: the tokens the generation kept (``SpecStats.num_generated``); a last
    step that ran past the end-of-sequence token or the budget is drawn up to there, and
    the title counts these."""
    if len(accepted_per_step) != len(drafted_per_step):
        raise ValueError(f"{len(accepted_per_step)} accepted counts for "
                         f"{len(drafted_per_step)} steps; they must match")
    if any(not 0 <= a <= d for a, d in zip(accepted_per_step, drafted_per_step)):
        raise ValueError("each step's accepted count must be in [0, drafted]")
    steps = list(zip(accepted_per_step, drafted_per_step))[:max_steps]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.28 * len(steps) + 1.4), dpi=80)
    ax.add_patch(Rectangle((0, -0.4), 1, 0.8, color=_COLORS["target"]))     # the prefill's token
    pos = 1
    end = float("inf") if num_tokens is None else num_tokens
    for row, (acc, drafted) in enumerate(steps, start=1):
        for i in range(drafted):
            kind = "accepted" if i < acc else "rejected"
            if kind == "accepted" and pos + i >= end:
                break
            ax.add_patch(Rectangle((pos + i, row - 0.4), 0.92, 0.8, color=_COLORS[kind],
                                   alpha=1.0 if kind == "accepted" else 0.45))
        if pos + acc < end:
            ax.add_patch(Rectangle((pos + acc, row - 0.4), 0.92, 0.8, color=_COLORS["target"],
                                   fill=acc == drafted, hatch=None if acc == drafted else "//",
                                   ec=_COLORS["target"], lw=1))
        pos = min(pos + acc + 1, end)
    pos = int(pos)
    width = max(pos + max((d for _, d in steps), default=0), 2)
    ax.set_xlim(0, width)
    ax.set_ylim(len(steps) + 0.6, -0.6)
    ax.set_xlabel("output token position")
    ax.set_ylabel("target forward (0 = prefill)")
    ax.legend(handles=[Patch(color=_COLORS["accepted"], label="draft accepted"),
                       Patch(color=_COLORS["rejected"], alpha=0.45,
                             label="draft rejected (rolled back)"),
                       Patch(color=_COLORS["target"], label="target's token: bonus, or plain step"),
                       Patch(fc="white", ec=_COLORS["target"], hatch="//",
                             label="target's correction")],
              fontsize=7, loc="lower left")
    ax.set_title(title or f"{pos} tokens in {len(steps) + 1} target forwards "
                          f"(plain decoding: {pos} forwards)", fontsize=10)
    ax.figure.tight_layout()
    return ax


def plot_speedup_vs_k(rows: list[dict], axes=None, highlight: tuple[str, int] | None = None):
    """Two panels per method: acceptance rate against k, and the measured speedup (median,
    error bar min-max) with the cost model's prediction (``row["model"]``, e.g.
    E[tokens per step] / (verify + k·c)) dashed.

    rows: {"method", "k", "accept", "speedup", "lo", "hi", "model"}, one per (method, k).
    ``highlight``: a (method, k) circled in both panels."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for i, m in enumerate(methods):
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["k"])
        ks = [r["k"] for r in rs]
        axes[0].plot(ks, [r["accept"] for r in rs], "o-", color=f"C{i}", label=m)
        sp = np.array([r["speedup"] for r in rs])
        err = [sp - [r["lo"] for r in rs], [r["hi"] for r in rs] - sp]
        axes[1].errorbar(ks, sp, yerr=err, fmt="o-", color=f"C{i}", capsize=3,
                         label=f"{m}: measured")
        axes[1].plot(ks, [r["model"] for r in rs], "--", color=f"C{i}", alpha=0.7,
                     label=f"{m}: cost model")
    if highlight is not None:
        for r in rows:
            if (r["method"], r["k"]) == tuple(highlight):
                for ax, key in zip(axes, ("accept", "speedup")):
                    ax.plot([r["k"]], [r[key]], "o", ms=15, mfc="none", mec="k", mew=2)
    axes[1].axhline(1.0, color="gray", lw=1, ls=":")
    axes[0].set(xlabel="drafts per step k", ylabel="acceptance (accepted / drafted)",
                ylim=(0, 1.05))
    axes[1].set(xlabel="drafts per step k", ylabel="speedup over KV-cache greedy")
    for ax in axes:
        ax.set_xticks(sorted({r["k"] for r in rows}))
        ax.legend(fontsize=7)
    return axes


@dataclass
class SpecChoice:
    """What the widget shows for one (method, k)."""

    method: str
    k: int
    speedup: float
    accept: float
    tokens_per_forward: float
    model: float
    figure: object = None


def explore_spec(grid: dict, method: str, k: int, draw: bool = True) -> SpecChoice:
    """The widget callback: the measured (method, k) from ``grid`` ({(method, k): row with
    "accept", "speedup", "lo", "hi", "model", "tok/fwd", "accepted_per_step",
    "drafted_per_step"}), and a figure: that run's timeline, and every configuration's
    acceptance and speedup against k with the choice circled."""
    if (method, k) not in grid:
        raise ValueError(f"(method={method!r}, k={k!r}) was not measured; allowed: "
                         f"{sorted(grid)}")
    r = grid[(method, k)]
    choice = SpecChoice(method, k, r["speedup"], r["accept"], r["tok/fwd"], r["model"])
    if not draw:
        return choice
    fig = plt.figure(figsize=(11, 6), dpi=80)
    top = fig.add_subplot(2, 1, 1)
    plot_timeline(r["accepted_per_step"], r["drafted_per_step"], max_steps=14, ax=top,
                  title=f"{method}, k={k}: the first target forwards of the measured run")
    bottom = [fig.add_subplot(2, 2, 3), fig.add_subplot(2, 2, 4)]
    plot_speedup_vs_k([dict(v, method=m, k=kk) for (m, kk), v in grid.items()], axes=bottom,
                      highlight=(method, k))
    fig.suptitle(f"{method}, k={k}: acceptance {r['accept']:.0%}, {r['tok/fwd']:.2f} tokens "
                 f"per target forward, speedup {r['speedup']:.2f}x (cost model "
                 f"{r['model']:.2f}x)", fontsize=10)
    fig.tight_layout()
    choice.figure = fig
    return choice


def batching_model(config: ModelConfig, ceilings: Ceilings, batches: list[int], k: int,
                   alpha: float, context: int = 256, c: float = 0.0,
                   bytes_per_el: int = 4) -> list[dict]:
    """Modelled speedup of speculation at each batch size: a forward takes
    max(FLOPs / peak, bytes / bandwidth) (the roofline); a verify step feeds k + 1 tokens
    per sequence and yields E[tokens] = 1 + α + ... + α^k of them, a plain step feeds 1.
    Rows: {"batch", "decode", "verify" (Cost), "verify_over_decode", "speedup"}."""
    if k < 1 or not batches or min(batches) < 1:
        raise ValueError(f"k={k!r} must be >= 1 and batches={batches!r} positive ints")

    def seconds(cost):
        return max(cost.flops / ceilings.peak_flops_per_s,
                   cost.bytes / ceilings.bandwidth_bytes_per_s)

    rows = []
    for b in batches:
        dec = forward_cost(config, b, 1, context, bytes_per_el, label=f"decode, batch {b}")
        ver = forward_cost(config, b, k + 1, context, bytes_per_el, logits_tokens=k + 1,
                           label=f"verify k={k}, batch {b}")
        ratio = seconds(ver) / seconds(dec)
        rows.append({"batch": b, "decode": dec, "verify": ver, "verify_over_decode": ratio,
                     "speedup": cost_model_speedup(expected_tokens(alpha, k), k, c, ratio)})
    return rows


def plot_batching(rows: list[dict], ceilings: Ceilings, k: int, alpha: float, axes=None):
    """Left: the modelled decode and verify forwards of each batch on the roofline (batch
    sizes written beside the verify points). Right: the modelled speedup against batch size."""
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), dpi=80)
    ax = axes[0]
    pts = {"decode": [r["decode"] for r in rows], f"verify, k={k}": [r["verify"] for r in rows]}
    xs = [c.intensity for cs in pts.values() for c in cs] + [ceilings.ridge_point]
    grid = np.logspace(np.log10(min(xs) / 3), np.log10(max(xs) * 3), 200)
    ax.loglog(grid, [ceilings.attainable(i) / 1e9 for i in grid], "k-", lw=1.5,
              label=f"roof: {ceilings.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                    f"{ceilings.peak_flops_per_s / 1e9:.0f} GFLOP/s")
    ax.axvline(ceilings.ridge_point, color="gray", ls=":", lw=1)
    for (label, costs), marker in zip(pts.items(), ("o", "s")):
        ax.loglog([c.intensity for c in costs],
                  [ceilings.attainable(c.intensity) / 1e9 for c in costs], marker, mfc="none",
                  ms=8, mew=1.5, label=f"{label} (model)")
    for r in rows:
        c = r["verify"]
        ax.annotate(f"B={r['batch']}", (c.intensity, ceilings.attainable(c.intensity) / 1e9),
                    textcoords="offset points", xytext=(0, -14), fontsize=7, ha="center")
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="GFLOP/s",
           title="decode and verify forwards on the roofline (model)")
    ax.legend(fontsize=7, loc="lower right")
    bs = [r["batch"] for r in rows]
    axes[1].plot(bs, [r["speedup"] for r in rows], "o-", label="speculation (model)")
    axes[1].axhline(1.0, color="gray", ls=":", lw=1)
    axes[1].set_xscale("log", base=2)
    axes[1].set(xlabel="batch size", ylabel="modelled speedup",
                title=f"k={k}, acceptance α={alpha}: E[tokens] = "
                      f"{expected_tokens(alpha, k):.2f} per step")
    axes[1].legend(fontsize=7)
    axes[0].figure.tight_layout()
    return axes
