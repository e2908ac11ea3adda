"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one forward.

Decode at batch 1 is memory-bound: each step streams every weight of the target to
produce one token. Feeding k+1 tokens instead of 1 costs about the same weight traffic, so
if a cheap *draft* guesses the next k tokens, one forward of the *target* can verify all of
them and keep the longest prefix it agrees with, plus one token of its own. Taught in
notebook 09.

One step (batch 1, the target's :class:`~llmlab.cache.ContiguousKVCache`)::

    draft   d1..dk                      (n-gram lookup, early exit, or a draft model)
    verify  target([t, d1..dk]) -> p0..pk    one forward, k+1 positions, K/V written
    accept  the longest accepted prefix d1..dn, then one token: a correction from
            p_n (n < k) or a bonus from p_k (n = k)
    roll back  the cache forgets the K/V of the k - n rejected drafts

Greedy: a draft is accepted when it is the target's argmax, so the output is the plain
greedy output token for token. Sampling: the rule of Leviathan et al. (ICML 2023) and
Chen et al. (2023): accept d with probability min(1, p(d)/q(d)); on rejection sample from
the normalized (p − q)⁺. The emitted tokens are then distributed exactly as the target's
(:func:`accept_reject`).

Draft methods (``SpeculativeConfig.method``):

* ``"ngram"``: prompt lookup. Find the last few tokens earlier in prompt + output and
  propose what followed them there. No model at all: strong when the output copies the
  input (editing, rewriting, code), useless in open chat.
* ``"early_exit"``: the target's own first ``num_layers`` layers, then its final norm and
  lm_head. No extra weights, but a shallow cut of an untrained-for-it model guesses poorly.
* ``"draft"``: any llmlab model with the same vocabulary (``draft_model``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from .cache.contiguous import ContiguousKVCache
from .device import sync
from .sampling import filter_logits, sample_rows
from .stopping import finish_reason, token_budget

METHODS = ("ngram", "early_exit", "draft")


@dataclass
class SpeculativeConfig:
    """How to speculate. ``num_tokens`` is k, the drafts per step.

    ``ngram_max``/``ngram_min``: the longest and shortest suffix the n-gram lookup tries
    to find earlier in the text. ``num_layers``: the early-exit draft's depth (default a
    quarter of the target's layers). ``draft_model``: the model of ``method="draft"``.
    ``accept_fn``: a replacement for :func:`accept_reject` (same signature), used at every
    verify step, greedy ones too: there p is one-hot on the target's argmax and q one-hot
    on each draft, where the rule reduces to greedy verification (notebook 09's exercise
    plugs the student's rule in here).
    """

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    num_layers: int | None = None
    draft_model: object = None
    accept_fn: object = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method={self.method!r}; allowed: {METHODS}")
        for name in ("num_tokens", "ngram_max", "ngram_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min} must be <= ngram_max={self.ngram_max}")
        if self.accept_fn is not None and not callable(self.accept_fn):
            raise ValueError(f"accept_fn={self.accept_fn!r} must be a function with the "
                             "signature of llmlab.speculative.accept_reject, or None")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method='draft' needs draft_model=<an llmlab model with the "
                             "target's vocabulary>")

    @classmethod
    def coerce(cls, spec) -> "SpeculativeConfig":
        """A config from a config or a dict such as ``{"method": "ngram", "num_tokens": 4}``."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            allowed = [f.name for f in fields(cls)]
            unknown = sorted(set(spec) - set(allowed))
            if unknown:
                raise ValueError(f"unknown speculative option(s) {unknown}; allowed: {allowed}")
            return cls(**spec)
        raise ValueError(f"speculative={spec!r}; allowed: a SpeculativeConfig, a dict of its "
                         "fields, or None")


@dataclass
class SpecStats:
    """What speculation did for one generation.

    ``accepted_per_step``: drafts the target accepted at each verify step (out of
    ``drafted_per_step``). A target forward is the prefill or a verify step; plain KV-cache
    decoding makes exactly 1 token per target forward. Times are wall-clock seconds.
    """

    method: str
    num_tokens: int
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    num_generated: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0

    @property
    def num_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def target_forwards(self) -> int:
        return 1 + self.num_steps              # the prefill, then one per step

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (0 when nothing was drafted)."""
        drafted = sum(self.drafted_per_step)
        return sum(self.accepted_per_step) / drafted if drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted_per_step) / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.num_generated / self.target_forwards


# -- accept / reject --------------------------------------------------------------------------

def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits [..., vocab] -> the sampler's distribution [..., vocab] (float32), the one
    :func:`llmlab.sampling.sample` draws from at ``temperature`` > 0."""
    shape = logits.shape
    flat = filter_logits(logits.reshape(-1, shape[-1]).float() / temperature, top_k, top_p)
    return torch.softmax(flat, dim=-1).reshape(shape)


def accept_reject(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative sampling rule, for N independent rows at once.

    p [N, k+1, vocab]: the target's distribution at each drafted position and one past
    the last; q [N, k, vocab]: the draft's distribution each draft was sampled from;
    drafts [N, k] long. Draft i is accepted with probability min(1, p(d_i) / q(d_i)),
    in order, until the first rejection. At the first rejected position n the next token
    is drawn from (p_n − q_n)⁺ normalized; if all k are accepted, from p_k (the bonus).
    Returns (num_accepted [N] long, next_token [N] long): the row emits
    ``drafts[:num_accepted] + [next_token]``, distributed exactly as the target's tokens.
    """
    n_rows, k = drafts.shape
    if p.shape[:2] != (n_rows, k + 1) or q.shape[:2] != (n_rows, k) or p.shape[2] != q.shape[2]:
        raise ValueError(f"shapes p {tuple(p.shape)}, q {tuple(q.shape)}, drafts "
                         f"{tuple(drafts.shape)}; expected [N, k+1, V], [N, k, V], [N, k]")
    pd = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)          # [N, k]
    qd = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand((n_rows, k), generator=generator, device=p.device)
    accepted = u * qd < pd                     # u < p/q without dividing by q
    num_accepted = accepted.long().cumprod(-1).sum(-1)               # leading accepts
    rows = torch.arange(n_rows, device=p.device)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)       # no draft past k: q = 0
    residual = (p[rows, num_accepted] - q_next[rows, num_accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # (p - q)+ is all zero only where p == q, and then a rejection has probability 0;
    # guard the rounding case by falling back to p.
    residual = torch.where(mass > 0, residual, p[rows, num_accepted])
    next_token = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1,
                                   generator=generator).squeeze(-1)
    return num_accepted, next_token


def greedy_accept(target_argmax: list[int], drafts: list[int]) -> tuple[int, int]:
    """Greedy verification: ``target_argmax`` [k+1] is the target's choice at each position.
    Accept drafts while they equal it; the next token is the target's choice where they
    first differ (or its bonus after all k). Returns (num_accepted, next_token)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


# -- the cost model ---------------------------------------------------------------------------

def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per verify step] when each of k drafts is accepted with probability
    ``alpha``, independently, until the first rejection: 1 + α + ... + α^k (Leviathan et al.,
    2023, eq. 1)."""
    if not 0 <= alpha <= 1 or not isinstance(k, int) or k < 0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1] and k={k!r} an int >= 0")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def cost_model_speedup(tokens_per_step: float, k: int, c: float, verify: float = 1.0) -> float:
    """Speedup over plain decoding ≈ E[tokens per step] / (verify + k·c): a step verifies
    k drafts at ``verify`` decode steps (1 where decode is memory-bound) after drafting
    them at ``c`` decode steps each."""
    if tokens_per_step < 1 or k < 0 or c < 0 or verify <= 0:
        raise ValueError(f"tokens_per_step={tokens_per_step!r} must be >= 1, k={k!r} >= 0, "
                         f"c={c!r} >= 0 and verify={verify!r} > 0")
    return tokens_per_step / (verify + k * c)


# -- drafters ---------------------------------------------------------------------------------

def ngram_propose(seq: list[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the most recent earlier occurrence
    of the longest suffix of ``seq`` (``ngram_max`` down to ``ngram_min`` tokens) that
    occurs earlier. [] when no suffix recurs."""
    n_seq = len(seq)
    for n in range(min(ngram_max, n_seq - 1), ngram_min - 1, -1):
        tail = seq[n_seq - n:]
        for i in range(n_seq - n - 1, -1, -1):
            if seq[i:i + n] == tail:
                return seq[i + n:i + n + k]
    return []


class NgramDrafter:
    """Drafts by prompt lookup (:func:`ngram_propose`); its q is one-hot on each draft."""

    def __init__(self, spec: SpeculativeConfig, vocab_size: int):
        self.spec, self.vocab_size = spec, vocab_size

    def propose(self, seq: list[int], k: int, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator | None
                ) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``k`` drafts after ``seq``, and q [len(drafts), vocab] when sampling
        (None when greedy: the verifier only compares tokens)."""
        drafts = ngram_propose(seq, k, self.spec.ngram_max, self.spec.ngram_min)
        q = None
        if temperature > 0 and drafts:
            q = torch.zeros(len(drafts), self.vocab_size)
            q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
        return drafts, q

    def rollback(self, num_valid: int) -> None:
        pass


class ModelDrafter:
    """Drafts autoregressively with a small causal model and its own contiguous KV cache.

    ``forward(ids [1, s], positions, cache) -> logits [1, vocab]`` of the last position.
    The cache holds a prefix of the text; each proposal first feeds what it lacks."""

    def __init__(self, forward, cache: ContiguousKVCache, device):
        self.forward, self.cache, self.device = forward, cache, device

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        positions = self.cache.begin(len(tokens))
        logits = self.forward(ids, positions, self.cache)
        self.cache.advance()
        return logits

    def propose(self, seq: list[int], k: int, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator | None
                ) -> tuple[list[int], torch.Tensor | None]:
        """``k`` drafts after ``seq``, each sampled from (or the argmax of) the draft's
        distribution; q [k, vocab] when sampling, None when greedy."""
        logits = self._feed(seq[self.cache.length:])
        drafts, qs = [], []
        for i in range(k):
            if temperature > 0:
                q = probabilities(logits, temperature, top_k, top_p)
                d = int(torch.multinomial(q, 1, generator=generator)[0, 0])
                qs.append(q[0])
            else:
                d = int(logits[0].argmax())
            drafts.append(d)
            if i < k - 1:
                logits = self._feed([d])
        return drafts, (torch.stack(qs) if qs else None)

    def rollback(self, num_valid: int) -> None:
        self.cache.truncate(min(self.cache.length, num_valid))


def early_exit_forward(model, num_layers: int):
    """The target cut after its first ``num_layers`` layers, then its final norm and
    lm_head: ``f(ids [1, s], positions, cache) -> logits [1, vocab]`` of the last token."""
    def forward(ids, positions, cache):
        return model.step(ids, positions, cache, rows="last", num_layers=num_layers)[:, -1]
    return forward


def make_drafter(spec: SpeculativeConfig, model, max_len: int):
    """The drafter ``spec`` names, for target ``model``, with room for ``max_len`` tokens."""
    cfg = model.config
    if spec.method == "ngram":
        return NgramDrafter(spec, cfg.vocab_size)
    if spec.method == "early_exit":
        n = spec.num_layers if spec.num_layers is not None else max(1, cfg.num_layers // 4)
        if not isinstance(n, int) or not 1 <= n < cfg.num_layers:
            raise ValueError(f"num_layers={n!r} must be an int in [1, {cfg.num_layers - 1}] "
                             f"(the target has {cfg.num_layers} layers)")
        kv_heads = model.layers[0].self_attn.num_kv_heads
        cache = ContiguousKVCache(n, 1, kv_heads, cfg.head_dim, max_len, dtype=model.dtype,
                                  device=model.device)
        return ModelDrafter(early_exit_forward(model, n), cache, model.device)
    draft = spec.draft_model
    dcfg = getattr(draft, "config", None)
    if dcfg is None or dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"draft_model must be an llmlab model with the target's vocabulary "
                         f"of {cfg.vocab_size} tokens; got "
                         f"{getattr(dcfg, 'vocab_size', type(draft).__name__)}")
    cache = ContiguousKVCache.for_model(draft, 1, max_len)

    def forward(ids, positions, c):
        return draft(ids, positions=positions, cache=c, last_only=True)[:, -1]
    return ModelDrafter(forward, cache, draft.device)


def verify(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, accept_fn,
           temperature: float, top_k: int | None, top_p: float | None,
           generator: torch.Generator | None) -> tuple[int, int]:
    """One verify step of one sequence: the target's ``logits`` [n + 1, vocab] at the last
    emitted token and the n ``drafts``; q [n, vocab] the draft's distributions (None when
    greedy). Returns (accepted drafts, the next token). ``accept_fn`` (default: greedy
    comparison, or :func:`accept_reject` when sampling) decides; greedy with an
    ``accept_fn`` hands it one-hot p and q (argmax of the target, the drafts)."""
    n = len(drafts)
    if n == 0:
        return 0, sample_rows(logits[-1:], [temperature], [top_k], [top_p], [generator])[0]
    if temperature == 0 and accept_fn is None:
        return greedy_accept(logits.argmax(-1).tolist(), drafts)
    draft_ids = torch.tensor(drafts, device=logits.device)
    if temperature == 0:
        vocab = logits.shape[-1]
        p = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        q = torch.nn.functional.one_hot(draft_ids, vocab).float()
    else:
        p = probabilities(logits, temperature, top_k, top_p)
        q = q.to(p.device)
    na, nt = (accept_fn or accept_reject)(p[None], q[None], draft_ids[None], generator)
    n_acc, nxt = int(torch.as_tensor(na).reshape(-1)[0]), int(torch.as_tensor(nt).reshape(-1)[0])
    if not 0 <= n_acc <= n or not 0 <= nxt < p.shape[-1]:
        raise ValueError(f"accept_fn returned num_accepted={n_acc}, next_token={nxt}; allowed: "
                         f"0 <= num_accepted <= {n} (the drafts) and a token id below "
                         f"{p.shape[-1]}")
    return n_acc, nxt


# -- the loop ---------------------------------------------------------------------------------

@dataclass
class SpecRun:
    """One prompt's speculative generation (the fields of ``llmlab.generate.TokenRun``)."""

    stats: SpecStats
    token_ids: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


@torch.inference_mode()
def speculative_token_ids(model, prompt: list[int], max_new_tokens: int,
                          spec: SpeculativeConfig, *, temperature: float = 0.0,
                          top_k: int | None = None, top_p: float | None = None,
                          seed: int | None = None, eos_token_id: int | None = None,
                          ignore_eos: bool = False) -> SpecRun:
    """Generate for one prompt (token ids) with draft-and-verify steps.

    Same stopping rule and sampler arguments as :func:`llmlab.generate.generate_token_ids`;
    greedy output equals its output token for token. Returns a :class:`SpecRun` whose
    ``stats`` count accepted drafts per step and time spent drafting and verifying.
    """
    ctx = model.config.max_position_embeddings
    budget = token_budget(len(prompt), max_new_tokens, ctx)
    k = spec.num_tokens
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    room = len(prompt) + budget + k + 1
    cache = ContiguousKVCache.for_model(model, 1, room)
    drafter = make_drafter(spec, model, room)
    run = SpecRun(SpecStats(spec.method, k))
    stats = run.stats

    def emit(tokens: list[int], now: float) -> bool:
        for tok in tokens:
            run.token_ids.append(tok)
            run.times_s.append(now)
            run.finish_reason = finish_reason(
                tok, len(run.token_ids), len(prompt) + len(run.token_ids),
                eos_token_id=eos_token_id, ignore_eos=ignore_eos,
                max_tokens=max_new_tokens, max_len=ctx)
            if run.finish_reason is not None:
                return True
        return False

    def target(tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` to the target; logits [len(tokens), vocab]."""
        t = time.perf_counter()
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        positions = cache.begin(len(tokens))
        logits = model(ids, positions=positions, cache=cache)[0]
        cache.advance()
        sync(dev)
        stats.target_s += time.perf_counter() - t
        return logits

    sync(dev)
    t0 = time.perf_counter()
    t = time.perf_counter()
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    logits = model(ids, positions=cache.begin(len(prompt)), cache=cache, last_only=True)[:, -1]
    cache.advance()
    first = sample_rows(logits, [temperature], [top_k], [top_p], [gen])
    stats.target_s += time.perf_counter() - t
    done = emit(first, time.perf_counter() - t0)
    while not done:
        seq = prompt + run.token_ids
        kk = min(k, budget - len(run.token_ids) - 1)     # never emit past the budget
        drafts, q = [], None
        if kk > 0:
            t = time.perf_counter()
            drafts, q = drafter.propose(seq, kk, temperature, top_k, top_p, gen)
            sync(dev)
            stats.draft_s += time.perf_counter() - t
        n = len(drafts)
        logits = target([seq[-1]] + drafts)                           # [n + 1, vocab]
        n_acc, nxt = verify(logits, drafts, q, spec.accept_fn, temperature, top_k, top_p, gen)
        cache.truncate(cache.length - (n - n_acc))        # forget the rejected drafts' K/V
        drafter.rollback(len(seq) + n_acc)
        stats.accepted_per_step.append(n_acc)             # 0 of 0 on a plain decode step
        stats.drafted_per_step.append(n)
        done = emit(drafts[:n_acc] + [nxt], time.perf_counter() - t0)
    stats.num_generated = len(run.token_ids)
    return run


__all__ = ["METHODS", "SpeculativeConfig", "SpecStats", "SpecRun", "accept_reject",
           "greedy_accept", "probabilities", "verify", "expected_tokens",
           "cost_model_speedup", "ngram_propose", "make_drafter",
           "early_exit_forward", "speculative_token_ids"]
