"""Process-group setup for tensor parallelism: gloo on CPU, NCCL on CUDA.

Every rank calls :func:`init_process_group` with the same address and port; rank 0
listens there and the others connect (a TCP rendezvous on localhost). Afterwards
``torch.distributed`` collectives (all_reduce, all_gather, broadcast) work across the
ranks. :func:`llmlab.parallel.launch` and ``torchrun`` do this for you. Taught in notebook 07.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """Who this process is: its rank among ``world_size`` ranks, the backend and its device."""
    rank: int
    world_size: int
    backend: str
    device: torch.device


def free_port() -> int:
    """A TCP port on localhost that nobody is listening on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: str | torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for CPU."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda'")
    return "nccl" if dev.type == "cuda" else "gloo"


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """The device rank ``rank`` computes on: CPU, or one GPU per rank."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' asked for, but CUDA is not available here; use 'cpu'")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(rank: int, world_size: int, device: str | torch.device = "cpu",
                       master_addr: str = "127.0.0.1", master_port: int | None = None,
                       timeout_s: float = 300.0) -> ParallelContext:
    """Join the default process group as ``rank`` of ``world_size``.

    Without ``master_port`` the rendezvous comes from the environment (``MASTER_ADDR``,
    ``MASTER_PORT``, as torchrun sets them).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be an int in 0..{world_size - 1}")
    backend = default_backend(device)
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if master_port is None:
        master_addr = os.environ.get("MASTER_ADDR", master_addr)
        master_port = int(os.environ.get("MASTER_PORT", "29500"))
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(rank, world_size, backend, dev)


def current() -> ParallelContext:
    """The context of this process (rank 0 of 1 on CPU when no group is initialized)."""
    if not dist.is_initialized():
        return ParallelContext(0, 1, "none", torch.device("cpu"))
    backend = dist.get_backend()
    dev = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
           else torch.device("cpu"))
    return ParallelContext(dist.get_rank(), dist.get_world_size(), backend, dev)


def destroy_process_group() -> None:
    """Leave the process group (a no-op when none is initialized)."""
    if dist.is_initialized():
        dist.destroy_process_group()
