"""Where does a forward pass spend its time? By operator (torch.profiler) and by part.

``time_by_part`` puts forward hooks on the model's attention, MLP, norms, embedding and
lm_head modules for one call and adds up the wall time spent inside each (synchronizing
on a GPU). Taught in notebook 01.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..device import sync


@dataclass
class OpTime:
    name: str
    self_ms: float
    calls: int


@contextlib.contextmanager
def _native_stderr_silenced():
    """Point file descriptor 2 at /dev/null for the block: the profiler's C++ side prints
    "profiler_start"/"profiler_stop" lines there, which Python's sys.stderr never sees."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_by_operator(fn, row_limit: int = 10) -> list[OpTime]:
    """Run ``fn()`` under torch.profiler; the operators with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _native_stderr_silenced(), profile(activities=acts) as prof:
        fn()
    rows = []
    for ev in prof.key_averages():
        t = ev.self_cpu_time_total
        if torch.cuda.is_available():
            t = max(t, getattr(ev, "self_device_time_total", 0))
        rows.append(OpTime(ev.key, t / 1e3, ev.count))
    rows.sort(key=lambda r: r.self_ms, reverse=True)
    return rows[:row_limit]


def _part_of(name: str, module: torch.nn.Module) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if last == "self_attn":
        return "attention"
    if last == "mlp":
        return "mlp"
    if last in ("input_layernorm", "post_attention_layernorm", "norm"):
        return "norms"
    if last in ("embed_tokens", "lm_head"):
        return last
    return None


@torch.inference_mode()
def time_by_part(model: torch.nn.Module, *args, **kwargs) -> dict[str, float]:
    """Seconds spent in each part of one ``model(*args, **kwargs)`` call, plus "other"."""
    totals: dict[str, float] = defaultdict(float)
    starts: dict[int, float] = {}
    handles = []
    dev = next(model.parameters()).device

    def pre(mod, _inp):
        sync(dev)
        starts[id(mod)] = time.perf_counter()

    def make_post(part):
        def post(mod, _inp, _out):
            sync(dev)
            totals[part] += time.perf_counter() - starts.pop(id(mod))
        return post

    for name, mod in model.named_modules():
        part = _part_of(name, mod)
        if part is not None:
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(make_post(part)))
    try:
        sync(dev)
        t0 = time.perf_counter()
        model(*args, **kwargs)
        sync(dev)
        total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    out = dict(totals)
    out["other"] = max(0.0, total - sum(totals.values()))
    return out
