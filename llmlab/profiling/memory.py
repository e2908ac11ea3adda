"""Peak memory of a piece of work, on CPU or GPU.

On CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) minus what
was allocated before. On CPU there is no such counter, so the work runs under a
``TorchDispatchMode`` that sees every tensor an operator creates: it adds the bytes of
each new storage and subtracts them when the storage is freed (a weakref finalizer),
keeping the peak. Tensors that existed before are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..device import default_device, sync


@dataclass
class MemoryResult:
    peak_bytes: int
    result: object = None


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside the mode that are still alive."""

    def __init__(self):
        super().__init__()
        self.live: dict[tuple, int] = {}
        self.current = self.peak = 0

    def _freed(self, key) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = (st.data_ptr(), str(st.device))
            if key in self.live or st.nbytes() == 0:
                continue  # a view or an in-place result: no new memory
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._freed, key)
        return out


def _cpu_peak(fn: Callable[[], object]) -> MemoryResult:
    with _LiveBytes() as tracker:
        out = fn()
    return MemoryResult(tracker.peak, out)


def peak_memory(fn: Callable[[], object], device: torch.device | str | None = None) -> MemoryResult:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        out = fn()
        sync(dev)
        return MemoryResult(torch.cuda.max_memory_allocated(dev) - base, out)
    return _cpu_peak(fn)
