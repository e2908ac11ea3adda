"""Where KV-cache memory goes: a step-by-step simulation of three ways to hand it out.

The vLLM paper (Kwon et al., SOSP 2023, Fig. 2) found that serving systems which give each
request one contiguous KV region used only 20.4%–38.2% of that memory for token states;
paging brought the waste under 4%. This module reproduces the accounting on a request
trace (``data/traces/*.jsonl``, read by :func:`llmlab.traces.load_trace`), for a pool of ``budget_tokens`` token slots:

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

import random
from dataclasses import dataclass, field
from typing import Sequence

# Traces are read through this module in notebook 04, hence the re-export.
from ..traces import TraceRequest, load_trace, trace_names
from .block_manager import BlockManager

POLICIES = ("max_len", "batch_max", "paged")


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
    recomputed_tokens: int = 0     # paged: tokens a preempted request must prefill again
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
    req: TraceRequest
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


@dataclass
class _Pool:
    """The simulated server: its queues and its KV memory under one policy."""

    policy: str
    budget_tokens: int
    block_size: int
    cap: int                       # output cap the server enforces (max_len reserves it)
    max_batch: int
    waiting: list[_Running] = field(default_factory=list)
    running: list[_Running] = field(default_factory=list)
    order: int = 0                 # admissions so far
    free_blocks: int = 0           # paged: no sharing here, so counts suffice
    batch_open: bool = False       # static batching: a batch is running
    regions: _FirstFit | None = None

    def __post_init__(self):
        self.free_blocks = self.budget_tokens // self.block_size
        self.regions = _FirstFit(self.budget_tokens)

    def _start(self, r: _Running) -> None:
        r.order = self.order
        self.order += 1
        self.running.append(r)
        self.waiting.remove(r)

    def admit(self) -> int | None:
        """Admit waiting requests as the policy allows; -> the size the first request
        left waiting could not get (slots for max_len, blocks for paged), or None."""
        if self.policy == "batch_max":
            self._admit_static_batch()
            return None
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            if self.policy == "max_len":
                start = self.regions.alloc(r.prompt + self.cap)
                if start is None:
                    return r.prompt + self.cap
                r.start, r.size = start, r.prompt + self.cap
            else:
                need = -(-(r.prompt + 1) // self.block_size)  # prompt + the first new token
                if need > self.free_blocks:
                    return need
                self.free_blocks -= need
                r.size = need * self.block_size
            self._start(r)
        return None

    def _admit_static_batch(self) -> None:
        """A new batch only when the last one has finished; all members reserve its longest."""
        if self.batch_open or not self.waiting:
            return
        batch: list[_Running] = []
        longest = 0
        for r in self.waiting[:self.max_batch]:
            cand = max(longest, r.req.total_tokens)
            if cand * (len(batch) + 1) > self.budget_tokens:
                break
            batch.append(r)
            longest = cand
        for r in batch:
            r.size = longest
            self.waiting.remove(r)
        self.running, self.batch_open = batch, True

    def account(self, res: WasteResult, blocked_need: int | None) -> None:
        """Add this step's slot classification to ``res`` (averaged at the end)."""
        used = reservation = internal = 0
        for r in self.running:
            held = r.size
            if r.done_at is not None:        # finished member of a static batch
                internal += held
                continue
            length = r.length + 1             # the slot written this step
            final = r.req.total_tokens
            used += length
            reservation += min(held, final) - length
            internal += held - min(held, final)
        free = self.budget_tokens - used - reservation - internal
        external = 0
        if self.policy == "max_len" and blocked_need is not None and free >= blocked_need:
            external = free                   # enough free slots, but only in small holes
        res.used += used
        res.reservation += reservation
        res.internal += internal
        res.external += external
        res.idle += free - external
        live = sum(1 for r in self.running if r.done_at is None)
        res.mean_running += live
        res.peak_running = max(res.peak_running, live)
        res.steps += 1

    def decode(self, res: WasteResult, step: int) -> None:
        """Every running request writes one token; finished ones give their memory back
        (a static batch only once all its members are done)."""
        for r in self.running:
            if r.done_at is None:
                r.generated += 1
                if r.remaining == 0:
                    r.done_at = step
                    res.finished += 1
        finished = [r for r in self.running if r.done_at is not None]
        if self.policy == "max_len":
            for r in finished:
                self.regions.free(r.start)
                self.running.remove(r)
        elif self.policy == "paged":
            for r in finished:
                self.free_blocks += r.size // self.block_size
                self.running.remove(r)
            self._grow_blocks(res)
        elif all(r.done_at is not None for r in self.running):
            self.running, self.batch_open = [], False

    def _grow_blocks(self, res: WasteResult) -> None:
        """Paged: reserve next step's slot, oldest first; preempt the newest when out of blocks."""
        needy = [r for r in self.running if r.length >= r.size]   # last block is full
        if len(needy) <= self.free_blocks:
            self.free_blocks -= len(needy)
            for r in needy:
                r.size += self.block_size
            return
        self.running.sort(key=lambda x: x.order)
        gone = set()
        for r in sorted(needy, key=lambda x: x.order):
            if id(r) in gone:
                continue
            while self.free_blocks == 0:
                victim = self.running.pop()               # the newest request
                if victim is r and not self.running:
                    raise ValueError(f"budget_tokens={self.budget_tokens} cannot hold "
                                     "one request")
                gone.add(id(victim))
                self.free_blocks += victim.size // self.block_size
                victim.prompt, victim.size = victim.length, 0   # recompute later
                self.waiting.insert(0, victim)
                res.preemptions += 1
                res.recomputed_tokens += victim.length
                if victim is r:
                    break
            if id(r) not in gone:
                self.free_blocks -= 1
                r.size += self.block_size


def _check_simulation(requests: Sequence[TraceRequest], policy: str, budget_tokens: int,
                      block_size: int, cap: int) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; allowed: {list(POLICIES)}")
    if policy == "paged" and (block_size < 1 or block_size & (block_size - 1)):
        raise ValueError(f"block_size={block_size!r} must be a power of two (1, 2, ..., 256)")
    too_big = [r for r in requests if r.prompt_tokens + cap > budget_tokens]
    if too_big:
        raise ValueError(f"budget_tokens={budget_tokens} cannot hold a request of "
                         f"{too_big[0].prompt_tokens} + {cap} tokens")


def simulate(requests: Sequence[TraceRequest], policy: str, budget_tokens: int,
             block_size: int = 16, max_tokens: int | None = None, max_batch: int = 256,
             step_s: float | None = None) -> WasteResult:
    """Run ``requests`` through a KV pool of ``budget_tokens`` slots; returns the accounting.

    ``max_tokens``: the output cap the server enforces (``max_len`` reserves prompt +
    max_tokens; default: the longest output in ``requests``). ``max_batch`` caps
    concurrent sequences. ``step_s``: seconds per decode step, used to turn arrival
    times into steps; None means every request is waiting at step 0 (a saturated server).
    Each step: admit (per policy), account every pool slot, then every running request
    writes one token.
    """
    if not requests:
        raise ValueError("requests is empty")
    cap = max_tokens if max_tokens is not None else max(r.output_tokens for r in requests)
    _check_simulation(requests, policy, budget_tokens, block_size, cap)
    res = WasteResult(policy, block_size if policy == "paged" else None, budget_tokens)
    arrivals = [0 if step_s is None else int(r.arrival_s / step_s) for r in requests]
    pool = _Pool(policy, budget_tokens, block_size, cap, max_batch)
    nxt = step = 0
    while nxt < len(requests) or pool.waiting or pool.running:
        while nxt < len(requests) and arrivals[nxt] <= step:
            pool.waiting.append(_Running(requests[nxt], requests[nxt].prompt_tokens))
            nxt += 1
        if not pool.waiting and not pool.running:     # idle until the next arrival
            step = arrivals[nxt]
            continue
        blocked_need = pool.admit()
        pool.account(res, blocked_need)
        pool.decode(res, step)
        step += 1
    for k in ("used", "reservation", "internal", "external", "idle", "mean_running"):
        setattr(res, k, getattr(res, k) / max(res.steps, 1))
    return res


def block_size_sweep(requests: Sequence[TraceRequest], budget_tokens: int,
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


def parallel_sampling_memory(requests: Sequence[TraceRequest], n: int = 4, block_size: int = 16,
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


def beam_search_memory(requests: Sequence[TraceRequest], width: int = 4, block_size: int = 16,
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


__all__ = ["TraceRequest", "load_trace", "trace_names", "simulate", "block_size_sweep",
           "WasteResult", "POLICIES", "SharingResult", "parallel_sampling_memory",
           "beam_search_memory"]
