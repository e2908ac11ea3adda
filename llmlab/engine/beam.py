"""Beam search over the paged KV cache: the beams of a prompt share their blocks.

Greedy decoding keeps the one most likely next token; beam search keeps the
``beam_width`` most likely *sequences* so far (Graves 2012, https://arxiv.org/abs/1211.3711;
Sutskever et al. 2014, https://arxiv.org/abs/1409.3215). Each step, as vLLM's
``LLM.beam_search`` does it
(https://docs.vllm.ai/en/latest/api/vllm/entrypoints/generate/beam_search/offline/):

1. every live beam proposes its ``2 * beam_width`` most likely next tokens, with the
   sum of log-probabilities so far (``cumulative_logprob``);
2. a proposal that ends in the end-of-sequence token is a *finished* beam (unless
   ``ignore_eos``); of the others, the ``beam_width`` best continue (all live beams
   have the same length, so "best" is the highest cumulative log-probability);
3. after ``max_tokens`` steps the live beams finish too, and the finished beams are
   ranked by the length-normalised score of HF transformers
   (``GenerationMixin._update_finished_beams``):
   ``score = cumulative_logprob / num_generated_tokens ** length_penalty`` (the EOS
   token counted). ``length_penalty`` > 1 favours longer beams, < 1 shorter ones.

Memory: the beams of a prompt descend from the same prompt and mostly from each other.
A beam that continues as several beams is *forked* (``BlockManager.fork``): the
children share every block of the parent, and the first write into a shared, partly
filled last block copies that block (copy-on-write); a beam that does not continue is
freed at once. So ``beam_width`` beams hold the prompt once, and their common history
once, not ``beam_width`` times. Every block is released when the search returns, even
when it fails. Taught with notebook 05's engine; used by :meth:`llmlab.engine.LLM.beam_search`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..sampling import check_sampling_args, processed_logprobs
from ..stopping import token_budget
from .scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (https://docs.vllm.ai/en/latest/api/vllm/sampling_params/).

    ``beam_width``: beams kept per prompt (1 is greedy decoding). ``max_tokens``: new
    tokens at most. ``ignore_eos``: the end-of-sequence token does not finish a beam.
    ``temperature`` (>= 0; 0 and 1 both use the model's distribution): the log-probabilities
    are those of ``logits / temperature``; the search stays deterministic.
    ``length_penalty``: the exponent of the length normalisation (see the module docstring).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) \
                or self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width!r} must be an int >= 1")
        check_sampling_args(self.temperature, max_tokens=self.max_tokens)
        lp = self.length_penalty
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp):
            raise ValueError(f"length_penalty={lp!r} must be a finite number")


@dataclass
class BeamSearchSequence:
    """One beam: its generated tokens (the EOS included when it ended there), text,
    per-token and cumulative log-probabilities, and its length-normalised score."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str                # "stop" (end-of-sequence token) or "length"
    logprobs: list[float] = field(default_factory=list, repr=False)


@dataclass
class BeamSearchOutput:
    """Per prompt: its best ``beam_width`` beams, best score first (vLLM's name)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


def beam_score(cumulative_logprob: float, num_tokens: int, length_penalty: float = 1.0) -> float:
    """``cumulative_logprob / num_tokens ** length_penalty`` (HF transformers' score)."""
    return cumulative_logprob / max(num_tokens, 1) ** length_penalty


@dataclass(eq=False)
class _Beam:
    """A live beam: what the model runner reads of a sequence, and its log-probabilities."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed: int = 0            # leading tokens whose K/V are in the cache

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def extended(self, seq_id: int, token: int, logprob: float) -> "_Beam":
        return _Beam(seq_id, self.prompt_token_ids, self.output_token_ids + [token],
                     self.logprobs + [logprob], self.cumulative_logprob + logprob,
                     self.num_computed)


@dataclass
class _Search:
    """One prompt's search: live beams, finished ones (as (beam, reason)), budget."""

    prompt: str | None
    prompt_token_ids: list[int]
    budget: int                      # new tokens allowed (max_tokens, or what the context holds)
    live: list[_Beam]
    finished: list[tuple[_Beam, str]] = field(default_factory=list)


def expand(beams: list[_Beam], top_logprobs: torch.Tensor, top_ids: torch.Tensor, width: int,
           eos_token_id: int | None, ignore_eos: bool):
    """Step 2 of the module docstring for one prompt. ``top_logprobs`` / ``top_ids``
    [len(beams), 2 * width]: each beam's best next tokens. -> (the ``width`` best
    continuing proposals, the proposals that end in EOS), each ``(parent, token, logprob)``."""
    going, ending = [], []
    for beam, values, ids in zip(beams, top_logprobs.tolist(), top_ids.tolist()):
        for lp, tok in zip(values, ids):
            stop = tok == eos_token_id and not ignore_eos
            (ending if stop else going).append((beam, tok, lp))
    going.sort(key=lambda c: c[0].cumulative_logprob + c[2], reverse=True)   # stable
    return going[:width], ending


class BeamSearcher:
    """Runs :class:`BeamSearchParams` over an :class:`~llmlab.engine.LLMEngine`'s model runner
    and block manager (not its scheduler): all live beams of all prompts go through one
    forward per step, packed, prompts read from the prefix cache where they can be."""

    def __init__(self, engine, params: BeamSearchParams):
        self.engine, self.params = engine, params
        self.bm = engine.cache.manager
        self._owned: list[int] = []      # every sequence id this search gave blocks to

    def _new_id(self) -> int:
        self._owned.append(next(self.engine._seq_ids))
        return self._owned[-1]

    def run(self, prompts: list[tuple[str | None, list[int]]]) -> list[BeamSearchOutput]:
        """``prompts``: (text or None, token ids) each. Frees every block it took, always
        (an exception or an interrupt included). ValueError for a prompt that leaves no
        room in the context, before anything runs."""
        limit = self.engine.config.max_model_len
        budgets = [token_budget(len(ids), self.params.max_tokens, limit) for _, ids in prompts]
        searches = [_Search(text, list(ids), b, [_Beam(self._new_id(), list(ids))])
                    for (text, ids), b in zip(prompts, budgets)]
        try:
            for s in searches:
                beam = s.live[0]
                beam.num_computed = self.bm.allocate(beam.seq_id, beam.prompt_token_ids)
            while any(s.live for s in searches):
                self._step(searches)
        finally:
            for seq_id in self._owned:
                if self.bm.has_seq(seq_id):
                    self.bm.free(seq_id)
        return [self._output(s) for s in searches]

    def _step(self, searches: list[_Search]) -> None:
        """One forward over every live beam, then each prompt keeps its best beams."""
        eng, p = self.engine, self.params
        start = eng.now()
        live = [b for s in searches for b in s.live]
        work = SchedulerOutput(packed=True)
        work.block_copies.extend(self.bm.take_copies())   # radix: prompts matched mid-block
        for beam in live:
            if beam.output_token_ids:          # its newest token needs a slot (maybe a copy)
                _, cow = self.bm.append_slot(beam.seq_id, beam.output_token_ids[-1])
                if cow is not None:
                    work.block_copies.append(cow)
            work.scheduled.append(ScheduledSeq(beam, len(beam.all_token_ids) - beam.num_computed,
                                               prefill=not beam.output_token_ids))
        logits = eng.runner.execute(work)
        for beam in live:
            beam.num_computed = len(beam.all_token_ids)
            self.bm.mark_computed(beam.seq_id, beam.num_computed)
        eng._record(work, start, [])         # the step's peak: every slot reserved
        logprobs = processed_logprobs(logits, [p.temperature] * len(live))
        top = logprobs.topk(2 * p.beam_width, dim=-1)
        row = 0
        for s in searches:
            n = len(s.live)
            self._advance(s, top.values[row:row + n], top.indices[row:row + n])
            row += n

    def _advance(self, s: _Search, top_logprobs: torch.Tensor, top_ids: torch.Tensor) -> None:
        """Replace the prompt's live beams by their best continuations: the first child of
        a beam takes over its blocks, the others fork them, a beam without one is freed."""
        p = self.params
        going, ending = expand(s.live, top_logprobs, top_ids, p.beam_width,
                               self.engine.eos_token_id, p.ignore_eos)
        s.finished += [(parent.extended(-1, tok, lp), "stop") for parent, tok, lp in ending]
        taken: set[int] = set()
        new: list[_Beam] = []
        for parent, tok, lp in going:
            if parent.seq_id in taken:
                child_id = self._new_id()
                self.bm.fork(parent.seq_id, child_id)
            else:
                child_id = parent.seq_id
                taken.add(child_id)
            new.append(parent.extended(child_id, tok, lp))
        for parent in s.live:
            if parent.seq_id not in taken:
                self.bm.free(parent.seq_id)
        s.live = new
        if s.live and len(s.live[0].output_token_ids) >= s.budget:
            for beam in s.live:
                self.bm.free(beam.seq_id)
            s.finished += [(b, "length") for b in s.live]
            s.live = []

    def _output(self, s: _Search) -> BeamSearchOutput:
        p, tok = self.params, self.engine.tokenizer
        seqs = []
        for beam, reason in s.finished:
            ids = beam.output_token_ids
            text = tok.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
            seqs.append(BeamSearchSequence(
                list(ids), text, beam.cumulative_logprob,
                beam_score(beam.cumulative_logprob, len(ids), p.length_penalty), reason,
                list(beam.logprobs)))
        seqs.sort(key=lambda q: q.score, reverse=True)        # stable: ties keep their order
        return BeamSearchOutput(s.prompt, s.prompt_token_ids, seqs[:p.beam_width])


__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearcher",
           "beam_score", "expand"]
