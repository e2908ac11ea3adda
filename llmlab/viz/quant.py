"""Figures and the widget callback for notebook 08 (quantization).

``explore_bits_group(grid, bits, group_size, bandwidth)`` is the callback of the notebook's
widget over bits × group size: from a precomputed grid (:func:`llmlab.quant.eval.sweep_bits_group`)
it reports the chosen format's weight bytes, KLD against float32, and the decode tokens/s
the memory roof allows (bandwidth / bytes: a model, labelled as one), and draws all three
against bits with the choice highlighted. ``plot_q4_1_block`` draws one Q4_1 block;
``plot_scheme_roofline`` places measured decode and prefill of each scheme on a roofline.
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch


@dataclass
class BitsGroupChoice:
    bits: int
    group_size: int | None
    weight_bytes: float
    kld: float
    top1: float
    modelled_tok_s: float
    figure: object = None


def explore_bits_group(grid: dict, bits: int, group_size: int | None, bandwidth: float,
                       draw: bool = True) -> BitsGroupChoice:
    """The chosen (bits, group_size) from ``grid`` ({(bits, group): {"kld", "top1", "bytes"}}),
    with a three-panel figure: weight MB, KLD (log) and the modelled decode tokens/s."""
    if (bits, group_size) not in grid:
        raise ValueError(f"(bits={bits}, group_size={group_size}) is not in the grid; "
                         f"allowed: {sorted(grid, key=lambda k: (k[0], k[1] or 10**9))}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth={bandwidth!r} must be positive (bytes/s)")
    cell = grid[(bits, group_size)]
    choice = BitsGroupChoice(bits, group_size, cell["bytes"], cell["kld"], cell["top1"],
                             bandwidth / cell["bytes"])
    if not draw:
        return choice
    all_bits = sorted({b for b, _ in grid})
    groups = sorted({g for _, g in grid}, key=lambda g: g or 10**9)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), dpi=80)
    for g in groups:
        label = "one per row" if g is None else f"group {g}"
        bs = [b for b in all_bits if (b, g) in grid]
        axes[0].plot(bs, [grid[(b, g)]["bytes"] / 1e6 for b in bs], "o-", label=label)
        axes[1].plot(bs, [max(grid[(b, g)]["kld"], 1e-7) for b in bs], "o-", label=label)
        axes[2].plot(bs, [bandwidth / grid[(b, g)]["bytes"] for b in bs], "o-", label=label)
    values = (cell["bytes"] / 1e6, max(cell["kld"], 1e-7), choice.modelled_tok_s)
    for ax, v in zip(axes, values):
        ax.plot([bits], [v], "o", ms=14, mfc="none", mec="k", mew=2)
        ax.set_xlabel("bits per weight (codes)")
        ax.set_xticks(all_bits)
    axes[0].set_ylabel("weight MB")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("KLD vs fp32 (nats/token)")
    axes[2].set_ylabel("decode tok/s at the memory roof (model)")
    axes[0].legend(fontsize=7)
    g = "per row" if group_size is None else f"groups of {group_size}"
    fig.suptitle(f"{bits}-bit, {g}: {cell['bytes'] / 1e6:.0f} MB, KLD {cell['kld']:.2e}, "
                 f"top-1 {cell['top1']:.1%}, ≤ {choice.modelled_tok_s:.0f} tok/s (model)", fontsize=10)
    fig.tight_layout()
    choice.figure = fig
    return choice


def plot_q4_1_block(w_block: torch.Tensor, ax=None):
    """One Q4_1 block of 32 weights: the values, the 16 levels m + q·d, and each weight's code."""
    from ..quant.formats import q4_1_dequantize, q4_1_quantize

    if w_block.numel() != 32:
        raise ValueError(f"a Q4_1 block has 32 weights; got {w_block.numel()}")
    b = q4_1_quantize(w_block.reshape(1, 32).float())
    d, m = b.d.float().item(), b.m.float().item()
    codes = b.codes()[0]
    back = q4_1_dequantize(b)[0]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2), dpi=80)
    for q in range(16):
        ax.axhline(m + q * d, color="0.85", lw=0.8, zorder=0)
    x = np.arange(32)
    ax.plot(x, w_block.reshape(32).float().numpy(), "o", label="weight", zorder=2)
    ax.plot(x, back.numpy(), "_", ms=12, mew=2, color="C3", label="m + q·d", zorder=3)
    for i in range(32):
        ax.annotate(str(int(codes[i])), (i, back[i].item()), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xlabel("position in the block (input dimension)")
    ax.set_ylabel("value")
    ax.set_title(f"one Q4_1 block: d = {d:.3g}, m = {m:.3g} (float16); 16 levels, codes above",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return ax


def plot_scheme_roofline(rows: list[dict], bandwidth: float, peak_flops: float, ax=None):
    """Measured points per scheme on a roofline: x = FLOPs per weight byte, y = FLOP/s.

    rows: {"scheme", "params", "bytes", "decode_tok_s", "prefill_tok_s", "prefill_tokens",
    "decode_spread": (lo, hi), "prefill_spread": (lo, hi)} with tokens/s medians and their
    min-max. A token costs 2 FLOPs per parameter; decode reads every weight byte once per
    token, prefill once per prompt.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4), dpi=80)
    xs = np.logspace(-1, 3.5, 100)
    ax.plot(xs, np.minimum(peak_flops, bandwidth * xs), "k-", lw=1.5, label="measured roofs")
    for i, r in enumerate(rows):
        flops_tok = 2 * r["params"]
        for kind, marker in (("decode", "o"), ("prefill", "s")):
            tps = r[f"{kind}_tok_s"]
            per_bytes = 1 if kind == "decode" else r["prefill_tokens"]
            x = flops_tok * per_bytes / r["bytes"]
            lo, hi = r.get(f"{kind}_spread", (tps, tps))
            ax.errorbar([x], [tps * flops_tok], yerr=[[tps * flops_tok - lo * flops_tok],
                                                        [hi * flops_tok - tps * flops_tok]],
                        fmt=marker, color=f"C{i}", ms=7, capsize=3,
                        label=f"{r['scheme']} {kind}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per weight byte read")
    ax.set_ylabel("FLOP/s")
    ax.legend(fontsize=7, ncol=2)
    return ax


def plot_step_breakdown(rows: list[dict], llama_cpp_ms: float | None = None, ax=None):
    """One horizontal bar per scheme: a batch-1 decode step split into the time outside the
    matmuls and the matmuls' time, with the matmuls' memory roof (weight bytes / copy
    bandwidth) marked; ``llama_cpp_ms``: llama.cpp's whole step on the same machine, a line.

    rows: :func:`llmlab.bench.quant.step_breakdown`'s ({"scheme", "step ms",
    "outside matmuls ms", "matmuls ms", "roof ms"}).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 2.2), dpi=80)
    names = [r["scheme"] for r in rows]
    y = np.arange(len(rows))[::-1]
    rest = np.array([r["outside matmuls ms"] for r in rows])
    mm = np.array([r["matmuls ms"] for r in rows])
    ax.barh(y, rest, color="0.7", label="outside the matmuls (Python, small ops, attention)")
    ax.barh(y, mm, left=rest, color="C0", label="matmuls (weights read)")
    for yi, r, roof in zip(y, rest, [r["roof ms"] for r in rows]):
        ax.plot([r + roof] * 2, [yi - 0.4, yi + 0.4], "k-", lw=2)
    ax.plot([], [], "k-", lw=2, label="matmuls at copy bandwidth (memory roof)")
    if llama_cpp_ms is not None:
        ax.axvline(llama_cpp_ms, color="C3", ls="--", label="llama.cpp Q4_1, whole step")
    ax.set_yticks(y, names)
    ax.set_xlabel("milliseconds per decode step (batch 1)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    ax.figure.tight_layout()
    return ax
