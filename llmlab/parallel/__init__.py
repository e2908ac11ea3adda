"""Tensor parallelism on torch.distributed: process groups, launching ranks, the TP model.

>>> from llmlab.parallel import launch
>>> from llmlab.parallel.workers import generate_on_ranks
>>> run = launch(generate_on_ranks, 3, "smollm2-135m", prompt_ids, 20)   # 3 processes
>>> run.tokens, [m.param_bytes for m in run.memory]

Command line: ``torchrun --nproc-per-node 3 -m llmlab.parallel.run --prompt "..."``.
The parallel layers themselves live in :mod:`llmlab.layers.linear`. Taught in notebook 07.
"""
from .generate import LockstepGeneration, greedy_generate
from .group import (ParallelContext, current, default_backend, destroy_process_group,
                    free_port, init_process_group)
from .launch import RankError, launch
from .loader import load_tp_model, read_shards, shard_plan
from .model import build_tp_model, check_tp_degree, parallelize, parameter_bytes, valid_tp_degrees

__all__ = ["launch", "RankError", "init_process_group", "destroy_process_group", "current",
           "ParallelContext", "default_backend", "free_port", "load_tp_model", "read_shards",
           "shard_plan", "build_tp_model", "parallelize", "check_tp_degree", "valid_tp_degrees",
           "parameter_bytes", "greedy_generate", "LockstepGeneration"]
