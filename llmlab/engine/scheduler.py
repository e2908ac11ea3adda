"""The scheduler: which sequences run in the next forward pass, and with how many tokens.

Two policies, chosen by name (``SchedulerConfig.policy``):

* ``"static"`` — the baseline. A batch of up to ``max_num_seqs`` requests is formed
  when the previous one has completely finished; its prompts are prefilled together,
  left-padded to the longest, and the batch decodes until its *longest* member is done.
  A member that finishes early keeps its seat empty: nobody joins mid-batch. KV blocks
  for each member's full length (prompt + max_tokens) are reserved up front, as a
  static server must.
* ``"continuous"`` — iteration-level scheduling (Orca, vLLM). Every step, finished
  sequences have already left; running sequences each get one decode token; then
  waiting requests join, first come first served, while there are free seats
  (``max_num_seqs``), token budget (``max_num_batched_tokens`` per step) and free KV
  blocks. Their prompts are *packed* into the same forward without padding (the
  "smart batching" of TurboTransformers, Fang et al., PPoPP 2021,
  https://arxiv.org/abs/2010.05680): the runner gets one flat token list with ``cu_seqlens``.
  When a running sequence needs a block and none is free, the newest running sequence
  is *preempted by recompute*: its blocks are freed and it goes back to the front of
  the waiting queue with all its tokens, to be prefilled again later. Nothing is lost.

  With ``enable_chunked_prefill`` the token budget is a hard cap: decodes go first
  (one token each), then prompts that are part-way through continue, then new ones
  join, each prompt fed in chunks of whatever budget is left (Sarathi-Serve's chunked
  prefill, on by default in vLLM V1). A 2,000-token prompt no longer stalls every
  decoding sequence for a whole long step: it is spread over several steps, each of
  which also advances the decodes. Its first token comes after its last chunk.

Under ``continuous``, ``admission`` orders the waiting queue: ``"fcfs"`` (first come, first
served, the default) or ``"cache_aware"``: the arrived request with the longest cached
prefix goes first (SGLang's longest-prefix-match policy, Zheng et al., NeurIPS 2024,
https://arxiv.org/abs/2312.07104), so requests whose prefix is in the cache run before it
is evicted, and their short prefills leave room for others. It is *bounded*: a request is
overtaken by later arrivals at most ``max_overtakes`` times; after that nothing that
arrived after it is admitted before it. (Only the first ``CACHE_AWARE_WINDOW`` arrived
requests are compared, which bounds the cost of a step.)

The scheduler owns the block manager calls (``allocate``, ``append_slot``, ``free``),
so the runner only executes what it is given. The continuous policy's one-step decision
is a plain function of the scheduler, so a hand-written one can replace it:
``Scheduler(config, bm, schedule_fn=my_schedule)`` or ``LLM(..., scheduler=my_schedule)``
(see :class:`Scheduler`). Taught in notebook 05.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..cache.block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

POLICIES = ("static", "continuous")
ADMISSIONS = ("fcfs", "cache_aware")
CACHE_AWARE_WINDOW = 64

EMPTY, HELD = -1, -2   # occupancy codes: a free seat; a static seat whose member is done


@dataclass
class SchedulerConfig:
    """Knobs of the scheduler. ``max_num_batched_tokens``: tokens per forward (prefill
    tokens + one per decoding sequence); a prompt longer than it still runs, alone —
    unless ``enable_chunked_prefill`` (continuous only), which splits prompts into
    chunks that fit what is left of the budget."""

    policy: str = "continuous"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = False
    admission: str = "fcfs"
    max_overtakes: int = 8

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler={self.policy!r}; allowed: {list(POLICIES)}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission={self.admission!r}; allowed: {list(ADMISSIONS)}")
        if self.admission != "fcfs" and self.policy != "continuous":
            raise ValueError(f"admission={self.admission!r} needs scheduler='continuous'; "
                             f"got scheduler={self.policy!r}")
        if not isinstance(self.max_overtakes, int) or self.max_overtakes < 0:
            raise ValueError(f"max_overtakes={self.max_overtakes!r} must be an int >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.enable_chunked_prefill and self.policy != "continuous":
            raise ValueError(f"enable_chunked_prefill needs scheduler='continuous'; "
                             f"got scheduler={self.policy!r}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int                 # tokens fed this step, from position seq.num_computed on
    prefill: bool = True         # prompt tokens (or a chunk of them), not a decode token


@dataclass
class SchedulerOutput:
    """One step's work. ``packed``: the runner concatenates every sequence's new tokens
    (no padding); otherwise it left-pads them into a [batch, max_new] rectangle."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    packed: bool = True
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    @property
    def num_padded_tokens(self) -> int:
        """Token positions the forward computes: the real ones, plus pads when not packed."""
        if self.packed or not self.scheduled:
            return self.num_tokens
        return len(self.scheduled) * max(s.num_new for s in self.scheduled)


class Scheduler:
    """Waiting queue, running set and seat map over one :class:`BlockManager`.

    ``schedule_fn``: a function that replaces the policy's one-step decision, called as
    ``schedule_fn(scheduler, now) -> SchedulerOutput``; it has the signature of the
    method :meth:`schedule_continuous` (``self`` is the scheduler), so that method's
    source is a working starting point. It may read and change ``scheduler.waiting``
    (a deque, arrival order), ``scheduler.running`` (admission order), ``scheduler.bm``
    and ``scheduler.config``, and use the helpers the built-in policy uses:
    ``in_prefill(seq)``, ``schedule_decodes(out, decoding)`` (a decode slot for each,
    preempting the newest when blocks run out), ``seats_in_use()``,
    ``seats_needed(seq)`` and ``admit(seq, out, limit)`` (allocate a waiting
    sequence's blocks, move it to running and schedule its prompt). Every sequence it
    schedules must hold slots for the tokens it feeds: ``num_new`` tokens from
    ``seq.num_computed`` on. If it raises, the engine recovers as from any failed step.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 schedule_fn: Callable[["Scheduler", float], SchedulerOutput] | None = None):
        if schedule_fn is not None and not callable(schedule_fn):
            raise ValueError(f"schedule_fn must be a function (scheduler, now) -> "
                             f"SchedulerOutput; got {type(schedule_fn).__name__}")
        self.config = config
        self.bm = block_manager
        self.schedule_fn = schedule_fn
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # admission order, oldest first
        self.batch: list[Sequence] = []            # static: the current batch's members
        self.seats: dict[int, Sequence | None] = {}
        self.num_preemptions = 0
        self.overtaken: dict[int, int] = {}        # seq_id -> later arrivals admitted first

    # -- queue --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (requests are added in arrival order)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child joins the running set right after its parent (same step)."""
        seq.status = SequenceStatus.RUNNING
        self._take_seat(seq)
        self.running.append(seq)
        if self.config.policy == "static":
            self.batch.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        """Arrival time of the head of the waiting queue (None if it is empty)."""
        return self.waiting[0].request.arrival_time if self.waiting else None

    def finish(self, seq: Sequence) -> None:
        """A sequence is done (or aborted): free its blocks and take it out of the
        queues; under ``continuous`` its seat frees too."""
        if self.bm.has_seq(seq.seq_id):
            self.bm.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.config.policy == "continuous":
            self.release_seat(seq)

    def reset(self, unfinished: list[Sequence]) -> None:
        """Start over after a step failed part-way: no sequence holds a block any more.

        ``unfinished``: the sequences to keep. They all go back to the waiting queue, to
        be prefilled again from their tokens (as if every running sequence had been
        preempted): the running ones first, oldest first, then the waiting queue in its
        order. Blocks whose K/V were written stay in the prefix cache, so the recompute
        is mostly cache hits; blocks of the failed step were never registered there.
        """
        keep = {id(s): s for s in unfinished}
        order: dict[int, Sequence] = {}
        for s in [*self.running, *self.waiting, *unfinished]:
            if id(s) in keep:
                order.setdefault(id(s), s)
        for seq_id in self.bm.seq_ids():
            self.bm.free(seq_id)
        for s in order.values():
            s.num_computed = 0
            s.status = SequenceStatus.WAITING
            s.slot = None
        self.waiting = deque(order.values())
        self.running, self.batch, self.seats = [], [], {}

    # -- seats (for the occupancy picture and the max_num_seqs limit) ---------------------
    def _take_seat(self, seq: Sequence) -> None:
        slot = 0
        while self.seats.get(slot) is not None:
            slot += 1
        self.seats[slot] = seq
        seq.slot = slot

    def release_seat(self, seq: Sequence) -> None:
        """``seq`` leaves its seat (finished, preempted or aborted); the seat is free."""
        if seq.slot is not None and self.seats.get(seq.slot) is seq:
            self.seats[seq.slot] = None
        seq.slot = None

    def occupancy(self, width: int | None = None) -> list[int]:
        """Per seat: the request id seated there, EMPTY, or HELD (static, member done)."""
        width = max(width or 0, max(self.seats, default=-1) + 1)
        row = []
        for slot in range(width):
            s = self.seats.get(slot)
            row.append(EMPTY if s is None else HELD if s.finished else s.request.request_id)
        return row

    def seats_in_use(self) -> int:
        """Running sequences plus seats promised to not-yet-forked completions."""
        pending = {id(s.request): s.request.params.n - len(s.request.seqs)
                   for s in self.running}
        held = sum(1 for s in self.seats.values() if s is not None and s.finished)
        return len(self.running) + sum(pending.values()) + held

    def seats_needed(self, seq: Sequence) -> int:
        req = seq.request
        return req.params.n if len(req.seqs) < req.params.n else 1

    # -- preemption -----------------------------------------------------------------------
    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: free the blocks, back to the front of the waiting queue."""
        self.bm.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.batch:
            self.batch.remove(seq)
        self.release_seat(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule_decodes(self, out: SchedulerOutput,
                         decoding: list[Sequence] | None = None) -> int:
        """One new token per decoding sequence (default: every running one that is not
        part-way through its prompt), preempting the newest when blocks run out.

        Returns the number of tokens scheduled."""
        queue = [s for s in self.running if not self.in_prefill(s)] if decoding is None \
            else list(decoding)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            while not self.bm.can_append(seq.seq_id):
                victim = queue.pop() if queue else seq
                self.preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            _, cow = self.bm.append_slot(seq.seq_id, seq.last_token_id)
            if cow is not None:
                out.block_copies.append(cow)
            out.scheduled.append(ScheduledSeq(seq, seq.num_uncomputed, prefill=False))
            kept.append(seq)
        return len(kept)          # the preempted have left self.running

    def in_prefill(self, seq: Sequence) -> bool:
        """Still feeding tokens it already holds slots for (a prompt, or a chunk of one)."""
        return self.bm.has_seq(seq.seq_id) and self.bm.num_tokens(seq.seq_id) > seq.num_computed

    def admit(self, seq: Sequence, out: SchedulerOutput, limit: int | None = None) -> int:
        """Allocate a waiting sequence's blocks and schedule its prefill (at most ``limit``
        tokens of it); returns the tokens scheduled."""
        cached = self.bm.allocate(seq.seq_id, seq.all_token_ids)
        out.block_copies.extend(self.bm.take_copies())   # a match that ends inside a block
        seq.num_computed = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)      # running before it leaves the queue: never in neither
        self.waiting.remove(seq)
        self._take_seat(seq)
        n = seq.num_uncomputed if limit is None else min(seq.num_uncomputed, limit)
        out.scheduled.append(ScheduledSeq(seq, n))
        return n

    # -- policies ----------------------------------------------------------------------------
    def schedule(self, now: float = float("inf")) -> SchedulerOutput:
        """Decide the next step. ``now``: the engine clock; requests arriving later wait."""
        if self.schedule_fn is not None:
            return self.schedule_fn(self, now)
        if self.config.policy == "continuous":
            return self.schedule_continuous(now)
        return self.schedule_static(now)

    def schedule_continuous(self, now: float) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(packed=True)
        filling, decoding = [], []      # split before the decodes append their slots
        for s in self.running:
            (filling if self.in_prefill(s) else decoding).append(s)
        used = self.schedule_decodes(out, decoding)
        budget = cfg.max_num_batched_tokens
        chunked = cfg.enable_chunked_prefill
        for seq in filling if chunked else []:   # prompts part-way through go on first
            if used < budget:
                n = min(seq.num_uncomputed, budget - used)
                out.scheduled.append(ScheduledSeq(seq, n))
                used += n
        if out.preempted:           # memory is tight: let the running ones drain first
            return out
        seats = self.seats_in_use()
        while self.waiting:
            seq = self.next_waiting(now)
            if seq is None:
                break
            need = self.seats_needed(seq)
            if seats + need > cfg.max_num_seqs:
                break
            if chunked and used >= budget:
                break
            if not chunked and out.scheduled and used + seq.num_tokens > budget:
                break
            if not self.bm.can_allocate(seq.all_token_ids):
                break
            self._count_overtakes(seq)
            used += self.admit(seq, out, budget - used if chunked else None)
            seats += need
        return out

    def next_waiting(self, now: float) -> Sequence | None:
        """The waiting sequence to admit next under ``config.admission`` (None: nobody has
        arrived). ``"cache_aware"``: the longest cached prefix (the earliest on a tie) among
        the arrived ones up to the first that was overtaken ``max_overtakes`` times."""
        if not self.waiting or self.waiting[0].request.arrival_time > now:
            return None
        if self.config.admission == "fcfs":
            return self.waiting[0]
        best, best_len = None, -1
        for i, seq in enumerate(self.waiting):
            if i >= CACHE_AWARE_WINDOW or seq.request.arrival_time > now:
                break
            n = self.bm.cached_prefix_length(seq.all_token_ids)
            if n > best_len:
                best, best_len = seq, n
            if self.overtaken.get(seq.seq_id, 0) >= self.config.max_overtakes:
                break                   # the bound: nobody behind it goes first
        return best

    def _count_overtakes(self, seq: Sequence) -> None:
        """``seq`` is admitted: every arrived sequence ahead of it in the queue is overtaken."""
        self.overtaken.pop(seq.seq_id, None)
        for s in self.waiting:
            if s is seq:
                break
            self.overtaken[s.seq_id] = self.overtaken.get(s.seq_id, 0) + 1

    def _blocks_reserved(self, seq: Sequence) -> int:
        """Blocks a static server reserves for a member: its whole possible length, × n."""
        req = seq.request
        remaining = req.params.max_tokens - len(seq.output_token_ids)
        length = min(seq.num_tokens + remaining, self.config.max_model_len)
        return -(-length // self.bm.block_size) * self.seats_needed(seq)

    def schedule_static(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(packed=False)
        self.batch = [s for s in self.batch if not s.finished or s.slot is not None]
        if self.batch and all(s.finished for s in self.batch):
            for s in self.batch:       # the whole table has finished: free the seats
                self.release_seat(s)
            self.batch = []
        if self.batch:
            self.schedule_decodes(out)
            return out
        seats, blocks = 0, 0
        while self.waiting:
            seq = self.waiting[0]
            if seq.request.arrival_time > now:
                break
            need_seats, need_blocks = self.seats_needed(seq), self._blocks_reserved(seq)
            if seats and (seats + need_seats > self.config.max_num_seqs
                          or blocks + need_blocks > self.bm.num_free_blocks):
                break
            if not self.bm.can_allocate(seq.all_token_ids):
                break
            seats += need_seats
            blocks += need_blocks
            self.admit(seq, out)
            self.batch.append(seq)
        return out


__all__ = ["POLICIES", "ADMISSIONS", "SchedulerConfig", "Scheduler", "SchedulerOutput", "ScheduledSeq",
           "EMPTY", "HELD"]
