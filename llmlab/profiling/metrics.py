"""Request latency metrics as serving systems report them.

TTFT (time to first token): arrival -> first generated token; dominated by prefill.
TPOT (time per output token): the mean gap between later tokens; dominated by decode.
End-to-end latency = TTFT + TPOT · (output_tokens - 1).
Worst stall: the longest gap between two consecutive output tokens of one request (what a
long prefill step that others wait behind does to a reader; chunked prefill bounds it).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class RequestMetrics:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    max_gap_s: float = float("nan")     # the longest gap between consecutive output tokens

    @property
    def tpot_s(self) -> float:
        """Mean seconds per output token after the first (nan with one token)."""
        if self.output_tokens < 2:
            return float("nan")
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.e2e_s if self.e2e_s > 0 else float("nan")


def _p(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def summarize(metrics: list[RequestMetrics], wall_s: float | None = None) -> dict[str, float]:
    """Mean and p50/p90/p99 TTFT and TPOT, the worst stall between two tokens of any request,
    and throughput (output tokens over ``wall_s``)."""
    ttft = [m.ttft_s for m in metrics]
    tpot = [m.tpot_s for m in metrics if m.output_tokens > 1]
    gaps = [m.max_gap_s for m in metrics if m.max_gap_s == m.max_gap_s]
    total = sum(m.output_tokens for m in metrics)
    wall = wall_s if wall_s is not None else max(m.e2e_s for m in metrics)
    return {
        "requests": len(metrics),
        "output_tokens": total,
        "tokens_per_s": total / wall if wall > 0 else float("nan"),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": _p(ttft, 0.5),
        "ttft_p90_s": _p(ttft, 0.9),
        "ttft_p99_s": _p(ttft, 0.99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else float("nan"),
        "tpot_p50_s": _p(tpot, 0.5),
        "tpot_p90_s": _p(tpot, 0.9),
        "tpot_p99_s": _p(tpot, 0.99),
        "stall_max_s": max(gaps) if gaps else float("nan"),
    }
