"""``compile=True``: the decode step through ``torch.compile``, one graph for every position.

An eager decode step of SmolLM2 calls over a thousand PyTorch operators from Python, and
each call costs microseconds of interpreter and dispatcher time whatever the size of its
tensor: at batch 1 that time rivals the time the weights take to stream from memory.
``torch.compile`` traces :meth:`llmlab.models.llama.CausalLM.step` once into a graph
(TorchDynamo), and Inductor turns the graph into fused kernels: the small elementwise ops
(norms, RoPE, SiLU·mul, residual adds) merge into a few loops, and Python runs once per
step instead of once per op. On CUDA, ``mode="reduce-overhead"`` also records the kernels
as a CUDA graph and replays it, so the CPU launches one graph per step (vLLM's CUDA graphs
per batch size; gpt-fast's ``decode_one_token``).

A graph is specialized to its input shapes. With the contiguous cache the keys grow by one
each step. Default ``torch.compile`` (``dynamic=None``) recompiles once when that length
changes and marks the dimension dynamic (automatic dynamic shapes): two graphs, the second
symbolic in the length. This step compiles with ``dynamic=False`` instead (a new length would
be a new graph) over the static cache (:class:`llmlab.cache.StaticKVCache`), which keeps
every shape fixed: one graph per batch size and bucket of slots serves all positions, with
loops Inductor specializes to known sizes, and CUDA graphs, which PyTorch records once per
distinct input size even from a dynamic graph, replay one recording at every position.
:func:`graphs_compiled` counts the graphs compiled in this process: after the warm-up it
must not move.

Every call of a compiled function first checks its *guards*, the facts the graph assumed
(each input's shape and dtype, and by default every module and parameter it touched: several
hundred checks, over a millisecond per step on a CPU). On the CPU this step keeps only the
guards on its inputs and globals and drops those on the model's modules
(``torch.compiler.skip_guard_on_all_nn_modules_unsafe``), in a compile region of its own
(``isolate_recompiles``), so another model's graph is never looked up. The model's
structure is then checked by a cheap stamp instead (:func:`model_stamp`: its dtype,
device, attention backend and fusion): ``set_attention``, ``fuse_model`` or a move to
another dtype rebuild the step; swapping a module by hand after the first call does not,
and needs a new ``compiled_step`` (``forget(model)``).

On the CPU a float32 step also goes through one graph pass of llmlab's (:func:`_gemv_pass`):
each few-row matmul against a weight becomes the C kernel ``llmlab::f32_gemv``, which
streams SmolLM2's small matrices at about 20 GB/s where MKL's sgemv reaches about 11 on
a 2-core CPU: the batch-1 step is its weight bytes, so this is most of what compiling
gains there (``CompiledStep(model, gemv=False)`` leaves it out).

The first call of a batch size compiles (tens of seconds on a 2-core CPU); Inductor keeps
what it built on disk (``TORCHINDUCTOR_CACHE_DIR``, by default under the system's temporary
directory), so a second process with the same model and shapes starts in seconds.
Taught in notebook 11.
"""
from __future__ import annotations

import functools
import time
import weakref

import torch

_STEPS: "weakref.WeakKeyDictionary[torch.nn.Module, CompiledStep]" = weakref.WeakKeyDictionary()


# TorchDynamo keeps at most ``recompile_limit`` graphs (default 8) per function, then runs it
# eagerly: every model shares CausalLM.step's code, and each gets a graph per batch bucket,
# slot or block-table bucket and cache type (the engine alone: 5 capture sizes × widths)
RECOMPILE_LIMIT = 128


def _allow_graphs(limit: int) -> None:
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * limit)


@functools.cache
def _gemv_pass():
    """An Inductor graph pass (after autograd's decompositions) for float32 CPU decode: each
    ``mm(x, wᵀ)`` of a few rows (at most ``GEMV_MAX_ROWS``) against a weight becomes
    ``llmlab::f32_gemv(x, w)``, the C kernel that streams W (:mod:`llmlab.kernels.cpu_gemv`;
    MKL's sgemv reads SmolLM2's small matrices at about half its rate). The graph computes
    the same products in another order of additions: eager's greedy tokens are checked, not
    assumed (tests/test_compile.py). Built once: its ``uuid`` keys Inductor's on-disk cache."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from .kernels import cpu_gemv
    from .quant.linear import GEMV_MAX_ROWS

    aten = torch.ops.aten

    class GemvPass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.target is not aten.mm.default:
                    continue
                x, wt = node.args
                xv = x.meta.get("val")
                if (wt.op != "call_function" or wt.target is not aten.permute.default
                        or list(wt.args[1]) != [1, 0] or xv is None
                        or xv.dtype is not torch.float32 or xv.device.type != "cpu"
                        or xv.shape[0] > GEMV_MAX_ROWS):
                    continue
                w = wt.args[0]
                wv = w.meta.get("val")
                if wv is None or wv.dtype is not torch.float32 or not wv.is_contiguous():
                    continue
                with graph.inserting_before(node):
                    new = graph.call_function(cpu_gemv.GEMV_OPS["f32"], (x, w))
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
            graph.eliminate_dead_code()

        def uuid(self):
            return get_hash_for_files((__file__, cpu_gemv.SOURCE))

    return GemvPass()


def model_stamp(model) -> tuple:
    """What a compiled step assumes of ``model`` beyond its inputs, checked on every call
    in a few microseconds (the module guards it replaces take over a millisecond)."""
    return (model.dtype, model.device, getattr(model, "attention", None),
            getattr(model, "fused", None))


def default_mode(device: torch.device | str) -> str | None:
    """``"reduce-overhead"`` (CUDA graphs) on CUDA; Inductor's default elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


class CompiledStep:
    """``model.step`` compiled for decode: ``step(ids [batch, 1], positions [batch, 1],
    cache) -> logits [batch, vocab]`` (float32 whatever the model's dtype).

    ``cache`` must keep fixed shapes (a :class:`~llmlab.cache.StaticKVCache`). Compiling
    happens on the first call of each batch size; ``compile_s`` adds up the time those
    first calls took. ``gemv`` (CPU, Inductor's default mode): the float32 graph pass
    (None or True: where the C kernels built; False: MKL's matmuls as traced).
    """

    def __init__(self, model, mode: str | None = None, gemv: bool | None = None):
        self.model = model
        self.mode = default_mode(model.device) if mode is None else mode
        self.gemv = False
        if model.device.type == "cpu":       # the C decode kernels: built now, not traced
            from .kernels import cpu_gemv

            self.gemv = cpu_gemv.available() and self.mode is None and gemv is not False
        _allow_graphs(RECOMPILE_LIMIT)
        self.compile_s = 0.0
        self._build()

    def _build(self) -> None:
        if self.mode is None:          # the CPU: module guards dropped (see the module doc)
            options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            if self.gemv:
                options["post_grad_custom_post_pass"] = _gemv_pass()
            kw = {"options": options, "isolate_recompiles": True}
        else:                          # CUDA graphs: replayed without Python, guards kept
            kw = {"mode": self.mode}
        self._fn = torch.compile(self.model.step, fullgraph=True, dynamic=False, **kw)
        self.stamp = model_stamp(self.model)
        self.batch_sizes: set[int] = set()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        if self.mode is None and model_stamp(self.model) != self.stamp:
            self._build()              # the model changed under the graph: trace it again
        first = ids.shape[0] not in self.batch_sizes
        t = time.perf_counter() if first else 0.0
        logits = self._fn(ids, positions, cache, None, "last")[:, -1].float()
        if first:
            self.batch_sizes.add(ids.shape[0])
            self.compile_s += time.perf_counter() - t
        if self.mode == "reduce-overhead":
            logits = logits.clone()       # a CUDA graph's output is overwritten by its next replay
        return logits


def compiled_step(model, mode: str | None = None) -> CompiledStep:
    """The model's compiled decode step, built once per model (and mode) and reused."""
    step = _STEPS.get(model)
    wanted = default_mode(model.device) if mode is None else mode
    if step is None or step.mode != wanted:
        step = _STEPS[model] = CompiledStep(model, wanted)
    return step


def forget(model) -> None:
    """Drop ``model``'s compiled step: the next ``compiled_step(model)`` traces it anew (after
    a change to its modules that :func:`model_stamp` does not see)."""
    _STEPS.pop(model, None)


def graphs_compiled() -> int:
    """How many graphs TorchDynamo has compiled in this process (a new shape, a failed
    guard or a graph break each add one): the recompile counter."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


__all__ = ["CompiledStep", "compiled_step", "graphs_compiled", "default_mode", "model_stamp",
           "forget"]
