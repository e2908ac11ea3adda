"""Multi-turn sessions served by the engine: each turn is sent when the previous answer ends.

A chat turn resends the whole conversation: turn k's prompt is turn k-1's prompt, its
answer (the tokens the engine generated) and the new text. :func:`run_sessions` plays a
list of :class:`Session` against an :class:`~llmlab.engine.llm.LLM` as a client would: a
session's first turn arrives at its arrival time; each later turn is queued only when the
previous answer has finished, ``think_s`` seconds later, so the engine never sees a turn
before it could exist. The prompt is built from token ids (the answer as generated, not
re-tokenized text), so a prefix cache can find the whole conversation so far.

:func:`simulate_sessions` serves the same sessions with the engine's real scheduler and
block manager but no model: each step takes the time a fitted step-cost model
(:class:`~llmlab.profiling.steps.StepCost`) gives it, on a virtual clock. Its TTFTs are a
model's, labelled so; its hit rates and token counts are what the scheduler and cache do.

Taught in notebook 13; ``python -m llmlab.bench prefix`` runs both traces.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

from ..cache.block_manager import BlockManager
from ..profiling.metrics import _p
from ..traces import TraceRequest
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Request, SamplingParams, Sequence, SequenceStatus


@dataclass
class Turn:
    """One turn: the token ids it appends to the conversation, how many tokens the answer
    has (EOS ignored), and when it arrives (turn 0: seconds after the start; later turns:
    seconds after the previous answer)."""

    token_ids: list[int]
    output_tokens: int
    wait_s: float = 0.0


@dataclass
class Session:
    id: str
    turns: list[Turn]


def sessions_of(trace: Seq[TraceRequest]) -> list[Session]:
    """Group a loaded trace (``load_trace(..., tokenizer=...)``) into sessions: requests with
    the same ``session`` in turn order; a request without one is a session of one turn."""
    groups: dict[str, list[TraceRequest]] = {}
    for i, r in enumerate(trace):
        if r.prompt_token_ids is None:
            raise ValueError(f"request {r.id!r} has no token ids; load the trace with "
                             "load_trace(name, tokenizer=tok)")
        groups.setdefault(r.session or f"#{i}", []).append(r)
    out = []
    for sid, rs in groups.items():
        rs = sorted(rs, key=lambda r: r.turn)
        out.append(Session(sid, [Turn(list(r.prompt_token_ids), r.output_tokens, r.arrival_s)
                                 for r in rs]))
    return out


@dataclass
class TurnResult:
    session: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    arrival_s: float = 0.0         # on the run's clock
    output_token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class SessionRun:
    """What serving a set of sessions measured (``model`` names a simulated run's clock)."""

    turns: list[TurnResult]
    wall_s: float
    prompt_tokens: int             # the prompts' lengths, summed
    computed_prompt_tokens: int    # prompt positions the forwards ran (recompute included)
    hit_rate: float                # prompt tokens served from the prefix cache / looked up
    num_preemptions: int = 0
    model: str = ""                # "" when measured, else what the clock is
    step_stats: object = field(default=None, repr=False)   # the engine's EngineStats

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    def ttft(self, q: float) -> float:
        """The q-quantile of the turns' TTFT, in seconds."""
        return _p([t.ttft_s for t in self.turns], q)

    @property
    def throughput(self) -> float:
        """Output tokens per second of the whole run."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def computed_share(self) -> float:
        """Prompt tokens computed over prompt tokens sent."""
        return self.computed_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _follow_up(prompt: list[int], output: list[int], turn: Turn) -> list[int]:
    return prompt + output + turn.token_ids


def run_sessions(llm, sessions: Seq[Session], *, time_scale: float = 1.0) -> SessionRun:
    """Serve ``sessions`` on ``llm`` (an :class:`~llmlab.engine.llm.LLM`), greedy, each answer
    exactly its turn's ``output_tokens`` long; arrival and think times are multiplied by
    ``time_scale``. Returns the per-turn TTFT and the run's token counts."""
    from .llm import EngineStats

    eng = llm.engine
    llm._check_not_served()
    bm = eng.cache.manager
    eng.stats = EngineStats()
    hits0, queries0 = bm.stats.hits, bm.stats.queries
    start = eng.now()
    # (arrival, order, session index, turn index, prompt ids), kept sorted by arrival
    future = [(start + s.turns[0].wait_s * time_scale, i, i, 0, list(s.turns[0].token_ids))
              for i, s in enumerate(sessions) if s.turns]
    future.sort()
    order = itertools.count(len(future))
    active: dict[int, tuple] = {}       # request id -> (request, session idx, turn idx, ids)
    results: list[TurnResult] = []
    sent = 0
    try:
        while future or active:
            now = eng.now()
            while future and future[0][0] <= now:
                at, _, si, ti, ids = future.pop(0)
                turn = sessions[si].turns[ti]
                params = SamplingParams(temperature=0, max_tokens=turn.output_tokens,
                                        ignore_eos=True)
                req = eng.add_request(ids, params, None, arrival_time=at)
                if req.error is not None:
                    raise ValueError(f"session {sessions[si].id!r} turn {ti}: {req.error}")
                active[req.request_id] = (req, si, ti, ids)
                sent += len(ids)
            if eng.has_unfinished():
                eng.step()
            elif future:
                time.sleep(max(0.0, min(future[0][0] - eng.now(), 0.05)))
            for rid in [r for r, v in active.items() if v[0].finished]:
                req, si, ti, ids = active.pop(rid)
                seq = req.seqs[0]
                m = seq.metrics()
                results.append(TurnResult(sessions[si].id, ti, len(ids), m.output_tokens,
                                          m.ttft_s, m.e2e_s, req.arrival_time - start,
                                          list(seq.output_token_ids)))
                turns = sessions[si].turns
                if ti + 1 < len(turns):
                    nxt = turns[ti + 1]
                    future.append((seq.finish_time + nxt.wait_s * time_scale, next(order), si,
                                   ti + 1, _follow_up(ids, list(seq.output_token_ids), nxt)))
                    future.sort()
    except BaseException:
        for req, *_ in active.values():
            eng.abort_request(req.request_id)
        raise
    wall = eng.now() - start
    eng.stats.wall_s = wall
    queries = bm.stats.queries - queries0
    return SessionRun(results, wall, sent, sum(r.prefill_tokens for r in eng.stats.steps),
                      (bm.stats.hits - hits0) / queries if queries else 0.0,
                      eng.stats.num_preemptions, step_stats=eng.stats)


def simulate_sessions(sessions: Seq[Session], cost, *, prefix_cache="radix",
                      admission: str = "fcfs", max_overtakes: int = 8,
                      num_blocks: int = 256, block_size: int = 16,
                      max_num_seqs: int = 8, max_num_batched_tokens: int = 2048,
                      max_model_len: int = 8192, time_scale: float = 1.0,
                      max_steps: int = 200_000) -> SessionRun:
    """Serve ``sessions`` with the engine's scheduler and block manager and no model.

    A step lasts ``cost.predict_ms(decode rows, prompt tokens)`` on a virtual clock
    (``cost``: a :class:`~llmlab.profiling.steps.StepCost`, e.g. fitted from a measured
    run); each answer's tokens are fresh ids, fed back in the next turn's prompt as the
    engine would. Hit rate and computed tokens are the real cache's; TTFT is the model's.
    """
    config = SchedulerConfig("continuous", max_num_seqs, max_num_batched_tokens,
                             max_model_len, admission=admission, max_overtakes=max_overtakes)
    bm = BlockManager(num_blocks, block_size, prefix_cache=prefix_cache)
    sched = Scheduler(config, bm)
    fresh = itertools.count(1_000_000)
    now = 0.0
    future = [(s.turns[0].wait_s * time_scale, i, i, 0, list(s.turns[0].token_ids))
              for i, s in enumerate(sessions) if s.turns]
    future.sort()
    order = itertools.count(len(future))
    ids_of: dict[int, tuple] = {}
    first_token: dict[int, float] = {}
    results, sent, computed, preempted = [], 0, 0, 0
    rid = itertools.count()
    for _ in range(max_steps):
        if not future and not sched.has_unfinished():
            break
        while future and future[0][0] <= now:
            at, _, si, ti, ids = future.pop(0)
            turn = sessions[si].turns[ti]
            need = -(-(len(ids) + turn.output_tokens) // block_size)
            if len(ids) + turn.output_tokens > max_model_len or need > num_blocks:
                raise ValueError(f"session {sessions[si].id!r} turn {ti} needs {need} blocks "
                                 f"and {len(ids) + turn.output_tokens} tokens; allowed: "
                                 f"num_blocks={num_blocks}, max_model_len={max_model_len}")
            params = SamplingParams(temperature=0, max_tokens=turn.output_tokens,
                                    ignore_eos=True)
            req = Request(next(rid), None, ids, params, at)
            seq = Sequence(req.request_id, req, 0, list(ids))
            req.seqs.append(seq)
            sched.add(seq)
            ids_of[req.request_id] = (req, si, ti, ids)
            sent += len(ids)
        out = sched.schedule(now)
        if out.is_empty:
            if not future:
                raise RuntimeError("the scheduler made no progress with nothing to wait for")
            now = max(now, future[0][0])
            continue
        prompt = sum(s.num_new for s in out.scheduled if s.prefill)
        rows = sum(1 for s in out.scheduled if not s.prefill)
        computed += prompt
        preempted += len(out.preempted)
        now += max(cost.predict_ms(rows, prompt), 0.0) / 1e3
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed += s.num_new
            bm.mark_computed(seq.seq_id, seq.num_computed)
            if seq.num_computed != seq.num_tokens:
                continue
            seq.output_token_ids.append(next(fresh))
            first_token.setdefault(seq.seq_id, now)
            req, si, ti, ids = ids_of[seq.request.request_id]
            if len(seq.output_token_ids) < req.params.max_tokens:
                continue
            seq.status = SequenceStatus.FINISHED_LENGTH
            sched.finish(seq)
            results.append(TurnResult(sessions[si].id, ti, len(ids), len(seq.output_token_ids),
                                      first_token.pop(seq.seq_id) - req.arrival_time,
                                      now - req.arrival_time, req.arrival_time))
            turns = sessions[si].turns
            if ti + 1 < len(turns):
                nxt = turns[ti + 1]
                future.append((now + nxt.wait_s * time_scale, next(order), si, ti + 1,
                               _follow_up(ids, list(seq.output_token_ids), nxt)))
                future.sort()
    else:
        raise RuntimeError(f"{max_steps} steps and sessions are still unfinished")
    return SessionRun(results, now, sent, computed, bm.stats.hit_rate, preempted,
                      model="step-cost model")


__all__ = ["Turn", "Session", "sessions_of", "TurnResult", "SessionRun", "run_sessions",
           "simulate_sessions"]
