"""Figures for notebook 11: measured decode steps on the overhead roofline.

``plot_overhead_roofline(points, model)`` draws step time against operator calls per step:
for each batch size the memory/compute roof alone (flat: it does not depend on the op
count) and the roof plus ops · t_op (a line of slope t_op), both from the
:class:`~llmlab.profiling.overhead.OverheadModel` and labelled as a model, with the measured
steps (median, min–max as error bars) on top. Eager and compiled steps of the same batch
sit on the same pair of lines, at different op counts. ``explore_overhead`` is the
callback of the notebook's widget over batch and t_op.
"""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np

from ..profiling.overhead import OverheadModel, OverheadPoint, TracedOp


def plot_overhead_roofline(points: list[OverheadPoint], model: OverheadModel, ax=None,
                           title: str | None = None):
    """Measured ``points`` against the overhead roofline ``model``; returns the Figure.

    x: operator calls per step; y: ms per step. Per batch size (one colour): a dashed
    line for the roof alone, max(bytes / bandwidth, FLOPs / peak), and a solid one for
    roof + ops · t_op; hollow markers are each point's modelled time, filled ones with
    error bars its measured median and min–max.
    """
    if not points:
        raise ValueError("points is empty: measure at least one step "
                         "(llmlab.profiling.overhead.measure_decode_point)")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.8), dpi=80)
    else:
        fig = ax.figure
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    batches = sorted({p.batch for p in points})
    grid = np.linspace(0, max(p.ops for p in points) * 1.15, 50)
    for i, b in enumerate(batches):
        colour = colours[i % len(colours)]
        group = [p for p in points if p.batch == b]
        # the batch's bytes and FLOPs (its points differ only in how the step is run)
        ref = max(group, key=lambda p: p.bytes)
        roof_ms = model.roof_seconds(ref.bytes, ref.flops) * 1e3
        ax.plot(grid, np.full_like(grid, roof_ms), "--", color=colour, lw=1,
                label=f"batch {b}: roof only (model)")
        ax.plot(grid, roof_ms + grid * model.t_op * 1e3, "-", color=colour, lw=1.2,
                label=f"batch {b}: roof + ops·t_op (model)")
        for p in group:
            y = p.median_s * 1e3
            err = [[y - p.min_s * 1e3], [p.max_s * 1e3 - y]]
            ax.errorbar(p.ops, y, yerr=err, fmt="o", color=colour, ms=6, capsize=3)
            ax.plot(p.ops, p.modelled(model).total_s * 1e3, "o", mfc="none", mec=colour,
                    ms=9, mew=1.2)
            ax.annotate(p.label, (p.ops, y), textcoords="offset points", xytext=(5, 5),
                        fontsize=7)
    ax.plot([], [], "ko", label="measured: median, min–max")
    ax.plot([], [], "o", mfc="none", mec="k", label="modelled (model)")
    ax.set(xlabel="operator calls per step", ylabel="ms per step",
           title=title or f"overhead roofline (t_op = {model.t_op * 1e6:.2f} µs"
                          + (f", {model.device}" if model.device else "") + ")")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def explore_overhead(points: list[OverheadPoint], model: OverheadModel, batch: int | None = None,
                     t_op_scale: float = 1.0):
    """Widget callback: the points of one ``batch`` (None: all) on the overhead roofline,
    with t_op scaled by ``t_op_scale`` (what if each op cost less, e.g. under CUDA graphs:
    a *model*, the measured points do not move). Returns the Figure."""
    if t_op_scale < 0:
        raise ValueError(f"t_op_scale={t_op_scale} must be >= 0")
    chosen = [p for p in points if batch is None or p.batch == batch]
    if not chosen:
        raise ValueError(f"no point has batch={batch}; "
                         f"batches: {sorted({p.batch for p in points})}")
    scaled = replace(model, t_op=model.t_op * t_op_scale)
    return plot_overhead_roofline(chosen, scaled)


def plot_trace(ops: list[TracedOp], first: int | None = None, ax=None, title: str | None = None):
    """A timeline of traced operator calls (:func:`llmlab.profiling.overhead.trace_ops`):
    one bar per call from its start to its end, matmuls in one colour and every other op in
    another; the white gaps between bars are time outside any operator. ``first``: only
    the first calls. Returns the Figure."""
    if not ops:
        raise ValueError("ops is empty: trace a step with llmlab.profiling.overhead.trace_ops")
    shown = ops[:first] if first else ops
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 2.4), dpi=80)
    else:
        fig = ax.figure
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for kind, colour, label in ((True, colours[0], "matmul"), (False, colours[1], "other op")):
        bars = [(o.start_us, max(o.duration_us, 0.3)) for o in shown if o.matmul == kind]
        ax.broken_barh(bars, (0, 1), facecolors=colour, label=f"{label} ({len(bars)})")
    end = shown[-1].start_us + shown[-1].duration_us
    busy = sum(o.duration_us for o in shown)
    ax.set(xlabel="µs since the first call", yticks=[], xlim=(0, end),
           title=title or f"{len(shown)} operator calls: {busy:.0f} of {end:.0f} µs inside "
                          "operators")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    return fig
