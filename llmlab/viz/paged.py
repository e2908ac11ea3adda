"""Figures for notebook 04 (PagedAttention): the block map, waste bars, the block-size
trade-off (the widget's callback), and sharing.

Every function takes plain data (a BlockManager, simulation results, dicts of numbers)
and returns a matplotlib Figure, so the notebook's widgets stay one line and the tests
can call the same functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ..cache.block_manager import BlockManager
from ..cache.waste import SharingResult, WasteResult

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
                             cost_ms: dict[int, float], device: str = ""):
    """Left: waste vs block size (small blocks waste less). Right: measured time of one
    paged decode per block size (small blocks mean more table lookups and smaller
    contiguous reads). The chosen ``block_size`` is highlighted. The widget's callback."""
    sizes = [r.block_size for r in sweep]
    if block_size not in sizes:
        raise ValueError(f"block_size={block_size!r}; allowed: {sizes}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(7, 3.0), dpi=80)
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
    b.plot(cs, [cost_ms[s] for s in cs], "s-", color="#2e86ab")
    if block_size in cost_ms:
        b.plot([block_size], [cost_ms[block_size]], "s", ms=12, mfc="none", mec="black")
    b.set_xscale("log", base=2)
    b.set_ylim(0, 1.15 * max(cost_ms.values()))
    b.set_xlabel("block size (tokens)")
    b.set_ylabel("ms per decode attention")
    b.set_title(f"measured on {device}" if device else "measured", fontsize=8)
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


def plot_prefix_cache(ttft_cold: Sequence[float], ttft_warm: Sequence[float], hit_rate: float):
    """Time to first token per request, without and with the prefix cache."""
    fig, ax = plt.subplots(figsize=(7, 3.0), dpi=80)
    n = len(ttft_cold)
    ax.bar([i - 0.2 for i in range(n)], [t * 1000 for t in ttft_cold], 0.4,
           label="no prefix cache", color="#999999")
    ax.bar([i + 0.2 for i in range(n)], [t * 1000 for t in ttft_warm], 0.4,
           label=f"prefix cache (hit rate {hit_rate:.0%})", color="#2e86ab")
    ax.set_xticks(range(n), [str(i + 1) for i in range(n)])
    ax.set_xlabel("request (same system prompt, different question)")
    ax.set_ylabel("TTFT (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["snapshot", "draw_block_map", "block_map_story", "plot_block_map_story",
           "plot_waste_bars", "plot_block_size_tradeoff", "plot_sharing", "plot_prefix_cache",
           "BlockMapSnapshot"]
