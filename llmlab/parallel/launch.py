"""``launch(fn, world_size, *args)``: run ``fn(*args)`` on ``world_size`` ranks, return rank 0's result.

Each rank is a fresh Python process started with multiprocessing's ``spawn`` method (so it
works from a notebook and with CUDA), joins a process group on a free localhost port, runs
``fn`` and leaves the group. Spawn pickles ``fn`` by its module and name, so a function of a
module (``llmlab.parallel.workers``) travels as is; a ``def`` from a notebook cell travels as
its source text (:func:`llmlab.parallel.portable.portable`); a lambda cannot travel. If a
rank raises, the others are stopped and :class:`RankError` carries that rank's traceback.
Results travel back pickled, so keep them small (tensors, lists, dataclasses).
Taught in notebook 07.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from .group import destroy_process_group, free_port, init_process_group
from .portable import portable


class RankError(RuntimeError):
    """A rank of :func:`launch` raised (or died); the message holds its traceback."""

    def __init__(self, rank: int, world_size: int, detail: str):
        self.rank, self.world_size, self.detail = rank, world_size, detail
        last = detail.strip().splitlines()[-1] if detail.strip() else "no traceback"
        super().__init__(f"rank {rank} of {world_size} failed: {last}\n\n{detail}")


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple,
               device: str, threads: int, results) -> None:
    torch.set_num_threads(threads)
    joined = False
    try:
        init_process_group(rank, world_size, device=device, master_port=port)
        joined = True
        out = fn(*args)
        results.put((rank, "ok", pickle.dumps(out if rank == 0 else None)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if joined:
            destroy_process_group()


def _sendable(fn: Callable) -> Callable:
    """``fn``, or its source-text package when it was defined in a notebook."""
    try:
        return portable(fn)
    except ValueError as exc:
        mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        raise ValueError(f"fn={getattr(fn, '__name__', fn)!r} must be importable by the spawned "
                         f"ranks (a module-level function, e.g. llmlab.parallel.workers."
                         f"generate_on_ranks) or a def in a notebook whose source can be read; "
                         f"got module={mod!r}, qualname={qual!r}: {exc}") from None


def launch(fn: Callable, world_size: int, *args: Any, device: str = "cpu", threads: int = 1,
           timeout_s: float = 600.0) -> Any:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks and return what rank 0 returned.

    ``device``: 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank). ``threads``: torch
    intra-op threads per rank (1 keeps ranks from fighting over a few CPU cores).
    Raises :class:`RankError` if a rank raises or dies, TimeoutError after ``timeout_s``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be a positive int")
    fn = _sendable(fn)
    if torch.device(device).type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < world_size:
            raise ValueError(f"world_size={world_size} needs {world_size} GPUs with device='cuda'; "
                             f"this machine has {n}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the children at start-up
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, daemon=True, name=f"llmlab-rank{rank}",
                            args=(rank, world_size, port, fn, args, device, threads, results))
            p.start()
            procs.append(p)
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before

    done: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if rank not in done and p.exitcode is not None:
                        # it may have reported just before exiting; drain once more
                        try:
                            r, status, payload = results.get(timeout=1.0)
                            done[r] = (status, payload)
                            if status == "error":
                                raise RankError(r, world_size, payload)
                        except queue_mod.Empty:
                            raise RankError(rank, world_size,
                                            f"process exited with code {p.exitcode} "
                                            "without reporting") from None
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"launch: ranks did not finish within {timeout_s} s; "
                                       f"finished: {sorted(done)}") from None
                continue
            done[rank] = (status, payload)
            if status == "error":
                raise RankError(rank, world_size, payload)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
    return pickle.loads(done[0][1])
