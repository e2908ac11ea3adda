"""Figures and the block-size explorer of notebook 03 (FlashAttention).

Each function returns a matplotlib figure (and the numbers it drew), so the notebook
widgets are thin wrappers and the tests can check what is plotted. Figures of the HBM
model and of the GPU say so in their titles: they are models, not measurements.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ..attention.flash import (CAUSAL_SKIPPED, FULL_BLOCK, MASKED_BLOCK, block_schedule)
from ..profiling.flops import attention_flops
from ..profiling.hbm import (ChipSpec, chip as chip_preset,
                             roofline_seconds, standard_attention_hbm, tile_footprint,
                             tiled_attention_hbm, tiled_attention_hbm_for_sram)

FIGSIZE, DPI = (7, 3.5), 80
_STATE_COLORS = {CAUSAL_SKIPPED: "#eeeeee", FULL_BLOCK: "#4c72b0", MASKED_BLOCK: "#dd8452"}


def _as_chip(spec: str | ChipSpec) -> ChipSpec:
    return spec if isinstance(spec, ChipSpec) else chip_preset(spec)


def plot_block_schedule(seq_q: int, seq_k: int, block_q: int, block_k: int,
                        causal: bool = True, ax=None):
    """Tiles of the (seq_q × seq_k) score matrix the tiled loop visits, with the causal
    boundary drawn; returns (figure, schedule [n_q_blocks, n_k_blocks])."""
    grid = block_schedule(seq_q, seq_k, block_q, block_k, causal)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.6, 3.5), dpi=DPI)
    cmap = ListedColormap([_STATE_COLORS[s] for s in (CAUSAL_SKIPPED, FULL_BLOCK, MASKED_BLOCK)])
    cells = np.repeat(np.repeat(grid.numpy(), block_q, 0), block_k, 1)[:seq_q, :seq_k]
    ax.imshow(cells, cmap=cmap, vmin=0, vmax=2, extent=(0, seq_k, seq_q, 0),
              interpolation="nearest")
    for y in range(0, seq_q + 1, block_q):
        ax.axhline(min(y, seq_q), color="white", lw=1.2)
    for x in range(0, seq_k + 1, block_k):
        ax.axvline(min(x, seq_k), color="white", lw=1.2)
    if causal:  # keys j <= i + seq_k - seq_q are visible
        off = seq_k - seq_q
        i = np.array([0, seq_q])
        ax.plot(np.clip(i + off + 1, 0, seq_k), i, color="black", lw=1.2, ls="--")
    # the ticks count positions; the white grid lines mark the blocks
    ax.set_xlabel(f"key position j (grid: blocks of Bc={block_k})")
    ax.set_ylabel(f"query position i (grid: Br={block_q})")
    counts = {s: int((grid == s).sum()) for s in _STATE_COLORS}
    ax.set_title(f"Br={block_q}, Bc={block_k}: {counts[FULL_BLOCK]} full, "
                 f"{counts[MASKED_BLOCK]} masked, {counts[CAUSAL_SKIPPED]} skipped", fontsize=9)
    ax.legend(handles=[Patch(color=_STATE_COLORS[FULL_BLOCK], label="computed"),
                       Patch(color=_STATE_COLORS[MASKED_BLOCK], label="computed + mask"),
                       Patch(color=_STATE_COLORS[CAUSAL_SKIPPED], label="skipped")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if fig is not None:
        fig.tight_layout()
    return (fig or ax.figure), grid


def plot_peak_memory(ns: list[int], series: dict[str, list[float]],
                     modelled_from: int | None = None,
                     title: str = "peak memory of one attention call"):
    """Peak bytes against N on log-log axes, one line per backend; points at N >=
    ``modelled_from`` are drawn hollow (analytic, not measured)."""
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for name, ys in series.items():
        ys = np.asarray(ys, dtype=float)
        x = np.asarray(ns)
        line, = ax.plot(x, ys / 2**20, marker="o", label=name)
        if modelled_from is not None:
            m = x >= modelled_from
            ax.plot(x[m], ys[m] / 2**20, marker="o", ls="none", mfc="white",
                    color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MiB")
    hollow = "" if modelled_from is None else f" (hollow: modelled, N ≥ {modelled_from})"
    ax.set_title(title + hollow,
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_traffic_model(ns: list[int], d: int = 64, block_q: int = 128, block_k: int = 64,
                       causal: bool = False, spec: str | ChipSpec = "H100", bytes_per_el: int = 2):
    """Modelled HBM bytes (and time at the chip's HBM bandwidth) for standard and tiled
    attention against N, one head; returns (figure, {name: bytes list})."""
    spec = _as_chip(spec)
    std = [standard_attention_hbm(n, d, bytes_per_el=bytes_per_el).total for n in ns]
    tiled = [tiled_attention_hbm(n, d, block_q, block_k, causal=causal,
                                 bytes_per_el=bytes_per_el).total for n in ns]
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.plot(ns, np.array(std) / 2**20, marker="o", label="standard: Θ(Nd + N²)")
    ax.plot(ns, np.array(tiled) / 2**20, marker="o",
            label=f"tiled Br={block_q}, Bc={block_k}: Θ(N²d/Br)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(f"HBM MiB per head (d={d}, {8 * bytes_per_el}-bit)")
    sec = ax.secondary_yaxis("right", functions=(lambda mib: mib * 2**20 / spec.hbm_bandwidth * 1e6,
                                                 lambda us: us * 1e-6 * spec.hbm_bandwidth / 2**20))
    sec.set_ylabel(f"µs at {spec.hbm_bandwidth / 1e12:.2f} TB/s ({spec.name})")
    ax.set_title("modelled HBM traffic of one attention head (a model, not a measurement)",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, {"standard": std, "tiled": tiled}


def plot_times(ns: list[int], times: dict[str, list[list[float]]],
               title: str = "time of one attention call"):
    """Median time against N, one line per backend, with the min–max spread of the runs as
    error bars; ``times[name][i]`` holds the seconds of every timed run at ``ns[i]``.
    Returns (figure, {name: medians in seconds})."""
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    medians = {}
    for name, runs in times.items():
        med = np.array([np.median(r) for r in runs])
        lo = med - np.array([np.min(r) for r in runs])
        hi = np.array([np.max(r) for r in runs]) - med
        ax.errorbar(ns, med * 1e3, yerr=[lo * 1e3, hi * 1e3], marker="o", capsize=3, label=name)
        medians[name] = med.tolist()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("ms (median; bars: min–max)")
    n_runs = min(len(r) for runs in times.values() for r in runs)
    ax.set_title(f"{title} (median of {n_runs} runs after a warm-up)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, medians


def plot_traffic_vs_sram(n: int, d: int, sram_kib: list[int],
                         fa2_block_q: tuple[int, ...] = (64, 128),
                         bytes_per_el: int = 2):
    """Modelled HBM bytes of one head against the on-chip memory M: standard attention,
    FlashAttention-1 with the paper's block sizes for M (Θ(N²d²/M), falling), and the
    FlashAttention-2 loop order at fixed Br (Θ(N²d/Br), set by registers and occupancy,
    not by M). Returns (figure, {name: bytes list})."""
    std = standard_attention_hbm(n, d, bytes_per_el=bytes_per_el).total
    fa1 = [tiled_attention_hbm_for_sram(n, d, kib * 1024, bytes_per_el=bytes_per_el).total
           for kib in sram_kib]
    data = {"standard": [std] * len(sram_kib), "FlashAttention-1": fa1}
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.plot(sram_kib, np.array(data["standard"]) / 2**20, color="#c44e52",
            label="standard: Θ(Nd + N²)")
    ax.plot(sram_kib, np.array(fa1) / 2**20, marker="o", color="#4c72b0",
            label="FlashAttention-1, Bc = ⌈M/4d⌉: Θ(N²d²/M)")
    for br, ls in zip(fa2_block_q, ("--", ":", "-.")):
        t = tiled_attention_hbm(n, d, br, 64, bytes_per_el=bytes_per_el).total
        data[f"FlashAttention-2 Br={br}"] = [t] * len(sram_kib)
        ax.plot(sram_kib, np.array(data[f"FlashAttention-2 Br={br}"]) / 2**20, ls=ls,
                color="#55a868",
                label=f"FlashAttention-2 order, Br={br}: Θ(N²d/Br), M-independent")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("on-chip memory M per thread block (KiB)")
    ax.set_ylabel(f"HBM MiB, one head (N={n}, d={d})")
    ax.set_title("modelled HBM traffic against SRAM size (a model, not a measurement)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, data


def gpu_attention_model(ns: list[int], d: int = 64, heads: int = 32, batch: int = 1,
                        block_q: int = 128, block_k: int = 64, causal: bool = True,
                        spec: str | ChipSpec = "H100") -> dict[str, list[float]]:
    """Roofline lower bounds (seconds) of one attention layer on a GPU, from the chip's
    datasheet figures: max(HBM bytes / bandwidth, FLOPs / peak bf16) for standard attention
    (the N×N scores through HBM) and for the FlashAttention-2 loop order. A model: real
    kernels reach a fraction of either peak."""
    spec = _as_chip(spec)
    out = {"standard": [], "flash": [], "flops": []}
    for n in ns:
        flops = attention_flops(batch, heads, n, n, d, causal=causal)
        std = standard_attention_hbm(n, d, batch=batch, heads=heads)
        fl = tiled_attention_hbm(n, d, block_q, block_k, causal=causal, batch=batch, heads=heads)
        out["standard"].append(roofline_seconds(std, flops, spec))
        out["flash"].append(roofline_seconds(fl, flops, spec))
        out["flops"].append(flops)
    return out


def plot_gpu_model(ns: list[int], d: int = 64, heads: int = 32, batch: int = 1,
                   block_q: int = 128, block_k: int = 64, causal: bool = True,
                   spec: str | ChipSpec = "H100"):
    """Plot :func:`gpu_attention_model`: modelled time of standard attention and of
    FlashAttention-2 on ``spec``, labelled as a model. Returns (figure, the model's dict)."""
    spec = _as_chip(spec)
    m = gpu_attention_model(ns, d, heads, batch, block_q, block_k, causal, spec)
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.plot(ns, np.array(m["standard"]) * 1e6, marker="o", color="#c44e52",
            label="standard attention (S and P through HBM)")
    ax.plot(ns, np.array(m["flash"]) * 1e6, marker="o", color="#4c72b0",
            label=f"FlashAttention-2 order, Br={block_q}, Bc={block_k}")
    ax.plot(ns, np.array(m["flops"]) / spec.peak_bf16_flops * 1e6, ls=":", color="gray",
            label=f"FLOPs alone at {spec.peak_bf16_flops / 1e12:.0f} TFLOP/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("µs per layer (roofline lower bound)")
    ax.set_title(f"MODEL, not measured: {spec.name} datasheet figures, bf16, batch {batch}, "
                 f"{heads} heads × d={d}{', causal' if causal else ''}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, m


# -- what the compiler made of a tile (notebooks 03, 04, 06) ------------------------------

def compiled_build(kernel: str, chip: str = "H100", dtype: str = "bf16", **tile):
    """The committed ahead-of-time build of one widget tile for ``chip`` (A100, H100, H200),
    as :func:`llmlab.kernels.report.lookup`; a str saying why where the table lacks it."""
    from ..kernels import report
    try:
        return report.lookup(kernel, chip, dtype, **tile)
    except (report.MissingBuild, FileNotFoundError) as exc:
        return f"not in the table of builds: {exc}"


def draw_build(ax, build, chip: str = "H100") -> None:
    """One panel: registers of the 255 a thread may hold, shared memory of the per-block
    limit and theoretical occupancy as bars, with spills, tensor-core instructions and the
    occupancy limiter written out. ``build`` is a report.Build or a str (why there is none)."""
    from ..kernels.report import ARCHS, CHIP_ARCH
    arch = CHIP_ARCH.get(chip, chip)
    head = f"compiled for {chip} ({arch}) on this CPU machine"
    if isinstance(build, str):
        ax.set_axis_off()
        ax.set_title(f"{head}, not run", fontsize=8)
        ax.text(0, 0.5, textwrap.fill(build, 50), fontsize=7, va="center", transform=ax.transAxes)
        return
    lim = ARCHS[build.arch]
    rows = [("regs/thread", build.registers / lim.max_registers_per_thread,
             f"{build.registers} of {lim.max_registers_per_thread}"),
            ("smem/block", build.shared_bytes / lim.shared_per_block,
             f"{build.shared_bytes / 1024:.0f} of {lim.shared_per_block // 1024} KiB"),
            ("occupancy", build.occupancy,
             f"{build.occupancy:.0%}: {build.blocks_per_sm} block(s)/SM, "
             f"{build.occupancy_limiter}")]
    ys = np.arange(len(rows))[::-1]
    fracs = [min(r[1], 1.0) for r in rows]
    # red: registers or shared memory at (or within 5% of) the limit
    colors = ["#c44e52" if r[1] >= 0.95 and i < 2 else "#4c72b0" for i, r in enumerate(rows)]
    ax.barh(ys, fracs, color=colors, height=0.6)
    for y, (_, frac, text) in zip(ys, rows):   # inside a long bar, after a short one
        inside = min(frac, 1) > 0.55
        ax.text(0.02 if inside else frac + 0.02, y, text + ("  (OVER)" if frac > 1 else ""),
                va="center", fontsize=7, color="white" if inside else "black")
    ax.set_yticks(ys, [r[0] for r in rows], fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xticks([0, 0.5, 1], ["0", "50%", "limit"], fontsize=7)
    spill = (f"SPILLS {build.spill_bytes} B/thread to local memory" if build.spills
             else "no spills")
    tc = ", ".join(f"{k} {v}" for k, v in build.tensor_core_ops.items()) or "none"
    ax.set_xlabel(f"{spill}; tensor-core instructions: {tc}", fontsize=7,
                  color="#c44e52" if build.spills else "black")
    ax.set_title(f"{head},\nnot run: {build.dtype} {build.config}", fontsize=8)


@dataclass
class ExplorerResult:
    """What the block-size explorer drew."""

    block_q: int
    block_k: int
    head_dim: int
    n: int
    footprint_bytes: int
    smem_bytes: int
    fits: bool
    standard_bytes: int
    tiled_bytes: int
    measured_n: int | None
    measured_s: float | None           # median of the timed runs
    measured_what: str
    measured_spread: tuple[float, float] | None = None   # (min, max) of the timed runs
    figure: object = None
    num_warps: int = 4
    build: object = None               # report.Build for the chip, or a str: why there is none


def _measure_kernel(n: int, block_q: int, block_k: int, head_dim: int, num_warps: int = 4
                    ) -> tuple[float | None, tuple[float, float] | None, str]:
    """Time the Triton kernel (median of 5 runs after a warm-up, and the min–max spread):
    compiled on a GPU, interpreted on CPU. Returns (median s, (min s, max s), what ran)."""
    from ..device import has_triton
    from ..profiling import time_fn

    if not has_triton():
        return None, None, "not measured: Triton is not installed here"
    from ..kernels.flash_attn import flash_attn_func

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, head_dim, generator=g).to(dev, dtype) for _ in range(3))

    def run():
        return flash_attn_func(q, k, v, causal=True, block_m=block_q, block_n=block_k,
                               num_warps=num_warps if dev == "cuda" else None)

    if dev == "cuda":
        try:
            r = time_fn(run, repeats=10, warmup=2, device=dev)
        except Exception as exc:  # e.g. triton's OutOfResources: the tile does not fit
            return None, None, f"did not run: {type(exc).__name__}"
        return r.median_s, (min(r.times_s), max(r.times_s)), "compiled kernel, bf16"
    r = time_fn(run, repeats=5, warmup=1, device=dev)
    return (r.median_s, (min(r.times_s), max(r.times_s)),
            "Triton interpreter on CPU (NumPy running each program: not a GPU's speed)")


def _draw_footprint(ax, fp, spec: ChipSpec, block_q: int, block_k: int, head_dim: int) -> None:
    parts = [("Q", fp.q), ("K+V", fp.kv), ("scores fp32", fp.scores), ("acc fp32", fp.acc),
             ("m, l", fp.stats)]
    bottom = 0
    for label, b in parts:
        ax.bar([0], [b / 1024], bottom=bottom / 1024, label=label, width=0.5)
        bottom += b
    ax.axhline(spec.smem_per_sm / 1024, color="red", ls="--",
               label=f"{spec.name} smem/SM {spec.smem_per_sm // 1024} KiB")
    ax.set_xticks([])
    ax.set_xlim(-0.4, 2.6)
    ax.set_ylabel("KiB on chip")
    ax.set_title(f"tile {block_q}×{block_k}, d={head_dim}: {fp.total / 1024:.0f} KiB "
                 f"({'fits' if fp.fits(spec) else 'does NOT fit'})", fontsize=9)
    ax.legend(fontsize=6, loc="center right")


def _draw_traffic(ax, n: int, std: int, tiled: int, spec: ChipSpec) -> None:
    ax.bar(["standard", "tiled"], [std / 2**20, tiled / 2**20], color=["#c44e52", "#4c72b0"])
    ax.set_ylabel("HBM MiB (one head, bf16)")
    ax.set_title(f"modelled traffic, N={n}, causal: tiled/standard = {tiled / std:.2f}",
                 fontsize=9)
    for i, b in enumerate((std, tiled)):
        ax.text(i, b / 2**20, f"{b / spec.hbm_bandwidth * 1e6:.0f} µs", ha="center",
                va="bottom", fontsize=7)


def _draw_measured(ax, measured_s, spread, measured_n, what: str) -> None:
    if measured_s is None:
        ax.set_axis_off()
        ax.set_title(what, fontsize=9)
        return
    err = [[(measured_s - spread[0]) * 1e3], [(spread[1] - measured_s) * 1e3]]
    ax.bar(["flash_triton"], [measured_s * 1e3], yerr=err, capsize=4, color="#55a868", width=0.5)
    ax.set_ylabel("ms (median; bar: min–max)")
    ax.set_title(f"measured, N={measured_n}, causal: {measured_s * 1e3:.1f} ms", fontsize=9)
    ax.set_xlabel(what.replace(" (", "\n("), fontsize=7)


def flash_explorer(block_q: int = 64, block_k: int = 64, head_dim: int = 64, n: int = 4096,
                   chip: str = "H100", measure: bool = True, interpreter_n: int = 128,
                   num_warps: int = 4) -> ExplorerResult:
    """Redraw for one (Br, Bc, d, N, warps): the tile's on-chip footprint against the chip's
    shared memory, the modelled HBM traffic of standard vs tiled attention, what the
    compiler made of this tile for the chip (bf16, from the committed table of
    :func:`llmlab.kernels.report.lookup`: compiled on a CPU, not run), and a measured time
    of the Triton kernel with these blocks (on CPU: the interpreter at
    N = min(n, ``interpreter_n``), causal, one head)."""
    for name, val in (("block_q", block_q), ("block_k", block_k), ("head_dim", head_dim)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"{name}={val!r} must be a power of two >= 16 (16, 32, 64, ...)")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps!r}; allowed: 1, 2, 4, 8, 16")
    spec = _as_chip(chip)
    fp = tile_footprint(block_q, block_k, head_dim, bytes_per_el=2)
    std = standard_attention_hbm(n, head_dim).total
    tiled = tiled_attention_hbm(n, head_dim, block_q, block_k, causal=True).total
    built = compiled_build("flash", chip, "bf16", block_m=block_q, block_n=block_k,
                           head_dim=head_dim, num_warps=num_warps)
    measured_n = measured_s = spread = None
    what = "not measured"
    if measure:
        measured_n = n if torch.cuda.is_available() else min(n, interpreter_n)
        measured_s, spread, what = _measure_kernel(measured_n, block_q, block_k, head_dim,
                                                   num_warps)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.2), dpi=DPI)
    _draw_footprint(axes[0, 0], fp, spec, block_q, block_k, head_dim)
    _draw_traffic(axes[0, 1], n, std, tiled, spec)
    draw_build(axes[1, 0], built, chip)
    _draw_measured(axes[1, 1], measured_s, spread, measured_n, what)
    fig.tight_layout()
    return ExplorerResult(block_q, block_k, head_dim, n, fp.total, spec.smem_per_sm,
                          fp.fits(spec), std, tiled, measured_n, measured_s, what, spread, fig,
                          num_warps, built)
