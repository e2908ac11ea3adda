"""Figures for notebook 13's prefix caches: measured runs side by side, the radix tree as
text, and the widget's callback over cache size and policy.

``plot_session_runs(runs)`` draws, per engine, the prompt tokens it computed against those
it was sent, and each turn's TTFT (a dot per turn, p50 and p90 marked). ``tree_text(tree)``
prints a radix tree one node per line. ``explore_prefix_cache`` is the widget's callback: it
serves the sessions with the real scheduler and block manager on a fitted step-cost model
(:func:`llmlab.engine.sessions.simulate_sessions`, labelled as a model) for one pool size
and policy, next to every policy at that size.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..engine.sessions import SessionRun, simulate_sessions

POLICIES = (("none", None, "fcfs"), ("hash", "hash", "fcfs"), ("radix", "radix", "fcfs"),
            ("hash + cache-aware", "hash", "cache_aware"),
            ("radix + cache-aware", "radix", "cache_aware"))


def plot_session_runs(runs: dict[str, SessionRun], title: str | None = None):
    """Per engine: prompt tokens computed vs sent (bars), and TTFT per turn; -> Figure."""
    if not runs:
        raise ValueError("runs is empty: serve the sessions with at least one engine")
    names = list(runs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80)
    x = np.arange(len(names))
    a.bar(x, [runs[n].prompt_tokens for n in names], color="#ddd", label="sent")
    a.bar(x, [runs[n].computed_prompt_tokens for n in names], width=0.5, label="computed")
    for i, n in enumerate(names):
        a.text(i, runs[n].computed_prompt_tokens, f"{runs[n].computed_share:.0%}",
               ha="center", va="bottom", fontsize=9)
    a.set_xticks(x, names)
    a.set_ylabel("prompt tokens")
    a.set_title("prompt tokens: sent and computed")
    a.legend(fontsize=8)
    rng = np.random.default_rng(0)
    for i, n in enumerate(names):
        t = np.array([r.ttft_s for r in runs[n].turns]) * 1e3
        b.plot(i + rng.uniform(-0.15, 0.15, len(t)), t, ".", alpha=0.5, color="C0")
        for q, m in ((0.5, "_"), (0.9, "v")):
            b.plot([i], [runs[n].ttft(q) * 1e3], m, color="C3", ms=22 if m == "_" else 10,
                   mew=2, label=f"p{int(q * 100)}" if i == 0 else None)
    b.set_xticks(x, names)
    b.set_ylabel("TTFT (ms)")
    b.set_title("time to first token, per turn")
    b.legend(fontsize=8)
    model = {r.model for r in runs.values()} - {""}
    if title or model:
        fig.suptitle((title or "") + (f" ({', '.join(model)})" if model else ""), fontsize=10)
    fig.tight_layout()
    return fig


def tree_text(tree, detokenize=None, width: int = 60) -> str:
    """The radix tree one node per line, indented by depth: its token span, lock count and
    blocks; ``detokenize(ids) -> str`` shows the edge's text instead of its ids."""
    lines = []

    def walk(node, depth):
        for child in sorted(node.children.values(), key=lambda n: n.tokens[0]):
            label = detokenize(child.tokens) if detokenize else str(child.tokens)
            label = label.replace("\n", "⏎")
            if len(label) > width:
                label = label[:width - 1] + "…"
            lines.append(f"{'  ' * depth}[{child.start}:{child.end}] lock {child.lock_ref} "
                         f"blocks {child.blocks}  {label!r}")
            walk(child, depth + 1)

    walk(tree.root, 0)
    return "\n".join(lines) or "(empty tree)"


def sweep_policies(sessions, cost, num_blocks: int, block_size: int = 16,
                   max_num_seqs: int = 8, time_scale: float = 1.0) -> dict[str, SessionRun]:
    """Every policy of :data:`POLICIES` on the sessions at one pool size (simulated)."""
    return {name: simulate_sessions(sessions, cost, prefix_cache=cache, admission=adm,
                                    num_blocks=num_blocks, block_size=block_size,
                                    max_num_seqs=max_num_seqs, time_scale=time_scale)
            for name, cache, adm in POLICIES}


def explore_prefix_cache(sessions, cost, num_blocks: int, policy: str = "radix",
                         block_size: int = 16, max_num_seqs: int = 8,
                         time_scale: float = 1.0):
    """The widget's callback: hit rate and TTFT p50/p90 of every policy at ``num_blocks``
    blocks, ``policy`` highlighted; returns the Figure. Simulated on ``cost`` (a fitted
    :class:`~llmlab.profiling.steps.StepCost`): the TTFTs are the model's."""
    names = [p[0] for p in POLICIES]
    if policy not in names:
        raise ValueError(f"policy={policy!r}; allowed: {names}")
    runs = sweep_policies(sessions, cost, num_blocks, block_size, max_num_seqs, time_scale)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2), dpi=80)
    x = np.arange(len(names))
    colours = ["C1" if n == policy else "C0" for n in names]
    a.bar(x, [runs[n].hit_rate for n in names], color=colours)
    a.set_ylim(0, 1)
    a.set_ylabel("prefix hit rate")
    b.bar(x - 0.2, [runs[n].ttft(0.5) * 1e3 for n in names], 0.4, color=colours, label="p50")
    b.bar(x + 0.2, [runs[n].ttft(0.9) * 1e3 for n in names], 0.4, color=colours, alpha=0.5,
          hatch="//", label="p90")
    b.set_ylabel("TTFT (ms, step-cost model)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xticks(x, [n.replace(" + ", " +\n") for n in names], fontsize=7.5)
    r = runs[policy]
    fig.suptitle(f"{num_blocks} blocks of {block_size} tokens — {policy}: hit rate "
                 f"{r.hit_rate:.0%}, computes {r.computed_share:.0%} of the prompt tokens, "
                 f"TTFT p90 {r.ttft(0.9) * 1e3:.0f} ms (model)", fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["POLICIES", "plot_session_runs", "tree_text", "sweep_policies",
           "explore_prefix_cache"]
