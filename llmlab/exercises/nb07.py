"""Check functions for notebook 07 (tensor parallelism). They print right or wrong and
never raise, so a notebook with unfinished exercises still runs top to bottom."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..parallel.comm import LLAMA2_70B, allreduce_per_token


def _not_done(x) -> bool:
    return x is None or x is Ellipsis


def check_column_shard(column_shard) -> bool:
    """Exercise 1: ``column_shard(weight [out, in], rank, tp)`` -> the rows rank ``rank`` holds."""
    if _not_done(column_shard) or not callable(column_shard):
        print("Not done yet: define column_shard(weight, rank, tp).")
        return False
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    for rank, tp in ((0, 3), (2, 3), (1, 4), (0, 1)):
        try:
            got = column_shard(w, rank, tp)
        except Exception as exc:  # noqa: BLE001 - report, do not raise
            print(f"Wrong: column_shard(w, {rank}, {tp}) raised {type(exc).__name__}: {exc}")
            return False
        if got is None:
            print("Not done yet: column_shard returns None; return the block of rows.")
            return False
        want = w[rank * 12 // tp:(rank + 1) * 12 // tp]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            print(f"Wrong: for rank={rank}, tp={tp} of a [12, 5] weight expected shape "
                  f"{tuple(want.shape)}, got {shape}. A column-parallel layer splits the "
                  "output features, which are the rows of W in torch's [out, in] layout.")
            return False
        if not torch.equal(got, want):
            print(f"Wrong: right shape but the wrong rows for rank={rank}, tp={tp}; rank r "
                  "holds the r-th contiguous block of out/tp rows.")
            return False
    print("Right: rank r holds W[r·out/tp : (r+1)·out/tp], the rows for its output features "
          "(for q_proj, whole heads).")
    return True


def check_allreduce_bytes(answer) -> bool:
    """Exercise 2: bytes all-reduced per generated token, SmolLM2-135M, tp=3, bfloat16."""
    from ..models.registry import resolve

    cfg = ModelConfig.from_file(resolve("smollm2-135m"))
    want = allreduce_per_token(cfg, 3, bytes_per_el=2).per_token_bytes
    if _not_done(answer):
        print("Not done yet: set allreduce_bytes to a number of bytes.")
        return False
    try:
        val = int(answer)
    except (TypeError, ValueError):
        print(f"Wrong: expected a number of bytes, got {answer!r}.")
        return False
    if val == want:
        print(f"Right: (2 × {cfg.num_layers} layers + 1 embedding) × {cfg.hidden_size} × 2 B "
              f"= {want} B per token, whatever tp is.")
        return True
    if val == 2 * cfg.num_layers * cfg.hidden_size * 2:
        print("Almost: you counted the two per layer; the vocab-parallel embedding adds one more.")
    elif val == want * 2:
        print("Wrong: bfloat16 is 2 bytes per element, not 4.")
    else:
        print(f"Wrong: {val} B. Count all-reduces per layer (after o_proj and after down_proj), "
              "layers, the embedding's one, and the bytes of one hidden vector.")
    return False


def check_valid_degrees(degrees) -> bool:
    """Exercise 3: the tp degrees this implementation accepts for Llama-2-70B."""
    from ..parallel.model import valid_tp_degrees

    want = valid_tp_degrees(LLAMA2_70B)
    if _not_done(degrees):
        print("Not done yet: set llama70b_degrees to a list of ints.")
        return False
    try:
        got = sorted(int(d) for d in degrees)
    except (TypeError, ValueError):
        print(f"Wrong: expected a list of ints, got {degrees!r}.")
        return False
    if got == want:
        print(f"Right: {want}. The 8 KV heads are the limit: at tp=16 a rank would hold half a "
              "KV head (vLLM copies KV heads instead; this workbook refuses).")
        return True
    bad = sorted(set(got) - set(want))
    if bad:
        print(f"Wrong: {bad} do not split 64 query heads, 8 KV heads, 28672 MLP features and "
              "32000 vocabulary rows evenly.")
    else:
        print(f"Wrong: missing {sorted(set(want) - set(got))}.")
    return False
