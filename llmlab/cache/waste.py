"""Where KV-cache memory goes: a step-by-step simulation of three ways to hand it out.

The vLLM paper (Kwon et al., SOSP 2023, Fig. 2) found that serving systems which give each
request one contiguous KV region used only 20.4%–38.2% of that memory for token states;
paging brought the waste under 4%. This module reproduces the accounting on a request
trace (``data/traces/*.jsonl``), for a pool of ``budget_tokens`` token slots:

* ``"max_len"`` — (a) each request reserves one contiguous region of
  ``prompt + max_tokens`` slots when admitted (it cannot know when generation stops),
  placed first-fit in the pool; iteration-level admission (as in Orca).
* ``"batch_max"`` — (b) static batching: a batch of requests is admitted together, every
  member reserves the batch's longest request (a padded ``[batch, max_len]`` cache), and
  the whole batch holds its memory until its longest member finishes.
* ``"paged"`` — (c) PagedAttention: blocks of ``block_size`` slots allocated on demand as
  a sequence grows; when a block is needed and none is free, the newest running request
  is preempted (its blocks freed; it is recomputed later).

Every step, each running request writes one token. Pool slots are classified as

* ``used``: token states that are still needed;
* ``reservation``: reserved slots that this request *will* fill later;
* ``internal``: reserved slots that will never be filled (over-provisioning, the tail of a
  block, slots held by a finished member of a static batch);
* ``external``: free slots that cannot be used because they are split into holes too
  small for the next waiting request (only contiguous allocation has this);
* ``idle``: other free slots.

``waste = (reservation + internal + external) / (used + reservation + internal + external)``,
time-averaged over the busy steps. Taught in notebook 04.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .block_manager import BlockManager

POLICIES = ("max_len", "batch_max", "paged")
TRACES_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    prompt: str = ""
    id: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def trace_names() -> list[str]:
    return sorted(p.stem for p in TRACES_DIR.glob("*.jsonl"))


def load_trace(name: str, limit: int | None = None) -> list[Request]:
    """Requests of ``data/traces/<name>.jsonl`` (see ``data/make_trace.py``), in arrival order."""
    path = TRACES_DIR / f"{name}.jsonl"
    if not path.exists():
        raise ValueError(f"unknown trace {name!r}; allowed: {trace_names()}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    reqs = [Request(r["prompt_tokens"], r["output_tokens"], r["arrival_s"], r["prompt"], r["id"])
            for r in rows]
    return reqs[:limit] if limit is not None else reqs


@dataclass
class WasteResult:
    policy: str
    block_size: int | None
    budget_tokens: int
    steps: int = 0                 # busy steps simulated
    used: float = 0.0              # time-averaged slots (divide by budget for a fraction)
    reservation: float = 0.0
    internal: float = 0.0
    external: float = 0.0
    idle: float = 0.0
    mean_running: float = 0.0      # time-averaged concurrent sequences
    peak_running: int = 0
    preemptions: int = 0
    finished: int = 0

    @property
    def held(self) -> float:
        return self.used + self.reservation + self.internal + self.external

    @property
    def waste(self) -> float:
        """Share of held memory that holds no needed token state."""
        return 1.0 - self.used / self.held if self.held else 0.0

    def fractions(self) -> dict[str, float]:
        """Each category as a share of the pool (they sum to 1)."""
        return {k: getattr(self, k) / self.budget_tokens
                for k in ("used", "reservation", "internal", "external", "idle")}

    @property
    def label(self) -> str:
        return f"paged (block {self.block_size})" if self.policy == "paged" else self.policy


@dataclass
class _Running:
    req: Request
    prompt: int                    # tokens to hold at admission (grows after a preemption)
    generated: int = 0             # output tokens produced so far (kept across preemption)
    start: int = 0                 # contiguous region start
    size: int = 0                  # contiguous region size
    order: int = 0                 # admission order, for preemption
    done_at: int | None = None     # static batching: finished but still holding memory

    @property
    def length(self) -> int:
        return self.req.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.req.output_tokens - self.generated


class _FirstFit:
    """Contiguous regions in [0, capacity), placed at the lowest address that fits."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.regions: dict[int, int] = {}       # start -> size

    def alloc(self, size: int) -> int | None:
        """Start of a new region of ``size`` slots, or None when no hole is big enough."""
        pos = 0
        for start in sorted(self.regions):
            if start - pos >= size:
                break
            pos = start + self.regions[start]
        else:
            if self.capacity - pos < size:
                return None
        self.regions[pos] = size
        return pos

    def free(self, start: int) -> None:
        del self.regions[start]


def simulate(requests: Sequence[Request], policy: str, budget_tokens: int,
             block_size: int = 16, max_tokens: int | None = None, max_batch: int = 256,
             step_s: float | None = None) -> WasteResult:
    """Run ``requests`` through a KV pool of ``budget_tokens`` slots; returns the accounting.

    ``max_tokens``: the output cap the server enforces (``max_len`` reserves prompt +
    max_tokens; default: the longest output in ``requests``). ``max_batch`` caps
    concurrent sequences. ``step_s``: seconds per decode step, used to turn arrival
    times into steps; None means every request is waiting at step 0 (a saturated server).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; allowed: {list(POLICIES)}")
    if not requests:
        raise ValueError("requests is empty")
    if policy == "paged" and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"block_size={block_size!r} must be a power of two (1, 2, ..., 256)")
    cap = max_tokens if max_tokens is not None else max(r.output_tokens for r in requests)
    too_big = [r for r in requests if r.prompt_tokens + cap > budget_tokens]
    if too_big:
        raise ValueError(f"budget_tokens={budget_tokens} cannot hold a request of "
                         f"{too_big[0].prompt_tokens} + {cap} tokens")
    res = WasteResult(policy, block_size if policy == "paged" else None, budget_tokens)
    arrivals = [0 if step_s is None else int(r.arrival_s / step_s) for r in requests]
    waiting: list[_Running] = []
    running: list[_Running] = []
    nxt, step, order = 0, 0, 0
    pool = _FirstFit(budget_tokens)
    free_blocks = budget_tokens // block_size     # paged: no sharing here, so counts suffice
    batch_open = False                        # static batching: a batch is running

    while nxt < len(requests) or waiting or running:
        while nxt < len(requests) and arrivals[nxt] <= step:
            waiting.append(_Running(requests[nxt], requests[nxt].prompt_tokens))
            nxt += 1
        if not waiting and not running:       # idle until the next arrival
            step = arrivals[nxt]
            continue

        # -- admission ---------------------------------------------------------------
        blocked_need = None
        if policy == "max_len":
            while waiting and len(running) < max_batch:
                r = waiting[0]
                start = pool.alloc(r.prompt + cap)
                if start is None:
                    blocked_need = r.prompt + cap
                    break
                r.start, r.size, r.order = start, r.prompt + cap, order
                order += 1
                running.append(waiting.pop(0))
        elif policy == "batch_max":
            if not batch_open and waiting:
                batch: list[_Running] = []
                longest = 0
                for r in waiting[:max_batch]:
                    cand = max(longest, r.req.total_tokens)
                    if cand * (len(batch) + 1) > budget_tokens:
                        break
                    batch.append(r)
                    longest = cand
                for r in batch:
                    r.size = longest
                    waiting.remove(r)
                running, batch_open = batch, True
        else:
            while waiting and len(running) < max_batch:
                r = waiting[0]
                need = -(-(r.prompt + 1) // block_size)   # prompt + the first new token's slot
                if need > free_blocks:
                    blocked_need = need
                    break
                free_blocks -= need
                r.size, r.order = need * block_size, order
                order += 1
                running.append(waiting.pop(0))

        # -- account this step ---------------------------------------------------------
        used = reservation = internal = 0
        for r in running:
            held = r.size
            if r.done_at is not None:        # finished member of a static batch
                internal += held
                continue
            length = r.length + 1             # the slot written this step
            final = r.req.total_tokens
            used += length
            reservation += min(held, final) - length
            internal += held - min(held, final)
        free = budget_tokens - used - reservation - internal
        external = 0
        if policy == "max_len" and blocked_need is not None and free >= blocked_need:
            external = free                   # enough free slots, but only in small holes
        res.used += used
        res.reservation += reservation
        res.internal += internal
        res.external += external
        res.idle += free - external
        live = sum(1 for r in running if r.done_at is None)
        res.mean_running += live
        res.peak_running = max(res.peak_running, live)
        res.steps += 1

        # -- every running request writes one token ------------------------------------
        for r in running:
            if r.done_at is None:
                r.generated += 1
                if r.remaining == 0:
                    r.done_at = step
                    res.finished += 1
        finished = [r for r in running if r.done_at is not None]
        if policy == "max_len":
            for r in finished:
                pool.free(r.start)
                running.remove(r)
        elif policy == "paged":
            for r in finished:
                free_blocks += r.size // block_size
                running.remove(r)
            # reserve next step's slot, oldest first; preempt the newest when out of blocks
            needy = [r for r in running if r.length >= r.size]   # last block is full
            if len(needy) > free_blocks:
                running.sort(key=lambda x: x.order)
                gone = set()
                for r in sorted(needy, key=lambda x: x.order):
                    if id(r) in gone:
                        continue
                    while free_blocks == 0:
                        victim = running.pop()               # the newest request
                        if victim is r and not running:
                            raise ValueError(f"budget_tokens={budget_tokens} cannot hold "
                                             "one request")
                        gone.add(id(victim))
                        free_blocks += victim.size // block_size
                        victim.prompt, victim.size = victim.length, 0   # recompute later
                        waiting.insert(0, victim)
                        res.preemptions += 1
                        if victim is r:
                            break
                    if id(r) not in gone:
                        free_blocks -= 1
                        r.size += block_size
            else:
                free_blocks -= len(needy)
                for r in needy:
                    r.size += block_size
        elif all(r.done_at is not None for r in running):
            running, batch_open = [], False
        step += 1

    for k in ("used", "reservation", "internal", "external", "idle", "mean_running"):
        setattr(res, k, getattr(res, k) / max(res.steps, 1))
    return res


def block_size_sweep(requests: Sequence[Request], budget_tokens: int,
                     block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                     **kw) -> list[WasteResult]:
    """``simulate(..., "paged", block_size=b)`` for each block size."""
    return [simulate(requests, "paged", budget_tokens, block_size=b, **kw) for b in block_sizes]


# -- sharing: parallel sampling and beam search ------------------------------------------
@dataclass
class SharingResult:
    mode: str                      # "parallel" or "beam"
    width: int
    block_size: int
    blocks_shared: float           # time-averaged blocks in use, with block sharing
    blocks_unshared: float         # the same sequences, each with its own copy
    cow_copies: int = 0

    @property
    def saving(self) -> float:
        return 1.0 - self.blocks_shared / self.blocks_unshared if self.blocks_unshared else 0.0


def _blocks(n: int, bs: int) -> int:
    return -(-n // bs)


def parallel_sampling_memory(requests: Sequence[Request], n: int = 4, block_size: int = 16,
                             ) -> SharingResult:
    """``n`` samples per prompt: forked after the prompt (shared), or ``n`` separate copies.

    Blocks are counted every decode step and averaged over all steps of all requests.
    """
    shared = unshared = steps = cows = 0
    for req in requests:
        bm = BlockManager(_blocks(req.total_tokens, block_size) * n + n, block_size,
                          enable_prefix_caching=False)
        bm.allocate(0, [0] * req.prompt_tokens)
        for child in range(1, n):
            bm.fork(0, child)
        for t in range(req.output_tokens):
            for s in range(n):
                cows += bm.append_slot(s, None)[1] is not None
            shared += bm.num_used_blocks
            unshared += n * _blocks(req.prompt_tokens + t + 1, block_size)
            steps += 1
    return SharingResult("parallel", n, block_size, shared / steps, unshared / steps, cows)


def beam_search_memory(requests: Sequence[Request], width: int = 4, block_size: int = 16,
                       seed: int = 0, keep_best: float = 0.6) -> SharingResult:
    """Beam search of ``width`` beams: each step every new beam extends a parent beam.

    Parents are drawn at random (the best beam with probability ``keep_best``, else any
    beam), so beams keep sharing long common histories and occasionally diverge, as in
    real beam search. With sharing a new beam forks its parent (copy-on-write on the
    shared last block); without, every beam holds its own full copy.
    """
    rng = random.Random(seed)
    shared = unshared = steps = cows = 0
    for req in requests:
        cap = _blocks(req.total_tokens, block_size) * width * 2 + width
        bm = BlockManager(cap, block_size, enable_prefix_caching=False)
        bm.allocate(("b", 0), [0] * req.prompt_tokens)
        beams, next_id = [("b", 0)], 1
        for t in range(req.output_tokens):
            parents = [beams[0] if rng.random() < keep_best else rng.choice(beams)
                       for _ in range(width)]
            new = []
            for p in parents:
                child = ("b", next_id)
                next_id += 1
                bm.fork(p, child)
                cows += bm.append_slot(child, None)[1] is not None
                new.append(child)
            for b in beams:
                bm.free(b)
            beams = new
            shared += bm.num_used_blocks
            unshared += width * _blocks(req.prompt_tokens + t + 1, block_size)
            steps += 1
    return SharingResult("beam", width, block_size, shared / steps, unshared / steps, cows)


__all__ = ["Request", "load_trace", "trace_names", "simulate", "block_size_sweep",
           "WasteResult", "POLICIES", "SharingResult", "parallel_sampling_memory",
           "beam_search_memory"]
