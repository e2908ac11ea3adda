"""Tensor-parallel layers with Megatron-LM's names, for inference and training alike.

A linear layer ``y = x Wᵀ`` (W is [out, in]) can be split across ``tp`` processes two ways:

* **ColumnParallelLinear** splits W by output features (rows of W, columns of Wᵀ): rank r
  holds W[r·out/tp : (r+1)·out/tp] and computes its slice of y from the full x. No
  communication in the forward pass; the output stays split ("parallel").
* **RowParallelLinear** splits W by input features: rank r holds W[:, r·in/tp : (r+1)·in/tp],
  takes its slice of x (what a column-parallel layer produced) and computes a partial sum
  of y; one all-reduce adds the partial sums.

A column layer followed by a row layer (attention's q/k/v then o; the MLP's gate/up then
down) needs one all-reduce, so a decoder layer needs two. Megatron-LM (Shoeybi et al.
2019) wraps the communication in two conjugate operators, which its paper calls f and g:

* f, ``copy_to_tensor_parallel_region``: identity forward, all-reduce of the gradient
  backward (placed before a column-parallel layer);
* g, ``reduce_from_tensor_parallel_region``: all-reduce forward, identity backward (after a
  row-parallel layer). In inference it is a plain ``all_reduce``.

**VocabParallelEmbedding** splits the embedding table by vocabulary rows: each rank looks
up the ids it owns, writes zeros for the others, and an all-reduce assembles the vectors.
**ParallelLMHead** is a column-parallel projection onto the vocabulary whose logits are
all-gathered so every rank sees the full distribution.

Every layer works with ``tp_size == 1`` and no process group (then it is the plain layer).
Collectives can be counted with :func:`count_collectives`.

The split layers' forward passes are two plain functions, :func:`column_parallel_forward`
and :func:`row_parallel_forward` ``(x, weight, bias) -> y``; :func:`use_parallel_forwards`
swaps in other functions with that signature (notebook 07's exercise runs the model with
the student's). Taught in notebook 07.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# -- process-group helpers ---------------------------------------------------------------

def tp_rank_and_size(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError saying what did not split evenly."""
    if denominator < 1 or numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel degree "
                         f"{denominator}")
    return numerator // denominator


# -- counting collectives ----------------------------------------------------------------

@dataclass
class CollectiveLog:
    """What :func:`count_collectives` saw: one (op, bytes of the message) per call."""
    calls: list[tuple[str, int]] = field(default_factory=list)

    def count(self, op: str | None = None) -> int:
        return sum(1 for o, _ in self.calls if op is None or o == op)

    def bytes(self, op: str | None = None) -> int:
        return sum(b for o, b in self.calls if op is None or o == op)


_LOGS: list[CollectiveLog] = []


@contextlib.contextmanager
def count_collectives():
    """``with count_collectives() as log: model(ids)`` records every all-reduce/all-gather."""
    log = CollectiveLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(op: str, t: torch.Tensor) -> None:
    for log in _LOGS:
        log.calls.append((op, t.numel() * t.element_size()))


def _require_group(op: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op} across tensor-parallel ranks needs an initialized process group; "
                           "run the model under llmlab.parallel.launch(...) or torchrun")


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` (in place on a contiguous copy); returns it."""
    _require_group("all_reduce")
    _, size = tp_rank_and_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    _record("all_reduce", x)
    dist.all_reduce(x, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order)."""
    _require_group("all_gather")
    _, size = tp_rank_and_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    _record("all_gather", x)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


# -- the two conjugate operators (Megatron's f and g) -------------------------------------

class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[-1]
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        rank = tp_rank_and_size(ctx.group)[0]
        return grad[..., rank * ctx.width:(rank + 1) * ctx.width].contiguous(), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (before a column-parallel layer)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return all_gather_last_dim(x, group)
    return _GatherFromTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce forward; identity backward (after a row-parallel layer)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return all_reduce(x, group)  # inference: a plain all_reduce
    return _ReduceFromTensorParallelRegion.apply(x, group)


# -- the two forward passes --------------------------------------------------------------

def column_parallel_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            group=None) -> torch.Tensor:
    """This rank's slice of y = x Wᵀ + b: x [..., in] (the full input, the same on every rank),
    weight [out/tp, in] and bias [out/tp] (this rank's rows) -> [..., out/tp].

    No communication in the forward pass (f is the identity); in training f all-reduces the
    gradient of x on the way back.
    """
    return F.linear(copy_to_tensor_parallel_region(x, group), weight, bias)


def row_parallel_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         group=None) -> torch.Tensor:
    """The full y = x Wᵀ + b from this rank's input slice: x [..., in/tp], weight [out, in/tp],
    bias [out] (the same on every rank) -> [..., out], identical on every rank.

    Each rank's product is a partial sum over its input features; g (an all-reduce) adds the
    partials, and the bias is added once, after the sum.
    """
    y = reduce_from_tensor_parallel_region(F.linear(x, weight), group)
    return y if bias is None else y + bias


_FORWARDS: dict[str, Callable | None] = {"column": None, "row": None}  # None: the library's


@contextlib.contextmanager
def use_parallel_forwards(column: Callable | None = None, row: Callable | None = None):
    """``with use_parallel_forwards(column=f, row=g): model(ids)`` runs every split
    ColumnParallelLinear (ParallelLMHead included, before its all-gather) with
    ``f(x, weight, bias)`` and every split RowParallelLinear with ``g(x, weight, bias)``,
    instead of :func:`column_parallel_forward` / :func:`row_parallel_forward`.
    They talk to the default process group. Layers with tp_size == 1 are unaffected.
    """
    for what, fn in (("column", column), ("row", row)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{what}={fn!r} must be a function (x, weight, bias) -> y, or None")
    before = dict(_FORWARDS)
    _FORWARDS.update(column=column, row=row)
    try:
        yield
    finally:
        _FORWARDS.update(before)


# -- layers -----------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W split by output features.

    weight [out_features / tp, in_features], bias [out_features / tp].
    x [..., in_features] -> y [..., out_features / tp] (or [..., out_features] with
    ``gather_output``, which all-gathers the slices).
    """

    partition_dim = 0  # of the full weight, the dimension that is split

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 gather_output: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None, group=None, device=None, dtype=None):
        super().__init__()
        rank, size = tp_rank_and_size(group)
        self.tp_rank = rank if tp_rank is None else tp_rank
        self.tp_size = size if tp_size is None else tp_size
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, self.tp_size, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.zeros(self.out_per_rank, device=device, dtype=dtype))
                     if bias else None)

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of the full weight's rows this rank holds."""
        return self.tp_rank * self.out_per_rank, (self.tp_rank + 1) * self.out_per_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        if _FORWARDS["column"] is not None:
            y = _FORWARDS["column"](x, self.weight, self.bias)
        else:
            y = column_parallel_forward(x, self.weight, self.bias, self.group)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {self.shard_range()[0]}:{self.shard_range()[1]} on rank {self.tp_rank} "
                f"of {self.tp_size}), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_rᵀ) + b with W split by input features.

    weight [out_features, in_features / tp], bias [out_features] (added once, after the sum).
    x [..., in_features / tp] (the split output of a column-parallel layer) -> y [..., out_features].
    """

    partition_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None, group=None,
                 device=None, dtype=None):
        super().__init__()
        rank, size = tp_rank_and_size(group)
        self.tp_rank = rank if tp_rank is None else tp_rank
        self.tp_size = size if tp_size is None else tp_size
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.tp_size, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
                     if bias else None)

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of the full weight's columns this rank holds."""
        return self.tp_rank * self.in_per_rank, (self.tp_rank + 1) * self.in_per_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        if _FORWARDS["row"] is not None:
            return _FORWARDS["row"](x, self.weight, self.bias)
        return row_parallel_forward(x, self.weight, self.bias, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (columns {self.shard_range()[0]}:"
                f"{self.shard_range()[1]} on rank {self.tp_rank} of {self.tp_size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows.

    weight [num_embeddings / tp, embedding_dim]; ids [...] int -> [..., embedding_dim].
    Rank r owns ids in [r·V/tp, (r+1)·V/tp); the others contribute zeros to the all-reduce.
    """

    partition_dim = 0

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int | None = None,
                 tp_size: int | None = None, group=None, device=None, dtype=None):
        super().__init__()
        rank, size = tp_rank_and_size(group)
        self.tp_rank = rank if tp_rank is None else tp_rank
        self.tp_size = size if tp_size is None else tp_size
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = divide(num_embeddings, self.tp_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, device=device, dtype=dtype))

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of the vocabulary this rank owns."""
        return self.tp_rank * self.rows_per_rank, (self.tp_rank + 1) * self.rows_per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        start, end = self.shard_range()
        foreign = (ids < start) | (ids >= end)
        local = (ids - start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight).masked_fill(foreign[..., None], 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        s, e = self.shard_range()
        return (f"{self.num_embeddings}, {self.embedding_dim} (ids {s}:{e} on rank "
                f"{self.tp_rank} of {self.tp_size})")


class ParallelLMHead(ColumnParallelLinear):
    """hidden -> logits over the whole vocabulary; each rank computes V/tp of them and the
    slices are all-gathered. Its shard matches :class:`VocabParallelEmbedding`'s, so a tied
    model shares one weight between the two."""

    def __init__(self, hidden_size: int, vocab_size: int, tp_rank: int | None = None,
                 tp_size: int | None = None, group=None, device=None, dtype=None):
        super().__init__(hidden_size, vocab_size, bias=False, gather_output=True,
                         tp_rank=tp_rank, tp_size=tp_size, group=group, device=device, dtype=dtype)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "column_parallel_forward", "row_parallel_forward", "use_parallel_forwards",
           "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "gather_from_tensor_parallel_region",
           "all_reduce", "all_gather_last_dim", "count_collectives", "CollectiveLog",
           "tp_rank_and_size", "divide"]
