"""Figures for notebook 02: the roofline, KV-cache memory, and the batch × length explorer.

``explore(batch, seq_len, ...)`` is the widget callback of notebook 02: it redraws the
KV-cache memory against sequence length and the roofline point of one decode step for
the chosen batch size and sequence length. Points from the analytic model are drawn on
the roof (attainable performance); measured points carry their measured FLOP/s.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..cache.contiguous import kv_cache_bytes
from ..config import ModelConfig
from ..profiling.flops import weight_bytes
from ..profiling.roofline import Ceilings, RooflinePoint, decode_cost, prefill_cost

_GFLOP = 1e9


def plot_roofline(ceilings: Ceilings, points: list[RooflinePoint] = (), modelled: list = (),
                  ax=None, title: str = "roofline", spreads: list[tuple[float, float]] | None = None):
    """Log-log roofline: the two measured roofs, measured ``points`` (filled) and
    ``modelled`` :class:`~llmlab.profiling.roofline.Cost` items drawn on the roof (hollow).

    ``spreads``: per measured point, the (fastest, slowest) seconds of its runs, drawn as a
    vertical error bar (the point itself is placed at its median)."""
    if spreads is not None and len(spreads) != len(points):
        raise ValueError(f"spreads has {len(spreads)} entries for {len(points)} points")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    xs = [p.intensity for p in points] + [c.intensity for c in modelled] + [ceilings.ridge_point]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.loglog(grid, [ceilings.attainable(i) / _GFLOP for i in grid], "k-", lw=1.5,
              label=f"roof: {ceilings.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
                    f"{ceilings.peak_flops_per_s / _GFLOP:.0f} GFLOP/s")
    ax.axvline(ceilings.ridge_point, color="gray", ls=":", lw=1)
    ax.text(ceilings.ridge_point, ceilings.peak_flops_per_s / _GFLOP * 1.15,
            f"ridge {ceilings.ridge_point:.1f}", fontsize=7, ha="center", color="gray")
    for i, p in enumerate(points):
        y = p.flops_per_s / _GFLOP
        if spreads is None:
            ax.loglog(p.intensity, y, "o", ms=6, label=f"{p.label} (measured)")
        else:
            fast, slow = spreads[i]
            err = [[y - p.cost.flops / slow / _GFLOP], [p.cost.flops / fast / _GFLOP - y]]
            ax.errorbar(p.intensity, y, yerr=err, fmt="o", ms=6, capsize=3,
                        label=f"{p.label} (measured: median, min–max)")
            ax.set_xscale("log")
            ax.set_yscale("log")
    for c in modelled:
        ax.loglog(c.intensity, ceilings.attainable(c.intensity) / _GFLOP, "o", mfc="none", ms=8,
                  mew=1.5, label=f"{c.label} (model)")
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="GFLOP/s", title=title)
    ax.set_ylim(top=ceilings.peak_flops_per_s / _GFLOP * 2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_cache_memory(config: ModelConfig, batches=(1, 8, 32), max_seq: int | None = None,
                      bytes_per_el: int = 4, ax=None, mark: tuple[int, int] | None = None):
    """KV-cache bytes against sequence length, one line per batch size, with the weights
    for scale; ``mark=(batch, seq_len)`` puts a dot on one configuration."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    max_seq = max_seq or config.max_position_embeddings
    seqs = np.linspace(0, max_seq, 65).astype(int)
    for b in batches:
        ax.plot(seqs, [kv_cache_bytes(config, b, int(s), bytes_per_el) / 2**20 for s in seqs],
                label=f"batch {b}")
    ax.axhline(weight_bytes(config, bytes_per_el) / 2**20, color="k", ls="--", lw=1,
               label="weights")
    if mark is not None:
        b, s = mark
        ax.plot([s], [kv_cache_bytes(config, b, s, bytes_per_el) / 2**20], "ko", ms=7)
    ax.set(xlabel="sequence length (tokens)", ylabel="MiB", title="KV cache memory")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return ax


def explore(batch: int, seq_len: int, config: ModelConfig, ceilings: Ceilings,
            bytes_per_el: int = 4, prompt_len: int = 32):
    """The notebook-02 widget: cache memory and the decode step's roofline point for
    ``batch`` sequences of ``seq_len`` tokens. Returns the figure and prints a summary."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive int")
    if not isinstance(seq_len, int) or not 1 <= seq_len <= config.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len!r} must be in 1..{config.max_position_embeddings}")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=80)
    batches = sorted({1, batch, 4 * batch})
    plot_cache_memory(config, batches, max(seq_len * 2, 256), bytes_per_el, a1, (batch, seq_len))
    dec = decode_cost(config, batch, seq_len, bytes_per_el)
    pre = prefill_cost(config, batch, prompt_len, bytes_per_el)
    plot_roofline(ceilings, modelled=[pre, dec], ax=a2, title="roofline (model)")
    bound = "memory" if dec.intensity < ceilings.ridge_point else "compute"
    fig.tight_layout()
    cache = kv_cache_bytes(config, batch, seq_len, bytes_per_el)
    print(f"batch {batch}, {seq_len} tokens: KV cache {cache / 2**20:.1f} MiB; decode step "
          f"{dec.intensity:.2f} FLOP/byte ({bound}-bound, ridge {ceilings.ridge_point:.1f}); "
          f"at best {ceilings.attainable(dec.intensity) / dec.flops * batch:.0f} tokens/s")
    return fig


def matmul_row_times(weight, rows: list[int], repeats: int = 7) -> dict[int, list[float]]:
    """Seconds of ``x @ weight.T`` for ``x`` of each row count (``F.linear``, the call the
    eager model makes), ``repeats`` runs each after a warm-up, row counts interleaved so a
    slow moment lands on all of them. One weight read per call whatever the rows: a flat
    line is a matmul that reuses its weights, a jump is the library changing its method."""
    import torch
    import torch.nn.functional as F

    from ..profiling import time_interleaved

    if not rows or any(not isinstance(r, int) or r < 1 for r in rows):
        raise ValueError(f"rows={rows!r} must be positive ints")
    xs = {r: torch.randn(r, weight.shape[1], dtype=weight.dtype, device=weight.device)
          for r in rows}
    with torch.inference_mode():
        got = time_interleaved({r: (lambda x=xs[r]: F.linear(x, weight)) for r in rows},
                               repeats=repeats, warmup=2, device=weight.device)
    return {r: got[r].times_s for r in rows}


def plot_batch_sweep(step_s: dict[int, list[float]], matmul_s: dict[int, list[float]] | None = None,
                     fit=None, title: str = ""):
    """Left: a decode step's median time against the batch (min–max as a band), with a
    fitted line when ``fit`` (a :class:`llmlab.profiling.Fit`) is given. Right: one
    matrix's time against its rows (``matmul_row_times``), when given."""
    import statistics

    ncols = 2 if matmul_s else 1
    fig, axes = plt.subplots(1, ncols, figsize=(4.6 * ncols, 3.2), dpi=80, squeeze=False)
    for ax, data, ylabel in ((axes[0][0], step_s, "ms per decode step"),
                             *(((axes[0][1], matmul_s, "ms per call"),) if matmul_s else ())):
        xs = sorted(data)
        med = [statistics.median(data[x]) * 1e3 for x in xs]
        ax.plot(xs, med, "o-", ms=4, label="measured (median)")
        ax.fill_between(xs, [min(data[x]) * 1e3 for x in xs], [max(data[x]) * 1e3 for x in xs],
                        alpha=0.25)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch (rows)", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if fit is not None:
        xs = np.array(sorted(x for x in step_s if x >= 2), dtype=float)
        axes[0][0].plot(xs, fit.predict(xs) * 1e3, "--", color="gray",
                        label=f"fit over batch ≥ 2: {fit.a * 1e3:.0f} + {fit.b * 1e3:.1f}·batch ms")
    axes[0][0].legend(fontsize=7)
    axes[0][0].set_title("SmolLM2 decode step", fontsize=9)
    if matmul_s:
        axes[0][1].set_title("the LM head alone (49152 × 576, float32)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
