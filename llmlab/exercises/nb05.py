"""Check functions for the exercises of notebook 05 (continuous batching)."""
from __future__ import annotations

from ..engine.runner import padding_tokens
from . import call_cases, say, unanswered


def check_padding(answer, prompt_lengths: list[int]) -> bool:
    """Pad tokens when these prompts are left-padded into one [batch, max_len] rectangle."""
    expected = padding_tokens(prompt_lengths)
    if unanswered(answer):
        return say(False, "", "fill in `answer` with an integer number of pad tokens")
    return say(answer == expected,
                f"{expected} pads: the rectangle has {len(prompt_lengths) * max(prompt_lengths)} "
                f"positions for {sum(prompt_lengths)} real tokens; packing computes none of them",
                f"got {answer}. Hint: every row is as long as the longest prompt; count the "
                "positions that are not real tokens")


def check_cu_seqlens(fn) -> bool:
    """``fn(lengths)`` must return cu_seqlens: [0, l0, l0+l1, ...] (length batch + 1)."""
    import torch

    cases = ([5, 1, 3], [7], [2, 2, 2, 2], [1, 16, 1])
    got, problem = call_cases(fn, [(list(c),) for c in cases], "a list or an int32 tensor")
    if problem:
        return say(False, "", problem)
    want = [[0] + torch.tensor(c).cumsum(0).tolist() for c in cases]
    norm = [g.tolist() if torch.is_tensor(g) else list(g) for g in got]
    return say(norm == want,
                "sequence i owns packed rows cu_seqlens[i]:cu_seqlens[i+1]",
                f"for lengths {list(cases[0])} expected {want[0]}, got {norm[0]}. Hint: a "
                "running sum that starts at 0 (torch.cumsum, or itertools.accumulate)")


def static_decode_steps(output_lengths: list[int], batch_size: int) -> int:
    """Iterations a static scheduler runs: each batch (in order) lasts as long as its longest."""
    return sum(max(output_lengths[i:i + batch_size])
               for i in range(0, len(output_lengths), batch_size))


def check_static_steps(answer, output_lengths: list[int], batch_size: int) -> bool:
    """Decode iterations of static batching, compared with the continuous lower bound."""
    expected = static_decode_steps(output_lengths, batch_size)
    best = -(-sum(output_lengths) // batch_size)
    if unanswered(answer):
        return say(False, "", "fill in `answer` with the number of iterations")
    return say(answer == expected,
                f"{expected} iterations; with every seat always busy it could be as few as "
                f"{best} ({expected / best:.1f}× fewer)",
                f"got {answer}. Hint: batches are taken in order, batch_size at a time, and a "
                "batch runs until its longest request is done")


__all__ = ["check_padding", "check_cu_seqlens", "check_static_steps", "static_decode_steps"]
