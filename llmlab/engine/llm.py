"""The serving engine and its offline API, shaped like vLLM's.

    llm = LLM(model="smollm2-135m", kv_cache="paged", scheduler="continuous",
              block_size=16, max_num_seqs=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    outs[0].outputs[0].text, outs[0].metrics.ttft_s

:class:`LLMEngine` is the step loop: ``schedule`` (which sequences, how many tokens) →
``execute`` (one forward over the paged KV cache) → ``sample`` (one token per
sequence, each with its own parameters: penalties first, then the sampler, then the
log-probabilities asked for) → ``finish`` checks (EOS, stop strings,
max_tokens, context) that free seats and blocks for the next step. Each step's work per
sequence does not grow with its length: the text is decoded a few tokens at a time
(:mod:`llmlab.engine.detokenizer`) and stop strings are searched only where a new one can
end. :class:`LLM` wraps
it: prompts in, :class:`RequestOutput` per prompt out, in input order, with TTFT, TPOT
and end-to-end latency per request; ``chat`` applies the chat template; ``stream``
yields tokens as they are produced; ``beam_search`` keeps the most likely sequences
(:mod:`llmlab.engine.beam`). Taught in notebook 05.

A step can fail anywhere (a bug, bad input, or a student pressing the stop button):
the engine then sends its running sequences back to the waiting queue with no block
held, and blocks enter the prefix cache only after the forward that wrote their K/V
has returned, so nothing half-computed is ever reused. ``LLM`` calls abort their own
requests when they fail, when interrupted, or when a stream is closed early, so the
next call starts clean. :meth:`LLMEngine.abort_request` does it for one request.
"""
from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..cache.paged import PagedKVCache
from ..device import resolve_dtype
from .beam import BeamSearcher, BeamSearchOutput, BeamSearchParams
from .runner import ModelRunner, choose_paged_attention
from ..prompts import check_token_ids
from ..sampling import apply_penalties, processed_logprobs, sample_rows, token_logprobs
from ..stopping import find_stop, finish_reason, stop_prefix_length
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import (CompletionOutput, Request, RequestOutput, SamplingParams, Sequence,
                       SequenceStatus)

KV_CACHES = ("paged",)
DEFAULT_KV_CACHE_BYTES = 512 * 2**20


@dataclass
class StepRecord:
    """What one engine step did (for the occupancy and padding pictures)."""

    step: int
    start_s: float
    end_s: float
    num_seqs: int
    prefill_tokens: int          # new tokens of sequences still reading their prompt
    decode_tokens: int           # one per decoding sequence
    computed_tokens: int         # token positions the forward ran (pads included)
    preempted: int
    free_blocks: int
    occupancy: list[int]         # per seat: request id, EMPTY (-1) or HELD (-2)


@dataclass
class EngineStats:
    steps: list[StepRecord] = field(default_factory=list)
    num_preemptions: int = 0
    wall_s: float = 0.0

    @property
    def real_tokens(self) -> int:
        return sum(r.prefill_tokens + r.decode_tokens for r in self.steps)

    @property
    def computed_tokens(self) -> int:
        return sum(r.computed_tokens for r in self.steps)

    @property
    def padding_tokens(self) -> int:
        """Token positions computed for nothing (left pads of a padded batch)."""
        return self.computed_tokens - self.real_tokens


@dataclass
class TokenEvent:
    """One new token of one completion, as :meth:`LLM.stream` yields them."""

    index: int                   # which prompt (input order)
    completion: int              # which of its n completions
    token_id: int
    text: str                    # new text; "" while held back (half a character, or
                                 # what may be the start of a stop string)
    finished: bool
    finish_reason: str | None = None
    logprobs: dict[int, float] | None = None   # this token's, if SamplingParams.logprobs


class LLMEngine:
    """Requests in, tokens out, one :meth:`step` at a time (see the module docstring).

    ``scheduler``: ``"continuous"``, ``"static"``, or a function ``(scheduler, now) ->
    SchedulerOutput`` that replaces the continuous policy's one-step decision (see
    :class:`~llmlab.engine.scheduler.Scheduler`).
    """

    def __init__(self, model, tokenizer, *, scheduler: str | Callable = "continuous",
                 block_size: int = 16,
                 num_blocks: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = False,
                 paged_attention: str | None = None, seed: int = 0,
                 decode_attention: str | None = None, kv_cache_dtype: str = "auto",
                 compile: bool = False, allocator: Callable | None = None,
                 append_slot: Callable | None = None,
                 prefix_cache: str | Callable | None = "hash", admission: str = "fcfs",
                 max_overtakes: int = 8):
        cfg = model.config
        ctx = cfg.max_position_embeddings
        max_model_len = ctx if max_model_len is None else max_model_len
        if not isinstance(max_model_len, int) or not 1 <= max_model_len <= ctx:
            raise ValueError(f"max_model_len={max_model_len!r} must be an int in 1..{ctx} "
                             "(the model's context)")
        schedule_fn = scheduler if callable(scheduler) else None
        policy = "continuous" if schedule_fn is not None else scheduler
        self.config = SchedulerConfig(policy, max_num_seqs, max_num_batched_tokens,
                                      max_model_len, enable_chunked_prefill, admission,
                                      max_overtakes)
        paged_attention = choose_paged_attention(paged_attention, model.device, decode_attention)
        if num_blocks is None:
            probe = PagedKVCache.for_model(model, 1, block_size, kv_dtype=kv_cache_dtype)
            per_seq = -(-max_model_len // block_size)
            num_blocks = max(1, min(DEFAULT_KV_CACHE_BYTES // probe.bytes_per_block,
                                    per_seq * max_num_seqs))
        self.model, self.tokenizer = model, tokenizer
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size,
                                            enable_prefix_caching=enable_prefix_caching,
                                            backend=paged_attention, kv_dtype=kv_cache_dtype,
                                            allocator=allocator, append_slot=append_slot,
                                            prefix_cache=prefix_cache)
        self.scheduler = Scheduler(self.config, self.cache.manager, schedule_fn)
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_token_id = eos
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if compile and kv_cache_dtype != "auto":
            raise ValueError(f"compile=True reads a float KV pool; got kv_cache_dtype="
                             f"{kv_cache_dtype!r}, allowed with compile: 'auto'")
        self.runner = ModelRunner(model, self.cache, pad_token_id=pad, compile=compile,
                                  max_num_seqs=max_num_seqs)
        self._rng = torch.Generator().manual_seed(seed)
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()
        self._t0 = time.perf_counter()
        self.stats = EngineStats()
        # a server steps forever: it turns the per-step log off (counters are kept)
        self.record_steps = True
        self.step_request_ids: tuple[int, ...] = ()   # the requests of the current step
        self.idle = True               # the last step found nothing to run
        self.requests: dict[int, Request] = {}     # unfinished requests, by id
        self._rng_states: dict = {}                 # during sampling: {seq_id: (len, state)}

    # -- clock and requests ---------------------------------------------------------------
    def now(self) -> float:
        """Seconds on the engine clock (arrival times and token times use it)."""
        return time.perf_counter() - self._t0

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Completion ``index``'s random generator: seeded ``seed + index``, taken modulo
        2**64 (what ``manual_seed`` reads a negative seed as), so that no seed in range and
        no ``n`` can overflow it inside a step."""
        if params.greedy:
            return None
        seed = (params.seed + index) % 2**64 if params.seed is not None else \
            int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.model.device).manual_seed(seed)

    def _reject_reason(self, ids: list[int], params: SamplingParams
                       ) -> tuple[str, str] | tuple[None, None]:
        """Why a request can never run, and the parameter to blame: (param, reason), or
        (None, None) when it can."""
        cfg, bm = self.config, self.cache.manager
        if not ids:
            return "prompt", "the prompt is empty"
        if len(ids) >= cfg.max_model_len:
            return "prompt", (f"prompt of {len(ids)} tokens does not fit the context of "
                              f"{cfg.max_model_len} tokens (it needs room for at least one new "
                              "token)")
        if params.n > cfg.max_num_seqs:
            return "n", (f"n={params.n} completions exceed max_num_seqs={cfg.max_num_seqs} "
                         "(each completion takes a seat of the batch)")
        longest = min(len(ids) + params.max_tokens, cfg.max_model_len)
        need = -(-longest // bm.block_size)
        if need > bm.num_blocks:
            return "max_tokens", (f"a sequence of up to {longest} tokens needs {need} KV blocks "
                                  f"but the pool has only {bm.num_blocks}; raise num_blocks or "
                                  "lower max_tokens")
        return None, None

    def check_token_ids(self, ids: Seq[int]) -> list[int]:
        """The prompt as a list of ints; ValueError naming the first id that is not an
        integer in ``0 .. vocab_size - 1`` (the one check :mod:`llmlab.prompts` defines)."""
        ids = list(ids)
        check_token_ids(ids, self.model.config.vocab_size)
        return [operator.index(t) for t in ids]

    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> Request:
        """Queue a request (arrival_time on the engine clock; default: now).

        A request that can never run (longer than the context, larger than the block
        pool) is returned finished with ``error`` set; the others are unaffected. A token
        id outside the vocabulary raises ValueError, and nothing is queued.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(params).__name__}")
        ids = self.check_token_ids(prompt_token_ids)
        arrival = self.now() if arrival_time is None else float(arrival_time)
        req = Request(next(self._request_ids), prompt, ids, params, arrival)
        req.error_param, req.error = self._reject_reason(ids, params)
        if req.error is None and params.structured is not None:
            try:
                req.grammar = self.grammar(params.structured)
            except ValueError as e:          # a schema the backends cannot compile
                req.error_param, req.error = "structured", str(e)
        if req.error is None:
            seq = Sequence(next(self._seq_ids), req, 0, ids, generator=self._generator(params, 0))
            seq.matcher = req.grammar.matcher() if req.grammar is not None else None
            req.seqs.append(seq)
            self.requests[req.request_id] = req
            self.scheduler.add(seq)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def grammar(self, structured):
        """``SamplingParams.structured`` compiled over this engine's tokenizer and vocabulary
        (kept: a repeated schema compiles once; :func:`llmlab.structured.compile_grammar`)."""
        from ..structured import compile_grammar

        return compile_grammar(structured, self.tokenizer, self.model.config.vocab_size,
                               self.eos_token_id)

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, int]]:
        """Schedule, run and sample once; returns the (sequence, token) pairs produced.

        Returns [] when nothing could run (e.g. the next request has not arrived yet; then
        ``idle`` is set), or when the step only fed chunks of prompts.

        If anything raises part-way (an exception, or KeyboardInterrupt from the stop
        button), the engine first goes back to a consistent state, then re-raises the
        exception unchanged: the running sequences return to the waiting queue to be
        recomputed (as if preempted), no block is held, and only blocks whose K/V were
        written remain in the prefix cache. Nothing is lost; :meth:`abort_request`
        drops requests the caller no longer wants (``LLM`` does that for its call).
        """
        start = self.now()
        try:
            return self._step(start)
        except BaseException:
            self._recover()
            raise

    def _step(self, start: float) -> list[tuple[Sequence, int]]:
        self.step_request_ids = ()
        work = self.scheduler.schedule(start)
        self.idle = work.is_empty
        if work.is_empty:
            return []
        self.step_request_ids = tuple(dict.fromkeys(s.seq.request.request_id
                                                    for s in work.scheduled))
        seats = self.scheduler.occupancy(self.config.max_num_seqs)
        logits = self.runner.execute(work)
        for s in work.scheduled:           # K/V written: only now may blocks serve as a prefix
            s.seq.num_computed += s.num_new
            self.cache.manager.mark_computed(s.seq.seq_id, s.seq.num_computed)
        # a prompt chunk that is not the last one produces no token yet
        rows = [r for r, s in enumerate(work.scheduled) if s.seq.num_computed == s.seq.num_tokens]
        scheduled = [work.scheduled[r].seq for r in rows]
        logits = logits[rows] if len(rows) < len(work.scheduled) else logits
        # random states before sampling: a failed step puts back those of sequences that
        # got no token, so a seeded request samples what it would have without the failure
        self._rng_states = {s.seq_id: (len(s.output_token_ids), s.generator.get_state())
                            for s in scheduled if s.generator is not None}
        raw = logits
        try:
            logits = self._constrain(self._penalize(raw, scheduled), scheduled, raw)
            tokens, logprobs = self._sample(logits, scheduled)
        except Exception as e:
            _blame(e, self._culprits(raw, scheduled))
            raise
        now = self.now()
        produced = []
        for row, (seq, tok) in enumerate(zip(scheduled, tokens)):
            req = seq.request
            try:
                if not seq.output_token_ids and len(req.seqs) < req.params.n:
                    produced += self._fork(seq, logits[row], now)
                self._keep_logprobs(seq, logprobs[row])
                self._append(seq, tok, now)
            except Exception as e:
                _blame(e, [req.request_id])
                raise
            produced.append((seq, tok))
        self._rng_states = {}
        self._record(work, start, seats)
        return produced

    def _culprits(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sampling the batch raised: the requests whose row raises on its own (each row
        sampled alone, its random state put back after). Only their parameters are to
        blame; the caller may fail them and go on with the others."""
        found = []
        for row, seq in enumerate(seqs):
            saved = self._rng_states.get(seq.seq_id)
            try:
                self._sample(self._constrain(self._penalize(logits[row:row + 1], [seq]), [seq],
                                             logits), [seq])
            except Exception:
                found.append(seq.request.request_id)
            finally:
                if saved is not None:
                    seq.generator.set_state(saved[1])
        return list(dict.fromkeys(found))

    @staticmethod
    def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The rows of sequences with presence / frequency / repetition penalties,
        penalised (:func:`llmlab.sampling.apply_penalties`); the others as they are."""
        rows = [r for r, s in enumerate(seqs) if s.request.params.penalized]
        if not rows:
            return logits
        ps = [seqs[r].request.params for r in rows]
        logits = logits.clone()
        logits[rows] = apply_penalties(
            logits[rows], [seqs[r].prompt_token_set() for r in rows],
            [seqs[r].output_counts() for r in rows], [p.presence_penalty for p in ps],
            [p.frequency_penalty for p in ps], [p.repetition_penalty for p in ps])
        return logits

    @staticmethod
    def _constrain(logits: torch.Tensor, seqs: list[Sequence], raw: torch.Tensor) -> torch.Tensor:
        """Rows of sequences with a grammar: the tokens it forbids in their current state
        set to -inf (notebook 12); ``raw`` (the model's logits) is never written."""
        rows = [r for r, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return logits
        if logits.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
            logits = logits.clone()
        for r in rows:
            m = seqs[r].matcher
            m.catch_up(seqs[r].output_token_ids)
            m.mask_logits_(logits[r])
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]
                ) -> tuple[list[int], list[dict[int, float] | None]]:
        """One token per row of ``logits`` [len(seqs), vocab], with each sequence's params;
        and per row its log-probabilities ``{token: logprob}`` (None unless asked for)."""
        params = [s.request.params for s in seqs]
        tokens = sample_rows(logits, [p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [s.generator for s in seqs])
        entries: list[dict[int, float] | None] = [None] * len(seqs)
        rows = [r for r, p in enumerate(params) if p.logprobs is not None]
        if rows:
            lp = processed_logprobs(logits[rows], [params[r].temperature for r in rows])
            found = token_logprobs(lp, [tokens[r] for r in rows],
                                   [params[r].logprobs for r in rows])
            for r, d in zip(rows, found):
                entries[r] = d
        return tokens, entries

    def _fork(self, parent: Sequence, logits: torch.Tensor, now: float) -> list:
        """n > 1: the other completions share the parent's prompt blocks (copy-on-write)."""
        req, made = parent.request, []
        p = req.params
        for index in range(1, p.n):
            child = Sequence(next(self._seq_ids), req, index, list(parent.prompt_token_ids),
                             num_computed=parent.num_computed,
                             generator=self._generator(p, index))
            self.cache.manager.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            child.matcher = req.grammar.matcher() if req.grammar is not None else None
            self.scheduler.add_running(child)
            toks, logprobs = self._sample(logits[None], [child])
            tok = toks[0]
            self._keep_logprobs(child, logprobs[0])
            self._append(child, tok, now)
            made.append((child, tok))
        return made

    def _stop_check(self, seq: Sequence
                    ) -> tuple[SequenceStatus | None, str | int | None, str | None]:
        """Whether the sequence's last token ends it: (status or None, reason, text cut at
        a stop string or None)."""
        p = seq.request.params
        tok = seq.output_token_ids[-1]
        why = finish_reason(tok, len(seq.output_token_ids), seq.num_tokens,
                            eos_token_id=self.eos_token_id, ignore_eos=p.ignore_eos,
                            max_tokens=p.max_tokens, max_len=self.config.max_model_len)
        if why == "stop":                  # the end-of-sequence token (it is not text)
            return SequenceStatus.FINISHED_STOPPED, tok, None
        if why is None and seq.matcher is not None:
            seq.matcher.catch_up(seq.output_token_ids)
            if seq.matcher.is_finished():  # the grammar is complete: only EOS could follow
                why = "grammar"
        text = seq.detok
        if why in ("length", "grammar"):   # the last token: a trailing half character too
            text.flush(self.tokenizer, seq.output_token_ids)
        else:                              # a few tokens decoded, not the whole list
            text.add(self.tokenizer, seq.output_token_ids)
        if p.stop:                         # stop strings: a text-level check on top
            # only where one can end: the new text and the longest stop string before it
            start = max(0, seq.stop_checked - max(map(len, p.stop)) + 1)
            hit = find_stop(text.tail(text.length - start), p.stop)
            if hit is not None:
                cut, reason = start + hit[0], hit[1]
                return SequenceStatus.FINISHED_STOPPED, reason, text.text()[:cut]
            seq.stop_checked = text.length
        if why == "length":
            return SequenceStatus.FINISHED_LENGTH, None, None
        if why == "grammar":
            return SequenceStatus.FINISHED_STOPPED, None, text.text()
        return None, None, None

    @staticmethod
    def _keep_logprobs(seq: Sequence, logprobs: dict[int, float] | None) -> None:
        """Store the log-probabilities of the token about to be appended (if asked for)."""
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)

    def _append(self, seq: Sequence, tok: int, now: float) -> None:
        seq.output_token_ids.append(tok)
        seq.token_times.append(now)
        status, reason, text = self._stop_check(seq)
        if status is not None:
            self._finish(seq, status, reason, now, text)

    def _finish(self, seq: Sequence, status: SequenceStatus, reason, now: float,
                text: str | None = None) -> None:
        """End a sequence: its final text, then its blocks and seat are freed."""
        self._end(seq, status, reason, now, text)
        self.scheduler.finish(seq)
        if seq.request.finished:
            self.requests.pop(seq.request.request_id, None)

    def _end(self, seq: Sequence, status: SequenceStatus, reason, now: float,
             text: str | None = None) -> None:
        """Set a sequence's final state (status, reason, text); the queues are not touched."""
        if text is None:
            end = len(seq.output_token_ids)
            if status is SequenceStatus.FINISHED_STOPPED:      # the EOS token is not text
                end -= 1
            seq.detok.flush(self.tokenizer, seq.output_token_ids, end)
            text = seq.detok.text()
        seq.text = text
        seq.stop_reason = reason
        seq.finish_time = now
        seq.status = status

    def _recover(self) -> None:
        """After a step failed part-way: every unfinished sequence back to waiting, with
        no block held (see :meth:`step`). Works from the requests the engine knows, so it
        does not matter at which instruction the step stopped."""
        now = self.now()
        unfinished = []
        for req in list(self.requests.values()):
            if len(req.seqs) < req.params.n and any(s.output_token_ids for s in req.seqs):
                # stopped while forking its n completions: the request starts over
                parent = req.seqs[0]
                del req.seqs[1:]
                parent.output_token_ids.clear()
                parent.token_times.clear()
                parent.reset_logprobs()
                parent.forget_output()
                parent.status = SequenceStatus.WAITING
                parent.stop_reason = parent.finish_time = None
                parent.generator = self._generator(req.params, 0)
            for seq in req.seqs:
                if seq.logprobs is not None:   # stopped between a token's logprobs and itself
                    del seq.logprobs[len(seq.output_token_ids):]
                saved = self._rng_states.get(seq.seq_id)
                if saved is not None and saved[0] == len(seq.output_token_ids):
                    seq.generator.set_state(saved[1])
                if seq.finished:
                    continue
                if seq.output_token_ids:       # its last token may not have been checked
                    status, reason, text = self._stop_check(seq)
                    if status is not None:
                        self._end(seq, status, reason, now, text)
                        continue
                unfinished.append(seq)
            if req.finished:
                del self.requests[req.request_id]
        self._rng_states = {}
        self.scheduler.reset(unfinished)

    def abort_request(self, request_id: int) -> bool:
        """Stop a request: its unfinished completions end with finish_reason ``"abort"``
        (keeping the tokens they have), leave the waiting and running queues and free
        their KV blocks. Returns False if the request is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        now = self.now()
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED, None, now)
        return True

    def _record(self, work: SchedulerOutput, start: float, seats: list[int]) -> None:
        self.stats.num_preemptions += len(work.preempted)
        if not self.record_steps:
            return
        prefill = sum(s.num_new for s in work.scheduled if s.prefill)
        decode = sum(1 for s in work.scheduled if not s.prefill)
        self.stats.steps.append(StepRecord(
            step=len(self.stats.steps), start_s=start, end_s=self.now(),
            num_seqs=len(work.scheduled), prefill_tokens=prefill, decode_tokens=decode,
            computed_tokens=work.num_padded_tokens, preempted=len(work.preempted),
            free_blocks=self.cache.manager.num_free_blocks,
            occupancy=seats))

    # -- outputs ---------------------------------------------------------------------------
    @staticmethod
    def output(req: Request) -> RequestOutput:
        if req.error is not None:
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [], True,
                                 None, req.error)
        outs = [CompletionOutput(s.index, s.text, list(s.output_token_ids),
                                 s.status.value if s.finished else None, s.stop_reason,
                                 s.metrics(), s.num_preemptions,
                                 None if s.logprobs is None else list(s.logprobs),
                                 s.cumulative_logprob)
                for s in sorted(req.seqs, key=lambda s: s.index)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             req.finished, outs[0].metrics if outs else None)

    def _wait_for_arrival(self, start: float) -> None:
        """Nothing could run at ``start``: sleep until the next request arrives."""
        nxt = self.scheduler.next_arrival()
        if nxt is None or nxt <= start:
            raise RuntimeError("the scheduler made no progress; this is a bug "
                               f"(waiting={len(self.scheduler.waiting)}, "
                               f"running={len(self.scheduler.running)})")
        time.sleep(max(0.0, min(nxt - self.now(), 0.05)))

    def _step_until(self, requests: list[Request] | None) -> Iterator[list]:
        """Step until ``requests`` (None: every request) are finished, waiting for those
        not yet arrived; yields what each step produced."""
        def done() -> bool:
            if requests is None:
                return not self.has_unfinished()
            return all(r.finished for r in requests)

        while not done():
            if not self.has_unfinished():
                raise RuntimeError("a request is unfinished but the scheduler holds no "
                                   "sequence; this is a bug")
            start = self.now()
            produced = self.step()
            if self.idle:
                self._wait_for_arrival(start)
            yield produced

    def run(self, requests: list[Request] | None = None, on_step=None) -> None:
        """Step until ``requests`` are finished (None: every queued request); waits for
        requests that have not arrived yet. ``on_step(produced)`` is called after each
        step. An exception leaves the engine usable (see :meth:`step`) and is re-raised."""
        t = self.now()
        try:
            for produced in self._step_until(requests):
                if on_step is not None:
                    on_step(produced)
        finally:
            self.stats.wall_s += self.now() - t


def settled_length(text: str, stop: Seq[str]) -> int:
    """How much of a completion's decoded ``text`` may be shown while it is running.

    Held back: a trailing half character (U+FFFD until its other bytes arrive) and a tail
    that could be the beginning of a stop string — the next tokens may complete it, and
    then it must never have been shown. Everything before that is final. (The engine's
    incremental detokenizer never emits a half character, so :meth:`LLM._new_text` needs
    only the second rule, on the last characters.)
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    return end - stop_prefix_length(text[:end], stop)


def _blame(exc: BaseException, request_ids: Seq[int]) -> None:
    """Note on a step's exception which requests' own parameters raised it (an empty list:
    none alone). The exception is re-raised unchanged; a server reads the note to fail
    those requests only (``llmlab.serve.loop``)."""
    exc.llmlab_culprits = tuple(request_ids)


def culprits(exc: BaseException) -> tuple[int, ...]:
    """The request ids a failed :meth:`LLMEngine.step` blamed its exception on (see
    :func:`_blame`): empty when no single request's parameters were at fault."""
    return tuple(getattr(exc, "llmlab_culprits", ()))


def chat_prompt(tokenizer, messages) -> tuple[str, list[int]]:
    """One conversation ({"role", "content"} dicts) through ``tokenizer``'s chat template,
    assistant turn header added: its text and token ids (what :meth:`LLM.chat` and the HTTP
    server's chat route feed the engine)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                         tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} "
                         f"(one per prompt); got {len(params)} items")
    return params


class LLM:
    """Offline batched generation over the serving engine (vLLM-shaped).

    ``model``: a registered name (``"smollm2-135m"``, ``"tiny-llama"``) or an already
    loaded llmlab model (then pass ``tokenizer`` unless the model was loaded by name).
    ``scheduler``: ``"continuous"`` or ``"static"`` (the padded baseline), or a function
    ``(scheduler, now) -> SchedulerOutput`` that replaces the continuous one-step decision
    (see :class:`~llmlab.engine.scheduler.Scheduler`).
    ``kv_cache``: ``"paged"`` (the engine's only cache). ``num_blocks``: KV blocks of
    ``block_size`` tokens in the pool (default: what 512 MiB holds, at most enough for
    ``max_num_seqs`` full-context sequences). ``attention``: the dense backend used when
    loading by name (prompts from scratch use its varlen form). ``paged_attention``: the
    backend that reads K/V from the pool, for decodes and for prompts that continue a
    cached prefix (``"paged_sdpa"``, ``"paged"``, ``"paged_triton"``; default
    ``"paged_triton"`` on a GPU, ``"paged_sdpa"`` elsewhere; ``decode_attention`` is its
    deprecated old name). ``device`` and ``dtype``: where and in what a model loaded by
    name runs (default: CUDA if present; bfloat16 on a GPU, float32 on a CPU, see
    :func:`llmlab.device.default_dtype`); the KV pool takes the model's dtype. An
    already loaded model keeps its own, and a ``dtype`` that differs from it is refused.
    ``kv_cache_dtype``: ``"auto"`` (the model's dtype) or ``"int8"`` (one scale per token
    and KV head, dequantized when read: a block takes about half the bytes of bfloat16,
    so the default pool holds about twice the blocks). ``enable_chunked_prefill``:
    prompts are fed in chunks so no step exceeds ``max_num_batched_tokens`` (see
    :mod:`llmlab.engine.scheduler`). ``compile=True`` (vLLM's ``enforce_eager=False``):
    every step that only decodes runs one compiled graph per capture size (the batch
    padded to 1, 2, 4, ... ``max_num_seqs``; CUDA graphs on a GPU) over the paged pool in
    fixed shapes (:mod:`llmlab.cache.graphed`); steps with prompt tokens run eagerly. The
    first decode step of each capture size compiles (notebook 11). ``allocator`` and
    ``append_slot`` replace the block manager's pool and its block-table update (a class
    called as ``allocator(num_blocks, block_size)``, and a function as
    :class:`~llmlab.cache.block_manager.BlockManager` takes it; notebook 04's builds);
    a replacement allocator needs ``enable_prefix_caching=False`` unless it has the
    prefix-cache methods. ``prefix_cache``: ``"hash"`` (full blocks by hash, the default),
    ``"radix"`` (a token-level radix tree, :mod:`llmlab.cache.radix`) or None;
    ``enable_prefix_caching=False`` is the older spelling of None. ``admission``:
    ``"fcfs"`` or ``"cache_aware"`` (the longest cached prefix first, each request overtaken
    at most ``max_overtakes`` times; :mod:`llmlab.engine.scheduler`). Notebook 13.
    """

    def __init__(self, model="smollm2-135m", tokenizer=None, *, kv_cache: str = "paged",
                 scheduler: str | Callable = "continuous", block_size: int = 16,
                 num_blocks: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = False,
                 attention: str = "sdpa", paged_attention: str | None = None, device=None,
                 dtype: str | torch.dtype | None = None, seed: int = 0,
                 decode_attention: str | None = None, kv_cache_dtype: str = "auto",
                 compile: bool = False, allocator: Callable | None = None,
                 append_slot: Callable | None = None,
                 prefix_cache: str | Callable | None = "hash", admission: str = "fcfs",
                 max_overtakes: int = 8):
        import llmlab

        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={kv_cache!r}; allowed: {list(KV_CACHES)} (the engine "
                             "schedules over a paged cache)")
        if isinstance(model, str):
            name = model
            model = llmlab.load_model(name, attention=attention, device=device, dtype=dtype)
        else:
            name = getattr(model, "name", None)
            if not hasattr(model, "config") or not hasattr(model, "layers"):
                raise ValueError(f"model must be a registered name or a loaded llmlab model; "
                                 f"got {type(model).__name__}")
            if dtype is not None and resolve_dtype(dtype) != model.dtype:
                raise ValueError(f"dtype={dtype!r} but the model is already loaded in "
                                 f"{model.dtype}; load it in that dtype "
                                 f"(llmlab.load_model(..., dtype=...)), or pass dtype=None")
        if tokenizer is None:
            if name is None or name == "custom":
                raise ValueError("pass tokenizer= for a model built by hand")
            tokenizer = llmlab.load_tokenizer(name)
        self.model, self.tokenizer = model, tokenizer
        self.served_by = None      # the llmlab.serve EngineLoop stepping this engine, if any
        self.engine = LLMEngine(model, tokenizer, scheduler=scheduler, block_size=block_size,
                                num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len,
                                enable_prefix_caching=enable_prefix_caching,
                                enable_chunked_prefill=enable_chunked_prefill,
                                paged_attention=paged_attention, seed=seed,
                                decode_attention=decode_attention, kv_cache_dtype=kv_cache_dtype,
                                compile=compile, allocator=allocator, append_slot=append_slot,
                                prefix_cache=prefix_cache, admission=admission,
                                max_overtakes=max_overtakes)

    # -- inputs ------------------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"a prompt must be a string, a list of token ids or "
                         f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")

    def _encode_all(self, prompts) -> list[tuple[str | None, list[int]]]:
        """One prompt or a list -> (text or None, token ids) each; ValueError naming the
        first prompt with a token id outside the vocabulary (nothing is queued)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        encoded = [self._encode(p) for p in prompts]       # every prompt checked before any
        for i, (_, ids) in enumerate(encoded):              # is queued
            try:
                self.engine.check_token_ids(ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return encoded

    def _check_not_served(self) -> None:
        """RuntimeError while a server's engine thread steps this engine: an offline call
        from another thread would step it too, interleaved with the server's steps."""
        if self.served_by is not None:       # set by EngineLoop.start, cleared as it ends
            raise RuntimeError("this LLM is being served (llmlab.serve runs its engine in a "
                               "background thread); send requests over HTTP, stop the "
                               "server first, or use a second LLM for offline calls")

    def _submit(self, prompts, sampling_params, arrival_times) -> list[Request]:
        self._check_not_served()
        encoded = self._encode_all(prompts)
        prompts = [text for text, _ in encoded]
        params = _as_params(sampling_params, len(prompts))
        if arrival_times is not None:
            arrival_times = [float(a) for a in arrival_times]
            if len(arrival_times) != len(prompts) or any(a < 0 for a in arrival_times):
                raise ValueError(f"arrival_times must be {len(prompts)} offsets >= 0 (seconds "
                                 "after the call)")
        eng = self.engine
        eng.stats = EngineStats()
        base = eng.now()
        order = range(len(prompts))
        if arrival_times is not None:   # the waiting queue is kept in arrival order
            order = sorted(order, key=lambda i: arrival_times[i])
        reqs: list[Request | None] = [None] * len(prompts)
        try:
            for i in order:
                text, ids = encoded[i]
                at = base + (arrival_times[i] if arrival_times is not None else 0.0)
                reqs[i] = eng.add_request(ids, params[i], text, at)
        except BaseException:
            self._abort(reqs)
            raise
        return reqs

    def _abort(self, reqs: list[Request | None]) -> None:
        """A call failed or was interrupted: its unfinished requests are aborted."""
        for r in reqs:
            if r is not None and not r.finished:
                self.engine.abort_request(r.request_id)

    # -- the API -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True, arrival_times: list[float] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        ``prompts``: a string, a list of strings, token-id lists, or dicts with
        ``prompt_token_ids``. ``sampling_params``: one for all, or one per prompt
        (default ``SamplingParams()``: temperature 1, 16 tokens). ``arrival_times``:
        seconds after the call at which each request arrives (simulated load); by
        default all arrive at once. Per-request metrics are on ``output.metrics``;
        the engine's step log is ``llm.stats``.

        A token id outside the vocabulary raises ValueError before anything runs. If
        the call fails or is interrupted, its requests are aborted (their blocks
        freed), the exception reaches the caller, and the LLM stays usable.
        """
        reqs = self._submit(prompts, sampling_params, arrival_times)
        bar = None
        if use_tqdm:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(reqs), desc="requests", unit="req")
            except ImportError:
                bar = None
        done = set()

        def on_step(_):
            if bar is None:
                return
            for r in reqs:
                if r.request_id not in done and r.finished:
                    done.add(r.request_id)
                    bar.update(1)

        try:
            on_step(None)
            self.engine.run(reqs, on_step)
        except BaseException:              # KeyboardInterrupt too: the engine stays usable
            self._abort(reqs)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.engine.output(r) for r in reqs]

    def chat(self, messages, sampling_params: SamplingParams | list | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations: one list of {"role", "content"} dicts, or a
        list of them. The model's chat template adds the assistant turn header."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "(or a list of such lists)")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in conv):
                raise ValueError("each message must be a dict with 'role' and 'content'")
            text, ids = self.chat_prompt(conv)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages) -> tuple[str, list[int]]:
        """One conversation ({"role", "content"} dicts) through the model's chat template,
        assistant turn header added: its text and token ids (what :meth:`chat` and the HTTP
        server's chat route feed the engine)."""
        return chat_prompt(self.tokenizer, messages)

    def stream(self, prompts, sampling_params: SamplingParams | list | None = None
               ) -> Iterator[TokenEvent]:
        """Yield each new token as the engine produces it (all prompts interleaved).

        The ``text`` of a completion's events concatenates exactly to its final text:
        text that might be the start of a stop string (or half a character) is held back
        until the next tokens decide, so nothing past a stop string is ever shown.
        Stopping early (``break``, ``close()``, or dropping the generator) aborts the
        call's unfinished requests, as does an exception inside the loop.
        """
        reqs = self._submit(prompts, sampling_params, None)
        index = {r.request_id: i for i, r in enumerate(reqs)}
        shown: dict[int, int] = {}
        eng = self.engine
        t = eng.now()
        try:
            for produced in eng._step_until(reqs):
                for seq, tok in produced:
                    i = index.get(seq.request.request_id)
                    if i is None:          # a request of another call sharing the engine
                        continue
                    yield TokenEvent(i, seq.index, tok, self._new_text(seq, shown),
                                     seq.finished, seq.status.value if seq.finished else None,
                                     seq.logprobs[-1] if seq.logprobs else None)
        except BaseException:              # GeneratorExit too: the caller stopped reading
            self._abort(reqs)
            raise
        finally:
            eng.stats.wall_s += eng.now() - t

    def _new_text(self, seq: Sequence, shown: dict[int, int]) -> str:
        """The text a completion adds since the last event (``shown`` keeps how many
        characters each completion has shown so far). Costs O(new text + longest stop
        string) while it runs: the engine has decoded the new tokens already
        (``seq.detok``); only a tail that may become a stop string is held back. The
        pieces concatenate exactly to the final text, which never cuts into what was
        shown: a stop string is cut where it starts, and no part of it was shown."""
        done = shown.get(seq.seq_id, 0)
        if seq.finished:
            shown[seq.seq_id] = max(done, len(seq.text))
            return seq.text[done:]
        text, stop = seq.detok, seq.request.params.stop
        settled = text.length
        if stop:
            settled -= stop_prefix_length(text.tail(max(map(len, stop)) - 1), stop)
        if settled <= done:
            return ""
        shown[seq.seq_id] = settled
        return text.tail(text.length - done)[:settled - done]

    def beam_search(self, prompts, params: BeamSearchParams | int, max_tokens: int | None = None,
                    *, ignore_eos: bool = False, temperature: float = 0.0,
                    length_penalty: float = 1.0) -> list[BeamSearchOutput]:
        """The ``beam_width`` most likely completions of each prompt (see
        :mod:`llmlab.engine.beam`); one :class:`BeamSearchOutput` per prompt, in input
        order, its ``sequences`` best score first.

        As vLLM: ``llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=16))``;
        or the plain numbers ``llm.beam_search(prompts, 4, 16)`` with the other fields as
        keywords. ``prompts`` as for :meth:`generate`. The beams share KV blocks (fork,
        copy-on-write); all are free again when it returns. The step log is ``llm.stats``
        (``free_blocks`` per step shows the sharing).
        """
        if isinstance(params, BeamSearchParams):
            if max_tokens is not None:
                raise ValueError("pass max_tokens inside BeamSearchParams, or pass "
                                 "beam_width and max_tokens as numbers; not both")
        else:
            if max_tokens is None:
                raise ValueError(f"beam_search(prompts, beam_width={params!r}, max_tokens) "
                                 "needs max_tokens (or a BeamSearchParams)")
            params = BeamSearchParams(params, max_tokens, ignore_eos, temperature,
                                      length_penalty)
        self._check_not_served()
        encoded = self._encode_all(prompts)
        eng = self.engine
        eng.stats = EngineStats()
        t = eng.now()
        try:
            return BeamSearcher(eng, params).run(encoded)
        finally:
            eng.stats.wall_s += eng.now() - t

    @property
    def stats(self) -> EngineStats:
        """The step log of the last generate / chat / stream / beam_search call."""
        return self.engine.stats


__all__ = ["LLM", "LLMEngine", "EngineStats", "StepRecord", "TokenEvent", "settled_length",
           "chat_prompt", "culprits"]
