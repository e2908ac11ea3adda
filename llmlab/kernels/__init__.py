"""Triton kernels and the CPU decode kernels in C; each module states its layouts and limits.

    flash_attn   FlashAttention-2 style forward, dense and varlen (notebook 03)
    paged_attn   attention over a paged KV pool through a block table (notebook 04)
    moe_gemm     grouped GEMM for MoE dispatch, one GEMM per expert (notebook 06)
    quant_gemm   weight-only int8 / int4 GEMM, dequantized in registers (notebook 08)
    cpu_gemv     the CPU's decode kernels for the same formats, in C (cpu_gemv.c; AVX2/FMA,
                 float32 activations), built on first use with the machine's compiler
    report       every kernel built for A100/H100 without a GPU: registers, spills,
                 shared memory, occupancy, tensor-core instructions

Kept free of imports, so that importing a sibling module stays cheap.
"""
