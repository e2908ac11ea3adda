"""Figures and explorers for notebook 05 (continuous batching).

* :func:`plot_occupancy` — who sits in which batch seat at every iteration, static vs
  continuous, from the engines' step logs;
* :func:`arrival_sweep` / :func:`plot_throughput_latency` — throughput against latency
  as requests arrive faster (arrival times from a trace, rescaled to a rate);
* :func:`explore_batching` — the widget callback: serve a fixed set of requests with a
  given ``max_num_seqs`` and KV block budget, and show seats, free blocks and preemptions.

The scheduler dry run (``dry_run``, ``DryRun``, ``SchedulerStall``) lives beside the engine
in :mod:`llmlab.engine.simulate`; the names are re-exported here for older imports.
"""
from __future__ import annotations

import functools
import statistics

import matplotlib.pyplot as plt
import numpy as np

from ..engine import LLM, EngineStats, SamplingParams
from ..engine.scheduler import EMPTY, HELD
from ..engine.simulate import DryRun, SchedulerStall, dry_run  # noqa: F401 (re-exported)


def occupancy_grid(stats: EngineStats, width: int) -> np.ndarray:
    """[seats, iterations] int array: request id per seat, EMPTY (-1) or HELD (-2)."""
    grid = np.full((width, len(stats.steps)), EMPTY, dtype=int)
    for j, rec in enumerate(stats.steps):
        row = rec.occupancy[:width]
        grid[:len(row), j] = row
    return grid


def _colors(grid: np.ndarray) -> np.ndarray:
    """RGB image: a colour per request (cycled), white for empty, grey for held."""
    palette = plt.get_cmap("tab20").colors
    img = np.ones(grid.shape + (3,))
    img[grid == HELD] = (0.55, 0.55, 0.55)
    ids = grid >= 0
    img[ids] = np.array(palette)[grid[ids] % len(palette)]
    return img


def plot_occupancy(stats_by_name: dict[str, EngineStats], width: int, title: str = ""):
    """One panel per engine: seats (rows) × iterations (columns), coloured by request.

    Grey: a static seat whose request has finished but cannot be given away until the
    whole batch is done. White: an empty seat.
    """
    n = len(stats_by_name)
    longest = max(len(s.steps) for s in stats_by_name.values())
    fig, axes = plt.subplots(n, 1, figsize=(7, 1.2 + 1.1 * n), dpi=80, squeeze=False)
    for ax, (name, stats) in zip(axes[:, 0], stats_by_name.items()):
        grid = occupancy_grid(stats, width)
        used = float((grid >= 0).mean()) if grid.size else 0.0
        ax.imshow(_colors(grid), aspect="auto", interpolation="nearest",
                  extent=(-0.5, grid.shape[1] - 0.5, width - 0.5, -0.5))
        ax.set_xlim(-0.5, longest - 0.5)
        ax.set_ylabel("seat")
        ax.set_title(f"{name}: {len(stats.steps)} iterations, seats busy {used:.0%}", fontsize=9)
    axes[-1, 0].set_xlabel("iteration (one forward pass each)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_step_times(stats_by_name: dict[str, EngineStats], title: str = ""):
    """Duration of every forward pass, one line per engine; dots mark steps that fed
    prompt tokens. Every sequence decoding in a long step waits for it (its TPOT)."""
    fig, ax = plt.subplots(figsize=(7, 2.8), dpi=80)
    for name, stats in stats_by_name.items():
        ms = np.array([(r.end_s - r.start_s) * 1e3 for r in stats.steps])
        line, = ax.plot(ms, lw=1, label=f"{name}: longest {ms.max():.0f} ms")
        pre = np.array([r.prefill_tokens > 0 for r in stats.steps])
        ax.plot(np.flatnonzero(pre), ms[pre], ".", color=line.get_color(), ms=5)
    ax.set_xlabel("iteration (dots: the step fed prompt tokens)")
    ax.set_ylabel("step time (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


# -- throughput against latency ----------------------------------------------------------

def arrival_sweep(llm_by_policy: dict[str, LLM], prompts: list[list[int]],
                  max_tokens: list[int], base_arrivals: list[float],
                  rates: list[float], repeats: int = 1) -> list[dict]:
    """Serve the same requests at several arrival rates with each engine.

    ``base_arrivals``: arrival times (s) of a trace; they are rescaled so requests come
    in at ``rate`` per second on average. Each (rate, engine) is served ``repeats`` times,
    the engines interleaved. Returns rows {"policy", "rate", "tokens_per_s",
    "ttft_mean_s", "e2e_mean_s", "e2e_p90_s"} holding the median over the repeats, plus
    "tokens_per_s_range" and "e2e_mean_range" (min, max). Greedy, EOS ignored.
    """
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates={rates!r} must be positive requests per second")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    span = base_arrivals[-1] - base_arrivals[0] or 1.0
    mean_rate = (len(base_arrivals) - 1) / span
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    rows = []
    for rate in rates:
        arrivals = [(a - base_arrivals[0]) * mean_rate / rate for a in base_arrivals]
        samples: dict[str, list[dict]] = {p: [] for p in llm_by_policy}
        for _ in range(repeats):
            for policy, llm in llm_by_policy.items():
                outs = llm.generate(prompts, params, use_tqdm=False, arrival_times=arrivals)
                wall = llm.stats.wall_s
                m = [o.metrics for o in outs]
                e2e = sorted(x.e2e_s for x in m)
                samples[policy].append({
                    "tokens_per_s": sum(x.output_tokens for x in m) / wall,
                    "ttft_mean_s": statistics.fmean(x.ttft_s for x in m),
                    "e2e_mean_s": statistics.fmean(e2e),
                    "e2e_p90_s": e2e[int(0.9 * (len(e2e) - 1))]})
        for policy, runs in samples.items():
            row = {"policy": policy, "rate": rate}
            for key in ("tokens_per_s", "ttft_mean_s", "e2e_mean_s", "e2e_p90_s"):
                row[key] = statistics.median(r[key] for r in runs)
            for key, name in (("tokens_per_s", "tokens_per_s_range"),
                              ("e2e_mean_s", "e2e_mean_range")):
                row[name] = (min(r[key] for r in runs), max(r[key] for r in runs))
            rows.append(row)
    return rows


def plot_throughput_latency(rows: list[dict], title: str = ""):
    """Mean end-to-end latency against throughput, one line per policy, points = rates
    (with min–max whiskers when the rows carry ranges, as :func:`arrival_sweep`'s do)."""
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    for policy in dict.fromkeys(r["policy"] for r in rows):
        rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        x = [r["tokens_per_s"] for r in rs]
        y = [r["e2e_mean_s"] for r in rs]
        line, = ax.plot(x, y, "o-", label=policy)
        if all("e2e_mean_range" in r for r in rs):
            ax.errorbar(x, y, fmt="none", ecolor=line.get_color(), capsize=2, lw=0.8,
                        yerr=[[v - r["e2e_mean_range"][0] for v, r in zip(y, rs)],
                              [r["e2e_mean_range"][1] - v for v, r in zip(y, rs)]],
                        xerr=[[v - r["tokens_per_s_range"][0] for v, r in zip(x, rs)],
                              [r["tokens_per_s_range"][1] - v for v, r in zip(x, rs)]])
        for r in rs:
            ax.annotate(f"{r['rate']:g}/s", (r["tokens_per_s"], r["e2e_mean_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="throughput (generated tokens/s)", ylabel="mean end-to-end latency (s)",
           title=title or "throughput vs latency as the arrival rate grows")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_rounds(values: dict[str, list[float]], ylabel: str, title: str = ""):
    """One bar per system: the median of its repeated measurements, whiskers min–max."""
    if not values or any(not v for v in values.values()):
        raise ValueError("values must map each name to a non-empty list of measurements")
    fig, ax = plt.subplots(figsize=(7, 2.8), dpi=80)
    names = list(values)
    med = [statistics.median(values[n]) for n in names]
    err = [[m - min(values[n]) for m, n in zip(med, names)],
           [max(values[n]) - m for m, n in zip(med, names)]]
    ax.barh(range(len(names)), med, xerr=err, capsize=4, color="#2e86ab")
    for i, (m, n) in enumerate(zip(med, names)):   # the label right of the whisker
        ax.text(max(values[n]), i, f"  {m:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max(max(v) for v in values.values()))
    ax.set_xlabel(f"{ylabel} (median, min–max over {min(len(v) for v in values.values())} runs)")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


# -- the widget callback -------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _tiny():
    import llmlab

    return llmlab.load_model("tiny-llama", attention="sdpa"), llmlab.load_tokenizer("tiny-llama")


def demo_requests(n: int = 24, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n`` requests of varied prompt (4..40) and output (2..40) lengths, as token ids."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 40000, int(rng.integers(4, 41))).tolist() for _ in range(n)]
    outputs = [int(x) for x in rng.integers(2, 41, n)]
    return prompts, outputs


def serve_demo(max_num_seqs: int, num_blocks: int, block_size: int = 4,
               scheduler: str = "continuous", n: int = 24) -> LLM:
    """Serve :func:`demo_requests` on tiny-llama; the returned LLM holds the step log."""
    model, tok = _tiny()
    llm = LLM(model, tok, scheduler=scheduler, max_num_seqs=max_num_seqs,
              num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    prompts, outputs = demo_requests(n)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.last_outputs = outs
    return llm


def explore_batching(max_num_seqs: int = 8, num_blocks: int = 40, block_size: int = 4,
                     scheduler: str = "continuous"):
    """Widget callback: seats per iteration, free KV blocks, and where preemptions hit.

    Prints how many requests finished (all of them, always), the iterations and the
    preemptions; returns the figure.
    """
    llm = serve_demo(max_num_seqs, num_blocks, block_size, scheduler)
    outs, stats = llm.last_outputs, llm.stats
    rejected = [o for o in outs if o.error]
    done = sum(1 for o in outs if o.finished and not o.error)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 4), dpi=80, sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
    grid = occupancy_grid(stats, max_num_seqs)
    a1.imshow(_colors(grid), aspect="auto", interpolation="nearest",
              extent=(-0.5, grid.shape[1] - 0.5, max_num_seqs - 0.5, -0.5))
    a1.set(ylabel="seat", title=f"{scheduler}, max_num_seqs={max_num_seqs}, "
           f"{num_blocks} blocks × {block_size} tokens")
    steps = np.arange(len(stats.steps))
    a2.plot(steps, [r.free_blocks for r in stats.steps], label="free KV blocks")
    pre = [r.step for r in stats.steps if r.preempted]
    if pre:
        a2.plot(pre, [0] * len(pre), "rv", label="preemption")
    a2.set(xlabel="iteration", ylabel="blocks")
    a2.legend(fontsize=7, loc="upper right")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    print(f"{done}/{len(outs)} requests finished, {len(rejected)} rejected, "
          f"{len(stats.steps)} iterations, {stats.num_preemptions} preemptions")
    if rejected:
        print("rejected:", rejected[0].error)
    return fig


__all__ = ["dry_run", "DryRun", "SchedulerStall", "occupancy_grid", "plot_occupancy",
           "plot_step_times", "arrival_sweep", "plot_throughput_latency", "plot_rounds",
           "demo_requests", "serve_demo", "explore_batching"]
