"""Choose the device and dtype, and describe the machine for a notebook header.

On a machine without CUDA the Triton kernels in ``llmlab.kernels`` run through the
Triton interpreter; that needs ``TRITON_INTERPRET=1`` in the environment *before*
any ``@triton.jit`` function is defined, so this module sets it at import time
(``llmlab/__init__.py`` imports it first). Taught in notebook 00.
"""
from __future__ import annotations

import os
import platform

if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        os.environ["TRITON_INTERPRET"] = "1"

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


_pinned_device: torch.device | None = None


def default_device() -> torch.device:
    """What ``device=None`` means everywhere in llmlab: the device pinned with
    :func:`set_default_device`, else CUDA if present, else CPU."""
    if _pinned_device is not None:
        return _pinned_device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def set_default_device(device: str | torch.device | None) -> None:
    """Pin what ``device=None`` means in this process; None goes back to the automatic choice.

    On a GPU machine, ``set_default_device("cpu")`` runs the workbook on the CPU (to compare
    the two, or to keep tensors built on the CPU and models on one device, as the test
    suite does). Triton kernels still compile for the GPU there: give them CUDA tensors.
    """
    global _pinned_device
    _pinned_device = None if device is None else resolve_device(device)


def default_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """The dtype models load in on ``device`` (None: :func:`default_device`).

    float32 on a CPU (bfloat16 arithmetic is emulated or slow on most CPUs, and float32
    keeps the parity checks exact); on a GPU bfloat16, whose dots run on the tensor
    cores and whose range is float32's, so activations do not overflow. A GPU older than
    Ampere (sm_80) has no bfloat16 tensor cores: float16 there.
    """
    dev = default_device() if device is None else torch.device(device)
    if dev.type != "cuda":
        return torch.float32
    if torch.cuda.is_available() and torch.cuda.get_device_capability(dev) < (8, 0):
        return torch.float16
    return torch.bfloat16


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for CUDA, but CUDA is not available here; "
                         "use device='cpu' or None")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda', None")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None,
                  device: str | torch.device | None = None) -> torch.dtype:
    """``dtype`` as a torch.dtype; None means :func:`default_dtype` of ``device``."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; allowed: {sorted(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def has_triton() -> bool:
    """True when ``import triton`` works here. Triton ships wheels for Linux only, so on
    macOS or Windows the notebooks' Triton cells print a one-line note and skip."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_MISSING = ("skipped: Triton is not installed on this machine (its wheels are for Linux); "
                  "the rest of the notebook runs without it.")


def triton_interpreted() -> bool:
    """True when Triton kernels run in the (CPU) interpreter rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def share_cores(processes: int) -> int:
    """Give this process its share of the machine's cores when ``processes`` processes run
    side by side (a parallel test run, several workers): torch's intra-op threads, and
    ``OMP_NUM_THREADS`` for the processes it starts (notebook kernels, ranks), become
    ``cores // processes`` (at least 1). Two processes that each take every core run
    slower together than one after the other. Returns the thread count."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r} must be an int >= 1")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // processes)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU, where ops run eagerly)."""
    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def device_name(device: torch.device | str | None = None) -> str:
    """A human name for the device, used to label every measured number."""
    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU ({cpu}, {torch.get_num_threads()} threads)"


def describe() -> dict[str, str]:
    """Device and library versions, for the top of a notebook."""
    info = {
        "device": device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "triton mode": "interpreter (CPU)" if triton_interpreted() else "compiled (GPU)",
    }
    for mod in ("transformers", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover - optional at runtime
            info[mod] = "not installed"
    return info
