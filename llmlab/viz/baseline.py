"""Measurements and figures for notebooks 01 and 02: where the time goes, the cost of a
generation step with and without a KV cache, and the N² cost of naive attention.

Every timing here is the median of ``repeats`` (≥ 5 by default) runs after a warm-up,
kept with its runs so a figure can draw the spread (min–max).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import attention as A
from ..profiling import peak_memory, time_fn


@dataclass
class Timing:
    """The runs of one measurement at ``n`` (a length, a batch, ...): median and spread."""

    n: int
    times_s: list[float] = field(default_factory=list)
    label: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def lo_s(self) -> float:
        return min(self.times_s)

    @property
    def hi_s(self) -> float:
        return max(self.times_s)


def _check_repeats(repeats: int) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")


def _check_batch(batch: int) -> None:
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive int")


@torch.inference_mode()
def forward_step_times(model, lengths: list[int], repeats: int = 5,
                       batch: int = 1) -> list[Timing]:
    """A no-cache generation step at each sequence length n: one forward over ``batch`` × n
    tokens (logits for the last one only; the same work as a prefill of n tokens),
    ``repeats`` timed runs per length after one warm-up run (at the first length)."""
    _check_repeats(repeats)
    _check_batch(batch)
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or not 1 <= n <= model.config.max_position_embeddings:
            raise ValueError(f"length {n!r} must be an int in 1..{model.config.max_position_embeddings}")
        ids = torch.randint(0, model.config.vocab_size, (batch, n), generator=g).to(model.device)
        t = time_fn(lambda: model(ids, last_only=True), repeats=repeats, warmup=int(i == 0),
                    device=model.device)
        out.append(Timing(n, list(t.times_s), "no cache"))
    return out


@torch.inference_mode()
def cached_step_times(model, lengths: list[int], repeats: int = 5,
                      batch: int = 1) -> list[Timing]:
    """A decode step with a KV cache at each sequence length n: one new token per row after
    n − 1 cached ones, for ``batch`` rows; ``repeats`` timed runs per length after one warm-up
    run (at the first length). The cache's K/V stay zero: the step does the same work
    whatever they hold."""
    from ..cache import ContiguousKVCache

    _check_repeats(repeats)
    _check_batch(batch)
    ids = torch.zeros((batch, 1), dtype=torch.long, device=model.device)
    out = []
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or not 2 <= n <= model.config.max_position_embeddings:
            raise ValueError(f"length {n!r} must be an int in 2..{model.config.max_position_embeddings}")
        cache = ContiguousKVCache.for_model(model, batch, n)

        def step():
            cache.reset()
            cache.begin(n - 1)
            cache.advance()
            model(ids, positions=cache.begin(1), cache=cache, last_only=True)
            cache.advance()

        t = time_fn(step, repeats=repeats, warmup=int(i == 0), device=model.device)
        out.append(Timing(n, list(t.times_s), "KV cache"))
    return out


def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares ``y ≈ a + b·x``; returns (a, b)."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def fit_exponent(xs, ys) -> float:
    """The slope of log y against log x: y ∝ x^k near these points."""
    return float(np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)[0])


def plot_step_times(series: list[list[Timing]], ax=None, title: str = "",
                    xlabel: str = "tokens in the sequence"):
    """Median ms per step against n, one line per series, the min–max spread as a band."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.3), dpi=80)
    for rows in series:
        ns = [r.n for r in rows]
        ax.plot(ns, [r.median_s * 1e3 for r in rows], "o-", ms=4,
                label=f"{rows[0].label} (median of {len(rows[0].times_s)})")
        ax.fill_between(ns, [r.lo_s * 1e3 for r in rows], [r.hi_s * 1e3 for r in rows],
                        alpha=0.25)
    ax.set(xlabel=xlabel, ylabel="ms per step", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def generation_totals(steps: list[Timing], prompt_len: int, new_tokens: int,
                      cached: bool, prefill: Timing | None = None) -> np.ndarray:
    """Seconds since the start when token 1..``new_tokens`` arrives, built from measured
    step medians (linear interpolation between the measured lengths).

    Without a cache token t (from 0) costs one forward over ``prompt_len + t`` tokens.
    With one, token 0 costs the prefill (``prefill``'s median, a forward over the prompt)
    and token t ≥ 1 a decode step at ``prompt_len + t`` tokens.
    """
    ns = np.array([r.n for r in steps], float)
    med = np.array([r.median_s for r in steps], float)
    lengths = prompt_len + np.arange(new_tokens)
    if lengths[-1] > ns[-1] or (not cached and lengths[0] < ns[0]):
        raise ValueError(f"the steps were measured for {int(ns[0])}..{int(ns[-1])} tokens; "
                         f"generating {new_tokens} after {prompt_len} needs "
                         f"{lengths[0]}..{lengths[-1]}")
    per_token = np.interp(lengths, ns, med)
    if cached:
        if prefill is None:
            raise ValueError("a cached generation needs the prefill's timing")
        per_token[0] = prefill.median_s
    return np.cumsum(per_token)


def plot_generation_totals(new_tokens: np.ndarray, totals: dict[str, np.ndarray],
                           token_passes: dict[str, np.ndarray], ax=None, title: str = ""):
    """Cumulative seconds against tokens generated (solid), and the token-passes the model
    computes (dashed, right axis)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.3), dpi=80)
    colors = {}
    for label, tot in totals.items():
        (line,) = ax.plot(new_tokens, tot, "-", label=f"{label}: time")
        colors[label] = line.get_color()
    ax.set(xlabel="tokens generated", ylabel="seconds since the start", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    right = ax.twinx()
    for label, passes in token_passes.items():
        right.plot(new_tokens, passes, "--", color=colors.get(label), alpha=0.7,
                   label=f"{label}: token-passes")
    right.set_ylabel("token-passes computed (dashed)")
    right.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = right.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    return ax


# ---- where one forward spends its time --------------------------------------------------------

def operator_medians(fn, repeats: int = 5, row_limit: int = 8) -> list[dict]:
    """Profile ``fn()`` ``repeats`` times (after a warm-up) with torch.profiler; per operator,
    the median self time in ms, its min and max, and the calls per run. The ``row_limit``
    operators with the largest median, largest first."""
    from ..profiling.breakdown import profile_by_operator

    _check_repeats(repeats)
    fn()
    runs = [{r.name: r for r in profile_by_operator(fn, row_limit=10_000)} for _ in range(repeats)]
    names = set().union(*runs)
    rows = []
    for name in names:
        ms = [run[name].self_ms if name in run else 0.0 for run in runs]
        calls = max(run[name].calls if name in run else 0 for run in runs)
        rows.append({"name": name, "median_ms": statistics.median(ms), "lo_ms": min(ms),
                     "hi_ms": max(ms), "calls": calls})
    rows.sort(key=lambda r: r["median_ms"], reverse=True)
    return rows[:row_limit]


def parts_by_length(model, lengths: list[int], repeats: int = 5) -> dict[int, dict]:
    """Per length n: the median seconds of each part of one forward over n tokens
    (:func:`llmlab.profiling.breakdown.time_by_part`, ``repeats`` runs per length after one
    warm-up run), and the runs' totals under the key ``"_totals"``."""
    from ..profiling.breakdown import time_by_part

    _check_repeats(repeats)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, n in enumerate(lengths):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(model.device)
        if i == 0:
            time_by_part(model, ids)   # warm-up
        runs = [time_by_part(model, ids) for _ in range(repeats)]
        parts = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        parts["_totals"] = [sum(r.values()) for r in runs]
        out[n] = parts
    return out


PARTS = ["attention", "mlp", "lm_head", "norms", "embed_tokens", "other"]


def plot_parts(parts_by_n: dict[int, dict]):
    """Left: share of forward time per part (medians), per N. Right: ms per forward,
    median with min–max error bars (when the runs' totals are there)."""
    ns = sorted(parts_by_n)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80,
                                 gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(ns)
    for k in PARTS:
        share = [parts_by_n[n].get(k, 0.0) / sum(parts_by_n[n].get(p, 0.0) for p in PARTS)
                 for n in ns]
        a1.bar([str(n) for n in ns], share, bottom=bottom, label=k)
        bottom = [b + s for b, s in zip(bottom, share)]
    a1.set(xlabel="prompt length N (one forward pass)", ylabel="share of time (medians)",
           ylim=(0, 1))
    a1.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    if all("_totals" in parts_by_n[n] for n in ns):
        tot = [parts_by_n[n]["_totals"] for n in ns]
        med = np.array([statistics.median(t) for t in tot]) * 1e3
        lo = med - np.array([min(t) for t in tot]) * 1e3
        hi = np.array([max(t) for t in tot]) * 1e3 - med
        a2.bar([str(n) for n in ns], med, yerr=[lo, hi], capsize=4, color="tab:gray")
        a2.set(xlabel="prompt length N", ylabel="ms per forward",
               title=f"median of {len(tot[0])}, min–max")
        a2.grid(True, axis="y", alpha=0.3)
    else:
        a2.axis("off")
    fig.tight_layout()
    return fig


# ---- the N² of naive attention ------------------------------------------------------------------

def attention_cost(n: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                   backend: str = "naive", repeats: int = 5, seed: int = 0) -> dict:
    """Measure one causal attention call at sequence length ``n`` (batch 1, float32).

    Returns {"n", "backend", "seconds" (median), "times_s" (every run), "peak_bytes",
    "score_bytes"} where score_bytes is the size of one [1, heads, n, n] float32 score
    matrix (what naive materializes) and peak_bytes the most memory the call held at once.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1")
    _check_repeats(repeats)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, n, heads, head_dim, generator=g)
    k = torch.randn(1, n, kv_heads, head_dim, generator=g)
    v = torch.randn(1, n, kv_heads, head_dim, generator=g)
    fn = A.get(backend).forward
    t = time_fn(lambda: fn(q, k, v, causal=True), repeats=repeats, warmup=1, device="cpu")
    mem = peak_memory(lambda: fn(q, k, v, causal=True), device="cpu")
    return {"n": n, "backend": backend, "seconds": t.median_s, "times_s": list(t.times_s),
            "peak_bytes": mem.peak_bytes, "score_bytes": 4 * heads * n * n}


def plot_attention_cost(rows: list[dict], title: str = ""):
    """Time (median, min–max error bars) and peak memory against N (log-log), one line per
    backend, with an N² guide through the largest naive point."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.3), dpi=80)
    for backend in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == backend]
        ns = [r["n"] for r in rs]
        med = np.array([r["seconds"] for r in rs]) * 1e3
        lo = med - np.array([min(r.get("times_s", [r["seconds"]])) for r in rs]) * 1e3
        hi = np.array([max(r.get("times_s", [r["seconds"]])) for r in rs]) * 1e3 - med
        a1.errorbar(ns, med, yerr=[lo, hi], fmt="o-", capsize=3, label=backend)
        a2.loglog(ns, [r["peak_bytes"] / 2**20 for r in rs], "o-", label=backend)
    ns = sorted({r["n"] for r in rows})
    ref = [r for r in rows if r["n"] == ns[-1]]
    if ref and len(ns) > 1:
        top = max(r["peak_bytes"] for r in ref) / 2**20
        a2.loglog(ns, [top * (n / ns[-1]) ** 2 for n in ns], "k:", label="∝ N²")
    a1.set(xlabel="sequence length N", ylabel="ms per call (median, min–max)", title="time")
    a1.set_yscale("log")
    a2.set(xlabel="sequence length N", ylabel="peak extra memory (MiB)", title="memory")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(ns, [str(n) for n in ns])
        a.minorticks_off()
        a.legend(fontsize=8)
        a.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def explore_attention(n: int = 512, backend: str = "naive"):
    """Widget callback: measure one attention call at N and show score memory vs measured."""
    if backend not in A.available():
        raise ValueError(f"backend={backend!r}; allowed: {A.available()}")
    r = attention_cost(n, backend=backend, repeats=5)
    fig, ax = plt.subplots(figsize=(6, 2.6), dpi=80)
    ax.barh(["score matrix [1,9,N,N] fp32", f"measured peak ({backend})"],
            [r["score_bytes"] / 2**20, r["peak_bytes"] / 2**20], color=["tab:gray", "tab:orange"])
    ax.set_xlabel("MiB")
    spread = (max(r["times_s"]) - min(r["times_s"])) * 1e3
    ax.set_title(f"N={n}: {r['seconds'] * 1e3:.1f} ms per call (median of 5, spread "
                 f"{spread:.1f} ms), {backend}")
    fig.tight_layout()
    return fig, r
