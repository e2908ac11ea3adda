"""Counting the collectives a piece of code makes, at the dispatcher.

:func:`llmlab.layers.linear.count_collectives` records the calls that go through llmlab's
own ``all_reduce`` / ``all_gather_last_dim``. Code that calls ``torch.distributed``
itself (under any name it was imported as) is seen here instead: a dispatch mode sees
every ``c10d`` operator, e.g. ``c10d.allreduce_`` for ``dist.all_reduce``.
"""
from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import TorchDispatchMode


class _C10dCounter(TorchDispatchMode):
    def __init__(self, counts: dict[str, int]):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            op = name.split(".")[1].rstrip("_")
            self.counts[op] = self.counts.get(op, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_c10d_ops():
    """``with count_c10d_ops() as counts: ...`` fills ``counts`` with the number of calls
    per collective (``{"allreduce": 2, "allgather": 1}``: c10d's names, without the
    trailing underscore), however the code reached ``torch.distributed``."""
    counts: dict[str, int] = {}
    with _C10dCounter(counts):
        yield counts
