"""The model runner: executes one scheduled step over the paged KV cache.

Two input layouts, as the two scheduling policies need them:

* **packed** (continuous batching): every sequence's new tokens are concatenated into
  one row ``input_ids [1, total_tokens]`` with ``cu_seqlens``, as in FlashAttention's
  varlen API; the cache object is :class:`~llmlab.cache.packed.PackedPagedCache`, whose
  attention calls the layer backend's varlen form for prompts read from scratch and the
  paged attention backend for everything that reads the pool.
* **padded** (the static baseline): new tokens are left-padded into a rectangle
  ``[batch, max_new]`` and go through :class:`~llmlab.cache.paged.PagedKVCache` as in
  notebook 04; pads cost compute but are never written to the cache (slot −1).

Both layouts read the pool with the same paged attention backend: the cache's
``backend`` (``LLM(..., paged_attention=...)``). Taught in notebook 05.

A step has two halves, as in nano-vllm's model runner: :meth:`ModelRunner.prepare` turns
the schedule into tensors once (token ids, positions, slot mapping, block tables and
lengths, on the model's device, checked on the host), and :meth:`ModelRunner.forward`
runs the layers, which only read that metadata; on a GPU the forward queues its work
without waiting for the device until the logits are read.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import attention as attn_backends
from ..cache.graphed import GraphedPagedDecode, bucket, capture_sizes
from ..cache.packed import PackedPagedCache
from ..cache.paged import PagedKVCache
from ..prompts import left_pad
from .scheduler import SchedulerOutput
from .sequence import token_slice

# the option's old name and value, accepted with a DeprecationWarning
_OLD_NAMES = {"gather": "paged_sdpa"}


def choose_paged_attention(paged_attention: str | None, device: torch.device,
                           decode_attention: str | None = None) -> str:
    """The backend that reads K/V from the engine's pool (decodes and continued prompts).

    ``paged_attention``: one of ``llmlab.attention.paged_backends()``; None picks
    ``"paged_triton"`` on a GPU and ``"paged_sdpa"`` elsewhere. ``decode_attention`` is
    this option's old name (its value ``"gather"`` is now ``"paged_sdpa"``).
    """
    if decode_attention is not None:
        warnings.warn("decode_attention= is now paged_attention= (it also serves prompts "
                      "that continue a cached prefix); 'gather' is now 'paged_sdpa'",
                      DeprecationWarning, stacklevel=3)
        if paged_attention is None:
            paged_attention = _OLD_NAMES.get(decode_attention, decode_attention)
    if paged_attention is None:
        paged_attention = "paged_triton" if torch.device(device).type == "cuda" else "paged_sdpa"
    allowed = attn_backends.paged_backends()
    if paged_attention not in allowed:
        raise ValueError(f"paged_attention={paged_attention!r}; allowed: {allowed}")
    return paged_attention


@dataclass
class StepInputs:
    """One step's model inputs, built by :meth:`ModelRunner.prepare` (tensors on the model's
    device). Packed: ``input_ids`` and ``positions`` [1, total] and ``last_rows`` long
    [batch]; padded: [batch, max_new] and ``last_rows`` None (each row ends at its last
    column)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    cache: PackedPagedCache | PagedKVCache
    last_rows: torch.Tensor | None


class ModelRunner:
    """Runs a :class:`SchedulerOutput` through the model; returns last-token logits.

    ``paged`` holds the K/V pool and the block manager the scheduler allocates from.
    """

    def __init__(self, model, paged: PagedKVCache, pad_token_id: int = 0,
                 compile: bool = False, max_num_seqs: int = 16):
        self.model = model
        self.paged = paged
        self.packed = PackedPagedCache(paged)
        self.pad_token_id = pad_token_id
        # compile=True: decode-only steps run the compiled step over fixed shapes
        self.graphed = self.compiled = None
        if compile:
            from ..compile import compiled_step

            self.graphed = GraphedPagedDecode(paged)
            self.compiled = compiled_step(model)
            self.capture_sizes = capture_sizes(max_num_seqs)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> torch.Tensor:
        """-> float32 logits [num_scheduled, vocab] for the last new token of each sequence."""
        if self.graphed is not None and all(s.num_new == 1 for s in step.scheduled):
            return self.decode_graphed(step)
        return self.forward(self.prepare(step))

    def decode_graphed(self, step: SchedulerOutput) -> torch.Tensor:
        """A decode-only step through the compiled graph of its capture size
        (:class:`~llmlab.cache.graphed.GraphedPagedDecode`): same logits as :meth:`forward`."""
        seqs, starts, ids = self._begin(step)
        tokens = [row[0] for row in ids]
        batch = bucket(len(seqs), self.capture_sizes)
        ids, positions = self.graphed.prepare([s.seq_id for s in seqs], tokens, starts, batch)
        return self.compiled(ids, positions, self.graphed)[:len(seqs)]

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        """The step's inputs and attention metadata, built once (the layers share them).

        Copies the step's copy-on-write blocks, and checks on the host that no position
        passes the model's context.
        """
        seqs, starts, ids = self._begin(step)
        num_new = [s.num_new for s in step.scheduled]
        dev = self.model.device
        # a step of single-token decodes has nothing to pad: both layouts are the same,
        # so it takes the packed path (one attention implementation for both policies)
        if step.packed or all(n == 1 for n in num_new):
            positions = self.packed.prepare([s.seq_id for s in seqs], num_new, starts)
            flat = torch.tensor([t for row in ids for t in row], dtype=torch.long).to(dev)
            return StepInputs(flat[None], positions, self.packed, self.packed.step.last_rows)
        positions = self.paged.prepare([s.seq_id for s in seqs], num_new)
        input_ids, _ = left_pad(ids, self.pad_token_id, dev)
        return StepInputs(input_ids, positions, self.paged, None)

    def _begin(self, step: SchedulerOutput):
        """What both layouts start from: the sequences, where each starts and its new token
        ids; checks on the host that no position passes the model's context, and copies
        the step's copy-on-write blocks."""
        seqs = [s.seq for s in step.scheduled]
        starts = [s.num_computed for s in seqs]
        top = max(a + s.num_new for a, s in zip(starts, step.scheduled)) - 1
        ctx = self.model.config.max_position_embeddings
        if top >= ctx:
            raise ValueError(f"position {top} is past the model's context of {ctx} tokens")
        self.paged.copy_blocks(step.block_copies)
        ids = [token_slice(s.seq, a, a + s.num_new) for a, s in zip(starts, step.scheduled)]
        return seqs, starts, ids

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The decoder over prepared inputs -> float32 logits [batch, vocab], computed only at
        each sequence's last token (the vocabulary projection is the most expensive matmul
        per token). Reads nothing back from the device."""
        rows = inputs.last_rows if inputs.last_rows is not None else "last"
        logits = self.model.step(inputs.input_ids, inputs.positions, inputs.cache, rows=rows)
        if inputs.last_rows is None:
            logits = logits[:, -1]
        # sampling in float32 whatever the model's dtype: bfloat16 logits tie often and
        # their softmax is coarse
        return logits.float()


def padding_tokens(lengths: list[int]) -> int:
    """Pads a left-padded rectangle of these rows holds: batch · max − sum."""
    return len(lengths) * max(lengths, default=0) - sum(lengths)


__all__ = ["ModelRunner", "StepInputs", "choose_paged_attention", "padding_tokens"]
