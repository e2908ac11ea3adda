"""Exercises of notebook 05 (continuous batching): ``cu_seqlens``, static iterations, two
predictions checked against the run, and the build exercise ``nb05.schedule``: one step of continuous batching.

``schedule(sched, now) -> SchedulerOutput`` replaces the engine's continuous policy
(``LLM(..., scheduler=schedule)``). The student writes the decisions; three given helpers
do the bookkeeping: :func:`decode_one` (a slot and one decode token for a running
sequence), :func:`admit` (the head of the waiting queue joins, its prompt scheduled) and
:func:`requeue` (a preempted sequence waits again, at the front, to be recomputed).
It is judged in three stages, cheapest first: single steps on hand-built queues (precise
messages), the engine's scheduler serving notebook 05's whole trace without the model
(:func:`llmlab.engine.simulate.dry_run`: no request lost or duplicated, fewer iterations and
positions than static batching), and the engine on tiny-llama with a pool small enough to
preempt, whose greedy tokens must equal generating each request alone.
"""
from __future__ import annotations

import functools

from ..cache.block_manager import BlockManager
from ..engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from ..engine.sequence import Request, SamplingParams, Sequence, SequenceStatus
from . import exercise, first_token_difference, number_verdict, right, wrong

NB = "05_continuous_batching"


# ---- 1. cu_seqlens -------------------------------------------------------------------------

def _solution_cu_seqlens(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@exercise("nb05.cu_seqlens", notebook=NB, title="offsets of packed sequences (cu_seqlens)",
          kind="build", solution=_solution_cu_seqlens,
          wrong_variants={"no leading zero": (lambda ls: _solution_cu_seqlens(ls)[1:],
                                              ("start with 0",)),
                          "the lengths themselves": (lambda ls: [0] + list(ls),
                                                     ("running sum",))})
def _check_cu_seqlens(fn):
    """``fn(lengths)`` must return cu_seqlens: [0, l0, l0+l1, ...] (length batch + 1)."""
    import torch

    cases = ([5, 1, 3], [7], [2, 2, 2, 2], [1, 16, 1])
    got = [fn(list(c)) for c in cases]        # an exception propagates: the verdict names it
    if any(g is None for g in got):
        return wrong("your function returns None.",
                     "return a list (or tensor) of batch + 1 offsets.")
    for c, g in zip(cases, got):
        g = g.tolist() if torch.is_tensor(g) else list(g)
        want = _solution_cu_seqlens(c)
        if g == want:
            continue
        if len(g) == len(c) and g == want[1:]:
            return wrong(f"for lengths {c} you returned {g}: cu_seqlens has batch + 1 entries "
                         f"and must start with 0 ({want}).", "prepend the 0.")
        return wrong(f"for lengths {c} expected {want}, got {g}.",
                     "a running sum that starts at 0 (itertools.accumulate, or torch.cumsum).")
    return right("sequence i owns packed rows cu_seqlens[i]:cu_seqlens[i+1].")


# ---- 3. static iterations -------------------------------------------------------------------

def _static_iterations(output_lengths: list[int], batch_size: int) -> int:
    return sum(max(output_lengths[i:i + batch_size])
               for i in range(0, len(output_lengths), batch_size))


_STATIC_CASE = ([5, 60, 8, 12, 90, 7, 3, 40], 4)


@exercise("nb05.static_steps", notebook=NB, title="iterations of static batching",
          kind="compute", solution=_static_iterations(*_STATIC_CASE),
          wrong_variants={"the every-seat-busy bound": (57, ("every seat",))})
def _check_static_steps(answer, output_lengths=_STATIC_CASE[0], batch_size=_STATIC_CASE[1]):
    outs = list(output_lengths)
    want = _static_iterations(outs, batch_size)
    best = -(-sum(outs) // batch_size)
    if answer == best and best != want:
        return wrong(f"{answer} is what a scheduler that keeps every seat busy would need; a "
                     "static batch waits for its longest member.",
                     "batches are taken in order, batch_size at a time.")
    return number_verdict(answer, want, good=f"{want} iterations; with every seat always busy "
                          f"it could be as few as {best} ({want / best:.1f}× fewer).",
                          hint="batches are taken in order, batch_size at a time, and a batch "
                          "runs until its longest request is done.")


# ---- 4. one step of continuous batching (the build exercise) --------------------------------

def decode_one(sched: Scheduler, seq: Sequence, out: SchedulerOutput) -> None:
    """Given: reserve the slot for ``seq``'s next token and schedule that one token.

    The caller has checked ``sched.bm.can_append(seq.seq_id)``. A copy-on-write that the
    slot needs is recorded in ``out.block_copies``.
    """
    _, cow = sched.bm.append_slot(seq.seq_id, seq.all_token_ids[-1])
    if cow is not None:
        out.block_copies.append(cow)
    out.scheduled.append(ScheduledSeq(seq, 1, prefill=False))


def admit(sched: Scheduler, seq: Sequence, out: SchedulerOutput) -> int:
    """Given: the waiting ``seq`` joins: its blocks are allocated, it takes a seat and moves
    from ``sched.waiting`` to the end of ``sched.running``, and its whole prompt (prompt +
    anything generated before a preemption) is scheduled. Returns the tokens scheduled.

    The caller has checked ``sched.bm.can_allocate(seq.all_token_ids)``.
    """
    return sched.admit(seq, out)


def requeue(sched: Scheduler, seq: Sequence) -> None:
    """Given: a preempted ``seq`` (its blocks already freed, out of ``sched.running``) waits
    again at the *front* of the queue; everything it computed is to be recomputed."""
    sched.release_seat(seq)
    seq.num_computed = 0
    seq.status = SequenceStatus.WAITING
    seq.num_preemptions += 1
    sched.num_preemptions += 1
    sched.waiting.appendleft(seq)


def _solution_schedule(sched: Scheduler, now: float) -> SchedulerOutput:
    """One continuous-batching step (requests with n = 1, no chunked prefill)."""
    out = SchedulerOutput(packed=True)
    cfg, bm = sched.config, sched.bm
    for seq in list(sched.running):             # 1. everyone running decodes, oldest first
        if seq not in sched.running:
            continue                            # preempted a moment ago, as a victim
        while not bm.can_append(seq.seq_id):     # no block for it: preempt the newest
            victim = sched.running[-1]
            bm.free(victim.seq_id)
            sched.running.remove(victim)
            requeue(sched, victim)
            out.preempted.append(victim)
            if victim is seq:
                break
        else:
            decode_one(sched, seq, out)
    if out.preempted:                           # 2. memory is tight: nobody joins
        return out
    used = len(out.scheduled)
    while sched.waiting:                        # 3. newcomers, first come first served
        seq = sched.waiting[0]
        if seq.request.arrival_time > now or len(sched.running) >= cfg.max_num_seqs:
            break
        if out.scheduled and used + seq.num_tokens > cfg.max_num_batched_tokens:
            break
        if not bm.can_allocate(seq.all_token_ids):
            break
        used += admit(sched, seq, out)
    return out


def _variant(ignore_budget=False, drop=False, ignore_seats=False, static=False, oldest=False):
    """The solution with one realistic mistake switched on."""

    def schedule(sched, now):
        out = SchedulerOutput(packed=True)
        cfg, bm = sched.config, sched.bm
        for seq in list(sched.running):
            if seq not in sched.running:
                continue
            while not bm.can_append(seq.seq_id):
                victim = sched.running[0 if oldest else -1]
                bm.free(victim.seq_id)
                sched.running.remove(victim)
                if not drop:
                    requeue(sched, victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                decode_one(sched, seq, out)
        if out.preempted or (static and sched.running):
            return out
        used = len(out.scheduled)
        while sched.waiting:
            seq = sched.waiting[0]
            if seq.request.arrival_time > now:
                break
            if not ignore_seats and len(sched.running) >= cfg.max_num_seqs:
                break
            if not ignore_budget and out.scheduled and \
                    used + seq.num_tokens > cfg.max_num_batched_tokens:
                break
            if not bm.can_allocate(seq.all_token_ids):
                break
            used += admit(sched, seq, out)
        return out

    return schedule


class _Bench:
    """A scheduler with hand-made requests, stepped like the engine steps it."""

    def __init__(self, schedule, prompt_lens, max_tokens=4, *, max_num_seqs=8,
                 max_num_batched_tokens=2048, num_blocks=64, block_size=4):
        self.config = SchedulerConfig("continuous", max_num_seqs, max_num_batched_tokens, 512)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sched = Scheduler(self.config, self.bm, schedule)
        self.seqs = []
        for i, n in enumerate(prompt_lens):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            req = Request(i, None, list(range(100 * i + 1, 100 * i + 1 + n)), params)
            seq = Sequence(i, req, 0, list(req.prompt_token_ids))
            req.seqs.append(seq)
            self.seqs.append(seq)
            self.sched.add(seq)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule(float("inf"))
        if not isinstance(out, SchedulerOutput):
            raise TypeError(f"schedule returned {type(out).__name__}, not a SchedulerOutput")
        ids = [s.seq.seq_id for s in out.scheduled]
        if len(ids) != len(set(ids)):
            raise _Problem(f"a sequence is scheduled twice in one step ({ids}).",
                           "each running sequence gets exactly one decode token.")
        for s in out.scheduled:
            if not self.bm.has_seq(s.seq.seq_id) or \
                    self.bm.num_tokens(s.seq.seq_id) < s.seq.num_computed + s.num_new:
                raise _Problem(f"sequence {s.seq.seq_id} is scheduled for {s.num_new} token(s) "
                               "without slots for them.",
                               "call decode_one / admit, which reserve the slots.")
            s.seq.num_computed += s.num_new
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed == seq.num_tokens:
                seq.output_token_ids.append(7)
                if len(seq.output_token_ids) >= seq.request.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH
                    self.sched.finish(seq)
        return out

    def where(self, seq) -> str:
        if seq in self.sched.running:
            return "running"
        if seq in self.sched.waiting:
            return "waiting"
        return "finished" if seq.finished else "nowhere"


class _Problem(Exception):
    def __init__(self, problem: str, hint: str):
        super().__init__(problem)
        self.problem, self.hint = problem, hint


def _unit_checks(schedule):
    """Single steps on hand-built queues; None when they pass, else a Verdict."""
    # seats: five small prompts, three seats
    b = _Bench(schedule, [4, 4, 4, 4, 4], max_num_seqs=3)
    out = b.step()
    n = len(out.scheduled)
    if n > 3:
        return wrong(f"with max_num_seqs=3 and 5 short prompts waiting, your step admitted {n} "
                     "sequences: more than max_num_seqs.",
                     "stop admitting when len(sched.running) reaches config.max_num_seqs.")
    if n < 3:
        return wrong(f"with 3 free seats, room in the budget and in the pool, your step "
                     f"admitted {n} of 5 waiting prompts; it should admit 3.",
                     "admit from the head of sched.waiting while every limit allows.")
    # the token budget: 10-token prompts, 25 tokens per step
    b = _Bench(schedule, [10, 10, 10, 10], max_num_batched_tokens=25)
    out = b.step()
    if out.num_tokens > 25:
        return wrong(f"with max_num_batched_tokens=25 your step scheduled {out.num_tokens} "
                     f"prompt tokens ({len(out.scheduled)} prompts of 10): it ignores the "
                     "token budget.", "before admitting, check that used + seq.num_tokens "
                     "stays within config.max_num_batched_tokens.")
    if len(out.scheduled) < 2:
        return wrong(f"with max_num_batched_tokens=25 two 10-token prompts fit, but your "
                     f"step admitted {len(out.scheduled)}.", "count the tokens already used.")
    # a prompt longer than the whole budget still runs, alone
    b = _Bench(schedule, [40, 3], max_num_batched_tokens=25)
    out = b.step()
    if [s.seq.seq_id for s in out.scheduled] != [0]:
        return wrong(f"a 40-token prompt with max_num_batched_tokens=25 at the head of the "
                     f"queue: your step scheduled {[s.seq.seq_id for s in out.scheduled]}, "
                     "expected it alone ([0]); otherwise it waits forever.",
                     "the budget limits what joins a step that already has work.")
    # continuous, not static: a seat that frees is refilled at the next step
    b = _Bench(schedule, [4, 4, 4], max_tokens=2, max_num_seqs=2)
    b.seqs[1].request.params.max_tokens = 6
    b.step()                     # 0 and 1 join; each gets its first token
    b.step()                     # both decode: 0 is done (2 tokens), 1 goes on
    out = b.step()
    joined = [s.seq.seq_id for s in out.scheduled if s.prefill]
    if b.where(b.seqs[0]) != "finished":
        return wrong("a request that reached its max_tokens was not finished; the check's "
                     "bookkeeping expected it to leave.", "schedule exactly one token per "
                     "running sequence per step.")
    if 2 not in joined:
        return wrong("sequence 0 finished and its seat is free, sequence 2 is waiting, yet "
                     "your step admitted nothing while sequence 1 was still running: that is "
                     "static batching, waiting for the whole batch.",
                     "admit newcomers every step, whenever a seat, budget and blocks allow.")
    # preemption: two sequences at a block boundary, the pool exhausted
    b = _Bench(schedule, [4, 4], max_tokens=5, num_blocks=2, block_size=4)
    b.step()                     # both prompts fill their single block exactly
    out = b.step()               # each needs a new block; none is free
    old, new = b.seqs
    if not out.preempted:
        return wrong("two running sequences each need a new block and the pool has none, but "
                     "your step preempted nobody.",
                     "while not sched.bm.can_append(seq.seq_id): preempt the newest running "
                     "sequence.")
    if out.preempted[0] is old:
        return wrong(f"your step preempted sequence {old.seq_id}, the oldest running one; "
                     f"preempt the newest ({new.seq_id}): it has the least work to redo, and "
                     "the oldest keeps its progress.", "the newest is sched.running[-1].")
    if b.where(new) == "nowhere":
        return wrong(f"sequence {new.seq_id} was preempted but is neither running nor waiting: "
                     "its request is lost. Preempting by recompute keeps the request.",
                     "free its blocks, take it out of sched.running and requeue(sched, seq): "
                     "it goes back to the front of the waiting queue.")
    if b.where(new) != "waiting" or b.sched.waiting[0] is not new:
        return wrong(f"the preempted sequence {new.seq_id} is {b.where(new)}, not at the front "
                     "of the waiting queue.", "requeue(sched, seq) puts it there.")
    if b.bm.has_seq(new.seq_id):
        return wrong(f"the preempted sequence {new.seq_id} still holds its blocks.",
                     "sched.bm.free(seq.seq_id) gives them back: that is the point.")
    if b.where(old) != "running" or [s.seq.seq_id for s in out.scheduled] != [old.seq_id]:
        return wrong(f"after preempting, your step scheduled "
                     f"{[s.seq.seq_id for s in out.scheduled]}; expected the older sequence "
                     f"{old.seq_id} to decode with the freed block.",
                     "once the block fits, decode_one(sched, seq, out).")
    return None


@functools.lru_cache(maxsize=1)
def _trace_lengths():
    """Prompt and output lengths of notebook 05's trace (data/traces/cpu.jsonl)."""
    import llmlab
    from ..models.registry import repo_root
    from ..traces import load_trace

    tok = llmlab.load_tokenizer("smollm2-135m")
    trace = load_trace(repo_root() / "data" / "traces" / "cpu.jsonl", tokenizer=tok)
    return [len(r.prompt_token_ids) for r in trace], [r.output_tokens for r in trace]


TIGHT_BLOCKS = 60          # blocks of 16: too few for 8 seats on the trace, so it must preempt


def _library_policies() -> tuple:
    """llmlab's own scheduling steps: what the schedule build writes."""
    return (Scheduler.schedule_continuous, Scheduler.schedule_static,
            Scheduler.schedule_decodes, Scheduler.preempt)


@functools.lru_cache(maxsize=1)
def _static_trace_run(num_blocks: int):
    from ..engine.simulate import dry_run

    p, o = _trace_lengths()
    return dry_run(p, o, "static", max_num_seqs=8, num_blocks=num_blocks)


def _trace_check(schedule):
    """The whole trace through the scheduler, no model; None when it passes."""
    from ..engine.simulate import SchedulerStall, dry_run

    p, o = _trace_lengths()
    tight = TIGHT_BLOCKS
    try:
        run = dry_run(p, o, schedule, max_num_seqs=8, num_blocks=tight)
    except SchedulerStall as exc:
        return wrong(f"serving notebook 05's {len(p)}-request trace, your scheduler stalled: "
                     f"{exc}.", "a step must schedule something while requests wait: at least "
                     "the head of the queue, once blocks are free.")
    except _Problem as exc:
        return wrong(exc.problem, exc.hint)
    lost = [i for i, (g, w) in enumerate(zip(run.output_tokens, o)) if g < w]
    extra = [i for i, (g, w) in enumerate(zip(run.output_tokens, o)) if g > w]
    if lost:
        return wrong(f"serving notebook 05's {len(p)}-request trace with {tight} KV blocks, "
                     f"{len(lost)} request(s) never finished (request {lost[0]} made "
                     f"{run.output_tokens[lost[0]]} of {o[lost[0]]} tokens): they were lost.",
                     "a preempted request must go back to the waiting queue.")
    if extra or run.finished_twice:
        return wrong(f"request {(extra or run.finished_twice)[0]} produced more tokens than "
                     "asked for: it was duplicated.", "a sequence is either running or "
                     "waiting, never both.")
    static = _static_trace_run(tight)
    if run.iterations >= static.iterations or \
            run.stats.computed_tokens >= static.stats.computed_tokens:
        return wrong(f"on the trace your scheduler took {run.iterations} iterations and "
                     f"{run.stats.computed_tokens:,} positions; static batching takes "
                     f"{static.iterations} and {static.stats.computed_tokens:,}: no better.",
                     "refill free seats at every step.")
    return run, static


@functools.lru_cache(maxsize=1)
def _tiny():
    import llmlab

    return llmlab.load_model("tiny-llama", attention="sdpa"), llmlab.load_tokenizer("tiny-llama")


def _engine_check(schedule):
    """tiny-llama serves 10 requests with a small pool: tokens equal generating alone."""
    import llmlab
    from ..engine import LLM

    model, tok = _tiny()
    prompts, outs = _engine_requests()
    llm = LLM(model, tok, scheduler=schedule, max_num_seqs=4, num_blocks=20, block_size=4,
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    got = llm.generate([list(x) for x in prompts], params, use_tqdm=False)
    alone = _alone(prompts, outs)
    for i, (g, a) in enumerate(zip(got, alone)):
        if not g.finished or not g.outputs:
            return wrong(f"with tiny-llama, request {i} did not finish: it was lost.",
                         "a preempted request goes back to the waiting queue."), None
        diff = first_token_difference(g.outputs[0].token_ids, a)
        if diff:
            return wrong(f"with tiny-llama, request {i} differs from generating it alone: "
                         f"{diff}", "a preempted sequence must recompute all its tokens "
                         "(prompt + generated) before decoding again."), None
    return None, llm.stats.num_preemptions


def _engine_requests() -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """10 requests for tiny-llama, shaped like the trace's first 10 but shorter."""
    p, o = _trace_lengths()
    prompts = tuple(tuple(range(300 + 17 * i, 300 + 17 * i + min(n, 24)))
                    for i, n in enumerate(p[:10]))
    return prompts, tuple(max(2, min(m // 6, 16)) for m in o[:10])


@functools.lru_cache(maxsize=2)
def _alone(prompts, outs):
    import llmlab

    model, tok = _tiny()
    return [llmlab.generate(model, tok, [list(p)], max_new_tokens=m, kv_cache="contiguous",
                            ignore_eos=True)[0].token_ids for p, m in zip(prompts, outs)]


@exercise("nb05.schedule", notebook=NB, title="one step of continuous batching",
          kind="build", solution=_solution_schedule,
          wrong_variants={
              "ignores the token budget": (_variant(ignore_budget=True), ("token budget",)),
              "preempts by dropping the request": (_variant(drop=True), ("lost",)),
              "admits beyond max_num_seqs": (_variant(ignore_seats=True), ("max_num_seqs",)),
              "static: waits for the whole batch": (_variant(static=True), ("static",)),
              "preempts the oldest": (_variant(oldest=True), ("newest",)),
              "wraps llmlab's policy": (lambda sched, now: sched.schedule_continuous(now),
                                        ("llmlab's own",)),
          })
def _check_schedule(schedule):
    """``schedule(sched, now) -> SchedulerOutput``, the engine's continuous step."""
    from . import forbid

    if not callable(schedule):
        return wrong(f"pass your function itself, got {type(schedule).__name__}.",
                     "exercises.check(\"nb05.schedule\", schedule)")
    with forbid(*_library_policies()):
        try:
            verdict = _unit_checks(schedule)
        except _Problem as exc:
            return wrong(exc.problem, exc.hint)
    if verdict is not None:
        return verdict
    _static_trace_run(TIGHT_BLOCKS)            # the baselines, with llmlab's policies on
    _alone(*_engine_requests())
    with forbid(*_library_policies()):
        result = _trace_check(schedule)
        if not isinstance(result, tuple):
            return result
        run, static = result
        verdict, preemptions = _engine_check(schedule)
    if verdict is not None:
        return verdict
    return right(f"the engine's scheduler with your step served notebook 05's "
                 f"{len(run.output_tokens)} requests with 8 seats and a tight pool: every "
                 "request finished once, "
                 f"{run.iterations} iterations and {run.stats.computed_tokens:,} positions "
                 f"against static batching's {static.iterations} and "
                 f"{static.stats.computed_tokens:,} ({run.stats.num_preemptions} preemptions). "
                 f"On tiny-llama, 10 requests with {preemptions} preemptions gave the same "
                 "greedy tokens as generating each alone.")


# ---- 5. predict, then measure: iterations saved -----------------------------------------------

@exercise("nb05.predict_speedup", notebook=NB,
          title="predict how many times fewer iterations continuous batching needs",
          kind="predict", solution=1.8,
          wrong_variants={"no gain": (1.0, ("off",))})
def _check_predict_speedup(answer, measured: float | None = None):
    """``answer``: static iterations / continuous iterations on the trace, 8 seats."""
    if measured is None:
        from ..engine.simulate import dry_run

        p, o = _trace_lengths()
        measured = (dry_run(p, o, "static", max_num_seqs=8).iterations
                    / dry_run(p, o, "continuous", max_num_seqs=8).iterations)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or answer <= 0:
        return wrong(f"the prediction should be a positive number (a ratio), got {answer!r}.",
                     "for example 1.5 for 1.5× fewer iterations.")
    if abs(answer - measured) <= 0.25 * measured:
        return right(f"you predicted {answer:.2g}×, measured {measured:.2f}×: a static batch "
                     "lasts as long as its longest member, and output lengths spread widely.")
    return wrong(f"you predicted {answer:.2g}×, measured {measured:.2f}×: off by "
                 f"{abs(answer / measured - 1):.0%}.",
                 "a static batch of 8 runs as long as the longest of its 8 outputs; continuous "
                 "batching needs about total output tokens / 8 iterations.")


# ---- 6. predict, then measure: the worst stall with chunked prefill --------------------------

# the ratio notebook 05's committed run measured (AMD EPYC / Intel Xeon, 2 threads): the
# checker's reference when no measurement is passed (the notebook always passes its own)
REFERENCE_STALL_RATIO = 1.5


@exercise("nb05.predict_stall", notebook=NB,
          title="predict how many times chunked prefill shortens the worst stall between tokens",
          kind="predict", solution=REFERENCE_STALL_RATIO,
          wrong_variants={"no change": (1.0, ("off",))})
def _check_predict_stall(answer, measured: float | None = None):
    """``answer``: the worst inter-token stall without chunks / with chunks (the median
    over the notebook's rounds); ``measured`` is passed by the notebook's cell."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"the prediction should be a positive number (a ratio), got {answer!r}.",
                     "for example 1.5 if the worst stall gets 1.5× shorter.")
    if measured is None:
        measured = REFERENCE_STALL_RATIO
    if abs(answer - measured) <= 0.3 * measured:
        return right(f"you predicted {answer:.2g}×, measured {measured:.2f}×: the worst stall "
                     "is the step that feeds the longest prompt while others wait, and a chunk "
                     "caps that step's prompt tokens at the budget.")
    return wrong(f"you predicted {answer:.2g}×, measured {measured:.2f}×: off by "
                 f"{abs(answer / measured - 1):.0%}.",
                 "the stall is one step's time: the fixed cost plus its prompt tokens times "
                 "the cost of one. Without chunks that step feeds a whole prompt, with chunks "
                 "at most the budget.")


# ---- 7. stretch: a prefix-cache-aware admission policy -----------------------------------------

def cached_blocks(sched: Scheduler, seq: Sequence) -> int:
    """Given (for the stretch): how many leading blocks of ``seq``'s tokens the prefix cache
    holds now (0 when prefix caching is off)."""
    return len(sched.bm.match_prefix(seq.all_token_ids)[0])


def _solution_prefix_aware(sched: Scheduler, now: float) -> SchedulerOutput:
    """The solution's step, but among the arrived waiting requests, those whose prompt
    starts with cached blocks join first (most cached blocks first, then arrival order)."""
    arrived = [s for s in sched.waiting if s.request.arrival_time <= now]
    rest = [s for s in sched.waiting if s.request.arrival_time > now]
    order = sorted(range(len(arrived)), key=lambda i: (-cached_blocks(sched, arrived[i]), i))
    sched.waiting.clear()
    sched.waiting.extend([arrived[i] for i in order] + rest)
    return _solution_schedule(sched, now)


def _prefix_workload(n_groups=4, per_group=4, system_len=48, question_len=6):
    """Prompts in arrival order that interleave a few system prompts: A1 B1 C1 D1 A2 B2 ..."""
    prompts = []
    for j in range(per_group):
        for g in range(n_groups):
            system = list(range(1000 * (g + 1), 1000 * (g + 1) + system_len))
            prompts.append(system + [50 + 7 * j + g + k for k in range(question_len)])
    return prompts


def _prefix_run(schedule, seats=2):
    """Serve :func:`_prefix_workload` through ``schedule`` without the model; -> (prompt
    tokens computed, prompt tokens served from the cache, ids of requests left unfinished)."""
    prompts = _prefix_workload()
    config = SchedulerConfig("continuous", seats, 4096, 512)
    bm = BlockManager(12, 16, enable_prefix_caching=True)   # room to cache about one prompt
    sched = Scheduler(config, bm, schedule)
    seqs = []
    for i, ids in enumerate(prompts):
        req = Request(i, None, ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        seq = Sequence(i, req, 0, list(ids))
        req.seqs.append(seq)
        seqs.append(seq)
        sched.add(seq)
    prefill = 0
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        out = sched.schedule(float("inf"))
        if out.is_empty:
            raise RuntimeError("the scheduler stalled")
        for s in out.scheduled:
            prefill += s.num_new if s.prefill else 0
            s.seq.num_computed += s.num_new
            bm.mark_computed(s.seq.seq_id, s.seq.num_computed)
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed == seq.num_tokens:
                seq.output_token_ids.append(3)
                if len(seq.output_token_ids) >= seq.request.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED_LENGTH
                    sched.finish(seq)
    lost = [s.seq_id for s in seqs if len(s.output_token_ids) != 4]
    return prefill, bm.stats.hits, lost


@exercise("nb05.prefix_aware", notebook=NB,
          title="stretch: admit requests whose prompt prefix is cached first",
          kind="build", solution=_solution_prefix_aware, stretch=True,
          wrong_variants={"plain first come first served": (_solution_schedule,
                                                            ("no fewer",))})
def _check_prefix_aware(schedule):
    """Interleaved requests over 4 system prompts, 2 seats, a prefix cache."""
    base_prefill, base_hits, _ = _prefix_run(_solution_schedule)
    prefill, hits, lost = _prefix_run(schedule)
    if lost:
        return wrong(f"{len(lost)} request(s) did not get their 4 tokens (first: {lost[0]}).",
                     "reorder sched.waiting, then admit as before; do not drop anyone.")
    if prefill >= base_prefill:
        return wrong(f"your policy computed {prefill} prompt tokens, first come first served "
                     f"{base_prefill}: no fewer.", "among the waiting requests, let those "
                     "whose prompt starts with cached blocks (sched.bm's prefix cache) go first.")
    return right(f"{prefill} prompt tokens computed instead of {base_prefill} "
                 f"({hits} served from the prefix cache, {base_hits} first come first served). "
                 "Reordering trades fairness for reuse: a real policy bounds how long anyone "
                 "can be passed over.")


__all__ = ["decode_one", "admit", "requeue", "cached_blocks"]
