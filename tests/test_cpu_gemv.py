"""llmlab.kernels.cpu_gemv: the C decode kernels against the dequantize-then-matmul reference,
at ragged sizes, several row counts and thread counts; a wrong layout is caught (in Python,
and the group size in C too); the build cache loads only a library it built itself."""
from __future__ import annotations

import os
import platform
import stat

import pytest
import torch

from llmlab.kernels import cpu_gemv
from llmlab.quant import formats

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler: "
                                "the layers keep PyTorch's kernels")

ROWS = [1, 2, 3, 4, 5, 8, 9]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def test_the_build_says_what_runs_here():
    line = cpu_gemv.describe()
    assert "AVX2" in line or "plain C" in line, line


# the formats with one code per weight: (quantize, dequantize, kernel), and the shapes to try
# (q8_0 needs K % 32 == 0; the others take ragged K)
SCALED = {"int8": (formats.int8_quantize, formats.int8_dequantize, cpu_gemv.int8_gemv),
          "q8_0": (formats.q8_0_quantize, formats.q8_0_dequantize, cpu_gemv.q8_0_gemv),
          "fp8": (formats.fp8_quantize, formats.fp8_dequantize, cpu_gemv.fp8_gemv)}
SHAPES = {"int8": [(37, 40), (64, 576), (17, 7), (130, 1536)],
          "q8_0": [(33, 64), (100, 576)], "fp8": [(37, 40), (64, 576)]}


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("fmt, n, k", [(f, n, k) for f, shapes in SHAPES.items() for n, k in shapes])
def test_scaled_formats_match_the_dequantized_matmul(fmt, n, k, m, threads):
    quantize, dequantize, kernel = SCALED[fmt]
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g)
    w[0, :6] = torch.tensor([1e-9, -1e-9, 3e-3, 0.0, 5.0, -5.0])[:k]  # fp8: subnormal codes
    q, s = quantize(w)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ dequantize(q, s).double().T
    y = kernel(x, q, s)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y.double(), ref) < 1e-5, f"max rel error {_rel(y.double(), ref):.1e}"


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k", [(37, 40), (64, 576), (17, 7), (130, 1536)])
def test_f32_matches_the_float_matmul(n, k, m, threads):
    """The float model's decode GEMV (compile=True's graph pass): W read as it is stored,
    ragged K included (the tail past the last 16)."""
    g = torch.Generator().manual_seed(n * k + m)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    y = cpu_gemv.f32_gemv(x, w)
    ref = x.double() @ w.double().T
    assert y.shape == (m, n) and _rel(y.double(), ref) < 1e-5
    small = torch.randint(-3, 4, (m, k)).float()          # exact in any order of additions
    wi = torch.randint(-9, 10, (n, k)).float()
    assert torch.equal(cpu_gemv.GEMV_OPS["f32"](small, wi), small @ wi.T)
    with pytest.raises(ValueError, match="f32: codes must be a CPU torch.float32"):
        cpu_gemv.gemv("f32", x, w.double(), k)
    with pytest.raises(ValueError, match="fmt='f32' is stored as float32 already"):
        cpu_gemv.dequantize("f32", w, k)


def test_int8_is_exact_on_integers():
    # small integers: every product and partial sum is exact in float32, so any order of the
    # additions gives the same bits; a kernel that drops the tail (K % 16) or a row is off
    q = torch.randint(-127, 128, (23, 45), dtype=torch.int8)
    scale = torch.ones(23)
    x = torch.randint(-3, 4, (5, 45)).float()
    assert torch.equal(cpu_gemv.int8_gemv(x, q, scale), x @ q.float().T)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("group, k", [(32, 320), (64, 320), (128, 384), (32, 32 * 70)])
@pytest.mark.parametrize("n", [19, 96])
def test_q4_matches_the_dequantized_matmul(m, group, k, n, threads):
    # several groups, K % 128 != 0; 70 groups: more than the kernel widens d for at once
    g = torch.Generator().manual_seed(group + n + m)
    w = torch.randn(n, k, generator=g)
    codes, d, mn = formats.group_quantize(w, bits=4, group_size=group)
    d, mn = d.half(), mn.half()
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ formats.group_dequantize(codes, d, mn).double().T
    y = cpu_gemv.q4_gemv(x, packed, d, mn, group)
    assert _rel(y.double(), ref) < 1e-5, f"max rel error {_rel(y.double(), ref):.1e}"


def test_q4_nibble_order_is_checked():
    # the same codes packed high-nibble-first (a plausible wrong layout) must not match
    k, n = 64, 8
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d, mn = torch.full((n, 2), 0.5).half(), torch.zeros(n, 2).half()
    x = torch.randn(1, k)
    ref = x @ formats.group_dequantize(codes, d, mn).T
    right = codes[:, 0::2] | (codes[:, 1::2] << 4)
    wrong = codes[:, 1::2] | (codes[:, 0::2] << 4)
    assert torch.allclose(cpu_gemv.q4_gemv(x, right, d, mn, 32), ref, atol=1e-4)
    assert not torch.allclose(cpu_gemv.q4_gemv(x, wrong, d, mn, 32), ref, atol=1e-2)


def test_bad_shapes_are_refused_with_the_values():
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        cpu_gemv.int8_gemv(torch.zeros(1, 32), q, torch.ones(4))
    packed = torch.zeros(4, 48, dtype=torch.uint8)                       # K = 96
    d = torch.zeros(4, 2).half()
    with pytest.raises(ValueError, match="group_size=48"):
        cpu_gemv.q4_gemv(torch.zeros(1, 96), packed, d, d, 48)
    with pytest.raises(ValueError, match="k=40 must be a multiple of 32"):
        cpu_gemv.q8_0_gemv(torch.zeros(1, 40), torch.zeros(4, 40, dtype=torch.int8),
                           torch.zeros(4, 1).half())


def _int8_layout(n=4, k=64):
    return torch.zeros(n, k, dtype=torch.int8), torch.ones(n)


@pytest.mark.parametrize("case, match", [
    (dict(fmt="int4"), r"fmt='int4'; allowed: \['int8', 'q4', 'q8_0', 'fp8', 'f32'\]"),
    (dict(x=torch.zeros(2, 64, dtype=torch.float64)), r"x must be a CPU float32 tensor \[\.\.\., 64\]; got cpu torch.float64"),
    (dict(x=torch.zeros(64, 2).T), r"x \[2, 64\] must be contiguous"),
    (dict(x=torch.zeros(2, 63)), r"x must be a CPU float32 tensor \[\.\.\., 64\]; got cpu torch.float32 \[2, 63\]"),
    (dict(codes=torch.zeros(4, 64, dtype=torch.uint8)), r"int8: codes must be a CPU torch.int8 tensor \[4, 64\]; got cpu torch.uint8"),
    (dict(codes=torch.zeros(64, 4, dtype=torch.int8).T), r"int8: codes must be a CPU torch.int8 tensor \[4, 64\]; got cpu torch.int8 \[4, 64\]|must be contiguous"),
    (dict(scale=torch.ones(4, dtype=torch.float64)), r"int8: scale must be a CPU torch.float32 tensor \[4\]; got cpu torch.float64"),
    (dict(scale=torch.ones(3)), r"scale must be a CPU torch.float32 tensor \[4\]; got cpu torch.float32 \[3\]"),
    (dict(scale=None), r"scale must be a torch.float32 tensor \[4\]; got NoneType"),
    (dict(k=0), r"k=0 must be an int in 1\.\."),
])
def test_the_checked_gemv_names_what_is_wrong(case, match):
    q, scale = _int8_layout()
    args = dict(fmt="int8", x=torch.zeros(2, 64), codes=q, k=64, scale=scale)
    args.update(case)
    fmt, x, codes, k = args.pop("fmt"), args.pop("x"), args.pop("codes"), args.pop("k")
    with pytest.raises(ValueError, match=match):
        cpu_gemv.gemv(fmt, x, codes, k, **args)


def test_the_checked_calls_take_what_the_layers_store():
    q, scale = _int8_layout()
    x = torch.randn(3, 64)
    assert torch.equal(cpu_gemv.gemv("int8", x, q, 64, scale=scale),
                       cpu_gemv.gemv_unchecked("int8", x, q, 64, scale=scale))
    packed, d = torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(4, 3).half()
    with pytest.raises(ValueError, match=r"q4: m must be a CPU torch.float16 tensor \[4, 3\]"):
        cpu_gemv.dequantize("q4", packed, 96, d=d, m=d[:, :2], group_size=32)
    with pytest.raises(ValueError, match="q4: group_size=0 must be a multiple of 32"):
        cpu_gemv.dequantize("q4", packed, 96, d=d, m=d, group_size=0)
    assert cpu_gemv.dequantize("q4", packed, 96, d=d, m=d, group_size=32).shape == (4, 96)


@pytest.mark.parametrize("group_size", [0, -32, 48, 64])       # 64 does not divide K = 96
def test_the_c_functions_refuse_a_bad_group_size_themselves(group_size):
    # past the Python checks (the unchecked calls): C must not divide by 0 or read past d
    packed, d = torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(4, 3).half()
    with pytest.raises(ValueError, match=f"group_size={group_size} \\(code -1\\)"):
        cpu_gemv.dequantize_unchecked("q4", packed, 96, d=d, m=d, group_size=group_size)
    with pytest.raises(ValueError, match=f"group_size={group_size} \\(code -1\\)"):
        cpu_gemv.gemv_unchecked("q4", torch.zeros(1, 96), packed, 96, d=d, m=d,
                                group_size=group_size)


def _every_format(w: torch.Tensor):
    """w in each stored layout: (int8 q, scale), (q4 packed, codes, d, m), (q8_0 q, d), (fp8, scale)."""
    codes, d, mn = formats.group_quantize(w, bits=4, group_size=32)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return (formats.int8_quantize(w), (packed, codes, d.half(), mn.half()),
            formats.q8_0_quantize(w), formats.fp8_quantize(w))


def test_the_plain_c_loops_agree_with_the_vector_path(tmp_path, monkeypatch):
    # the portable build (no -march=native: no AVX2 on x86-64) is what runs on other CPUs
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path))
    lib = cpu_gemv._open(cpu_gemv._build(cpu_gemv._compiler(), native=False))
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(21, 96, generator=g), torch.randn(3, 96, generator=g)
    (q, scale), (packed, codes, d, mn), (q8, d8), (w8, s8) = _every_format(w)
    refs = [x @ formats.int8_dequantize(q, scale).T, x @ formats.group_dequantize(codes, d, mn).T,
            x @ formats.q8_0_dequantize(q8, d8).T, x @ formats.fp8_dequantize(w8, s8).T]

    def run():
        return [cpu_gemv.int8_gemv(x, q, scale), cpu_gemv.q4_gemv(x, packed, d, mn, 32),
                cpu_gemv.q8_0_gemv(x, q8, d8), cpu_gemv.fp8_gemv(x, w8, s8)]

    fast = run()
    monkeypatch.setitem(cpu_gemv._LIB, "lib", lib)
    if platform.machine() == "x86_64":
        assert lib.llmlab_vector_width() == 1, "the portable build took the AVX2 path"
    plain = run()
    for name, ref, a, b in zip(["int8", "q4", "q8_0", "fp8"], refs, fast, plain):
        assert _rel(a, ref) < 1e-5 and _rel(b, ref) < 1e-5, name
    assert torch.equal(cpu_gemv.dequantize("q4", packed, 96, d=d, m=mn, group_size=32),
                       formats.group_dequantize(codes, d, mn))
    assert torch.equal(cpu_gemv.dequantize("fp8", w8, 96, scale=s8), formats.fp8_dequantize(w8, s8))
    assert torch.equal(cpu_gemv.dequantize("q8_0", q8, 96, d=d8), formats.q8_0_dequantize(q8, d8))


def test_fp8_decodes_every_finite_code_exactly():
    # one row per code: x = e_k picks column k, so y is the decoded weight itself
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                         # e4m3fn's NaNs
    w8 = codes.view(torch.float8_e4m3fn).reshape(1, -1).contiguous()
    x = torch.eye(w8.shape[1])
    y = cpu_gemv.fp8_gemv(x, w8, torch.ones(1))[:, 0]
    assert torch.equal(y, w8.float()[0]), (y - w8.float()[0]).abs().max()


def test_dequantize_is_bit_for_bit_the_pytorch_formats():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(23, 96, generator=g)
    w[0, :4] = torch.tensor([1e-9, -3e-7, 0.0, 4.0])
    (q, scale), (packed, codes, d, mn), (q8, d8), (w8, s8) = _every_format(w)
    pairs = {
        "int8": (cpu_gemv.dequantize("int8", q, 96, scale=scale), formats.int8_dequantize(q, scale)),
        "q4": (cpu_gemv.dequantize("q4", packed, 96, d=d, m=mn, group_size=32),
               formats.group_dequantize(codes, d, mn)),
        "q8_0": (cpu_gemv.dequantize("q8_0", q8, 96, d=d8), formats.q8_0_dequantize(q8, d8)),
        "fp8": (cpu_gemv.dequantize("fp8", w8, 96, scale=s8), formats.fp8_dequantize(w8, s8)),
    }
    for name, (got, want) in pairs.items():
        assert torch.equal(got, want), f"{name}: max |diff| {(got - want).abs().max():.1e}"
    # int8 with K not a multiple of 16 (the scalar tail)
    q7, s7 = formats.int8_quantize(torch.randn(5, 21, generator=g))
    assert torch.equal(cpu_gemv.dequantize("int8", q7, 21, scale=s7), formats.int8_dequantize(q7, s7))


# -- the build cache: load only what this user built -----------------------------------------
def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_cache_loads_only_a_library_this_user_owns_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path))
    cc = cpu_gemv._compiler()
    lib = cpu_gemv._build(cc, native=False)
    cache = tmp_path / "kernels"
    assert lib.parent == cache and _mode(cache) == 0o700
    assert _mode(lib) & 0o022 == 0 and os.lstat(lib).st_uid == os.getuid()
    built = os.lstat(lib).st_ino
    assert cpu_gemv._build(cc, native=False) == lib and os.lstat(lib).st_ino == built   # cached

    os.chmod(lib, 0o777)                          # anyone could have swapped its code
    assert cpu_gemv._build(cc, native=False) == lib
    assert os.lstat(lib).st_ino != built and _mode(lib) & 0o022 == 0         # rebuilt

    planted = tmp_path / "planted.so"             # a link to a library someone else chose
    planted.write_bytes(lib.read_bytes())
    lib.unlink()
    lib.symlink_to(planted)
    assert cpu_gemv._build(cc, native=False) == lib and not lib.is_symlink()

    os.chmod(cache, 0o777)                        # the directory too: tightened before use
    cpu_gemv._build(cc, native=False)
    assert _mode(cache) == 0o700
    assert cpu_gemv._open(lib).llmlab_vector_width() in (1, 8)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="giving a file to another user needs root")
def test_the_cache_rebuilds_a_library_another_user_owns(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path))
    cc = cpu_gemv._compiler()
    lib = cpu_gemv._build(cc, native=False)
    os.chown(lib, 65534, 65534)
    assert cpu_gemv._build(cc, native=False) == lib and os.lstat(lib).st_uid == 0
    # a cache directory that belongs to someone else is not used at all
    os.chown(tmp_path / "kernels", 65534, 65534)
    elsewhere = cpu_gemv._build(cc, native=False)
    assert elsewhere.parent != tmp_path / "kernels" and _mode(elsewhere.parent) == 0o700


def test_a_compiler_that_hangs_is_stopped(tmp_path, monkeypatch):
    hang = tmp_path / "cc"
    hang.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo hanging-cc; exit 0; fi\n'
                    "exec sleep 30\n")
    hang.chmod(0o755)
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_gemv, "COMPILE_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match=r"no answer within 0.5 s"):
        cpu_gemv._build(str(hang), native=False)
    assert not [p for p in (tmp_path / "cache" / "kernels").iterdir()]    # no half-written file


def _op_inputs(m: int, n: int, k: int, seed: int):
    """x [m, k] and each format's operator arguments for one random W [n, k]."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    (q, scale), (packed, _, d, mn), (q8, d8), (w8, s8) = _every_format(w)
    return x, {"int8": (q, scale), "q4": (packed, d, mn, 32), "q8_0": (q8, d8),
               "fp8": (w8, s8), "f32": (w,)}


@pytest.mark.parametrize("m, n, k", [(1, 37, 64), (3, 21, 96), (9, 130, 576)])
def test_the_operators_run_the_c_kernels_in_cpp_where_a_cpp_compiler_works(m, n, k):
    """The gemv operators' CPU kernels are cpu_gemv_ops.cpp's (3 µs a call, not the Python
    kernel's 9) and give exactly what the C function gives through ctypes; strided and
    batched x included."""
    dump = torch._C._dispatch_dump("llmlab::f32_gemv")
    cpu = next(line for line in dump.splitlines() if line.startswith("CPU:"))
    if cpu_gemv._cxx_compiler() is None:
        assert "no C++ compiler" in cpu_gemv.describe() and "cpu_gemv_ops" not in cpu
        return
    assert "operators: C++ kernels" in cpu_gemv.describe() and "cpu_gemv_ops.cpp" in cpu, cpu
    x, args = _op_inputs(m, n, k, seed=m * n + k)
    for fmt, others in args.items():
        op = cpu_gemv.GEMV_OPS[fmt]
        direct = cpu_gemv._GEMV_KERNELS[fmt][1](x, *others)    # the Python kernel: ctypes
        assert torch.equal(op(x, *others), direct), fmt
        strided = torch.cat([x, x], dim=1)[:, ::2]                 # not contiguous: copied
        assert torch.equal(op(strided, *others), op(strided.contiguous(), *others)), fmt
        batched = op(x.expand(2, m, k), *others)                   # [..., K]: 2m rows
        assert batched.shape == (2, m, n), fmt
        assert torch.equal(batched.reshape(2 * m, n), op(torch.cat([x, x]), *others)), fmt
        with pytest.raises(ValueError, match=rf"_gemv: x must be float32 \[\.\.\., {k}\]; "
                                             rf"got Float \[{m}, {k - 1}\]"):
            op(x[:, :k - 1].contiguous(), *others)
        with pytest.raises(ValueError, match="x must be float32"):
            op(x.double(), *others)
    packed, d, mn, _ = args["q4"]
    with pytest.raises(ValueError, match=r"group_size=48 \(code -1\)"):     # refused in C
        cpu_gemv.GEMV_OPS["q4"](x, packed, d, mn, 48)


def test_without_the_cpp_kernels_the_operators_keep_python_ones():
    import subprocess
    import sys
    code = ("import torch; from llmlab.kernels import cpu_gemv as c; c.available(); "
            "print(c.describe()); x, w = torch.randn(2, 40), torch.randn(5, 40); "
            "print(torch.equal(c.GEMV_OPS['f32'](x, w), c.gemv_unchecked('f32', x, w, 40)), "
            "c.skips_dispatcher(x), 'cpu_gemv.py' in torch._C._dispatch_dump('llmlab::f32_gemv')"
            ".split('CPU:')[1].splitlines()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "LLMLAB_CPU_GEMV_OPS": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    describe, result = out.stdout.splitlines()[-2:]
    assert "Python kernels (C++ kernels turned off by LLMLAB_CPU_GEMV_OPS=0)" in describe
    assert result == "True True True"
