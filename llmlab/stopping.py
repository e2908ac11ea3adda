"""When a sequence stops: one rule for every generation path.

``llmlab.generate`` (every KV cache), the tensor-parallel loop and the serving engine all
end a sequence the same way, so a prompt gets the same tokens whichever path runs it and
whatever else shares its batch:

* ``"stop"``: it produced the end-of-sequence token (unless ``ignore_eos``);
* ``"length"``: it has ``max_tokens`` new tokens, or it fills the context
  (``max_len`` tokens, prompt included: the model has no position for another one).

The engine adds stop strings on top (a text-level check, :func:`find_stop`). It runs
after every token, so it must not cost more as the text grows: a stop string that
completes with the newest text begins at most ``longest - 1`` characters before it, so
only that window is searched (:meth:`LLMEngine._stop_check` keeps where the last search
ended). :func:`stop_prefix_length` says how much of a running completion's text a stream
must hold back: a tail that the next tokens may turn into a stop string. A leaf module:
it imports nothing from llmlab. Taught in notebook 01.
"""
from __future__ import annotations

from typing import Sequence


def token_budget(prompt_len: int, max_tokens: int, max_len: int) -> int:
    """How many new tokens a prompt of ``prompt_len`` tokens may get: at most ``max_tokens``,
    and no more than the context ``max_len`` has room for (ValueError if it has none)."""
    if prompt_len >= max_len:
        raise ValueError(f"prompt of {prompt_len} tokens does not fit the context of {max_len} "
                         "tokens (it needs room for at least one new token)")
    return min(max_tokens, max_len - prompt_len)


def finish_reason(token: int, num_output: int, num_tokens: int, *, eos_token_id: int | None,
                  ignore_eos: bool, max_tokens: int, max_len: int) -> str | None:
    """Why a sequence stops after emitting ``token``, or None if it goes on.

    ``num_output``: its new tokens so far, ``token`` included; ``num_tokens``: prompt +
    new tokens. Returns ``"stop"`` (end-of-sequence token), ``"length"`` (``max_tokens``
    reached, or the ``max_len``-token context full) or None.
    """
    if token == eos_token_id and not ignore_eos:
        return "stop"
    if num_output >= max_tokens or num_tokens >= max_len:
        return "length"
    return None


def find_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """The first stop string in ``text``: (where it starts, which one), the earliest start
    winning (the shorter string on a tie); None if there is none. O(len(text) * len(stop))."""
    hits = [(i, s) for s in stop if (i := text.find(s)) >= 0]
    return min(hits, key=lambda h: (h[0], len(h[1]))) if hits else None


def stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the beginning of a stop string
    (the longest such tail, shorter than the stop string itself). Looks at the last
    ``longest - 1`` characters only."""
    longest = max((len(s) for s in stop), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(s.startswith(tail) for s in stop):
            return len(text) - start
    return 0


__all__ = ["finish_reason", "token_budget", "find_stop", "stop_prefix_length"]
