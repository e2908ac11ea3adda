"""Figures for notebook 07 (tensor parallelism): the split, all-reduce cost, the scaling model.

``plot_tp_scaling`` is the callback of the notebook's widget (tp degree x interconnect
bandwidth); it draws a model, not a measurement, and says so in its title.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..config import ModelConfig
from ..parallel.comm import A100_NVLINK, LLAMA2_70B, Hardware, tp_decode_model

_RANK_COLORS = plt.get_cmap("tab10").colors


def plot_tp_split(config: ModelConfig, tp: int):
    """Which rank holds which columns / rows of each weight of one decoder layer.

    Weights are drawn as A = Wᵀ [in, out] (``y = x A``), so a ColumnParallelLinear is split
    into vertical stripes (columns of A = output features) and a RowParallelLinear into
    horizontal stripes (rows of A = input features). Query/KV head boundaries are dotted.
    """
    from ..parallel.model import check_tp_degree

    check_tp_degree(config, tp)
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    mats = [("q_proj", h, config.num_heads * d, "col", d), ("k_proj", h, config.num_kv_heads * d, "col", d),
            ("v_proj", h, config.num_kv_heads * d, "col", d), ("o_proj", config.num_heads * d, h, "row", d),
            ("gate_proj", h, f, "col", None), ("up_proj", h, f, "col", None), ("down_proj", f, h, "row", None)]
    fig, axes = plt.subplots(1, len(mats), figsize=(10, 3.2), dpi=80,
                             gridspec_kw={"width_ratios": [m[2] for m in mats]})
    for ax, (name, rows, cols, kind, head) in zip(axes, mats):
        for r in range(tp):
            c = _RANK_COLORS[r % 10]
            if kind == "col":
                ax.add_patch(plt.Rectangle((r * cols / tp, 0), cols / tp, rows, color=c, alpha=0.75))
            else:
                ax.add_patch(plt.Rectangle((0, rows - (r + 1) * rows / tp), cols, rows / tp, color=c, alpha=0.75))
        if head:
            n = (cols if kind == "col" else rows) // head
            for i in range(1, n):
                if kind == "col":
                    ax.axvline(i * head, color="white", lw=0.6, ls=":")
                else:
                    ax.axhline(rows - i * head, color="white", lw=0.6, ls=":")
        ax.set_xlim(0, cols)
        ax.set_ylim(0, rows)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{name.replace('_proj', '')}\n{'column' if kind == 'col' else 'row'}", fontsize=8)
        ax.set_xlabel(f"out {cols}", fontsize=7)
        ax.set_ylabel(f"in {rows}", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_RANK_COLORS[r % 10], alpha=0.75) for r in range(tp)]
    fig.legend(handles, [f"rank {r}" for r in range(tp)], loc="lower center", ncol=tp, fontsize=8)
    fig.suptitle(f"One decoder layer split over tp={tp} ranks (A = Wᵀ; heads dotted): "
                 f"{config.num_heads // tp} query + {config.num_kv_heads // tp} KV heads per rank",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def plot_allreduce(rows_by_tp: dict[int, list[dict]], mark_bytes: int | None = None, device: str = "",
                   fit: dict[int, tuple[float, float]] | None = None):
    """Measured all-reduce time against message size, one line per number of ranks.

    Points are medians, bars the quartiles (rows from :func:`llmlab.parallel.comm.time_allreduce`);
    the y axis starts at 0 so a flat curve looks flat and noise looks like noise. ``fit`` maps
    tp to (latency µs, GB/s) from ``fit_latency_bandwidth``, drawn dashed.
    """
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    top = 0.0
    for tp, rows in sorted(rows_by_tp.items()):
        x = np.array([r["bytes"] for r in rows], dtype=float)
        med = np.array([r["us"] for r in rows])
        lo = np.array([r.get("us_q1", r["us"]) for r in rows])
        hi = np.array([r.get("us_q3", r["us"]) for r in rows])
        line = ax.errorbar(x, med, yerr=[med - lo, hi - med], fmt="o-", capsize=3,
                           label=f"{tp} ranks (median, quartiles)")
        top = max(top, hi.max())
        if fit and tp in fit:
            lat, gbps = fit[tp]
            xs = np.geomspace(x.min(), x.max(), 50)
            what = (f"{lat:.0f} µs + bytes / {gbps:.2g} GB/s" if np.isfinite(gbps)
                    else f"{lat:.0f} µs, no measurable cost per byte")
            ax.plot(xs, lat + xs / (gbps * 1e3), "--", color=line[0].get_color(), lw=1,
                    label=f"fit: {what}")
    ax.set_xscale("log")
    ax.set_ylim(0, top * 1.15)
    if mark_bytes:
        ax.axvline(mark_bytes, color="gray", ls="--", lw=1)
        ax.text(mark_bytes * 1.1, top * 0.05, "one hidden vector\n(one token)", fontsize=8, va="bottom")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("all-reduce time (µs)")
    ax.set_title(f"gloo all-reduce, measured on {device}" if device else "all-reduce, measured", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_tp_scaling(tp: int = 8, link_GBps: float = A100_NVLINK.link_GBps, batch: int = 1,
                    context: int = 1024, hw: Hardware = A100_NVLINK, config: ModelConfig = LLAMA2_70B):
    """MODEL of one decode step of a 70B model for tp = 1, 2, 4, 8 at a given link bandwidth.

    Stacked bars: per-rank device time (memory- or compute-bound) and communication;
    the chosen ``tp`` is outlined. Returns the figure.
    """
    degrees = [1, 2, 4, 8]
    if tp not in degrees:
        raise ValueError(f"tp={tp} is not modelled; allowed: {degrees}")
    if link_GBps <= 0:
        raise ValueError(f"link_GBps={link_GBps} must be > 0")
    hw = Hardware(hw.name.split(",")[0] + f", {link_GBps:g} GB/s link", hw.hbm_GBps, hw.peak_TFLOPs,
                  hw.memory_GB, link_GBps, hw.hop_latency_us)
    est = [tp_decode_model(t, hw, config, batch, context) for t in degrees]
    dev = np.array([e.device_s for e in est]) * 1e3
    comm = np.array([e.comm_s for e in est]) * 1e3
    x = np.arange(len(degrees))
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    ax.bar(x, dev, color="tab:blue", label="weights + KV reads (HBM) / compute")
    ax.bar(x, comm, bottom=dev, color="tab:orange", label="all-reduces over the link")
    i = degrees.index(tp)
    ax.bar(x[i], dev[i] + comm[i], fill=False, edgecolor="black", lw=2)
    for j, e in enumerate(est):
        note = f"{e.total_s * 1e3:.1f} ms" + ("" if e.fits else "\n(does not fit)")
        ax.text(x[j], dev[j] + comm[j], note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"tp={t}" for t in degrees])
    ax.set_ylabel("ms per decode step")
    ax.set_ylim(0, (dev + comm).max() * 1.3)
    sp = est[0].total_s / est[i].total_s
    ax.set_title(f"MODEL: Llama-2-70B bf16 decode, batch {batch}, context {context}, {hw.name}\n"
                 f"tp={tp}: {est[i].total_s * 1e3:.1f} ms/step, {sp:.1f}x vs tp=1, "
                 f"communication {100 * est[i].comm_s / est[i].total_s:.0f}%", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_time_per_token(labels: list[str], step_s: list[list[float]], device: str = "",
                        what: str = "SmolLM2-135M decode"):
    """Measured decode time per token: for each configuration the median decode step, with a
    bar from its fastest to its slowest step (``step_s``: each configuration's step times, s).
    ``what`` names the step in the title."""
    med = np.array([np.median(s) for s in step_s]) * 1e3
    lo = np.array([min(s) for s in step_s]) * 1e3
    hi = np.array([max(s) for s in step_s]) * 1e3
    fig, ax = plt.subplots(figsize=(7, 3.0), dpi=80)
    ax.barh(labels, med, xerr=[med - lo, hi - med], capsize=4,
            color=["tab:blue"] * (len(med) - 1) + ["tab:green"])
    for i, v in enumerate(med):
        ax.text(hi[i], i, f" {v:.0f} ms (median of {len(step_s[i])})", va="center", fontsize=8)
    ax.set_xlabel("ms per token (median decode step; bar: fastest to slowest)")
    ax.set_xlim(0, hi.max() * 1.5)
    ax.set_title(f"{what}, measured on {device}" if device else f"{what}, measured", fontsize=9)
    fig.tight_layout()
    return fig


def plot_step_account(labels: list[str], accounts: list, allreduce_us: float | None = None,
                      device: str = "", what: str = "One SmolLM2-135M decode step"):
    """One decode step taken apart, one stacked bar per account (``StepAccount`` from
    :func:`llmlab.parallel.workers.decode_account_on_ranks` or ``mlp_stack_on_ranks``):
    matmuls, the other operators
    (Python, dispatcher, small kernels), and the time inside collectives. With
    ``allreduce_us`` (an isolated all-reduce of one hidden vector), the collective time is
    split into calls × that cost and the rest, spent waiting for the other ranks; without it,
    accounts that clocked the ranks' arrivals (``arrival_wait_s``) split it into the time
    before the last rank arrived and the time after.
    The bars add up to each account's median step; ``what`` names the step in the title.
    Returns the figure."""
    if len(labels) != len(accounts) or not accounts:
        raise ValueError(f"need one label per account; got {len(labels)} labels, "
                         f"{len(accounts)} accounts")
    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(accounts) + 2.2), dpi=80)
    y = np.arange(len(accounts))[::-1]
    arrivals = not allreduce_us and any(getattr(a, "arrival_wait_s", None) for a in accounts)
    parts = []
    for a in accounts:
        coll = a.inside_collectives_s * 1e3
        if allreduce_us:
            own = min(coll, a.collectives * allreduce_us / 1e3)
        elif arrivals:
            own = coll - min(coll, a.arrival_wait_median_s * 1e3)
        else:
            own = coll
        parts.append([a.matmul_s * 1e3, max(a.other_s, 0.0) * 1e3, own, coll - own])
    parts = np.array(parts)
    names = ["matmuls", "other operators, Python, dispatch",
             "collectives: calls × isolated cost" if allreduce_us else
             "collectives: after every rank arrived" if arrivals else "inside collectives",
             "collectives: waiting for the other ranks" if allreduce_us else
             "collectives: before the last rank arrived"]
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:pink"]
    left = np.zeros(len(accounts))
    for j in range(4 if allreduce_us or arrivals else 3):
        ax.barh(y, parts[:, j], left=left, color=colors[j], label=names[j])
        left += parts[:, j]
    for yi, a, total in zip(y, accounts, left):
        ax.text(total, yi, f" {a.median_s * 1e3:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlim(0, left.max() * 1.2)
    ax.set_xlabel("ms per step (median; parts as measured)")
    ax.set_title(f"{what}, taken apart, measured on {device}" if device
                 else f"{what}, taken apart", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)
    fig.tight_layout()
    return fig
