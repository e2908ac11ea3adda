"""Figures of notebook 10: a server's gauges over time, the rate sweep, latency CDFs.

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


def plot_sweep(rows: list[dict], ttft_target_s: float, title: str = ""):
    """p90 TTFT against the arrival rate (left; the dashed line is the TTFT target; error
    bars where rows carry ``ttft_p90_lo`` and ``ttft_p90_hi``, e.g. bootstrap intervals),
    p90 end-to-end latency against throughput (middle), and goodput against the arrival
    rate (right; the dotted diagonal is every request meeting the target), one line per
    scheduler."""
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(12, 3.3), dpi=80)
    for sched in dict.fromkeys(r["scheduler"] for r in rows):
        rs = sorted((r for r in rows if r["scheduler"] == sched), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rs]
        p90 = [r["ttft_p90_s"] for r in rs]
        if all("ttft_p90_lo" in r and "ttft_p90_hi" in r for r in rs):
            err = [[max(0.0, v - r["ttft_p90_lo"]) for v, r in zip(p90, rs)],
                   [max(0.0, r["ttft_p90_hi"] - v) for v, r in zip(p90, rs)]]
            ax.errorbar(rates, p90, yerr=err, fmt="o-", capsize=3, label=sched)
        else:
            ax.plot(rates, p90, "o-", label=sched)
        bx.plot([r["throughput_tok_s"] for r in rs], [r["e2e_p90_s"] for r in rs], "o-",
                label=sched)
        for r in rs:
            bx.annotate(f"{r['rate']:g}/s", (r["throughput_tok_s"], r["e2e_p90_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        cx.plot(rates, [r.get("goodput_req_s", math.nan) for r in rs], "o-", label=sched)
    ax.axhline(ttft_target_s, ls="--", color="gray", lw=1, label=f"target {ttft_target_s:g} s")
    ax.set(xscale="log", yscale="log", xlabel="arrival rate (requests/s)",
           ylabel="p90 TTFT (s)", title="latency as the load grows")
    bx.set(xlabel="throughput (generated tokens/s)", ylabel="p90 end-to-end latency (s)",
           title="throughput against latency (points: rates)")
    bx.set_xlim(left=0)
    bx.set_ylim(bottom=0)
    rates = sorted({r["rate"] for r in rows})
    cx.plot([0, max(rates)], [0, max(rates)], ":", color="gray", lw=1, label="every request")
    cx.set(xlabel="arrival rate (requests/s)", ylabel="goodput (requests/s)",
           title=f"requests/s with TTFT <= {ttft_target_s:g} s")
    cx.set_xlim(left=0)
    cx.set_ylim(bottom=0)
    ax.set_xticks(rates, [f"{x:g}" for x in rates])
    ax.xaxis.set_minor_formatter(NullFormatter())
    for a in (ax, bx, cx):
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(_two_and_five))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


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
                    label=f"{row['scheduler']} (p90 {view.p90[row['scheduler']]:.2f} s)")
    if draw:
        ax.set(xlabel=METRICS[metric], ylabel="fraction of requests",
               title=f"{metric.upper()} at {rate:g} requests/s")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        plt.show()
    return view


__all__ = ["plot_gauges", "plot_sweep", "latencies", "explore_rate", "RateView"]
