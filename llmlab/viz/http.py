"""Figures of notebook 10: a server's gauges over time (and what they show, as numbers),
the rate sweep, latency CDFs.

The rows are those of :func:`llmlab.bench.serve_http.rate_sweep` (one per scheduler and
rate, with the per-request :class:`~llmlab.serve.client.StreamResult` list under
``"results"``); the samples those of :func:`llmlab.serve.client.watch_metrics`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullFormatter
import numpy as np

GAUGES = {"llmlab_requests_running": "running", "llmlab_requests_waiting": "waiting",
          "llmlab_kv_blocks_used": "KV blocks used"}
METRICS = {"ttft": "time to first token (s)", "tpot": "time per output token (s)",
           "e2e": "end-to-end latency (s)"}


def plot_gauges(samples: list[tuple[float, dict[str, float]]], title: str = ""):
    """The server's gauges (running, waiting, KV blocks used) against time."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3), dpi=80)
    t = [s for s, _ in samples]
    for name in ("llmlab_requests_running", "llmlab_requests_waiting"):
        ax.step(t, [m[name] for _, m in samples], where="post", label=GAUGES[name])
    bx.step(t, [m["llmlab_kv_blocks_used"] for _, m in samples], where="post", color="C2")
    ax.set(xlabel="time (s)", ylabel="requests", title="requests in the engine")
    bx.set(xlabel="time (s)", ylabel="blocks", title="KV blocks held by live sequences")
    for a in (ax, bx):
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _p90_panel(ax, rows: list[dict], metric: str, target_s: float | None, unit: str,
               log_y: bool = True) -> None:
    """p90 of ``metric`` against the rate, one line per scheduler, with error bars where the
    rows carry ``{metric}_p90_lo`` and ``{metric}_p90_hi``; the target as a dashed line;
    a log y axis, or a linear one from 0."""
    for sched in dict.fromkeys(r["scheduler"] for r in rows):
        rs = sorted((r for r in rows if r["scheduler"] == sched), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rs]
        p90 = [r[f"{metric}_p90_s"] for r in rs]
        if all(f"{metric}_p90_lo" in r and f"{metric}_p90_hi" in r for r in rs):
            err = [[max(0.0, v - r[f"{metric}_p90_lo"]) for v, r in zip(p90, rs)],
                   [max(0.0, r[f"{metric}_p90_hi"] - v) for v, r in zip(p90, rs)]]
            ax.errorbar(rates, p90, yerr=err, fmt="o-", capsize=3, label=sched)
        else:
            ax.plot(rates, p90, "o-", label=sched)
    if target_s is not None:
        ax.axhline(target_s, ls="--", color="gray", lw=1, label=f"target {_fmt_s(target_s)}")
    ax.set(xscale="log", yscale="log" if log_y else "linear", xlabel="arrival rate (requests/s)",
           ylabel=f"p90 {unit} (s)", title=f"p90 {unit} as the load grows")
    rates = sorted({r["rate"] for r in rows})
    ax.set_xticks(rates, [f"{x:g}" for x in rates])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if log_y:
        ax.yaxis.set_minor_formatter(FuncFormatter(_two_and_five))
    else:
        ax.set_ylim(bottom=0)


def _fmt_s(v: float) -> str:
    """A duration for a label: milliseconds under a second, else seconds."""
    return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


def plot_sweep(rows: list[dict], ttft_target_s: float, title: str = "",
               tpot_target_s: float | None = None):
    """The rate sweep, one line per scheduler.

    Without ``tpot_target_s``, three panels: p90 TTFT against the arrival rate (the dashed
    line is the target; error bars where rows carry ``ttft_p90_lo`` and ``ttft_p90_hi``,
    e.g. bootstrap intervals), p90 end-to-end latency against throughput, and goodput
    against the arrival rate (the dotted diagonal is every request meeting the target).
    With it, four panels (2 x 2): p90 TTFT, p90 TPOT (on a linear axis from 0, its target
    dashed, error bars from ``tpot_p90_lo``/``tpot_p90_hi``), then throughput against
    latency and the goodput, now the requests per second that met both targets (DistServe's
    definition)."""
    if tpot_target_s is None:
        fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(12, 3.3), dpi=80)
        tx = None
    else:
        fig, grid = plt.subplots(2, 2, figsize=(10, 6.4), dpi=80)
        (ax, tx), (bx, cx) = grid
    _p90_panel(ax, rows, "ttft", ttft_target_s, "TTFT")
    if tx is not None:
        _p90_panel(tx, rows, "tpot", tpot_target_s, "TPOT", log_y=False)
    for sched in dict.fromkeys(r["scheduler"] for r in rows):
        rs = sorted((r for r in rows if r["scheduler"] == sched), key=lambda r: r["rate"])
        bx.plot([r["throughput_tok_s"] for r in rs], [r["e2e_p90_s"] for r in rs], "o-",
                label=sched)
        for r in rs:
            bx.annotate(f"{r['rate']:g}/s", (r["throughput_tok_s"], r["e2e_p90_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        cx.plot([r["rate"] for r in rs], [r.get("goodput_req_s", math.nan) for r in rs], "o-",
                label=sched)
    bx.set(xlabel="throughput (generated tokens/s)", ylabel="p90 end-to-end latency (s)",
           title="throughput against latency (points: rates)")
    bx.set_xlim(left=0)
    bx.set_ylim(bottom=0)
    rates = sorted({r["rate"] for r in rows})
    cx.plot([0, max(rates)], [0, max(rates)], ":", color="gray", lw=1, label="every request")
    met = f"TTFT <= {_fmt_s(ttft_target_s)}" + (
        "" if tpot_target_s is None else f" and TPOT <= {_fmt_s(tpot_target_s)}")
    cx.set(xlabel="arrival rate (requests/s)", ylabel="goodput (requests/s)",
           title=f"requests/s with {met}")
    cx.set_xlim(left=0)
    cx.set_ylim(bottom=0)
    for a in (ax, tx, bx, cx):
        if a is not None:
            a.grid(alpha=0.3, which="both")
            a.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


@dataclass
class Stretch:
    """A time the gauges held still with seats free and requests waiting."""

    start_s: float
    duration_s: float
    running: int
    waiting: int


@dataclass
class GaugeStory:
    """What the gauges of a burst show, read off :func:`~llmlab.serve.client.watch_metrics`'s
    samples (times in seconds from the first scrape; None where it never happened).

    ``first_s``: the first sample with a request in the engine; ``full_s``: the first with
    every seat taken; ``stretches``: each time the gauges held one state with a seat free and
    a request waiting for at least ``min_s`` (a long step: the gauges change only between
    steps); ``queue_empty_s``: the first sample after ``full_s`` with nobody waiting;
    ``last_s``: the first sample after that with nothing running; ``peak_running``,
    ``peak_waiting``, ``peak_blocks`` and ``end_blocks``."""

    first_s: float | None
    full_s: float | None
    stretches: list[Stretch]
    queue_empty_s: float | None
    last_s: float | None
    peak_running: int
    peak_waiting: int
    peak_blocks: int
    end_blocks: int

    @property
    def time_to_full_s(self) -> float | None:
        """From the burst's first request in the engine to every seat taken."""
        return None if self.first_s is None or self.full_s is None else self.full_s - self.first_s


def read_gauges(samples: list[tuple[float, dict[str, float]]], seats: int,
                min_s: float = 0.3) -> GaugeStory:
    """The :class:`GaugeStory` of a burst's samples, for a server with ``seats`` seats."""
    run = [(t, int(m["llmlab_requests_running"]), int(m["llmlab_requests_waiting"]),
            int(m["llmlab_kv_blocks_used"])) for t, m in samples]
    if not run:
        raise ValueError("no samples")
    first = next((t for t, r, w, _ in run if r + w > 0), None)
    full = next((t for t, r, _, _ in run if r >= seats), None)
    stretches, i = [], 0
    while i < len(run):                   # runs of one state with a free seat and a queue
        t, r, w, _ = run[i]
        j = i
        while j + 1 < len(run) and run[j + 1][1:3] == (r, w):
            j += 1
        end = run[j + 1][0] if j + 1 < len(run) else run[j][0]
        if r < seats and w > 0 and end - t >= min_s:
            stretches.append(Stretch(t, end - t, r, w))
        i = j + 1
    empty = (next((t for t, _, w, _ in run if t > full and w == 0), None)
             if full is not None else None)
    after = empty if empty is not None else full if full is not None else first
    last = (next((t for t, r, w, _ in run if t > after and r + w == 0), None)
            if after is not None else None)
    return GaugeStory(first, full, stretches, empty, last, max(r for _, r, _, _ in run),
                      max(w for _, _, w, _ in run), max(b for *_, b in run), run[-1][3])


def _two_and_five(v: float, _pos=None) -> str:
    """Label a log axis's minor ticks at 2 and 5 times a power of ten only."""
    if v <= 0:
        return ""
    lead = v / 10 ** math.floor(math.log10(v))
    return f"{v:g}" if round(lead, 6) in (2.0, 5.0) else ""


def latencies(row: dict, metric: str = "ttft") -> np.ndarray:
    """The finite per-request values of ``metric`` (ttft, tpot or e2e) of one sweep row."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}; allowed: {list(METRICS)}")
    vals = [getattr(r, f"{metric}_s") for r in row["results"] if r.ok]
    return np.sort(np.array([v for v in vals if math.isfinite(v)]))


@dataclass
class RateView:
    """What the widget shows at one rate: p50 and p90 of ``metric`` per scheduler."""

    rate: float
    metric: str
    p50: dict[str, float]
    p90: dict[str, float]


def explore_rate(rows: list[dict], rate: float, metric: str = "ttft", draw: bool = True
                 ) -> RateView:
    """The latency CDF of each scheduler at ``rate`` (the widget of notebook 10)."""
    at = [r for r in rows if r["rate"] == rate]
    if not at:
        raise ValueError(f"rate={rate!r}; swept: {sorted({r['rate'] for r in rows})}")
    view = RateView(rate, metric, {}, {})
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=80) if draw else (None, None)
    for row in at:
        v = latencies(row, metric)
        view.p50[row["scheduler"]] = float(np.percentile(v, 50)) if len(v) else math.nan
        view.p90[row["scheduler"]] = float(np.percentile(v, 90)) if len(v) else math.nan
        if draw and len(v):
            ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post",
                    label=f"{row['scheduler']} (p90 {_fmt_s(view.p90[row['scheduler']])})")
    if draw:
        ax.set(xlabel=METRICS[metric], ylabel="fraction of requests",
               title=f"{metric.upper()} at {rate:g} requests/s")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        plt.show()
    return view


__all__ = ["plot_gauges", "plot_sweep", "latencies", "explore_rate", "RateView",
           "GaugeStory", "Stretch", "read_gauges"]
