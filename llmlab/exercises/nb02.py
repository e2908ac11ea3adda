"""Check functions for the exercises of notebook 02 (KV cache and the roofline)."""
from __future__ import annotations

from ..config import ModelConfig
from . import say, unanswered

# Llama-2-7B: 32 layers, 32 heads of dim 128, no grouped-query attention.
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                        max_position_embeddings=4096)


def check_kv_bytes_7b(answer) -> bool:
    """KV-cache bytes per token of Llama-2-7B in float16 (2 · 32 · 32 · 128 · 2)."""
    from ..cache import kv_bytes_per_token

    expected = kv_bytes_per_token(LLAMA2_7B, 2)
    if unanswered(answer):
        return say(False, "", "fill in `answer` with an integer number of bytes")
    if not isinstance(answer, (int, float)):
        return say(False, "", f"expected a number of bytes, got {type(answer).__name__}")
    if answer == expected:
        return say(True, f"{expected:,} bytes = {expected / 2**20:.2f} MiB per token; a full "
                          f"4096-token sequence needs {4096 * expected / 2**30:.1f} GiB",
                    "")
    if answer == expected // 2:
        hint = "you counted K or V, not both"
    elif answer == expected * 2:
        hint = "float16 is 2 bytes per element, not 4"
    elif answer == expected // 32:
        hint = "every layer has its own K and V"
    else:
        hint = "2 (K and V) · layers · kv_heads · head_dim · bytes per element"
    return say(False, "", f"got {answer:,}; {hint}")


def smallest_compute_bound_batch(config: ModelConfig, context: int, ridge_point: float,
                                 bytes_per_el: int = 4, max_batch: int = 4096) -> int | None:
    """The smallest batch whose decode step has intensity >= ``ridge_point`` (None: never)."""
    from ..profiling.roofline import decode_cost

    for b in range(1, max_batch + 1):
        if decode_cost(config, b, context, bytes_per_el).intensity >= ridge_point:
            return b
    return None


def check_compute_bound_batch(answer, config: ModelConfig, context: int = 512,
                              ridge_point: float = 10.0) -> bool:
    """The smallest batch size at which a decode step (``context`` cached tokens, float32)
    reaches ``ridge_point`` FLOP/byte."""
    expected = smallest_compute_bound_batch(config, context, ridge_point)
    if unanswered(answer):
        return say(False, "", "fill in `answer` with an integer batch size")
    if not isinstance(answer, int):
        return say(False, "", f"expected an int batch size, got {type(answer).__name__}")
    if answer == expected:
        return say(True, f"batch {expected}: each weight byte is reused by {expected} tokens, "
                          "but every sequence also reads its own KV cache, so intensity "
                          "saturates instead of growing forever", "")
    if answer == int(2 * ridge_point):
        return say(False, "", f"got {answer}: batch/2 ignores the KV cache each sequence reads. "
                               "Hint: use decode_cost(config, batch, context).intensity")
    direction = "too small" if answer < expected else "not the smallest"
    return say(False, "", f"got {answer}, {direction}. Hint: loop over batch sizes with "
                           "llmlab.profiling.roofline.decode_cost(config, batch, context).intensity")
