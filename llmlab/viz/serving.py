"""Figures and explorers for notebook 05 (continuous batching).

* :func:`plot_occupancy` — who sits in which batch seat at every iteration, static vs
  continuous, from the engines' step logs;
* :func:`capacity`, :func:`load_sweep` / :func:`plot_load_sweep` — p50 and p99 TTFT and
  TPOT as Poisson arrivals come faster, up to and past each policy's capacity;
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

def capacity(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> float:
    """Requests per second an engine serves when every request is waiting at t = 0: the
    load beyond which its queue can only grow. Greedy, EOS ignored. ``llm.stats`` then holds
    that run's step log (its iterations and their times)."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) / llm.stats.wall_s


def load_sweep(llm_by_policy: dict[str, LLM], prompts: list[list[int]],
               max_tokens: list[int], rates: list[float], seed: int = 0) -> list[dict]:
    """Serve the same requests, arriving as a Poisson process, at several rates with each
    engine (the engines interleaved at each rate; one draw of arrivals per rate, the same
    for every engine). Greedy, EOS ignored.

    Returns one row per (policy, rate) with ``llmlab.profiling.summarize``'s keys (p50 /
    p90 / p99 TTFT and TPOT, throughput, the worst stall), plus ``ttft_p99_ci`` and
    ``tpot_p99_ci`` (bootstrap intervals for those percentiles over the requests), and
    ``ttfts`` / ``tpots``, every request's values (for ``llmlab.profiling.compare``).
    """
    from ..profiling.metrics import summarize
    from ..serve.client import percentile_interval, poisson_arrivals

    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates={rates!r} must be positive requests per second")
    if len(prompts) != len(max_tokens) or not prompts:
        raise ValueError(f"prompts ({len(prompts)}) and max_tokens ({len(max_tokens)}) must "
                         "be non-empty and of equal length")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    rows = []
    for i, rate in enumerate(rates):
        arrivals = poisson_arrivals(rate, len(prompts), seed=seed + i)
        for policy, llm in llm_by_policy.items():
            outs = llm.generate(prompts, params, use_tqdm=False, arrival_times=arrivals)
            m = [o.metrics for o in outs]
            row = {"policy": policy, "rate": rate, **summarize(m, llm.stats.wall_s)}
            row["ttfts"] = [x.ttft_s for x in m]
            row["tpots"] = [x.tpot_s for x in m if x.output_tokens > 1]
            row["ttft_p99_ci"] = percentile_interval(row["ttfts"], 99)
            row["tpot_p99_ci"] = percentile_interval(row["tpots"], 99)
            rows.append(row)
    return rows


def plot_load_sweep(rows: list[dict], title: str = "", capacities: dict | None = None):
    """TTFT (left) and TPOT (right) against the arrival rate, p50 solid and p99 dashed with
    its bootstrap interval, one colour per policy; a dotted vertical line at each policy's
    measured capacity when ``capacities`` ({policy: requests/s}) is given."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.3), dpi=80)
    colors = dict(zip(dict.fromkeys(r["policy"] for r in rows), plt.get_cmap("tab10").colors))
    for ax, key, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "tpot", "TPOT (ms)")):
        scale = 1.0 if key == "ttft" else 1e3
        for policy, color in colors.items():
            rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
            x = [r["rate"] for r in rs]
            ax.plot(x, [r[f"{key}_p50_s"] * scale for r in rs], "o-", color=color, ms=4,
                    label=f"{policy} p50")
            p99 = [r[f"{key}_p99_s"] * scale for r in rs]
            lo = [r[f"{key}_p99_ci"][0] * scale for r in rs]
            hi = [r[f"{key}_p99_ci"][1] * scale for r in rs]
            ax.errorbar(x, p99, yerr=[[max(p - a, 0) for p, a in zip(p99, lo)],
                                      [max(b - p, 0) for p, b in zip(p99, hi)]],
                        fmt="s--", color=color, ms=3, capsize=2, lw=1, label=f"{policy} p99")
            if capacities and policy in capacities:
                ax.axvline(capacities[policy], color=color, ls=":", lw=1)
        ax.set(xlabel="arrival rate (requests/s)", ylabel=label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title or "latency as the load grows", fontsize=10)
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
           "plot_step_times", "capacity", "load_sweep", "plot_load_sweep", "plot_rounds",
           "demo_requests", "serve_demo", "explore_batching"]
