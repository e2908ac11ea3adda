"""Request traces: the workloads that notebooks 04 and 05 and the benchmarks replay.

A trace is a JSONL file under ``data/traces/`` (written by ``data/make_trace.py``), one
request per line: ``{"id", "arrival_s", "prompt", "prompt_tokens", "output_tokens"}``.
A multi-turn trace adds ``"session"`` and ``"turn"``: turn 0 arrives at ``arrival_s``;
turn k > 0 is the text appended to the conversation after turn k-1's answer, and
arrives ``arrival_s`` seconds after that answer ends (:mod:`llmlab.engine.sessions`).
:func:`load_trace` reads one into :class:`TraceRequest` records. A leaf module: it
imports nothing from llmlab (a tokenizer, when wanted, is passed in).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

TRACES_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: how long its prompt is, how many tokens it will generate,
    and when it arrives. Not to be confused with the engine's live
    :class:`llmlab.engine.sequence.Request`, which holds a running request's state."""

    prompt_tokens: int             # as counted when the trace was made
    output_tokens: int             # tokens the request generates (EOS ignored)
    arrival_s: float = 0.0         # seconds after the trace starts
    prompt: str = ""
    id: str = ""
    # the prompt tokenized by load_trace(tokenizer=...): no special tokens, no chat template
    prompt_token_ids: list[int] | None = dataclasses.field(default=None, compare=False,
                                                           repr=False)
    session: str = ""              # multi-turn traces: the conversation it belongs to
    turn: int = 0                  # its place in the conversation (0: the first)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def trace_names() -> list[str]:
    """The traces under ``data/traces`` (file stems)."""
    return sorted(p.stem for p in TRACES_DIR.glob("*.jsonl"))


def _trace_path(name_or_path: str | Path) -> Path:
    if str(name_or_path) in trace_names():
        return TRACES_DIR / f"{name_or_path}.jsonl"
    path = Path(name_or_path)
    if path.suffix == ".jsonl" and path.exists():
        return path
    raise ValueError(f"unknown trace {str(name_or_path)!r}; allowed: {trace_names()} "
                     "or the path of a .jsonl trace")


def load_trace(name_or_path: str | Path, limit: int | None = None, *,
               max_output: int | None = None, output_scale: float = 1.0,
               tokenizer=None) -> list[TraceRequest]:
    """The requests of a trace, in arrival order.

    ``name_or_path``: a name from :func:`trace_names` or the path of a JSONL trace.
    ``limit``: keep the first ``limit`` requests (None: all). ``output_scale`` multiplies
    every ``output_tokens`` (rounded, at least 1), keeping their spread; ``max_output``
    then caps them. With a ``tokenizer`` each request also gets ``prompt_token_ids``.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r} must be an int >= 1, or None (all requests)")
    if not output_scale > 0:
        raise ValueError(f"output_scale={output_scale!r} must be > 0")
    if max_output is not None and max_output < 1:
        raise ValueError(f"max_output={max_output!r} must be >= 1, or None (no cap)")
    path = _trace_path(name_or_path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = []
    for r in rows[:limit]:
        n = r["output_tokens"]
        if output_scale != 1.0:
            n = max(1, round(n * output_scale))
        if max_output is not None:
            n = min(n, max_output)
        ids = (list(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"])
               if tokenizer is not None else None)
        out.append(TraceRequest(r["prompt_tokens"], n, r["arrival_s"], r["prompt"], r["id"], ids,
                                r.get("session", ""), r.get("turn", 0)))
    return out


__all__ = ["TraceRequest", "TRACES_DIR", "load_trace", "trace_names"]
