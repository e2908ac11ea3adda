"""CPU matrix-vector products on quantized weights with float32 activations (decode):
int8 per row, 4-bit groups (int4, GGUF Q4_1), GGUF Q8_0 and float8 e4m3 per row; and plain
float32 weights ("f32"), which ``compile=True`` puts in the float model's graph in place of
MKL's sgemv (:mod:`llmlab.compile`; about 1.8x faster over SmolLM2's 211 small matrices).

The C source is ``cpu_gemv.c`` beside this file; its header states the layouts and limits.
PyTorch's packed CPU kernels (``torch._weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
are fast only with bfloat16 activations (their float32 paths are slower than a dense
float32 matmul), so they round x to 8 significant bits; these loops keep x in float32, widen
the codes in registers (AVX2 + FMA, or plain C elsewhere), and give the float32 product with
the dequantized weight up to the order of the additions. ``dequantize`` writes the float32
weight itself, bit for bit what :mod:`llmlab.quant.formats` gives, for many rows (prefill).

Built on first use with the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``), as ``-O3 -march=native -ffp-contract=off -fopenmp``, into ``kernels/`` under
``$LLMLAB_CACHE`` (default ``~/.cache/llmlab``), under a name keyed by the source, the
compiler and the CPU, then loaded with ctypes. Loading a shared library runs its code, so
the cache trusts nothing it did not build: the directory is created private (0700), and a
cached library is loaded only when it and its directory belong to the current user and
nobody else may write them; otherwise it is rebuilt (in a fresh private directory if the
cache directory itself is another user's). The compiler gets ``COMPILE_TIMEOUT_S``.
OpenMP binds to the runtime torch has already loaded, so these loops share torch's threads
(``torch.get_num_threads()``). Where no compiler works, :func:`available` is False and
the callers keep PyTorch's kernels. ``LLMLAB_CPU_GEMV=0`` turns the kernels off.

    x [M, K] float32 (any M; meant for M <= 8)  ->  y [M, N] float32

:func:`gemv` and :func:`dequantize` check every tensor (dtype, shape, contiguity, device)
and say which one is wrong; ``gemv_unchecked`` and ``dequantize_unchecked`` skip the checks, for the
quantized layers (:mod:`llmlab.quant.linear`), whose stored weights are valid by
construction and which call them about 120 times per decode step. The layers call them
as torch operators (``torch.ops.llmlab.int8_gemv``, ``q4_gemv``, ``q8_0_gemv``,
``fp8_gemv``, ``f32_gemv`` and ``dequantize``: :data:`GEMV_OPS`, :data:`dequantize_op`,
with fake kernels for shapes), so that a graph compiled by ``torch.compile`` calls the C kernels
without a graph break. The gemv operators' CPU kernels are C++ (``cpu_gemv_ops.cpp``, built
with ``$CXX``, else ``c++``, ``g++`` or ``clang++``, against the installed torch, and cached
the same way): about 3 µs a call where a Python kernel costs 9. Without a C++ compiler (or with
``LLMLAB_CPU_GEMV_OPS=0``) the operators keep Python kernels, and eager decode skips the
dispatcher instead (:func:`skips_dispatcher`).

Taught in notebook 08.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_gemv.c")
OPS_SOURCE = Path(__file__).with_name("cpu_gemv_ops.cpp")   # the operators' C++ kernels
COMPILE_TIMEOUT_S = 120.0           # a compiler that hangs must not hang the first decode step
_LIB: dict[str, object] = {}   # "lib": the loaded library or None, "error": why not,
                               # "available": whether "lib" is one (see available())


def _cpu_id() -> str:
    """What the -march=native build depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler(env: str = "CC", names: tuple[str, ...] = ("cc", "gcc", "clang")) -> str | None:
    """The first of ``$env`` and ``names`` found on the PATH, or None."""
    for cc in (os.environ.get(env), *names):
        if cc and shutil.which(cc):
            return cc
    return None


def _cxx_compiler() -> str | None:
    return _compiler("CXX", ("c++", "g++", "clang++"))


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)}: no answer within {COMPILE_TIMEOUT_S:g} s "
                           "(COMPILE_TIMEOUT_S)") from None


def _untrusted(st: os.stat_result, what: str) -> str | None:
    """Why a file or directory that we are about to trust is not ours alone, or None.
    Another user who owns it, or may write it, could put code in the library we load."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by its group or by others (mode {stat.filemode(st.st_mode)})"
    return None


def _cache_dir() -> Path:
    """The private directory the libraries are built in: ``$LLMLAB_CACHE/kernels``,
    created 0700. If it exists but is not ours alone, and we own it, its mode is
    tightened; if another user owns it (or it is not a directory), a fresh private
    temporary directory is used instead (the library is then rebuilt by every process)."""
    root = Path(os.environ.get("LLMLAB_CACHE", Path.home() / ".cache" / "llmlab"))
    path = root / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and _untrusted(st, "") is not None \
                and hasattr(os, "getuid") and st.st_uid == os.getuid():
            os.chmod(path, 0o700)
            st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and _untrusted(st, "") is None:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="llmlab-kernels-"))


def _trusted_library(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) that this user owns and nobody
    else may write: only then is a cached build loaded."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and _untrusted(st, str(path)) is None


def _build(cc: str, native: bool = True) -> Path:
    """The shared library, compiled once per source, compiler and CPU. ``native=False``
    builds for the generic target (no AVX2 on x86-64: the plain C loops), for tests.
    A cached file that is not trusted (see :func:`_trusted_library`) is rebuilt."""
    version = _run([cc, "--version"]).stdout
    arch = ["-march=native"] if native else []
    key = SOURCE.read_bytes() + version.encode() + _cpu_id().encode() + bytes(native)
    base = [cc, "-O3", *arch, "-ffp-contract=off", "-shared", "-fPIC"]
    # without OpenMP (e.g. Apple clang): 1 thread
    return _cached_build("cpu_gemv", key, [[*base, *flags, str(SOURCE)]
                                           for flags in (["-fopenmp"], [])])


def _cached_build(stem: str, key: bytes, commands: list[list[str]]) -> Path:
    """``$cache/{stem}-{hash of key}.so``: reused when it is trusted, else made by the first
    of ``commands`` (each completed with ``-o <file>``) that succeeds; RuntimeError with
    every command's error when none does."""
    cache = _cache_dir()
    out = cache / f"{stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if _trusted_library(out):
        return out
    errors = []
    for cmd in commands:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            run = _run([*cmd, "-o", tmp])
            if run.returncode == 0:
                os.chmod(tmp, 0o700)                # whatever the umask: ours alone
                os.replace(tmp, out)                # atomic: a concurrent build is harmless
                return out
            errors.append(f"{' '.join(cmd)}: {run.stderr.strip()[-500:]}")
        except RuntimeError as e:                  # the compiler timed out
            errors.append(str(e))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("\n".join(errors))


def _build_ops(cxx: str) -> Path:
    """``cpu_gemv_ops.cpp`` built against the installed torch (C++20, else C++17), once per
    source, compiler, CPU and torch."""
    version = _run([cxx, "--version"]).stdout
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = (OPS_SOURCE.read_bytes() + version.encode() + _cpu_id().encode()
           + f"{torch.__version__} {root} {abi}".encode())
    rest = ["-w", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I",
            str(root / "include"), str(OPS_SOURCE), "-L", str(root / "lib"), "-lc10",
            "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]
    # torch's own extensions build as C++20; an older compiler may still take its headers as
    # C++17. -march=native vectorizes static_attend's loops (the gemv calls go to the C library)
    return _cached_build("cpu_gemv_ops", key, [[cxx, "-O3", *arch, f"-std={std}", *rest]
                                               for arch in (["-march=native"], [])
                                               for std in ("c++20", "c++17")])


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
        return None
    _LIB["ops_error"] = _use_cxx_kernels(_LIB["lib"])
    return _LIB["lib"]


def _open(path: Path):
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.llmlab_gemv.argtypes = [i, p, p, p, p, p, p, i, i, i, i, i]
    lib.llmlab_gemv.restype = i
    lib.llmlab_dequantize.argtypes = [i, p, p, p, p, p, i, i, i, i]
    lib.llmlab_dequantize.restype = i
    lib.llmlab_vector_width.restype = i
    return lib


def available() -> bool:
    """True when the C kernels are built and loaded on this machine (built on the first
    call). A traced call reads the stored answer, a constant of the graph:
    :class:`llmlab.compile.CompiledStep` calls this before tracing, so the build itself is
    never traced. (Marking it ``torch.compiler.assume_constant_result`` would import
    TorchDynamo, over a second, into every process that imports llmlab.)"""
    if "available" not in _LIB:
        _LIB["available"] = _load() is not None
    return _LIB["available"]


def describe() -> str:
    """One line: which build runs here, or why none does."""
    lib = _load()
    if lib is None:
        return f"CPU GEMV kernels unavailable ({_LIB['error']})"
    width = lib.llmlab_vector_width()
    ops = _LIB["ops_error"]
    return (f"CPU GEMV kernels: {'AVX2+FMA, 8 float32 lanes' if width == 8 else 'plain C loops'}"
            f"; operators: {'C++ kernels' if ops is None else f'Python kernels ({ops})'}")


def _library():
    lib = _load()
    if lib is None:
        raise RuntimeError(describe())
    return lib


FORMATS = {"int8": 0, "q4": 1, "q8_0": 2, "fp8": 3, "f32": 4}   # the C file's format numbers
_C_INT_MAX = 2**31 - 1                                  # the C functions take int sizes


def _pointers(codes, scale, d, m) -> list[int]:
    """d, m, scale as the C functions take them (an unused one: any valid pointer)."""
    return [(codes if t is None else t).data_ptr() for t in (d, m, scale)]


def _expect(name: str, t, dtype: torch.dtype, shape: tuple[int, ...], fmt: str) -> None:
    """ValueError naming the tensor, what it is and what ``fmt`` needs, unless ``t`` is a
    contiguous CPU tensor of ``dtype`` and ``shape``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fmt}: {name} must be a {dtype} tensor {list(shape)}; "
                         f"got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape or t.device.type != "cpu":
        raise ValueError(f"{fmt}: {name} must be a CPU {dtype} tensor {list(shape)}; got "
                         f"{t.device.type} {t.dtype} {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{fmt}: {name} {list(shape)} must be contiguous (row-major); "
                         f"got strides {t.stride()}")


def _check_layout(fmt: str, codes: torch.Tensor, k: int, scale, d, m, group_size: int) -> None:
    """The stored weight of ``fmt`` for an input size ``k`` (cpu_gemv.c's Layouts):
    ValueError naming the first tensor or number that does not fit, and what would."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}; allowed: {list(FORMATS)}")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= _C_INT_MAX:
        raise ValueError(f"k={k!r} must be an int in 1..{_C_INT_MAX}")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        got = list(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise ValueError(f"{fmt}: codes must be a matrix [N, ...]; got {got}")
    n = codes.shape[0]
    if not 0 < n <= _C_INT_MAX:
        raise ValueError(f"{fmt}: codes has N={n} rows; allowed 1..{_C_INT_MAX}")
    if fmt == "f32":
        _expect("codes", codes, torch.float32, (n, k), fmt)
    elif fmt in ("int8", "fp8"):
        _expect("codes", codes, torch.int8 if fmt == "int8" else torch.float8_e4m3fn, (n, k), fmt)
        _expect("scale", scale, torch.float32, (n,), fmt)
    elif fmt == "q8_0":
        if k % 32:
            raise ValueError(f"q8_0: k={k} must be a multiple of 32 (its blocks of 32 inputs)")
        _expect("codes", codes, torch.int8, (n, k), fmt)
        _expect("d", d, torch.float16, (n, k // 32), fmt)
    else:
        if not isinstance(group_size, int) or isinstance(group_size, bool) \
                or group_size <= 0 or group_size % 32 or k % group_size:
            raise ValueError(f"q4: group_size={group_size!r} must be a multiple of 32 that "
                             f"divides k={k}")
        _expect("codes", codes, torch.uint8, (n, k // 2), fmt)
        _expect("d", d, torch.float16, (n, k // group_size), fmt)
        _expect("m", m, torch.float16, (n, k // group_size), fmt)


def gemv(fmt: str, x: torch.Tensor, codes: torch.Tensor, k: int, *,
         scale: torch.Tensor | None = None, d: torch.Tensor | None = None,
         m: torch.Tensor | None = None, group_size: int = 32) -> torch.Tensor:
    """y [..., N] = x [..., k] · Wᵀ for W stored as ``fmt`` ("int8": codes, scale; "q4":
    packed codes, d, m, group_size; "q8_0": codes, d; "fp8": codes, scale; "f32": the
    float32 weight itself as codes; the layouts of cpu_gemv.c). x: a contiguous float32
    CPU tensor, any leading dims. Every tensor is checked; a ValueError names the one that
    does not fit and what would."""
    _check_layout(fmt, codes, k, scale, d, m, group_size)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != k \
            or x.dtype != torch.float32 or x.device.type != "cpu":
        got = (f"{x.device.type} {x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor)
               else type(x).__name__)
        raise ValueError(f"{fmt}: x must be a CPU float32 tensor [..., {k}]; got {got}")
    if not x.is_contiguous():
        raise ValueError(f"{fmt}: x {list(x.shape)} must be contiguous; got strides {x.stride()}")
    if x.numel() // k > _C_INT_MAX:
        raise ValueError(f"{fmt}: x has {x.numel() // k} rows; allowed 1..{_C_INT_MAX}")
    _library()
    return gemv_unchecked(fmt, x, codes, k, scale=scale, d=d, m=m, group_size=group_size)


def dequantize(fmt: str, codes: torch.Tensor, k: int, *, scale: torch.Tensor | None = None,
               d: torch.Tensor | None = None, m: torch.Tensor | None = None,
               group_size: int = 32) -> torch.Tensor:
    """The float32 weight [N, k] from the stored codes: bit for bit what
    :mod:`llmlab.quant.formats` gives, several times faster, for prefill (a float32 GEMM on
    the whole matrix) and the quality evaluation. Checked as :func:`gemv` ("f32" has
    nothing to dequantize)."""
    if fmt == "f32":
        raise ValueError("fmt='f32' is stored as float32 already; allowed: "
                         f"{[f for f in FORMATS if f != 'f32']}")
    _check_layout(fmt, codes, k, scale, d, m, group_size)
    _library()
    return dequantize_unchecked(fmt, codes, k, scale=scale, d=d, m=m, group_size=group_size)


# The unchecked calls: only for callers whose tensors are valid by construction (the layers
# of llmlab.quant.linear). A wrong dtype, shape or stride here reads or writes out of bounds.

def gemv_unchecked(fmt: str, x: torch.Tensor, codes: torch.Tensor, k: int, *,
                   scale: torch.Tensor | None = None, d: torch.Tensor | None = None,
                   m: torch.Tensor | None = None, group_size: int = 32) -> torch.Tensor:
    """:func:`gemv` without its checks: it only allocates y and calls C."""
    n = codes.shape[0]
    y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    rc = _LIB["lib"].llmlab_gemv(FORMATS[fmt], x.data_ptr(), codes.data_ptr(),
                                 *_pointers(codes, scale, d, m), y.data_ptr(), x.numel() // k,
                                 n, k, group_size, torch.get_num_threads())
    if rc:
        raise (MemoryError if rc == -2 else ValueError)(
            f"{fmt} gemv refused x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
            f"group_size={group_size} (code {rc})")
    return y


def dequantize_unchecked(fmt: str, codes: torch.Tensor, k: int, *,
                         scale: torch.Tensor | None = None, d: torch.Tensor | None = None,
                         m: torch.Tensor | None = None, group_size: int = 32) -> torch.Tensor:
    """:func:`dequantize` without its checks."""
    out = torch.empty(codes.shape[0], k, dtype=torch.float32)
    rc = _LIB["lib"].llmlab_dequantize(FORMATS[fmt], codes.data_ptr(),
                                       *_pointers(codes, scale, d, m), out.data_ptr(),
                                       codes.shape[0], k, group_size, torch.get_num_threads())
    if rc:
        raise ValueError(f"{fmt} dequantize refused codes {tuple(codes.shape)}, k={k}, "
                         f"group_size={group_size} (code {rc})")
    return out


# -- the same kernels as torch operators ---------------------------------------------------
#
# One operator per format runs ``gemv_unchecked`` behind PyTorch's dispatcher, and one runs
# ``dequantize_unchecked``, so that ``torch.compile`` puts them into its graph as single calls (a
# ctypes call cannot be traced: it breaks the graph) and the profiler sees them as
# operators. Their fake kernels give the output's shape and dtype without running C.
#
#   llmlab::int8_gemv(x, codes, scale)         llmlab::q4_gemv(x, codes, d, m, group_size)
#   llmlab::q8_0_gemv(x, codes, d)             llmlab::fp8_gemv(x, codes, scale)
#   llmlab::dequantize(fmt, codes, k, scale, d, m, group_size)
#
# x [..., K] float32 -> y [..., N] float32, codes and the other tensors as in the layouts
# above (K from codes: its width, twice that for q4). Unchecked like the calls they wrap:
# for tensors valid by construction only; x is made contiguous here, since a compiled
# graph may hand over a strided view.
#
# What a call costs. The layers make about 120 of these calls per decode step, so the
# route matters. Measured on a 2-core CPU (1 thread, PyTorch 2.13) against calling the
# kernel's Python function directly: the ``torch.library.custom_op`` decorator adds about
# 4 µs per call; a ``torch.library.Library`` operator with a Python kernel, as here, about
# 1.1 µs with three arguments (1.8 µs for a whole int8 call) and 2.2 µs with eight; a
# keyword argument about 0.2 µs more. Hence ``Library``, one short positional signature
# per format, and, in eager mode, no dispatcher at all where nothing needs it
# (:func:`skips_dispatcher`, 0.2 µs). With the operator on every call, an int8 SmolLM2
# decode step (121 calls, 11-13 ms at batch 1) measured about 0.4 ms slower. A compiled graph
# cannot skip the dispatcher, so where a C++ compiler works the Python kernels are replaced
# by C++ ones (:func:`_use_cxx_kernels`): 3.0 µs for a whole f32 call of 16 x 64, against
# 9.3 µs with the Python kernel and 7.5 µs for ``gemv_unchecked`` itself (2 threads).

_OPS = torch.library.Library("llmlab", "FRAGMENT")   # kept alive: it holds the registrations


def _ready(x: torch.Tensor) -> torch.Tensor:
    if _LIB.get("lib") is None:        # the library is built on first use
        _library()
    return x if x.is_contiguous() else x.contiguous()


def _int8_gemv(x, codes, scale):
    return gemv_unchecked("int8", _ready(x), codes, codes.shape[1], scale=scale)


def _q4_gemv(x, codes, d, m, group_size):
    return gemv_unchecked("q4", _ready(x), codes, 2 * codes.shape[1], d=d, m=m,
                          group_size=group_size)


def _q8_0_gemv(x, codes, d):
    return gemv_unchecked("q8_0", _ready(x), codes, codes.shape[1], d=d)


def _fp8_gemv(x, codes, scale):
    return gemv_unchecked("fp8", _ready(x), codes, codes.shape[1], scale=scale)


def _f32_gemv(x, w):
    return gemv_unchecked("f32", _ready(x), w, w.shape[1])


def _fake_gemv(fmt: str):
    """The fake kernel of ``fmt``'s operator: y's shape and dtype, no C."""
    per_byte = 2 if fmt == "q4" else 1

    def fake(x, codes, *others):
        k = per_byte * codes.shape[1]
        if x.shape[-1] != k:
            raise ValueError(f"llmlab::{fmt}_gemv: x {list(x.shape)} must end in K={k}")
        return x.new_empty((*x.shape[:-1], codes.shape[0]), dtype=torch.float32)
    return fake


_GEMV_KERNELS = {
    "int8": ("(Tensor x, Tensor codes, Tensor scale) -> Tensor", _int8_gemv),
    "q4": ("(Tensor x, Tensor codes, Tensor d, Tensor m, int group_size) -> Tensor", _q4_gemv),
    "q8_0": ("(Tensor x, Tensor codes, Tensor d) -> Tensor", _q8_0_gemv),
    "fp8": ("(Tensor x, Tensor codes, Tensor scale) -> Tensor", _fp8_gemv),
    "f32": ("(Tensor x, Tensor w) -> Tensor", _f32_gemv)}
for _fmt, (_schema, _kernel) in _GEMV_KERNELS.items():
    _OPS.define(f"{_fmt}_gemv{_schema}")
    torch.library.register_fake(f"llmlab::{_fmt}_gemv", _fake_gemv(_fmt), lib=_OPS)


# The static KV cache's write and read for one layer (cpu_gemv_ops.cpp: the new K/V written in
# place, each query reading only its visible slots). Its Python kernel is the PyTorch reference.
_OPS.define("static_attend(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor q, "
            "Tensor k, Tensor v) -> Tensor")


def _static_attend(k_cache, v_cache, slots, q, k, v):
    from ..cache.static import static_attend     # the reference; cache imports kernels
    ids = torch.arange(k_cache.shape[2], device=k_cache.device)
    return static_attend(k_cache, v_cache, slots, ids, q, k, v)


@torch.library.register_fake("llmlab::static_attend", lib=_OPS)
def _fake_static_attend(k_cache, v_cache, slots, q, k, v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def cxx_static_attend(k_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``llmlab::static_attend`` runs as the C++ kernel for these tensors: float32 on
    the CPU, with the C++ kernels loaded (:func:`describe`)."""
    return (k_cache.device.type == "cpu" and k_cache.dtype == q.dtype == torch.float32
            and available() and _LIB.get("ops_error") is None)


def _python_kernels() -> torch.library.Library:
    """The operators' Python CPU kernels, in a library of their own, so that they can be
    removed when the C++ ones load (:func:`_use_cxx_kernels`)."""
    lib = torch.library.Library("llmlab", "IMPL", "CPU")
    for fmt, (_, kernel) in _GEMV_KERNELS.items():
        lib.impl(f"{fmt}_gemv", kernel)
    lib.impl("static_attend", _static_attend)
    return lib


_PY_KERNELS = _python_kernels()


def _use_cxx_kernels(lib) -> str | None:
    """Put ``cpu_gemv_ops.cpp``'s C++ kernels in place of the gemv operators' Python ones
    (called once, when the C library has loaded). Returns None, or why the Python kernels
    stay: ``LLMLAB_CPU_GEMV_OPS=0``, no C++ compiler, or a failed build or load."""
    global _PY_KERNELS
    if os.environ.get("LLMLAB_CPU_GEMV_OPS", "1") == "0":
        return "C++ kernels turned off by LLMLAB_CPU_GEMV_OPS=0"
    cxx = _cxx_compiler()
    if cxx is None:
        return "no C++ compiler found ($CXX, c++, g++ or clang++)"
    try:
        path = _build_ops(cxx)
    except RuntimeError as e:
        return f"could not build {OPS_SOURCE.name}: {e}"
    _PY_KERNELS._destroy()             # one kernel per dispatch key: the Python one goes first
    try:
        torch.ops.load_library(str(path))
        ctypes.CDLL(str(path)).llmlab_ops_init(ctypes.cast(lib.llmlab_gemv, ctypes.c_void_p))
    except (OSError, AttributeError) as e:
        _PY_KERNELS = _python_kernels()
        return f"could not load {path.name}: {e}"
    return None


def _dequantize_kernel(fmt, codes, k, scale=None, d=None, m=None, group_size=32):
    if _LIB.get("lib") is None:
        _library()
    return dequantize_unchecked(fmt, codes, k, scale=scale, d=d, m=m, group_size=group_size)


def _dequantize_fake(fmt, codes, k, scale=None, d=None, m=None, group_size=32):
    return codes.new_empty((codes.shape[0], k), dtype=torch.float32)


_OPS.define("dequantize(str fmt, Tensor codes, int k, Tensor? scale=None, Tensor? d=None, "
            "Tensor? m=None, int group_size=32) -> Tensor")
_OPS.impl("dequantize", _dequantize_kernel, "CPU")
torch.library.register_fake("llmlab::dequantize", _dequantize_fake, lib=_OPS)

#: The operator of each format: ``GEMV_OPS[fmt](x, codes, *others)``, the others in the
#: order of the schemas above (what the quantized layers' ``c_layout`` lists).
GEMV_OPS = {fmt: getattr(torch.ops.llmlab, f"{fmt}_gemv").default for fmt in _GEMV_KERNELS}
#: ``dequantize_op(fmt, codes, k, scale, d, m, group_size)``.
dequantize_op = torch.ops.llmlab.dequantize.default
_profiling, _dispatch_modes = torch._C._autograd._profiler_enabled, torch._C._len_torch_dispatch_stack


def skips_dispatcher(x: torch.Tensor) -> bool:
    """Whether a product with x may call its kernel (``gemv_unchecked``) directly instead of the
    operator: in eager mode, on a plain tensor, with no profiler (which should see the
    operator) and no dispatch mode (which intercepts operators), and only while the
    operators have their Python kernels (the C++ ones are faster than the direct call).
    Under ``torch.compile`` it is False, so the graph holds the operator. About 0.2 µs."""
    return (not torch.compiler.is_compiling() and type(x) is torch.Tensor
            and _LIB.get("ops_error") is not None and not _profiling() and not _dispatch_modes())


def _input(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as the kernels take it: a float32 contiguous CPU matrix [M, k]."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k \
            or x.device.type != "cpu":
        got = f"{x.device.type} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a CPU matrix [M, {k}]; got {got}")
    return x.float().contiguous()


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · (q · scale[:, None])ᵀ; q [N, K] int8, scale [N] float32."""
    return gemv("int8", _input(x, q.shape[1]), q, q.shape[1], scale=scale)


def q4_gemv(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """y = x · Wᵀ with W[n, k] = code[n, k] · d[n, g] + m[n, g], g = k // group_size;
    packed [N, K/2] uint8 (code 2j low nibble, 2j+1 high), d and m [N, K/group_size] float16.
    group_size must be a multiple of 32 dividing K."""
    k = packed.shape[1] * 2
    return gemv("q4", _input(x, k), packed, k, d=d, m=m, group_size=group_size)


def q8_0_gemv(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """y = x · Wᵀ with W[n, k] = q[n, k] · d[n, k // 32]; q [N, K] int8, d [N, K/32] float16."""
    return gemv("q8_0", _input(x, q.shape[1]), q, q.shape[1], d=d)


def f32_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x · wᵀ; w [N, K] float32 (an ``nn.Linear``'s weight), for a few rows of x."""
    return gemv("f32", _input(x, w.shape[1]), w, w.shape[1])


def fp8_gemv(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · (w8 · scale[:, None])ᵀ; w8 [N, K] float8_e4m3fn (finite), scale [N] float32."""
    return gemv("fp8", _input(x, w8.shape[1]), w8, w8.shape[1], scale=scale)
