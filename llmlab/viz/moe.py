"""Figures, timings and the widget callback for notebook 06 (mixture of experts).

``explore_routing`` is the callback of the notebook's widget over the number of experts,
top-k and capacity factor: it routes a synthetic batch through a seeded random router and
shows each expert's load against its capacity, what gets dropped, and the balance loss.
``measure_dispatch`` times the three dispatch strategies (median of several runs after a
warm-up, every run kept so the figure can show the spread); ``compare_dispatch`` compares
two strategies' runs per token count and ``pair_sentence`` writes the notebook's sentence from
those verdicts; ``plot_moe_gpu_model`` draws a roofline model of the GPU case, labelled as a
model.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..layers.moe import route
from ..layers.moe_stats import (ComputeAccount, load_balancing_loss, moe_layer_gpu_model,
                                simulate_capacity)
from ..profiling.hbm import H100, ChipSpec


@dataclass
class RoutingExploration:
    num_experts: int
    top_k: int
    capacity_factor: float
    tokens: int
    capacity: int
    load: list[int]
    drop_fraction: float
    tokens_fully_dropped: int
    balance_loss: float
    active_fraction: float  # k / E of the expert parameters a token uses


def synthetic_routing(tokens: int, num_experts: int, top_k: int, skew: float = 1.0,
                      hidden: int = 64, seed: int = 0):
    """Route ``tokens`` random hidden states with a seeded random router.

    ``skew`` adds a bias favouring low-numbered experts (0: an unbiased router; real
    routers, untrained or trained without a balance loss, are lopsided).
    Returns (router_logits [tokens, E], weights [tokens, k], experts [tokens, k]).
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(num_experts, hidden, generator=g) / hidden ** 0.5
    bias = skew * torch.linspace(1.0, -1.0, num_experts)
    logits = x @ w.t() + bias
    weights, experts = route(logits, top_k)
    return logits, weights, experts


def explore_routing(num_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25,
                    tokens: int = 512, skew: float = 1.0, seed: int = 0, show: bool = True):
    """Widget callback: expert loads vs capacity for one synthetic batch.

    Returns (figure or None, :class:`RoutingExploration`).
    """
    logits, _, experts = synthetic_routing(tokens, num_experts, top_k, skew, seed=seed)
    cap = simulate_capacity(experts, num_experts, capacity_factor)
    stats = RoutingExploration(num_experts, top_k, capacity_factor, tokens, cap.capacity,
                               cap.load.tolist(), cap.drop_fraction, cap.tokens_fully_dropped,
                               load_balancing_loss(logits, experts, alpha=0.01), top_k / num_experts)
    if not show:
        return None, stats
    load = cap.load.numpy()
    kept = np.minimum(load, cap.capacity)
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    idx = np.arange(num_experts)
    ax.bar(idx, kept, color="tab:blue", label="processed")
    ax.bar(idx, load - kept, bottom=kept, color="tab:red", label="dropped (over capacity)")
    ax.axhline(cap.capacity, color="k", ls="--", lw=1, label=f"capacity = {cap.capacity}")
    ax.axhline(tokens * top_k / num_experts, color="gray", ls=":", lw=1, label="perfect balance")
    ax.set(xlabel="expert", ylabel="(token, expert) assignments",
           title=f"E={num_experts}, top-{top_k}, cf={capacity_factor}: dropped "
                 f"{stats.drop_fraction:.0%}, balance loss {stats.balance_loss:.4f} "
                 f"(uniform 0.0100)")
    ax.title.set_fontsize(9)
    if num_experts <= 32:
        ax.set_xticks(idx)
        ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig, stats


def plot_layer_loads(loads: torch.Tensor, title: str = ""):
    """Heatmap of each layer's share of assignments per expert ([layers, experts] counts)."""
    share = (loads.float() / loads.sum(1, keepdim=True)).numpy()
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=80)
    im = ax.imshow(share.T, aspect="auto", cmap="viridis", origin="lower")
    ax.set(xlabel="layer", ylabel="expert", title=title or "share of routed tokens per expert")
    ax.title.set_fontsize(9)
    fig.colorbar(im, ax=ax, label=f"share (uniform = {1 / share.shape[1]:.3f})")
    fig.tight_layout()
    return fig


STRATEGIES = ("dense", "loop", "grouped")
_COLORS = {"dense": "tab:blue", "loop": "tab:orange", "grouped": "tab:green"}


def _summary(times_ms: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of one configuration's runs."""
    t = sorted(times_ms)
    return float(np.median(t)), t[0], t[-1]


def measure_dispatch(tokens: list[int], experts: list[int], fixed_tokens: int = 128,
                     shape: dict | None = None, repeats: int = 5,
                     strategies_by_experts: tuple[str, ...] = ("dense", "grouped"),
                     threads: int | None = 1):
    """Time one MoE layer per dispatch strategy: ``repeats`` timed runs after one warm-up,
    on ``threads`` torch threads (1 by default: steadier on a shared machine; None keeps
    torch's setting).

    Returns (token_rows, expert_rows). A token row is {"tokens", "<strategy> ms": [runs]} for
    8 experts, top-2 and each token count; an expert row is {"experts", "tokens",
    "<strategy> µs/token": [runs]} for ``fixed_tokens`` tokens, top-2 and each expert count.
    ``shape`` is {"hidden", "inter"} (default: Mixtral 8x7B's layer scaled down 8×).
    """
    from ..bench.moe import CPU_SHAPE

    if repeats < 5:
        raise ValueError(f"repeats={repeats}: a median needs at least 5 runs")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r} must be a positive int or None")
    shape = dict(CPU_SHAPE if shape is None else shape)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(tokens, experts, fixed_tokens, shape, repeats, strategies_by_experts)
    finally:
        torch.set_num_threads(before)


def _measure(tokens, experts, fixed_tokens, shape, repeats, strategies_by_experts):
    from ..bench.moe import MoELayerCase, make_layer
    from ..profiling import time_fn

    def runs(layer, x, name):
        layer.dispatch = name
        with torch.inference_mode():
            return time_fn(lambda: layer(x), repeats=repeats, warmup=1, device=x.device).times_s

    token_rows = []
    for n in tokens:
        layer, x = make_layer(MoELayerCase(n, **shape))
        token_rows.append({"tokens": n, **{f"{name} ms": [t * 1e3 for t in runs(layer, x, name)]
                                          for name in STRATEGIES}})
    expert_rows = []
    for e in experts:
        layer, x = make_layer(MoELayerCase(fixed_tokens, experts=e, **shape))
        expert_rows.append({"experts": e, "tokens": fixed_tokens,
                            **{f"{name} µs/token": [t * 1e6 / fixed_tokens for t in runs(layer, x, name)]
                               for name in strategies_by_experts}})
    return token_rows, expert_rows


def median_of(row: dict, key: str) -> float:
    """The median of one row's runs, e.g. ``median_of(row, "dense ms")``."""
    return _summary(row[key])[0]


def compare_dispatch(token_rows: list[dict], baseline: str, candidate: str = "grouped"):
    """One :func:`llmlab.profiling.compare` per token row: ``baseline``'s runs against
    ``candidate``'s (ratio of medians above 1: the candidate is faster)."""
    from ..profiling import compare

    return [compare(r[f"{baseline} ms"], r[f"{candidate} ms"], baseline, candidate)
            for r in token_rows]


def pair_sentence(tokens: list[int], comparisons: list) -> str:
    """The notebook's sentence on two dispatch strategies, written from each comparison's
    verdict: the sizes where the candidate is faster, where the baseline is, and the ties,
    each with its ratio and interval. A tie is written as a tie."""
    if len(tokens) != len(comparisons) or not tokens:
        raise ValueError(f"need one comparison per token count, got {len(tokens)} token counts "
                         f"and {len(comparisons)} comparisons")

    def sizes(cs):
        return ", ".join(f"{n} token{'s' if n != 1 else ''} ({text})" for n, text in cs)

    first = comparisons[0]
    base, cand = first.baseline, first.candidate
    faster = [(n, c.interval()) for n, c in zip(tokens, comparisons) if c.verdict == "faster"]
    slower = [(n, f"{1 / c.ratio:.2f}× [{1 / c.hi:.2f}–{1 / c.lo:.2f}]")
              for n, c in zip(tokens, comparisons) if c.verdict == "slower"]
    ties = [(n, c.interval()) for n, c in zip(tokens, comparisons) if not c.resolved]
    parts = []
    if faster:
        parts.append(f"{cand} is faster than {base} at {sizes(faster)}")
    if slower:
        parts.append(f"{base} is faster than {cand} at {sizes(slower)}")
    if ties:
        where = "at any size measured: " if not (faster or slower) else "at "
        parts.append(f"{base} and {cand} do not differ at this noise {where}{sizes(ties)}")
    return "; ".join(parts)


def _errorbar(ax, xs, rows, key, name):
    med, lo, hi = zip(*(_summary(r[key]) for r in rows))
    med, lo, hi = np.array(med), np.array(lo), np.array(hi)
    ax.errorbar(xs, med, yerr=[med - lo, hi - med], fmt="o-", capsize=3, label=name,
                color=_COLORS[name])


def plot_dispatch_times(token_rows: list[dict], expert_rows: list[dict], title: str = ""):
    """Left: ms per layer call vs tokens per strategy; right: µs/token vs experts.
    Points are medians, bars span the fastest to the slowest run."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.5, 3.4), dpi=80)
    toks = [r["tokens"] for r in token_rows]
    for name in STRATEGIES:
        if f"{name} ms" in token_rows[0]:
            _errorbar(a1, toks, token_rows, f"{name} ms", name)
    a1.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms per MoE layer (median)",
           title="one MoE layer, 8 experts, top-2")
    ex = [r["experts"] for r in expert_rows]
    for name in STRATEGIES:
        if f"{name} µs/token" in expert_rows[0]:
            _errorbar(a2, ex, expert_rows, f"{name} µs/token", name)
    a2.set_xscale("log", base=2)
    a2.set_ylim(bottom=0)
    a2.set(xlabel="experts (top-2)", ylabel="µs per token (median)",
           title=f"more experts, same top-2 ({expert_rows[0]['tokens']} tokens)")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
        a.title.set_fontsize(9)
    if title:
        fig.suptitle(title + " (bars: fastest to slowest run)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_moe_gpu_model(tokens: list[int] | None = None, chip: ChipSpec = H100, **shape):
    """MODEL, not a measurement: one Mixtral-shaped MoE layer on ``chip`` in bfloat16, dense
    against grouped dispatch, from :func:`llmlab.layers.moe_stats.moe_layer_gpu_model`.
    Returns (figure, estimates)."""
    tokens = tokens or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    est = [moe_layer_gpu_model(n, chip=chip, **shape) for n in tokens]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.5, 3.4), dpi=80)
    a1.loglog(tokens, [e.dense_s * 1e3 for e in est], "o-", color=_COLORS["dense"], label="dense")
    a1.loglog(tokens, [e.grouped_s * 1e3 for e in est], "o-", color=_COLORS["grouped"],
              label="grouped (ideal kernel)")
    a1.set(xlabel="tokens in the batch", ylabel="ms per MoE layer (model)")
    a2.semilogx(tokens, [e.dense_over_grouped for e in est], "o-", color="k")
    a2.set_ylim(0, max(e.dense_over_grouped for e in est) * 1.2)
    a2.set(xlabel="tokens in the batch", ylabel="dense time / grouped time (model)")
    a2.twinx().semilogx(tokens, [e.experts_touched for e in est], ":", color="tab:red")
    fig.axes[-1].set_ylabel("experts touched by grouped", color="tab:red", fontsize=8)
    fig.axes[-1].set_ylim(0, None)
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle(f"MODEL (roofline, not measured): Mixtral 8x7B MoE layer, bf16, {chip.name} "
                 f"({chip.peak_bf16_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e12:.2f} TB/s)",
                 fontsize=9)
    fig.tight_layout()
    return fig, est


def plot_compute_accounts(accounts: list[ComputeAccount]):
    """Total vs active parameters (log scale) for each model."""
    fig, ax = plt.subplots(figsize=(7, 3.0), dpi=80)
    idx = np.arange(len(accounts))
    ax.bar(idx - 0.2, [a.total_params for a in accounts], 0.4, label="total (reachable)")
    ax.bar(idx + 0.2, [a.active_params for a in accounts], 0.4, label="active per token")
    ax.set_yscale("log")
    ax.set_xticks(idx)
    ax.set_xticklabels([a.name for a in accounts], fontsize=8)
    ax.set_ylabel("parameters")
    for i, a in enumerate(accounts):
        ax.text(i, a.total_params * 1.3, f"{a.active_fraction:.0%} active", ha="center", fontsize=8)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(top=max(a.total_params for a in accounts) * 8)
    fig.tight_layout()
    return fig


@dataclass
class GemmTileExploration:
    """What the grouped-GEMM tile explorer drew."""

    block_m: int
    block_n: int
    block_k: int
    rows: int                    # (token, expert) rows of the routed batch
    padded_rows: int             # rows the BLOCK_M tiles cover: each expert's group rounded up
    measured_s: float | None     # median of the timed runs
    measured_spread: tuple[float, float] | None
    measured_what: str
    build: object = None         # report.Build for the chip, or a str: why there is none
    figure: object = None


def _time_grouped_gemm(x, w, offsets, block_m, block_n, block_k):
    """(median s, (min s, max s), what ran) of the Triton grouped GEMM with this tile:
    compiled on a GPU, interpreted on a CPU (median of 5 after a warm-up)."""
    from ..device import has_triton
    from ..profiling import time_fn
    if not has_triton():
        return None, None, "not measured: Triton is not installed here"
    from ..kernels.moe_gemm import grouped_gemm_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x, w, offsets = x.to(dev, dtype), w.to(dev, dtype), offsets.to(dev)
    r = time_fn(lambda: grouped_gemm_triton(x, w, offsets, None, block_m, block_n, block_k),
                repeats=5, warmup=1, device=dev)
    what = ("compiled kernel, bf16" if dev == "cuda" else
            "Triton interpreter on CPU (NumPy running each program: not a GPU's speed)")
    return r.median_s, (min(r.times_s), max(r.times_s)), what


def gemm_tile_explorer(block_m: int = 32, block_n: int = 64, block_k: int = 32,
                       chip: str = "H100", tokens: int = 32, num_experts: int = 8,
                       top_k: int = 2, hidden: int = 64, out_features: int = 128,
                       measure: bool = True) -> GemmTileExploration:
    """Widget callback for the grouped GEMM's tile: what the compiler made of it for
    ``chip`` (bfloat16, 4 warps, 3 stages as the kernel is launched; from the committed
    table of :func:`llmlab.kernels.report.lookup`: compiled on a CPU, not run), the rows
    its BLOCK_M tiles compute against the routed rows (each expert's group is rounded up to
    whole tiles), and the kernel timed with this tile on ``tokens`` routed tokens."""
    from .flash import compiled_build, draw_build
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b!r} must be a power of two >= 16 (16, 32, 64, ...)")
    _, _, experts = synthetic_routing(tokens, num_experts, top_k, skew=1.0, hidden=hidden)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    padded = int(sum(-(-int(c) // block_m) * block_m for c in counts))
    built = compiled_build("moe", chip, "bf16", block_m=block_m, block_n=block_n, block_k=block_k)
    med = spread = None
    what = "not measured"
    if measure:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(int(offsets[-1]), hidden, generator=g)
        w = torch.randn(num_experts, out_features, hidden, generator=g) / hidden ** 0.5
        med, spread, what = _time_grouped_gemm(x, w, offsets, block_m, block_n, block_k)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.2), dpi=80,
                                  gridspec_kw={"width_ratios": [1.15, 0.8, 0.8]})
    draw_build(a, built, chip)
    rows = int(offsets[-1])
    b.bar(["routed rows", "tile rows"], [rows, padded], color=["#4c72b0", "#dd8452"])
    b.set_title(f"BLOCK_M={block_m}: {padded / rows:.2f}× the rows computed\n"
                f"({tokens} tokens, top-{top_k} of {num_experts} experts)", fontsize=8)
    b.tick_params(labelsize=7)
    if med is None:
        c.set_axis_off()
        c.set_title(what, fontsize=8)
    else:
        c.bar(["grouped GEMM"], [med * 1e3], yerr=[[(med - spread[0]) * 1e3],
                                                   [(spread[1] - med) * 1e3]],
              capsize=4, color="#55a868", width=0.5)
        c.set_ylabel("ms (median; bar: min–max)", fontsize=8)
        c.set_title(f"measured: {med * 1e3:.1f} ms\n{rows} rows, K={hidden} -> N={out_features}, "
                    f"{num_experts} experts", fontsize=8)
        c.set_xlabel(textwrap.fill(what, 34), fontsize=7)
    fig.tight_layout()
    return GemmTileExploration(block_m, block_n, block_k, rows, padded, med, spread, what,
                               built, fig)
