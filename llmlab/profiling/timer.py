"""Device-aware timing: CUDA events on GPU, synchronized perf_counter on CPU.

GPU work is asynchronous: reading a wall clock right after launching a kernel measures
the launch, not the work. CUDA events are recorded in the stream and timed by the GPU.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..device import default_device, sync


class Timer:
    """``with Timer() as t: ...``; then ``t.seconds``. Uses CUDA events on a CUDA device."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        self.seconds = float("nan")

    def __enter__(self) -> "Timer":
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            sync(self.device)
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            sync(self.device)
            self.seconds = time.perf_counter() - self._t0


@dataclass
class TimingResult:
    times_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    def __repr__(self) -> str:
        return f"TimingResult(median={self.median_s * 1e3:.3f} ms, n={len(self.times_s)})"


def time_fn(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
            device: torch.device | str | None = None) -> TimingResult:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed."""
    return time_interleaved({"fn": fn}, repeats, warmup, device)["fn"]


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                     device: torch.device | str | None = None) -> dict[str, TimingResult]:
    """Time several functions against each other: ``warmup`` untimed calls of each, then
    ``repeats`` rounds in which each runs once, in turn. A slow minute on a shared machine
    then lands on every function's samples instead of on one function's median."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {name: TimingResult() for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with Timer(device) as t:
                fn()
            out[name].times_s.append(t.seconds)
    return out
