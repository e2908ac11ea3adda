"""Load each rank's shard of a safetensors checkpoint, and nothing more.

safetensors maps the file and ``get_slice`` reads only the requested rows or columns of
a tensor, so rank r of tp reads about 1/tp of every split matrix (plus the small
replicated norms). The bytes each rank read are recorded on the model as
``model.tp_bytes_read``. Taught in notebook 07.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from ..config import ModelConfig
from ..device import resolve_device, resolve_dtype
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..models import registry
from ..models.fetch import resolve
from ..models.llama import CausalLM
from .model import build_tp_model


def shard_bounds(full: int, rank: int, tp: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s equal part of a dimension of size ``full``."""
    if full % tp:
        raise ValueError(f"dimension of size {full} does not split into tp={tp} equal parts")
    part = full // tp
    return rank * part, (rank + 1) * part


def shard_plan(model: CausalLM) -> dict[str, int | None]:
    """Parameter name -> the dimension of the full tensor that is split (None: replicated)."""
    plan, seen = {}, set()
    for mod_name, mod in model.named_modules():
        for p_name, param in mod.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight is read once, under its first name
                continue
            seen.add(id(param))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
                plan[name] = 0  # weight rows and bias entries follow the output split
            elif isinstance(mod, RowParallelLinear):
                plan[name] = 1 if p_name == "weight" else None  # bias is added once, after the sum
            else:
                plan[name] = None
    return plan


def _checkpoint_index(model_dir: Path) -> dict[str, tuple[Path, str]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    index = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                index[k[len("model."):] if k.startswith("model.") else k] = (f, k)
    return index


def read_shards(model_dir: Path, plan: dict[str, int | None], rank: int,
                tp: int) -> tuple[dict[str, torch.Tensor], int]:
    """Read rank ``rank``'s slice of every parameter in ``plan``; returns (tensors, bytes read)."""
    index = _checkpoint_index(model_dir)
    missing = [n for n in plan if n not in index]
    if missing:
        raise KeyError(f"checkpoint in {model_dir} lacks {missing[:5]}")
    by_file: dict[Path, list[str]] = {}
    for name in plan:
        by_file.setdefault(index[name][0], []).append(name)
    out, nbytes = {}, 0
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for name in names:
                sl = st.get_slice(index[name][1])
                dim = plan[name]
                if dim is None:
                    t = sl[:]
                else:
                    start, end = shard_bounds(sl.get_shape()[dim], rank, tp)
                    t = sl[start:end] if dim == 0 else sl[:, start:end]
                out[name] = t
                nbytes += t.numel() * t.element_size()
    return out, nbytes


def load_tp_model(name_or_path: str, attention: str = "naive", device=None,
                  dtype: str | torch.dtype | None = None, tp_rank: int | None = None,
                  tp_size: int | None = None, group=None) -> CausalLM:
    """This rank's shard of a registered model (``smollm2-135m``, ``tiny-llama``) or folder.

    Rank and degree default to the initialized process group (rank 0 of 1 without one).
    The result is an ordinary :class:`CausalLM` whose parallel layers talk to the other
    ranks; call it on every rank with the same inputs. ``dtype`` defaults as in
    :func:`llmlab.load_model`: float32 on a CPU, bfloat16 on a GPU.
    """
    from .. import attention as attn_backends

    attn_backends.get(attention)
    if tp_rank is None or tp_size is None:
        init = dist.is_available() and dist.is_initialized()
        tp_rank = dist.get_rank(group) if init else 0
        tp_size = dist.get_world_size(group) if init else 1
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve(name_or_path)
    config = ModelConfig.from_file(path)
    model = build_tp_model(config, tp_rank, tp_size, attention, group)
    plan = shard_plan(model)
    sd, nbytes = read_shards(path, plan, tp_rank, tp_size)
    model.load_state_dict(sd, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"parameters not loaded: {still_meta[:5]}")
    model.reset_rotary()
    model = model.to(device=dev, dtype=dt)
    model.reset_rotary(dev)
    model.name = f"{name_or_path} (tp rank {tp_rank} of {tp_size})"
    model.tp_bytes_read = nbytes
    return model.eval()
