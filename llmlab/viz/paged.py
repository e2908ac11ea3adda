"""Figures for notebook 04 (PagedAttention): the block map, waste bars, the reservation-cap
sweep, the block-size trade-off (the widget's callback), sharing, prefix caching, and a
labelled model of what the memory saved buys on a GPU (:func:`gpu_serving_model`).

Every function takes plain data (a BlockManager, simulation results, dicts of numbers)
and returns a matplotlib Figure, so the notebook's widgets stay one line and the tests
can call the same functions.
"""
from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass
from typing import Hashable, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..cache import waste as _waste
from ..cache.block_manager import BlockManager
from ..cache.waste import SharingResult, WasteResult
from ..config import ModelConfig
from ..profiling.flops import model_flops_per_token, weight_bytes
from ..profiling.hbm import H100, ChipSpec
from ..profiling.roofline import decode_cost

CATEGORY_COLOURS = {"used": "#4c9a2a", "reservation": "#f2b134", "internal": "#e4572e",
                    "external": "#7b2d26", "idle": "#dddddd"}
_SEQ_COLOURS = plt.get_cmap("tab10").colors


@dataclass
class BlockMapSnapshot:
    """What the pool looks like at one moment: tables, reference counts, cached blocks."""
    title: str
    num_blocks: int
    block_size: int
    tables: dict
    fill: dict                      # seq -> tokens
    ref_counts: list
    cached: set


def snapshot(bm: BlockManager, title: str = "") -> BlockMapSnapshot:
    """Freeze the state of ``bm`` for drawing."""
    seqs = bm.seq_ids()
    return BlockMapSnapshot(title, bm.num_blocks, bm.block_size,
                            {s: bm.block_table(s) for s in seqs},
                            {s: bm.num_tokens(s) for s in seqs},
                            list(bm.allocator.ref_counts),
                            {b for b in range(bm.num_blocks) if bm.allocator.is_evictable(b)})


def _colour(seqs: list, seq: Hashable):
    return _SEQ_COLOURS[seqs.index(seq) % len(_SEQ_COLOURS)]


def draw_block_map(ax, snap: BlockMapSnapshot, cols: int = 8, seq_order: list | None = None):
    """Physical blocks as a grid; each block coloured by its owner, filled by its tokens.

    A block shared by several sequences is hatched and labelled with its reference count;
    a cached block (unreferenced, content kept for prefix hits) is grey.
    """
    seqs = seq_order or list(snap.tables)
    rows = -(-snap.num_blocks // cols)
    owner: dict[int, list] = {}
    fill: dict[int, int] = {}
    for s, table in snap.tables.items():
        for i, b in enumerate(table):
            owner.setdefault(b, []).append(s)
            fill[b] = max(fill.get(b, 0), min(snap.block_size, snap.fill[s] - i * snap.block_size))
    for b in range(snap.num_blocks):
        r, c = divmod(b, cols)
        y = rows - 1 - r
        ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor="white", edgecolor="#999999"))
        if b in owner:
            colour = _colour(seqs, owner[b][0])
            frac = fill[b] / snap.block_size
            ax.add_patch(Rectangle((c, y), 0.92 * frac, 0.92, facecolor=colour, alpha=0.85,
                                   hatch="//" if len(owner[b]) > 1 else None, edgecolor="black"
                                   if len(owner[b]) > 1 else colour))
            label = ",".join(str(s) for s in owner[b])
            ax.text(c + 0.46, y + 0.46, label if len(owner[b]) == 1 else f"×{len(owner[b])}",
                    ha="center", va="center", fontsize=7)
        elif b in snap.cached:
            ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor="#bbbbbb"))
            ax.text(c + 0.46, y + 0.46, "cache", ha="center", va="center", fontsize=6)
        ax.text(c + 0.05, y + 0.78, str(b), fontsize=5, color="#666666")
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    tables = "; ".join(f"{s}:{t}" for s, t in snap.tables.items())
    ax.set_title(f"{snap.title}\n{tables}" if snap.title else tables, fontsize=7)


def block_map_story(num_blocks: int = 16, block_size: int = 4) -> list[BlockMapSnapshot]:
    """A scripted run of the block manager: arrivals, growth, a finish, a fork with
    copy-on-write, and a prefix-cache hit. Returns a snapshot after each event."""
    bm = BlockManager(num_blocks, block_size)
    shots = []
    bm.allocate("A", list(range(10)))                      # 10 tokens -> 3 blocks
    bm.allocate("B", list(range(100, 106)))                # 6 tokens -> 2 blocks
    shots.append(snapshot(bm, "1. A (10 tokens) and B (6) arrive"))
    for t in range(5):
        bm.append_slot("A", 10 + t)
        bm.append_slot("B", 106 + t)
    for seq in ("A", "B"):                                 # their K/V written: cacheable
        bm.mark_computed(seq, bm.num_tokens(seq))
    shots.append(snapshot(bm, "2. both decode 5 tokens: new blocks on demand"))
    bm.free("B")
    bm.allocate("C", list(range(100, 108)) + [7, 7, 7])    # same first 8 tokens as B
    shots.append(snapshot(bm, "3. B finishes; C reuses B's cached prefix"))
    bm.fork("C", "D")
    bm.append_slot("C", 1)
    bm.append_slot("D", 2)
    shots.append(snapshot(bm, "4. C forks D (parallel sampling): copy-on-write"))
    return shots


def plot_block_map_story(shots: Sequence[BlockMapSnapshot] | None = None, cols: int = 8):
    """The story of :func:`block_map_story` as a row of block maps."""
    shots = list(shots) if shots is not None else block_map_story()
    order: list = []
    for s in shots:
        order += [q for q in s.tables if q not in order]
    ncols = min(2, len(shots))
    nrows = -(-len(shots) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7, 1.9 * nrows), dpi=80, squeeze=False)
    for ax in axes.flat[len(shots):]:
        ax.axis("off")
    for ax, snap in zip(axes.flat, shots):
        draw_block_map(ax, snap, cols=cols, seq_order=order)
    fig.tight_layout()
    return fig


def plot_waste_bars(results: Sequence[WasteResult], title: str = ""):
    """Stacked bars: each policy's pool split into used / reservation / internal / external / idle."""
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(results) + 1.4), dpi=80)
    labels = [r.label for r in results]
    for i, r in enumerate(results):
        left = 0.0
        for cat, frac in r.fractions().items():
            ax.barh(i, frac * 100, left=left, color=CATEGORY_COLOURS[cat],
                    label=cat if i == 0 else None)
            left += frac * 100
        ax.text(101, i, f"waste {r.waste:.0%}, {r.mean_running:.1f} seqs", va="center", fontsize=8)
    ax.set_yticks(range(len(results)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 135)
    ax.set_xlabel("% of the KV pool (time-averaged)")
    ax.legend(ncol=5, fontsize=7, loc="lower center", bbox_to_anchor=(0.4, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=9, pad=24)
    fig.tight_layout()
    return fig


def plot_block_size_tradeoff(block_size: int, sweep: Sequence[WasteResult],
                             cost_ms: dict[int, float], device: str = "",
                             spread_ms: dict[int, tuple[float, float]] | None = None,
                             ylabel: str = "ms per decode attention", chip: str | None = None):
    """Left: waste vs block size (small blocks waste less). Middle: measured time of one
    paged decode per block size (median; ``spread_ms`` maps a size to its (min, max), drawn
    as error bars; ``ylabel`` says what was timed). The chosen ``block_size`` is
    highlighted. With ``chip`` ("A100", "H100", "H200"), a right panel shows what the
    compiler made of the ``paged_triton`` kernel at this KV block size for that chip
    (bfloat16, head_dim 64, 3 query heads per KV head as SmolLM2; compiled on a CPU, not
    run: :func:`llmlab.viz.flash.draw_build`). The widget's callback."""
    sizes = [r.block_size for r in sweep]
    if block_size not in sizes:
        raise ValueError(f"block_size={block_size!r}; allowed: {sizes}")
    if chip is None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.0), dpi=80)
    else:
        from .flash import compiled_build, draw_build
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.2), dpi=80,
                                      gridspec_kw={"width_ratios": [1, 1, 1.15]})
        draw_build(c, compiled_build("paged", chip, "bf16", block_size=block_size, head_dim=64),
                   chip)
    waste = [r.waste * 100 for r in sweep]
    a.plot(sizes, waste, "o-", color="#e4572e")
    i = sizes.index(block_size)
    a.plot([block_size], [waste[i]], "o", ms=12, mfc="none", mec="black")
    a.set_xscale("log", base=2)
    a.set_xlabel("block size (tokens)")
    a.set_ylabel("waste (% of held KV memory)")
    a.set_title(f"block {block_size}: waste {waste[i]:.1f}%, "
                f"{sweep[i].mean_running:.1f} seqs", fontsize=9)
    cs = sorted(cost_ms)
    ys = [cost_ms[s] for s in cs]
    if spread_ms:
        lo = [ys[j] - spread_ms[s][0] for j, s in enumerate(cs)]
        hi = [spread_ms[s][1] - ys[j] for j, s in enumerate(cs)]
        b.errorbar(cs, ys, yerr=[lo, hi], fmt="s-", color="#2e86ab", capsize=3,
                   label="median, min–max")
        b.legend(fontsize=7, loc="best")
    else:
        b.plot(cs, ys, "s-", color="#2e86ab")
    if block_size in cost_ms:
        b.plot([block_size], [cost_ms[block_size]], "s", ms=12, mfc="none", mec="black")
    b.set_xscale("log", base=2)
    top = max(spread_ms[s][1] for s in cs) if spread_ms else max(ys)
    b.set_ylim(0, 1.15 * top)
    b.set_xlabel("block size (tokens)")
    b.set_ylabel(ylabel)
    b.set_title(textwrap.fill(f"measured on {device}" if device else "measured", 48), fontsize=8)
    fig.tight_layout()
    return fig


def plot_cap_sweep(capped: Sequence[WasteResult], caps: Sequence[int], paged: WasteResult):
    """Reserving prompt + cap: waste and sequences in flight against the cap, with paging
    (which reserves nothing ahead) as a horizontal line."""
    if len(capped) != len(caps):
        raise ValueError(f"{len(capped)} results for {len(caps)} caps")
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 2.8), dpi=80)
    a.plot(caps, [r.waste * 100 for r in capped], "o-", color="#e4572e",
           label="reserve prompt + cap")
    a.axhline(paged.waste * 100, color="#4c9a2a", ls="--", label=paged.label)
    a.set(xlabel="output cap reserved (tokens)", ylabel="waste (% of held KV memory)",
          ylim=(0, 100))
    b.plot(caps, [r.mean_running for r in capped], "o-", color="#e4572e")
    b.axhline(paged.mean_running, color="#4c9a2a", ls="--")
    b.set(xlabel="output cap reserved (tokens)", ylabel="sequences in flight (mean)",
          ylim=(0, 1.15 * paged.mean_running))
    a.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_sharing(results: Sequence[SharingResult]):
    """KV blocks with and without sharing, for parallel sampling and beam search."""
    fig, ax = plt.subplots(figsize=(7, 3.0), dpi=80)
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r.blocks_unshared for r in results], 0.4,
           label="each sequence its own copy", color="#999999")
    ax.bar([i + 0.2 for i in x], [r.blocks_shared for r in results], 0.4,
           label="shared blocks + copy-on-write", color="#4c9a2a")
    for i, r in enumerate(results):
        ax.text(i + 0.2, r.blocks_shared, f"−{r.saving:.0%}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [f"{r.mode} ×{r.width}" for r in results])
    ax.set_ylabel("KV blocks in use (time-averaged)")
    ax.set_ylim(0, 1.3 * max(r.blocks_unshared for r in results))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def _median_and_spread(samples):
    """A number or a list of samples -> (median, low, high)."""
    xs = list(samples) if isinstance(samples, (list, tuple)) else [samples]
    return statistics.median(xs), min(xs), max(xs)


def plot_prefix_cache(ttft_cold: Sequence, ttft_warm: Sequence, hit_rate: float,
                      cached_tokens: Sequence[int] | None = None, ylabel: str = "TTFT (ms)"):
    """Time to first token per request, without and with the prefix cache.

    Each entry is a time in seconds or a list of repeated measurements (then the bar is
    the median and the error bar min–max). ``cached_tokens`` labels each request with the
    prompt tokens its cache hit served; ``ylabel`` names what was timed (milliseconds)."""
    fig, ax = plt.subplots(figsize=(7, 3.0), dpi=80)
    n = len(ttft_cold)
    for off, runs, label, colour in ((-0.2, ttft_cold, "no prefix cache", "#999999"),
                                     (0.2, ttft_warm, f"prefix cache (hit rate {hit_rate:.0%})",
                                      "#2e86ab")):
        stats = [_median_and_spread(r) for r in runs]
        med = [m * 1000 for m, _, _ in stats]
        err = [[(m - lo) * 1000 for m, lo, _ in stats], [(hi - m) * 1000 for m, _, hi in stats]]
        ax.bar([i + off for i in range(n)], med, 0.4, yerr=err, capsize=3, label=label,
               color=colour)
    names = [str(i + 1) if cached_tokens is None else f"{i + 1}\n{c} cached"
             for i, c in enumerate(cached_tokens or [0] * n)]
    ax.set_xticks(range(n), names)
    ax.set_xlabel("request (same system prompt, different question)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# -- a labelled model: what the memory saved buys on a GPU ---------------------------------

LLAMA2_13B = ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                         num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
                         max_position_embeddings=4096)


@dataclass
class GpuServingRow:
    """One policy in :func:`gpu_serving_model` (every number a model, not a measurement)."""
    policy: str
    kv_slots: int                  # token slots the KV pool holds
    mean_running: float            # sequences in flight, time-averaged (from the simulation)
    waste: float
    preemptions: int
    recomputed_tokens: int
    step_s: float                  # one decode step at the mean batch and context
    total_s: float                 # every step, plus recomputing the preempted prompts
    tokens_per_s: float            # generated tokens / total_s


def gpu_serving_model(requests: Sequence, chip: ChipSpec = H100, config: ModelConfig = LLAMA2_13B,
                      bytes_per_el: int = 2, memory_fraction: float = 0.9, cap: int = 1024,
                      block_size: int = 16) -> list[GpuServingRow]:
    """A model of serving ``requests`` on ``chip``: how many sequences each KV policy keeps
    in flight, and the decode throughput the roofline gives at that batch.

    The KV pool is what is left of ``memory_fraction`` of HBM after the weights; the
    ``max_len`` and ``paged`` policies of :func:`llmlab.cache.waste.simulate` run the
    trace through it (all requests waiting at the start). A decode step at the mean batch
    and mean context costs max(bytes / bandwidth, FLOPs / peak) (:func:`decode_cost`);
    the trace takes ``steps`` of them, plus, for paging, the prefill FLOPs of every token a
    preemption forces to be recomputed. A model: no kernel overheads, no scheduling gaps.
    """
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_el
    free = chip.hbm_bytes * memory_fraction - weight_bytes(config, bytes_per_el)
    if free < kv_per_token * (max(r.prompt_tokens for r in requests) + cap):
        raise ValueError(f"{chip.name} has no room for one request's KV after "
                         f"{weight_bytes(config, bytes_per_el) / 1e9:.0f} GB of weights")
    slots = int(free // kv_per_token)
    generated = sum(r.output_tokens for r in requests)
    rows = []
    for policy in ("max_len", "paged"):
        res = _waste.simulate(requests, policy, slots, block_size=block_size, max_tokens=cap)
        batch = max(1, round(res.mean_running))
        context = max(1, round(res.used / res.mean_running)) if res.mean_running else 1
        cost = decode_cost(config, batch, context, bytes_per_el)
        step = max(cost.bytes / chip.hbm_bandwidth, cost.flops / chip.peak_bf16_flops)
        recompute = res.recomputed_tokens * model_flops_per_token(config, context) \
            / chip.peak_bf16_flops
        total = res.steps * step + recompute
        rows.append(GpuServingRow(policy, slots, res.mean_running, res.waste, res.preemptions,
                                  res.recomputed_tokens, step, total, generated / total))
    return rows


def plot_gpu_serving_model(rows: Sequence[GpuServingRow], chip: ChipSpec = H100,
                           model_name: str = "Llama-2-13B, 16-bit"):
    """Sequences in flight and modelled decode throughput per policy, labelled as a model."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 2.8), dpi=80)
    names = [r.policy for r in rows]
    colours = ["#e4572e" if r.policy == "max_len" else "#4c9a2a" for r in rows]
    a.bar(names, [r.mean_running for r in rows], color=colours)
    a.set_ylabel("sequences in flight (mean)")
    b.bar(names, [r.tokens_per_s for r in rows], color=colours)
    b.set_ylabel("generated tokens/s (model)")
    for ax, vals in ((a, [r.mean_running for r in rows]), (b, [r.tokens_per_s for r in rows])):
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.2 * max(vals))
    fig.suptitle(f"MODEL, not a measurement: {model_name} on one {chip.name} "
                 f"({chip.hbm_bandwidth / 1e12:.2f} TB/s, {chip.peak_bf16_flops / 1e12:.0f} "
                 "TFLOP/s)", fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["snapshot", "draw_block_map", "block_map_story", "plot_block_map_story",
           "plot_waste_bars", "plot_block_size_tradeoff", "plot_cap_sweep", "plot_sharing",
           "plot_prefix_cache", "BlockMapSnapshot", "LLAMA2_13B", "GpuServingRow",
           "gpu_serving_model", "plot_gpu_serving_model"]
