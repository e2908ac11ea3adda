"""Figures and explorers for notebook 05 (continuous batching).

* :func:`plot_occupancy` — who sits in which batch seat at every iteration, static vs
  continuous, from the engines' step logs;
* :func:`arrival_sweep` / :func:`plot_throughput_latency` — throughput against latency
  as requests arrive faster (arrival times from a trace, rescaled to a rate);
* :func:`explore_batching` — the widget callback: serve a fixed set of requests with a
  given ``max_num_seqs`` and KV block budget, and show seats, free blocks and preemptions.
"""
from __future__ import annotations

import functools
import statistics

import matplotlib.pyplot as plt
import numpy as np

from ..engine import LLM, EngineStats, SamplingParams
from ..engine.scheduler import EMPTY, HELD


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
                  rates: list[float]) -> list[dict]:
    """Serve the same requests at several arrival rates with each engine.

    ``base_arrivals``: arrival times (s) of a trace; they are rescaled so requests come
    in at ``rate`` per second on average. Returns rows {"policy", "rate", "tokens_per_s",
    "ttft_mean_s", "e2e_mean_s", "e2e_p90_s"} (greedy, EOS ignored).
    """
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates={rates!r} must be positive requests per second")
    span = base_arrivals[-1] - base_arrivals[0] or 1.0
    mean_rate = (len(base_arrivals) - 1) / span
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    rows = []
    for rate in rates:
        arrivals = [(a - base_arrivals[0]) * mean_rate / rate for a in base_arrivals]
        for policy, llm in llm_by_policy.items():
            outs = llm.generate(prompts, params, use_tqdm=False, arrival_times=arrivals)
            wall = llm.stats.wall_s
            m = [o.metrics for o in outs]
            e2e = sorted(x.e2e_s for x in m)
            rows.append({"policy": policy, "rate": rate,
                         "tokens_per_s": sum(x.output_tokens for x in m) / wall,
                         "ttft_mean_s": statistics.fmean(x.ttft_s for x in m),
                         "e2e_mean_s": statistics.fmean(e2e),
                         "e2e_p90_s": e2e[int(0.9 * (len(e2e) - 1))]})
    return rows


def plot_throughput_latency(rows: list[dict], title: str = ""):
    """Mean end-to-end latency against throughput, one line per policy, points = rates."""
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=80)
    for policy in dict.fromkeys(r["policy"] for r in rows):
        rs = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        ax.plot([r["tokens_per_s"] for r in rs], [r["e2e_mean_s"] for r in rs], "o-",
                label=policy)
        for r in rs:
            ax.annotate(f"{r['rate']:g}/s", (r["tokens_per_s"], r["e2e_mean_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="throughput (generated tokens/s)", ylabel="mean end-to-end latency (s)",
           title=title or "throughput vs latency as the arrival rate grows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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


__all__ = ["occupancy_grid", "plot_occupancy", "plot_step_times", "arrival_sweep", "plot_throughput_latency",
           "demo_requests", "serve_demo", "explore_batching"]
