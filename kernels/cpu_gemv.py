"""CPU matrix-vector products on quantized weights with float32 activations (decode):
int8 per row, 4-bit groups (int4, GGUF Q4_1), GGUF Q8_0 and float8 e4m3 per row.

The C source is ``cpu_gemv.c`` beside this file; its header states the layouts and limits.
PyTorch's packed CPU kernels (``torch._weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
are fast only with bfloat16 activations (their float32 paths are slower than a dense
float32 matmul), so they round x to 8 significant bits; these loops keep x in float32, widen
the codes in registers (AVX2 + FMA, or plain C elsewhere), and give the float32 product with
the dequantized weight up to the order of the additions. ``dequantize`` writes the float32
weight itself, bit for bit what :mod:`llmlab.quant.formats` gives, for many rows (prefill).

Built on first use with the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``), as ``-O3 -march=native -ffp-contract=off -fopenmp``, into ``$LLMLAB_CACHE`` (default ``~/.cache/llmlab``) under a
name keyed by the source, the compiler and the CPU, then loaded with ctypes. OpenMP binds
to the runtime torch has already loaded, so these loops share torch's threads
(``torch.get_num_threads()``). Where no compiler works, :func:`available` is False and
the callers keep PyTorch's kernels. ``LLMLAB_CPU_GEMV=0`` turns the kernels off.

    x [M, K] float32 (any M; meant for M <= 8)  ->  y [M, N] float32

Taught in notebook 08.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemv.c")
_LIB: dict[str, object] = {}        # "lib": the loaded library or None, "error": why not


def _cpu_id() -> str:
    """What the -march=native build depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str, native: bool = True) -> Path:
    """The shared library, compiled once per source, compiler and CPU. ``native=False``
    builds for the generic target (no AVX2 on x86-64: the plain C loops), for tests."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    src = SOURCE.read_bytes()
    arch = ["-march=native"] if native else []
    key = hashlib.sha256(src + version.encode() + _cpu_id().encode() + bytes(native)).hexdigest()[:16]
    cache = Path(os.environ.get("LLMLAB_CACHE", Path.home() / ".cache" / "llmlab"))
    out = cache / f"cpu_gemv-{key}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in (["-fopenmp"], []):               # without OpenMP (e.g. Apple clang): 1 thread
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [cc, "-O3", *arch, "-ffp-contract=off", "-shared", "-fPIC", *flags, str(SOURCE),
               "-o", tmp]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode == 0:
            os.replace(tmp, out)                    # atomic: a concurrent build is harmless
            return out
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {run.stderr.strip()[-500:]}")
    raise RuntimeError("\n".join(errors))


def _load():
    if "lib" in _LIB:
        return _LIB["lib"]
    _LIB["lib"], _LIB["error"] = None, None
    if os.environ.get("LLMLAB_CPU_GEMV", "1") == "0":
        _LIB["error"] = "turned off by LLMLAB_CPU_GEMV=0"
        return None
    cc = _compiler()
    if cc is None:
        _LIB["error"] = "no C compiler found ($CC, cc, gcc or clang)"
        return None
    try:
        _LIB["lib"] = _open(_build(cc))
    except (OSError, RuntimeError) as e:
        _LIB["error"] = f"could not build or load {SOURCE.name}: {e}"
    return _LIB["lib"]


def _open(path: Path):
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.llmlab_gemv.argtypes = [i, p, p, p, p, p, p, i, i, i, i, i]
    lib.llmlab_gemv.restype = i
    lib.llmlab_dequantize.argtypes = [i, p, p, p, p, p, i, i, i, i]
    lib.llmlab_dequantize.restype = None
    lib.llmlab_vector_width.restype = i
    return lib


def available() -> bool:
    """True when the C kernels are built and loaded on this machine."""
    return _load() is not None


def describe() -> str:
    """One line: which build runs here, or why none does."""
    lib = _load()
    if lib is None:
        return f"CPU GEMV kernels unavailable ({_LIB['error']})"
    width = lib.llmlab_vector_width()
    return f"CPU GEMV kernels: {'AVX2+FMA, 8 float32 lanes' if width == 8 else 'plain C loops'}"


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU matrix [M, {k}]; got {x.device.type} {tuple(x.shape)}")
    if _load() is None:
        raise RuntimeError(describe())
    return x.float().contiguous()


def _contiguous(*ts: torch.Tensor) -> None:
    for t in ts:
        if not t.is_contiguous():
            raise ValueError("quantized weights must be contiguous")


FORMATS = {"int8": 0, "q4": 1, "q8_0": 2, "fp8": 3}    # the C file's format numbers


def _pointers(codes, scale, d, m) -> list[int]:
    """d, m, scale as the C functions take them (an unused one: any valid pointer)."""
    return [(codes if t is None else t).data_ptr() for t in (d, m, scale)]


# The unchecked calls, for the layers of llmlab.quant.linear, which hold valid contiguous
# weights in the layouts of cpu_gemv.c: fmt "int8" (codes, scale), "q4" (packed codes, d, m,
# group_size), "q8_0" (codes, d) or "fp8" (codes, scale). A decode step makes about 120
# gemv calls, so they only allocate y and call C.

def gemv(fmt: str, x: torch.Tensor, codes: torch.Tensor, k: int, *,
         scale: torch.Tensor | None = None, d: torch.Tensor | None = None,
         m: torch.Tensor | None = None, group_size: int = 32) -> torch.Tensor:
    """y [..., N] = x [..., k] · Wᵀ; x float32 and contiguous, any leading dims."""
    n = codes.shape[0]
    y = torch.empty(x.shape[:-1] + (n,))
    rc = _LIB["lib"].llmlab_gemv(FORMATS[fmt], x.data_ptr(), codes.data_ptr(),
                                 *_pointers(codes, scale, d, m), y.data_ptr(), x.numel() // k,
                                 n, k, group_size, torch.get_num_threads())
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(
            f"{fmt} gemv refused x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
            f"group_size={group_size} (code {rc})")
    return y


def dequantize(fmt: str, codes: torch.Tensor, k: int, *, scale: torch.Tensor | None = None,
               d: torch.Tensor | None = None, m: torch.Tensor | None = None,
               group_size: int = 32) -> torch.Tensor:
    """The float32 weight [N, k] from the stored codes: bit for bit what
    :mod:`llmlab.quant.formats` gives, several times faster, for prefill (a float32 GEMM on
    the whole matrix) and the quality evaluation."""
    out = torch.empty(codes.shape[0], k)
    _LIB["lib"].llmlab_dequantize(FORMATS[fmt], codes.data_ptr(), *_pointers(codes, scale, d, m),
                                  out.data_ptr(), codes.shape[0], k, group_size,
                                  torch.get_num_threads())
    return out


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · (q · scale[:, None])ᵀ; q [N, K] int8, scale [N] float32."""
    x = _check(x, q.shape[1])
    _contiguous(q, scale)
    if q.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError(f"q must be int8 [N, K] and scale float32 [N]; got {q.dtype}, "
                         f"{scale.dtype} {tuple(scale.shape)}")
    return gemv("int8", x, q, q.shape[1], scale=scale)


def q4_gemv(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """y = x · Wᵀ with W[n, k] = code[n, k] · d[n, g] + m[n, g], g = k // group_size;
    packed [N, K/2] uint8 (code 2j low nibble, 2j+1 high), d and m [N, K/group_size] float16.
    group_size must be a multiple of 32 dividing K."""
    n, k = packed.shape[0], packed.shape[1] * 2
    x = _check(x, k)
    _contiguous(packed, d, m)
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"group_size={group_size} must be a multiple of 32 that divides K={k}")
    if d.dtype != torch.float16 or m.dtype != torch.float16 or d.shape != (n, k // group_size) \
            or m.shape != d.shape or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [{n}, {k // 2}] and d, m float16 "
                         f"[{n}, {k // group_size}]; got {packed.dtype}, {d.dtype} "
                         f"{tuple(d.shape)}, {m.dtype} {tuple(m.shape)}")
    return gemv("q4", x, packed, k, d=d, m=m, group_size=group_size)


def q8_0_gemv(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """y = x · Wᵀ with W[n, k] = q[n, k] · d[n, k // 32]; q [N, K] int8, d [N, K/32] float16."""
    n, k = q.shape
    x = _check(x, k)
    _contiguous(q, d)
    if k % 32 or q.dtype != torch.int8 or d.dtype != torch.float16 or d.shape != (n, k // 32):
        raise ValueError(f"Q8_0 needs int8 q with K % 32 == 0 and d float16 [{n}, {k // 32}]; "
                         f"got K={k}, {q.dtype}, {d.dtype} {tuple(d.shape)}")
    return gemv("q8_0", x, q, k, d=d)


def fp8_gemv(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · (w8 · scale[:, None])ᵀ; w8 [N, K] float8_e4m3fn (finite), scale [N] float32."""
    x = _check(x, w8.shape[1])
    _contiguous(w8, scale)
    if w8.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 \
            or scale.shape != (w8.shape[0],):
        raise ValueError(f"w8 must be float8_e4m3fn [N, K] and scale float32 [N]; got "
                         f"{w8.dtype}, {scale.dtype} {tuple(scale.shape)}")
    return gemv("fp8", x, w8, w8.shape[1], scale=scale)
