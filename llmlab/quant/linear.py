"""Quantized drop-in replacements for ``nn.Linear`` and the (tied) token embedding.

Each layer stores its weight in a quantized format (:mod:`llmlab.quant.formats`) and has
these forward paths, chosen per call (:func:`use_kernels`):

* the **reference**: dequantize the whole weight to float32 (in PyTorch), then ``F.linear``.
  Clear; it reads more bytes than float32 itself, so it is no help to decode, but for many
  rows (prefill, the quality evaluation) it is a float32 GEMM plus one pass over the
  weight, and that is what runs there, with the weight from the C dequantizer (bit for bit
  the same, several times faster) where it is built;
* the **C decode kernels** (CPU, up to ``GEMV_MAX_ROWS`` rows): :mod:`llmlab.kernels.cpu_gemv`
  reads the small codes and widens them in registers, with float32 activations, so a decode
  step reads 1 byte (int8) or about 0.6 (4-bit) per weight instead of 4, and its answer is
  the reference's up to the order of the additions. The layers call them as torch operators
  (``torch.ops.llmlab.int8_gemv``, ``q4_gemv``, ... and ``dequantize``), so
  ``torch.compile`` traces a quantized model's decode step into one graph;
* **PyTorch's packed kernels** (``torch._weight_int8pack_mm``,
  ``aten._weight_int4pack_mm_for_cpu``): the fallback where no C compiler is found, and
  ``use_kernels("torch")``. They are fast only with bfloat16 activations (their float32
  paths are slower than a dense float32 matmul), so the layer rounds its input to bfloat16
  and widens the output.

On CUDA the int8 and 4-bit layers run the Triton dequantize-in-GEMM kernel instead
(:mod:`llmlab.kernels.quant_gemm`, on the same stored codes and scales).

``Q8_0Linear`` is GGUF's Q8_0, the shipped embedding's type (for PyTorch's kernels it is
written as two 4-bit digits per code). ``SharedProjection`` computes several projections
of one input (q/k/v, gate/up) with one call.

Taught in notebook 08.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_gemv
from . import formats

_KERNELS = {"mode": "auto"}
KERNEL_MODES = ("auto", "torch", "off")
INT4_KERNEL_GROUPS = (32, 64, 128, 256)     # group sizes PyTorch's CPU int4 kernel accepts
GEMV_MAX_ROWS = 8     # up to this many rows (decode) the C kernels run; more: dequantize + matmul


@contextlib.contextmanager
def use_kernels(enabled: bool | str = True):
    """Within the block, quantized layers on the CPU take these paths:

    * ``True`` or ``"auto"`` (the default outside any block): up to ``GEMV_MAX_ROWS`` rows,
      the C decode kernels (float32 activations, :mod:`llmlab.kernels.cpu_gemv`), or
      PyTorch's packed kernels where no C compiler is found; more rows (prefill), the
      reference (dequantize, then a float32 matmul);
    * ``"torch"``: PyTorch's packed kernels at every size (bfloat16 activations);
    * ``False`` or ``"off"``: the reference everywhere.

    On CUDA every mode but ``"off"`` runs the Triton kernel.
    """
    mode = {True: "auto", False: "off"}.get(enabled, enabled)
    if mode not in KERNEL_MODES:
        raise ValueError(f"use_kernels({enabled!r}): allowed True, False or one of {list(KERNEL_MODES)}")
    old = _KERNELS["mode"]
    _KERNELS["mode"] = mode
    try:
        yield
    finally:
        _KERNELS["mode"] = old


def _cpu_path(x: torch.Tensor) -> str:
    """Which CPU path a quantized layer takes for x: "c" (the C decode kernels), "torch"
    (PyTorch's packed kernels, bfloat16 activations), "dequant" (many rows: dequantize, then
    a float32 matmul) or "reference" (kernels off)."""
    mode = _KERNELS["mode"]
    if mode != "auto":
        return "torch" if mode == "torch" else "reference"
    built = x.dtype is torch.float32 and cpu_gemv.available()
    if x.numel() > GEMV_MAX_ROWS * x.shape[-1]:
        return "dequant" if built else "reference"
    return "c" if built and x.is_contiguous() else "torch"


def _as_2d(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class QuantizedLinear(nn.Module):
    """Base class: ``y = x Wᵀ`` with W stored quantized; x [..., in] -> y [..., out] (float32)."""

    scheme = "?"

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer stands for."""
        raise NotImplementedError

    def weight_nbytes(self) -> int:
        """Bytes of the stored format (codes plus scales), what a decode step reads."""
        raise NotImplementedError

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.dequantized_weight())

    def rounds_activations(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` rounds x to 16 bits (PyTorch's packed CPU kernels, or a
        16-bit x on CUDA). Where it does not, the output is the float32 product with the
        dequantized weight, up to the order of the additions."""
        if x.is_cuda:
            return x.dtype is not torch.float32 and _KERNELS["mode"] != "off"
        return _cpu_path(x) == "torch"

    def c_layout(self) -> tuple[str, torch.Tensor, dict] | None:
        """(format, codes, other stored tensors) as :mod:`llmlab.kernels.cpu_gemv` takes
        them, or None where its kernels do not take this layer. The dict lists the others
        by the names, and in the order, of the format's operator
        (``cpu_gemv.GEMV_OPS[format](x, codes, *others.values())``)."""
        return None

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """PyTorch's packed CPU kernel's answer (bfloat16 activations), or None."""
        return None

    def cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The Triton kernel's answer on CUDA, or None."""
        return None

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """A kernel's answer (see :func:`use_kernels`: the C decode kernel, the C dequantizer
        and a float32 matmul, PyTorch's packed kernel or, on CUDA, Triton's), or None where
        the reference is the path."""
        if x.is_cuda:
            return self.cuda_forward(x)
        path = _cpu_path(x)
        if path == "torch":
            return self.torch_forward(x)
        layout = self.c_layout() if path != "reference" else None
        if layout is None:
            return None
        fmt, codes, stored = layout
        if path == "c":                    # positional: a keyword costs the dispatcher time
            if cpu_gemv.skips_dispatcher(x):   # Python op kernels: call C, 1.8 µs sooner
                return cpu_gemv.gemv_unchecked(fmt, x, codes, self.in_features, **stored)
            return cpu_gemv.GEMV_OPS[fmt](x, codes, *stored.values())
        get = stored.get
        w = cpu_gemv.dequantize_op(fmt, codes, self.in_features, get("scale"), get("d"),
                                   get("m"), get("group_size", 32))
        return F.linear(x, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _KERNELS["mode"] != "off" and x.device.type in ("cpu", "cuda"):   # CUDA: Triton
            y = self.kernel_forward(x)
            if y is not None:
                return y
        return self.reference_forward(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class Int8Linear(QuantizedLinear):
    """Symmetric int8 weight, one float32 scale per output channel."""

    scheme = "int8"

    def __init__(self, weight: torch.Tensor):
        self._store(*formats.int8_quantize(weight))

    def _store(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        QuantizedLinear.__init__(self, q.shape[1], q.shape[0])
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        # the kernel's own scales are bfloat16 (8 significant bits): give it ones and apply
        # the float32 scales to its output instead (one multiply that also widens it)
        self.register_buffer("unit_bf16", torch.ones_like(scale, dtype=torch.bfloat16),
                             persistent=False)

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor) -> "Int8Linear":
        """The layer for given codes (int8 [out, in]) and scales ([out]), stored as they are
        (no re-quantization): for codes chosen another way, e.g. by GPTQ."""
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
            got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be an int8 matrix [out_features, in_features]; got {got}")
        if (not isinstance(scale, torch.Tensor) or not scale.is_floating_point()
                or tuple(scale.shape) != (q.shape[0],)):
            got = (f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
                   else type(scale).__name__)
            raise ValueError(f"scale must be a floating-point vector [{q.shape[0]}] (one per "
                             f"output row of q); got {got}")
        layer = cls.__new__(cls)
        layer._store(q.detach().contiguous(), scale.detach().float().contiguous())
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        return formats.int8_dequantize(self.qweight, self.scale)

    def weight_nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` of the weight (the embedding lookup of a tied table)."""
        return self.qweight[ids].float() * self.scale[ids][..., None]

    def c_layout(self):
        b = self._buffers                   # not Module.__getattr__: this runs 120 times a step
        return "int8", b["qweight"], {"scale": b["scale"]}

    def cuda_forward(self, x):
        from ..kernels.quant_gemm import int8_gemm
        return int8_gemm(x, self.qweight, self.scale).float()

    def torch_forward(self, x):
        x2, lead = _as_2d(x)
        y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self.unit_bf16)
        return torch.mul(y, self.scale).reshape(*lead, self.out_features)


class GroupLinear(QuantizedLinear):
    """Group-wise asymmetric 4-bit weight: w = q·d + m per group of ``group_size`` inputs.

    ``q4_1=True`` makes the groups GGUF Q4_1 blocks (32 inputs, codes by llama.cpp's
    rounding); otherwise any group size, codes rounded to nearest. d and m are float16.
    The codes are kept packed two per byte; the CPU kernel's own packing is built once.
    """

    def __init__(self, weight: torch.Tensor, group_size: int = 32, q4_1: bool = False):
        super().__init__(weight.shape[1], weight.shape[0])
        self.group_size = formats.Q4_1_BLOCK if q4_1 else group_size
        self.scheme = "q4_1" if q4_1 else "int4"
        if q4_1:
            b = formats.q4_1_quantize(weight)
            codes, d, m = b.codes(), b.d, b.m
        else:
            codes, d, m = formats.group_quantize(weight, bits=4, group_size=group_size)
            # stored in float16 like Q4_1's (4 bytes per group); codes were rounded with the
            # float32 step, as llama.cpp does
            d, m = d.to(torch.float16), m.to(torch.float16)
        self.register_buffer("packed_codes", codes[:, 0::2] | (codes[:, 1::2] << 4))
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self._kernel_weight = None   # (packed int4 weight, scales_and_zeros), built on first use

    def codes(self) -> torch.Tensor:
        lo, hi = self.packed_codes & 0x0F, self.packed_codes >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        return formats.group_dequantize(self.codes(), self.d, self.m)

    def weight_nbytes(self) -> int:
        return (self.packed_codes.numel() + self.d.numel() * self.d.element_size()
                + self.m.numel() * self.m.element_size())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` of the weight (the embedding lookup of a tied table)."""
        pc = self.packed_codes[ids]
        codes = torch.stack([pc & 0x0F, pc >> 4], dim=-1).reshape(*ids.shape, -1, self.group_size)
        w = codes.float() * self.d[ids].float()[..., None] + self.m[ids].float()[..., None]
        return w.reshape(*ids.shape, self.in_features)

    def _build_kernel_weight(self):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
        # the kernel computes w = (q - 8)·scale + zero, so zero = m + 8·d
        d, m = self.d.float(), self.m.float()
        sz = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        self._kernel_weight = (packed, sz.to(torch.bfloat16))

    def c_layout(self):
        if self.group_size % 32:            # the C kernels read groups of 32 codes at a time
            return None
        b = self._buffers
        return "q4", b["packed_codes"], {"d": b["d"], "m": b["m"], "group_size": self.group_size}

    def cuda_forward(self, x):
        from ..kernels.quant_gemm import int4_gemm
        return int4_gemm(x, self.packed_codes, self.d, self.m, self.group_size).float()

    def torch_forward(self, x):
        if self.group_size not in INT4_KERNEL_GROUPS:
            return None
        if self._kernel_weight is None:
            self._build_kernel_weight()
        packed, sz = self._kernel_weight
        x2, lead = _as_2d(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), packed,
                                                       self.group_size, sz)
        return y.float().reshape(*lead, self.out_features)


class Q8_0Linear(QuantizedLinear):
    """GGUF Q8_0: int8 codes with a float16 scale per block of 32 inputs (34 bytes per 32
    weights). SmolLM2's file stores the tied embedding in this type, so here it is exact.

    The C decode kernel reads this layout as it is. PyTorch has no CPU kernel for
    block-scaled int8, so its path writes every code
    as two 4-bit digits, q = 16·hi + lo with hi in [-8, 7] and lo in [0, 15], and runs the
    4-bit group kernel once over [W_hi | W_lo] (scales 16·d and d) against [x | x]: the same
    weights, up to the kernel's bfloat16 scales, at 40 bytes per 32 weights read.
    """

    scheme = "q8_0"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        q, d = formats.q8_0_quantize(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("d", d)
        self._kernel_weight = None

    def dequantized_weight(self) -> torch.Tensor:
        return formats.q8_0_dequantize(self.qweight, self.d)

    def weight_nbytes(self) -> int:
        return self.qweight.numel() + self.d.numel() * 2

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``ids`` of the weight (the embedding lookup of a tied table)."""
        q = self.qweight[ids].reshape(*ids.shape, -1, formats.Q4_1_BLOCK).float()
        return (q * self.d[ids].float()[..., None]).reshape(*ids.shape, self.in_features)

    def _build_kernel_weight(self):
        q = self.qweight.to(torch.int32)
        hi, lo = q >> 4, q & 0x0F                 # arithmetic shift: q = 16·hi + lo
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat([hi + 8, lo], 1), 1)
        d = self.d.float()
        # the kernel computes (code - 8)·scale + zero per group: hi groups (16d, 0), lo (d, 8d)
        scale = torch.cat([16 * d, d], dim=1)
        zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self._kernel_weight = (packed, sz.to(torch.bfloat16))

    def c_layout(self):
        b = self._buffers
        return "q8_0", b["qweight"], {"d": b["d"]}

    def torch_forward(self, x):
        if self._kernel_weight is None:
            self._build_kernel_weight()
        packed, sz = self._kernel_weight
        x2, lead = _as_2d(x)
        xb = x2.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([xb, xb], dim=-1), packed,
                                                       formats.Q4_1_BLOCK, sz)
        return y.float().reshape(*lead, self.out_features)


class FP8Linear(QuantizedLinear):
    """float8 e4m3 weight, one float32 scale per output channel. On the CPU the C decode
    kernel reads it (one byte per weight, widened to float32 in registers; PyTorch has no
    float8 CPU matmul); elsewhere the reference. On H100-class GPUs it is a tensor-core
    type, which this layer does not use."""

    scheme = "fp8"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        w8, scale = formats.fp8_quantize(weight)
        self.register_buffer("w8", w8)
        self.register_buffer("scale", scale)

    def dequantized_weight(self) -> torch.Tensor:
        return formats.fp8_dequantize(self.w8, self.scale)

    def weight_nbytes(self) -> int:
        return self.w8.numel() + self.scale.numel() * 4

    def c_layout(self):
        b = self._buffers
        return "fp8", b["w8"], {"scale": b["scale"]}


class BF16Linear(QuantizedLinear):
    """bfloat16 weight (8 significant bits, float32's range); the kernel path runs the matmul
    in bfloat16 (this CPU has bfloat16 matrix instructions), the reference in float32."""

    scheme = "bf16"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("wbf16", weight.detach().to(torch.bfloat16))

    def dequantized_weight(self) -> torch.Tensor:
        return self.wbf16.float()

    def weight_nbytes(self) -> int:
        return self.wbf16.numel() * 2

    def kernel_forward(self, x):
        return F.linear(x.to(torch.bfloat16), self.wbf16).float()

    def rounds_activations(self, x: torch.Tensor) -> bool:
        return _KERNELS["mode"] != "off"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wbf16[ids].float()


class QuantizedEmbedding(nn.Module):
    """A token embedding that reads its rows from a quantized [vocab, hidden] linear (the
    tied lm_head), so the table is stored once: ids [...] -> vectors [..., hidden]."""

    def __init__(self, table: QuantizedLinear):
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


class SharedProjection(nn.Module):
    """Several projections of one input (q, k and v; or gate and up) as one packed matmul.

    ``fused`` is one quantized layer whose output rows are the projections' rows stacked
    (per-row and per-group formats quantize each row alone, so stacking changes no weight).
    Its :attr:`parts` stand where the separate layers stood: the first part called with an
    input computes the whole product, and the other parts, called with the same tensor,
    return their slices of it; the module that calls them is unchanged. One call instead of
    three reads the same bytes but pays the fixed costs of a call (converting the input,
    starting the kernel's threads) once.
    """

    def __init__(self, fused: QuantizedLinear, sizes: list[int]):
        super().__init__()
        if sum(sizes) != fused.out_features:
            raise ValueError(f"part sizes {list(sizes)} must add up to the fused layer's "
                             f"{fused.out_features} outputs")
        self.fused, self.sizes = fused, tuple(sizes)
        self.parts = [ProjectionSlice(self, i) for i in range(len(sizes))]
        # [input, its outputs, parts served]: one plain list, mutated in place, because
        # setting attributes on a Module goes through its (slow) __setattr__
        self._pending = [None, None, set()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Output ``index`` for input ``x``: computed with the others on the first call."""
        pending = self._pending
        if x is not pending[0]:
            pending[:] = x, self.fused(x).split(self.sizes, dim=-1), set()
        y = pending[1][index]
        served = pending[2]
        served.add(index)
        if len(served) == len(self.sizes):             # all parts served: keep nothing
            pending[:] = None, None, set()
        return y

    def extra_repr(self) -> str:
        return f"sizes={list(self.sizes)}"


class ProjectionSlice(nn.Module):
    """Part ``index`` of a :class:`SharedProjection`, in place of one projection layer."""

    def __init__(self, owner: SharedProjection, index: int):
        super().__init__()
        object.__setattr__(self, "owner", owner)      # not a submodule: stored once, by the owner
        self.index = index
        self.in_features, self.out_features = owner.fused.in_features, owner.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.part(self.index, x)

    # Called five times per layer and step: skip Module.__call__'s hook bookkeeping (a slice
    # has no hooks; hooks on the fused layer, which does the work, still run).
    __call__ = forward

    def extra_repr(self) -> str:
        return f"part {self.index} of a shared projection, out_features={self.out_features}"


def top_indices(y: torch.Tensor, k: int, block: int = 128) -> torch.Tensor:
    """Indices of the ``k`` largest values of each row of y [rows, n], in no particular
    order: the same set as ``y.topk(k).indices`` (ties aside), found in two smaller passes.

    Cut each row into blocks of ``block``; a value among the row's k largest lies in one of
    the k blocks with the largest maxima (otherwise k blocks would each hold a larger
    value). So take those k blocks (k·block candidates instead of n) and the k largest
    among them: for SmolLM2's 49,152 logits and k = 64, a third of one full top-k's time.
    Falls back to ``topk`` where n is not a multiple of ``block`` or has fewer than k blocks.
    """
    r, n = y.shape
    if n % block or n // block < k:
        return y.topk(k, dim=-1, sorted=False).indices
    blocks = y.view(r, n // block, block)
    best = blocks.amax(-1).topk(k, dim=-1, sorted=False).indices               # [r, k] blocks
    cand = blocks.gather(1, best[..., None].expand(r, k, block)).view(r, k * block)
    pick = cand.topk(k, dim=-1, sorted=False).indices                          # [r, k]
    return best.gather(1, pick // block) * block + pick % block


class RefinedHead(nn.Module):
    """An output projection whose largest logits are recomputed exactly.

    PyTorch's packed CPU kernels round their input to bfloat16 and return bfloat16, whose 8-bit
    significand puts an error of up to 0.4% of its size on every logit (up to 0.03 on a
    logit of 12). Softmax turns a logit error into a probability error, and the few largest
    logits carry almost all the probability. So: compute all ``vocab`` logits with a fast
    kernel, take the ``top`` largest per row, and recompute those in float32 from the
    dequantized rows of ``head`` (``top`` × hidden multiply-adds, negligible next to
    vocab × hidden). The rest keep the kernel's values. Over the first 1,024 tokens of
    notebook 08's text this takes the int4 model's KLD against float32 from 8.1e-4 to
    3.3e-4 nats/token (top 64), for about 0.2-0.3 ms per decode step on a 2-core CPU.
    Where the head computes in float32 (the C decode kernels, the reference) there is
    nothing to fix, and the head's logits are returned as they are.

    x [..., hidden] -> logits [..., vocab] float32.
    """

    CHUNK = 64        # rows refined at once (bounds the gathered [rows, top, hidden] block)

    def __init__(self, head: QuantizedLinear, top: int = 64):
        super().__init__()
        if not isinstance(top, int) or not 1 <= top <= head.out_features:
            raise ValueError(f"top={top!r} must be an int in [1, {head.out_features}]")
        self.head, self.top = head, top
        self.in_features, self.out_features = head.in_features, head.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        if not self.head.rounds_activations(x):     # the head's logits are float32 already
            return y
        x2, y2 = x.reshape(-1, self.in_features).float(), y.reshape(-1, self.out_features)
        for start in range(0, x2.shape[0], self.CHUNK):
            rows, xs = y2[start:start + self.CHUNK], x2[start:start + self.CHUNK]
            top = top_indices(rows, self.top)                                 # [r, top]
            exact = torch.bmm(self.head.rows(top), xs[:, :, None])[..., 0]   # [r, top]
            rows.scatter_(-1, top, exact)
        return y

    def extra_repr(self) -> str:
        return f"top={self.top}"
