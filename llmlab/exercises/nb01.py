"""Check functions for the exercises of notebook 01 (and 00)."""
from __future__ import annotations

from . import call_cases, say, unanswered


def check_token_passes(answer, prompt_len: int, new_tokens: int) -> bool:
    """No KV cache: step t runs the model over prompt_len + t tokens, for t = 0..new_tokens-1."""
    expected = sum(prompt_len + t for t in range(new_tokens))
    if unanswered(answer):
        return say(False, "", "fill in `answer` with an integer")
    return say(answer == expected,
                f"{expected} token-passes; with a cache it would be {prompt_len + new_tokens - 1}",
                f"got {answer}. Hint: step t sees the prompt plus the t tokens generated so far.")


def check_score_bytes(answer, n: int, heads: int, bytes_per_el: int = 4, batch: int = 1) -> bool:
    """Bytes of one [batch, heads, n, n] score matrix."""
    expected = batch * heads * n * n * bytes_per_el
    if unanswered(answer):
        return say(False, "", "fill in `answer` with an integer number of bytes")
    return say(answer == expected, f"{expected / 2**20:.1f} MiB",
                f"got {answer}, expected a [batch, heads, N, N] tensor of {bytes_per_el}-byte floats")


def check_temperature(fn) -> bool:
    """``fn(logits, temperature)`` must return probabilities softmax(logits / temperature)."""
    import torch

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    got, problem = call_cases(fn, [(logits, t) for t in (0.5, 1.0, 2.0)],
                              "a tensor of probabilities")
    if problem:
        return say(False, "", problem)
    want = [torch.softmax(logits / t, -1) for t in (0.5, 1.0, 2.0)]
    ok = all(torch.is_tensor(g) and g.shape == w.shape and torch.allclose(g.float(), w, atol=1e-6)
             for g, w in zip(got, want))
    return say(ok, "lower temperature sharpens the distribution, higher flattens it",
                "expected softmax(logits / temperature). Hint: torch.softmax(x, dim=-1)")
