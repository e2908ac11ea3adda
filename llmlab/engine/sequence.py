"""Request state for the serving engine: sampling parameters, sequences, requests.

A *request* is one prompt with its :class:`SamplingParams`; it owns ``n`` *sequences*
(one per completion asked for). A sequence moves through the states

    WAITING --admit--> RUNNING --finish--> FINISHED_*
       ^                  |
       +-----preempt------+        (blocks freed; recomputed later from its tokens)

A step that fails part-way sends its running sequences back to WAITING the same way;
``abort`` (from either state) ends a sequence as FINISHED_ABORTED.

and keeps everything the scheduler needs: its tokens, how many of them already have
K/V in the cache (``num_computed``), its batch slot, its random generator and the
times its tokens came out (for TTFT / TPOT). Taught in notebook 05.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..profiling.metrics import RequestMetrics
from ..sampling import check_sampling_args, has_penalties
from .detokenizer import IncrementalDetokenizer


@dataclass
class SamplingParams:
    """How to turn logits into tokens for one request (vLLM's names and meanings,
    https://docs.vllm.ai/en/latest/api/vllm/sampling_params/).

    ``temperature=0`` is greedy. ``top_k`` None (or 0 or -1) and ``top_p`` 1.0 disable
    those filters. ``n`` completions share the prompt's KV blocks (a fork, copy-on-write).
    ``stop``: strings that end a completion (not included in its text). ``ignore_eos``
    keeps generating past the end-of-sequence token. ``seed`` (a 64-bit signed int) makes
    sampling reproducible per request, whatever else is in the batch; completion ``i`` of
    ``n`` uses ``seed + i``.

    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 is off) lower the logits
    of tokens the completion has already generated, once / once per occurrence;
    ``repetition_penalty`` (> 0, 1 is off) shrinks the logits of tokens seen in the prompt
    or the completion (see :func:`llmlab.sampling.apply_penalties`). ``logprobs`` (None or
    0..20): each completion reports, per generated token, the log-probability of the
    chosen token and of the ``logprobs`` most likely ones, and their sum
    (``cumulative_logprob``), from the distribution sampled (penalties and temperature
    applied, before top-k / top-p; see :mod:`llmlab.sampling`).

    ``structured``: constrain the output to a grammar (vLLM's guided decoding):
    ``{"regex": ...}``, ``{"json_schema": ...}`` (a dict or a pydantic model),
    ``{"choice": [...]}`` or ``{"json_object": True}``, optionally with ``"backend"``
    (``"auto"``, ``"llmlab"``, ``"llguidance"``). Each step sets the logits of the tokens
    the grammar forbids to -inf before sampling; the completion ends (``"stop"``) when
    the grammar accepts and EOS is sampled, or as soon as nothing but EOS may follow
    (:mod:`llmlab.structured`, notebook 12).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    structured: object = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an int >= 1")
        if self.top_p is None:   # None and 1.0 both mean no top-p filter
            self.top_p = 1.0
        # the same validator as llmlab.generate: both accept and refuse the same values
        check_sampling_args(self.temperature, self.top_k, self.top_p, self.max_tokens, self.seed,
                            presence_penalty=self.presence_penalty,
                            frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs)
        if self.top_k in (0, -1):        # both spell "no top-k filter" (vLLM: -1, and 0)
            self.top_k = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a non-empty string or a list of them")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n={self.n} needs temperature > 0: greedy decoding would give "
                             f"{self.n} identical completions")
        if self.structured is not None:
            from ..structured.spec import coerce_spec

            self.structured = coerce_spec(self.structured)   # ValueError "structured...: why"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return has_penalties(self.presence_penalty, self.frequency_penalty,
                             self.repetition_penalty)


def token_slice(seq, start: int, stop: int) -> list[int]:
    """``(seq.prompt_token_ids + seq.output_token_ids)[start:stop]`` for 0 <= start <= stop,
    without building the whole list: a decode step reads one token of a long sequence, and
    must not cost more as the sequence grows. ``seq``: anything with those two lists (a
    :class:`Sequence`, a beam)."""
    prompt, output = seq.prompt_token_ids, seq.output_token_ids
    p = len(prompt)
    if start >= p:
        return output[start - p:stop - p]
    return prompt[start:stop] + output[:max(0, stop - p)]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"        # end-of-sequence token or a stop string
    FINISHED_LENGTH = "length"       # max_tokens or the context limit
    FINISHED_ABORTED = "abort"       # LLMEngine.abort_request, or its call was interrupted

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(eq=False)
class Sequence:
    """One completion: prompt tokens + generated tokens, and its place in the engine."""

    seq_id: int
    request: "Request"
    index: int                                   # which of the request's n completions
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0            # leading tokens whose K/V are in the cache
    slot: int | None = None          # batch slot while admitted (for the occupancy picture)
    generator: torch.Generator | None = None
    token_times: list[float] = field(default_factory=list)   # engine clock, per output token
    finish_time: float | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    text: str = ""                   # the final text, once finished
    logprobs: list[dict[int, float]] | None = None   # per output token, if params.logprobs
    # the text so far, a few tokens at a time (LLMEngine._stop_check feeds it), and how
    # much of it the stop strings have been searched in: per token, both cost O(1)
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer, repr=False)
    stop_checked: int = 0
    matcher: object = None           # its place in the request's grammar (structured output)
    _counts: dict | None = field(default=None, init=False, repr=False)    # output_counts()
    _counted: int = field(default=0, init=False, repr=False)
    _prompt_set: frozenset | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.reset_logprobs()

    def output_counts(self) -> dict[int, int]:
        """``{token: times generated}``, kept up to date incrementally: the penalties read
        it every step, and recounting the whole output would cost O(length) per token.
        (Recounted from scratch if the output was cleared or edited shorter.)"""
        out = self.output_token_ids
        if self._counts is None or self._counted > len(out):
            self._counts, self._counted = {}, 0
        for t in out[self._counted:]:
            self._counts[t] = self._counts.get(t, 0) + 1
        self._counted = len(out)
        return self._counts

    def prompt_token_set(self) -> frozenset[int]:
        """The prompt's distinct tokens (the repetition penalty's), computed once."""
        if self._prompt_set is None:
            self._prompt_set = frozenset(self.prompt_token_ids)
        return self._prompt_set

    def forget_output(self) -> None:
        """Its output tokens were cleared: forget what was derived from them (the text so
        far, the token counts)."""
        self.detok, self.stop_checked, self.text = IncrementalDetokenizer(), 0, ""
        self._counts, self._counted = None, 0

    def reset_logprobs(self) -> None:
        """Empty log-probabilities when its request asks for them, else None."""
        params = getattr(self.request, "params", None)
        self.logprobs = [] if getattr(params, "logprobs", None) is not None else None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of its chosen tokens' log-probabilities (None unless asked for)."""
        if self.logprobs is None:
            return None
        return sum(d[t] for d, t in zip(self.logprobs, self.output_token_ids))

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens, a new list (O(length): not for every step)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]``, costing O(stop - start) (see :func:`token_slice`)."""
        return token_slice(self, start, stop)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens the next forward must feed (the whole prompt at first, then 1)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status.finished

    def metrics(self) -> RequestMetrics:
        """TTFT / end-to-end measured from the request's arrival, on the engine clock."""
        arrival = self.request.arrival_time
        n = len(self.output_token_ids)
        ttft = self.token_times[0] - arrival if self.token_times else float("nan")
        end = (self.finish_time if self.finish_time is not None
               else (self.token_times[-1] if self.token_times else float("nan")))
        times = self.token_times
        gap = max((b - a for a, b in zip(times, times[1:])), default=float("nan"))
        return RequestMetrics(prompt_tokens=len(self.prompt_token_ids), output_tokens=n,
                              ttft_s=ttft, e2e_s=end - arrival, max_gap_s=gap)


@dataclass(eq=False)
class Request:
    """One prompt and its parameters; owns ``params.n`` sequences once it is forked."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0        # engine clock (seconds since the engine started)
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None
    error_param: str | None = None   # the parameter that made it fail ("prompt", "n", ...)
    grammar: object = None           # params.structured compiled (llmlab.structured)

    @property
    def finished(self) -> bool:
        if self.error is not None or self.aborted:
            return True
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)

    @property
    def aborted(self) -> bool:
        return any(s.status is SequenceStatus.FINISHED_ABORTED for s in self.seqs)


@dataclass
class CompletionOutput:
    """One of a request's completions (vLLM's name)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None        # "stop", "length", "abort", or None while running
    stop_reason: str | int | None = None   # the stop string or EOS id that ended it
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_preemptions: int = 0
    # SamplingParams.logprobs set: per generated token {token id: logprob} (the chosen
    # token and the top ones), and the chosen tokens' sum; None otherwise (as vLLM)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, in input order.

    ``error`` is set (and ``outputs`` empty) when the request was rejected, e.g. a
    prompt longer than the context; the other requests of the batch still run.
    ``metrics`` are those of the first completion: TTFT, TPOT, end-to-end latency.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None


__all__ = ["SamplingParams", "SequenceStatus", "Sequence", "token_slice", "Request", "CompletionOutput",
           "RequestOutput"]
