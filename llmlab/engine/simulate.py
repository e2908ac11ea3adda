"""The engine's scheduler and block manager serving requests without the model.

:class:`SimulatedRunner` stands where :class:`~llmlab.engine.runner.ModelRunner` stands in
the engine, but runs no forward pass: the tokens a step schedules count as computed, and a
sequence whose tokens are all computed "samples" one new token (a fresh id). Everything
else is the real thing: the real :class:`~llmlab.engine.scheduler.Scheduler` (either
policy, or a hand-written one-step function) decides every step over a real
:class:`~llmlab.cache.block_manager.BlockManager`, so iterations, token positions, seats,
free blocks and preemptions are exactly what the engine would see with a model whose
every answer has the requested length. A whole trace takes milliseconds.

:func:`dry_run` serves a list of (prompt length, output length) requests this way and
returns the step log in the engine's own record type (:class:`~llmlab.engine.llm.EngineStats`),
so the occupancy pictures of :mod:`llmlab.viz.serving` draw it like a real run. Used by
notebook 05 and its exercises.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..cache.block_manager import BlockManager
from .llm import EngineStats, StepRecord
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import Request, SamplingParams, Sequence, SequenceStatus


class SchedulerStall(RuntimeError):
    """:func:`dry_run` found a step with nothing scheduled while requests were waiting."""


class SimulatedRunner:
    """Executes a :class:`SchedulerOutput` without a model: the engine's bookkeeping only.

    Per step: every scheduled sequence's ``num_computed`` grows by the tokens it was fed;
    each one that has then computed all its tokens gets one new token (ids from
    ``first_token`` on), and finishes when it reaches its request's ``max_tokens``
    (``scheduler.finish``, which frees its blocks, as in the engine).
    """

    def __init__(self, scheduler: Scheduler, first_token: int = 1000):
        self.scheduler = scheduler
        self._token = itertools.count(first_token)
        self.finished_order: list[int] = []     # request ids, as they ended
        self.finished_twice: list[int] = []     # request ids sampled again after finishing

    def new_token(self) -> int:
        return next(self._token)

    def execute(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            s.seq.num_computed += s.num_new
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed != seq.num_tokens:
                continue                      # a prompt chunk: no token yet
            if seq.finished:
                self.finished_twice.append(seq.request.request_id)
                continue
            seq.output_token_ids.append(self.new_token())
            if len(seq.output_token_ids) >= seq.request.params.max_tokens:
                seq.status = SequenceStatus.FINISHED_LENGTH
                self.scheduler.finish(seq)
                self.finished_order.append(seq.request.request_id)


@dataclass
class DryRun:
    """What :func:`dry_run` observed: the step log (the engine's own record type, so the
    occupancy pictures work on it), and every request's generated-token count."""

    stats: EngineStats
    output_tokens: list[int]                 # per request, in input order
    finished_order: list[int] = field(default_factory=list)   # request indices, as they ended
    finished_twice: list[int] = field(default_factory=list)

    @property
    def iterations(self) -> int:
        return len(self.stats.steps)


def dry_run(prompt_lens: list[int], output_lens: list[int],
            scheduler: str | Callable = "continuous", *, max_num_seqs: int = 8,
            max_num_batched_tokens: int = 2048, num_blocks: int | None = None,
            block_size: int = 16, max_steps: int = 200_000) -> DryRun:
    """Serve requests with the engine's scheduler and block manager and a
    :class:`SimulatedRunner` instead of the model.

    Request i has a prompt of ``prompt_lens[i]`` tokens and generates ``output_lens[i]``
    tokens (EOS ignored); all arrive at once. ``scheduler``: ``"static"``,
    ``"continuous"`` or a one-step function ``schedule(scheduler, now) -> SchedulerOutput``
    (see :class:`llmlab.engine.scheduler.Scheduler`). ``num_blocks`` defaults to enough
    for every request at once (no preemption). Raises :class:`SchedulerStall` when a step
    schedules nothing while requests wait.
    """
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError(f"prompt_lens ({len(prompt_lens)}) and output_lens "
                         f"({len(output_lens)}) must be non-empty and of equal length")
    if any(n < 1 for n in list(prompt_lens) + list(output_lens)):
        raise ValueError("every prompt and output length must be >= 1")
    schedule_fn = scheduler if callable(scheduler) else None
    policy = "continuous" if schedule_fn is not None else scheduler
    longest = max(p + o for p, o in zip(prompt_lens, output_lens))
    if num_blocks is None:
        num_blocks = sum(-(-(p + o) // block_size) for p, o in zip(prompt_lens, output_lens))
    config = SchedulerConfig(policy, max_num_seqs, max_num_batched_tokens, longest + 1)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(config, bm, schedule_fn)
    runner = SimulatedRunner(sched)

    requests = []
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens)):
        params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
        req = Request(i, None, [runner.new_token() for _ in range(p)], params, 0.0)
        seq = Sequence(i, req, 0, list(req.prompt_token_ids))
        req.seqs.append(seq)
        requests.append(req)
        sched.add(seq)
    stats = EngineStats()
    for step in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule(float("inf"))
        seats = sched.occupancy(max_num_seqs)        # after scheduling, as the engine records
        if out.is_empty:
            raise SchedulerStall(f"step {step}: nothing was scheduled while "
                                 f"{len(sched.waiting)} request(s) waited and "
                                 f"{len(sched.running)} ran")
        runner.execute(out)
        stats.num_preemptions += len(out.preempted)
        stats.steps.append(StepRecord(
            step=step, start_s=0.0, end_s=0.0, num_seqs=len(out.scheduled),
            prefill_tokens=sum(s.num_new for s in out.scheduled if s.prefill),
            decode_tokens=sum(1 for s in out.scheduled if not s.prefill),
            computed_tokens=out.num_padded_tokens, preempted=len(out.preempted),
            free_blocks=bm.num_free_blocks, occupancy=seats))
    else:
        raise SchedulerStall(f"{max_steps} steps and requests are still unfinished")
    return DryRun(stats, [len(r.seqs[0].output_token_ids) for r in requests],
                  runner.finished_order, runner.finished_twice)


__all__ = ["SimulatedRunner", "DryRun", "SchedulerStall", "dry_run"]
