/* Weight-only quantized matrix-vector products for the CPU, float32 activations.
 *
 * y[m, n] = sum_k W[n, k] * x[m, k] for a few rows m (decode: one row per sequence), where
 * W is stored quantized and widened to float32 in registers, never in memory. A decode
 * step reads every weight once, so its time is the bytes read; these loops read the
 * small codes and do exact float32 arithmetic on them (no rounding of x or of the
 * scales), so the answer is the float32 product with the dequantized weight, up to the
 * order of the additions.
 *
 * Layouts (all row-major and contiguous; x [M, K] float32, y [M, N] float32):
 *   int8  q [N, K] int8, scale [N] float32:            W[n,k] = q[n,k] * scale[n]
 *   q4    packed [N, K/2] uint8, d, m [N, K/G] float16: byte j of a row holds the codes of
 *         inputs 2j (low nibble) and 2j+1 (high nibble), codes in [0, 15];
 *         W[n,k] = code[n,k] * d[n, k/G] + m[n, k/G]    (asymmetric groups of G inputs)
 *         (llmlab.quant.linear.GroupLinear's own storage, so no second copy is made)
 *   q8_0  q [N, K] int8, d [N, K/32] float16:          W[n,k] = q[n,k] * d[n, k/32]
 *   fp8   q [N, K] float8 e4m3 (its bytes), scale [N] float32: W[n,k] = e4m3(q[n,k]) * scale[n]
 *   f32   w [N, K] float32 (its bytes):                W[n,k] = w[n,k]   (no widening: the float
 *         model's decode, where MKL's sgemv on SmolLM2's small matrices streams at about half
 *         the rate of these loops; gemv only, nothing to dequantize)
 *
 * Limits: q4 needs G % 32 == 0 and K % G == 0; q8_0 needs K % 32 == 0; int8 and fp8 take
 * any K (fp8: finite codes only).
 * M is any size, but the loops are for small M: a tile of 4 weight rows is widened once per
 * 2 rows of x (its bytes stay in L1 between passes, but the widening is redone), so for
 * large M a blocked GEMM on a dequantized copy is faster.
 *
 * How: the inner step takes 16 weights of each of NR = 4 rows, widens them to float32
 * (int8 and q8_0: sign-extend and convert; q4: zero-extend 8 bytes and split the nibbles;
 * fp8: move the e4m3 bits into a float16 and convert) and multiply-adds them into NR x MT
 * accumulators of 8 lanes. The 16 codes of 8 q4 bytes come out as inputs 0,2,..,14 then
 * 1,3,..,15, so x is first copied with each run of 16 inputs reordered the same way. The
 * group formats sum code * x over a group, then multiply by the group's d once (the tile's
 * d are widened from float16 64 groups at a time); q4's m term is sum_g m_g * (sum of x over
 * g), one short dot product per row at the end. For int8 and one row of x (decode) each
 * accumulator is split in two, so that 8 chains of FMAs are in flight. The codes of the
 * rows PREFETCH_BYTES ahead are prefetched: each call streams a different matrix once.
 * f32 with one row of x skips the tiles: each thread reads its rows one after the other
 * (f32_rows), a single stream the hardware prefetcher keeps ahead of.
 *
 * Vector path: AVX2 + FMA + F16C (8 float32 lanes) when the compiler targets them (it is
 * built with -march=native on the machine that runs it); otherwise plain C loops.
 * Threads: OpenMP over blocks of output rows, nthreads given by the caller.
 * llmlab_dequantize writes the float32 matrix itself, for prefill (see there).
 * Taught in notebook 08.
 */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMLAB_AVX2 1
#include <immintrin.h>
#endif


static float half_to_float(uint16_t h) {
#ifdef LLMLAB_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {                                  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#ifdef LLMLAB_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#define NR 4            /* weight rows per tile */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far ahead of the tile prefetch_rows reads */
#endif
#define DCHUNK 64       /* groups whose d are widened at once into a tile's buffer */
#define NBLOCK 16       /* output rows per unit of parallel work (a multiple of NR) */
#define AI static inline __attribute__((always_inline))

enum { FMT_INT8 = 0, FMT_Q4 = 1, FMT_Q8_0 = 2, FMT_FP8 = 3, FMT_F32 = 4 };
/* one scale per row (f32: none), no groups */
#define PER_ROW(fmt) ((fmt) == FMT_INT8 || (fmt) == FMT_FP8 || (fmt) == FMT_F32)

typedef struct {        /* one quantized weight matrix and its input */
    const float *x;     /* [M, K], reordered per 16 for q4 */
    const uint8_t *w;   /* codes, row_bytes per row */
    const uint16_t *d, *m;  /* float16 [N, K/G] (q4: step and minimum; q8_0: step, G = 32) */
    const float *scale; /* int8: [N] */
    const float *xs;    /* q4: [M, K/G], the sum of x over each group */
    float *y;           /* [M, N] */
    int M, N, K, G, fmt;
    size_t row_bytes, groups;
    int ahead;          /* rows between the tile and the rows prefetch_rows asks for */
} gemv_t;

#ifdef LLMLAB_AVX2
/* the codes of 16 weights [k, k+16) of one row as two vectors of 8 float32 (q4: in the
 * reordered input order); the group's d and m are applied by the caller, once per group */
AI void load_unit(int fmt, const uint8_t *row, int k, __m256 *w0, __m256 *w1) {
    if (fmt == FMT_F32) {
        const float *p = (const float *)row + k;
        *w0 = _mm256_loadu_ps(p);
        *w1 = _mm256_loadu_ps(p + 8);
    } else if (fmt == FMT_FP8) {
        /* e4m3 seeeemmm -> the float16 s0eeeemmm0000000, worth 2^-8 of it (both formats
         * have subnormals, so this holds for every finite value); the 256 goes into the
         * row's scale. x << 8 per 16-bit lane, arithmetic >> 1, clear bit 14. */
        __m128i b = _mm_loadu_si128((const __m128i *)(row + k));
        __m128i mask = _mm_set1_epi16((short)0xBFFF);
        __m128i lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1), mask);
        __m128i hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(_mm_setzero_si128(), b), 1), mask);
        *w0 = _mm256_cvtph_ps(lo);
        *w1 = _mm256_cvtph_ps(hi);
    } else if (fmt == FMT_Q4) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
        *w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
        *w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    } else {
        const int8_t *p = (const int8_t *)row + k;
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    }
}
#endif

/* one dequantized weight (int8: the code; the scalar tail and the plain-C path);
 * for q4, k is in the reordered order */
AI float weight_at(int fmt, const uint8_t *row, const uint16_t *d, const uint16_t *m, int G, int k) {
    if (fmt == FMT_Q4) {
        int base = k & ~15, j = k & 15;           /* reordered: j < 8 low nibbles, else high */
        uint8_t b = row[base / 2 + (j & 7)];
        int code = j < 8 ? (b & 15) : (b >> 4);
        return code * half_to_float(d[k / G]) + half_to_float(m[k / G]);
    }
    if (fmt == FMT_F32) return ((const float *)row)[k];
    if (fmt == FMT_FP8) {                         /* in units of 2^-8, as load_unit */
        uint8_t b = row[k];
        return half_to_float((uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7)));
    }
    float q = (float)((const int8_t *)row)[k];
    return fmt == FMT_Q8_0 ? q * half_to_float(d[k / 32]) : q;
}

/* y[m0 + r, n0 + j] for j < nr, r < mt: rows n0.. of W times rows m0.. of x.
 * Per group: ga = sum over the group of code * x; then acc += d * ga, and (q4) the
 * group's m * (sum of x over the group), from xs. int8 is one group (its scale is per
 * row, applied at the end). */
AI void tile(const gemv_t *g, int fmt, int gc, int n0, int m0, int nr, int mt) {
    const int K = g->K;
    const float *x = g->x + (size_t)m0 * K;
    float out[NR][2];
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < mt; r++) out[j][r] = 0.0f;
    int k = 0;
#ifdef LLMLAB_AVX2
    const int K16 = K & ~15, G = PER_ROW(fmt) ? K16 : gc ? gc : g->G;  /* gc: G known at compile time */
    /* int8, few rows: two accumulators each, so that 8 chains of FMAs are in flight (the
     * group formats have enough other work per group to hide the latency) */
    const int split = PER_ROW(fmt) && nr * mt <= 4;
    __m256 acc[NR][2];
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < mt; r++) acc[j][r] = _mm256_setzero_ps();
    float dg[NR][DCHUNK];                         /* the tile's d, widened DCHUNK groups at a time */
    for (int k0 = 0; G > 0 && k0 < K16; k0 += G) {
        const int gidx = k0 / G;
        if (!PER_ROW(fmt) && gidx % DCHUNK == 0) {
            int cnt = g->groups - gidx < DCHUNK ? (int)g->groups - gidx : DCHUNK;
            for (int j = 0; j < nr; j++) {
                const uint16_t *dr = g->d + ((size_t)n0 + j) * g->groups + gidx;
                int i = 0;
                for (; i + 8 <= cnt; i += 8)
                    _mm256_storeu_ps(&dg[j][i], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr + i))));
                for (; i < cnt; i++) dg[j][i] = _cvtsh_ss(dr[i]);
            }
        }
        __m256 ga[NR][2][2];
        for (int j = 0; j < nr; j++)
            for (int r = 0; r < mt; r++) ga[j][r][0] = ga[j][r][1] = _mm256_setzero_ps();
        for (k = k0; k < k0 + G; k += 16) {
            __m256 x0[2], x1[2];
            for (int r = 0; r < mt; r++) {
                x0[r] = _mm256_loadu_ps(x + (size_t)r * K + k);
                x1[r] = _mm256_loadu_ps(x + (size_t)r * K + k + 8);
            }
            for (int j = 0; j < nr; j++) {
                __m256 w0, w1;
                load_unit(fmt, g->w + ((size_t)n0 + j) * g->row_bytes, k, &w0, &w1);
                for (int r = 0; r < mt; r++) {
                    ga[j][r][0] = _mm256_fmadd_ps(w0, x0[r], ga[j][r][0]);
                    if (split) ga[j][r][1] = _mm256_fmadd_ps(w1, x1[r], ga[j][r][1]);
                    else ga[j][r][0] = _mm256_fmadd_ps(w1, x1[r], ga[j][r][0]);
                }
            }
        }
        for (int j = 0; j < nr; j++)
            for (int r = 0; r < mt; r++) {
                __m256 s = split ? _mm256_add_ps(ga[j][r][0], ga[j][r][1]) : ga[j][r][0];
                if (PER_ROW(fmt)) acc[j][r] = s;
                else acc[j][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dg[j][gidx % DCHUNK]), s, acc[j][r]);
            }
    }
    if (fmt == FMT_Q4)                            /* sum over groups of m * (sum of x) */
        for (int j = 0; j < nr; j++)
            for (int r = 0; r < mt; r++) {
                const uint16_t *mr = g->m + ((size_t)n0 + j) * g->groups;
                const float *xs = g->xs + (size_t)(m0 + r) * g->groups;
                __m256 t = _mm256_setzero_ps();
                size_t i = 0;
                for (; i + 8 <= g->groups; i += 8)
                    t = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mr + i))),
                                        _mm256_loadu_ps(xs + i), t);
                float ts = hsum8(t);
                for (; i < g->groups; i++) ts += _cvtsh_ss(mr[i]) * xs[i];
                out[j][r] += ts;
            }
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < mt; r++) out[j][r] += hsum8(acc[j][r]);
    k = K16;
#endif
    for (; k < K; k++)                            /* int8's tail, or every k in plain C */
        for (int j = 0; j < nr; j++) {
            size_t n = (size_t)n0 + j;
            float w = weight_at(fmt, g->w + n * g->row_bytes, g->d + n * g->groups,
                                g->m + n * g->groups, g->G, k);
            for (int r = 0; r < mt; r++) out[j][r] += w * x[(size_t)r * K + k];
        }
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < mt; r++) {
            float v = out[j][r];
            if (fmt == FMT_INT8) v *= g->scale[n0 + j];
            if (fmt == FMT_FP8) v *= g->scale[n0 + j] * 256.0f;     /* see load_unit */
            g->y[(size_t)(m0 + r) * g->N + n0 + j] = v;
        }
}

/* Call tile with compile-time nr and mt, so its accumulators stay in registers. */
/* Ask for the codes of rows n .. n+NR-1 (PREFETCH_BYTES ahead) before they are needed:
 * each call reads a different matrix of 0.3-2 MB once, from DRAM, and the hardware
 * prefetcher alone does not keep enough reads in flight. */
AI void prefetch_rows(const gemv_t *g, int n) {
#ifdef LLMLAB_AVX2
    if (PREFETCH_BYTES == 0 || n >= g->N) return;
    const char *p = (const char *)g->w + (size_t)n * g->row_bytes;
    size_t len = (size_t)(g->N - n < NR ? g->N - n : NR) * g->row_bytes;
    for (size_t o = 0; o < len; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#else
    (void)g; (void)n;
#endif
}

AI void tiles(const gemv_t *g, int fmt, int gc, int n0, int n1) {
    for (int n = n0; n < n1; n += NR) {
        int nr = n1 - n < NR ? n1 - n : NR;
        int step = PER_ROW(fmt) ? 2 : 1;         /* group formats: ga and acc per row */
        prefetch_rows(g, n + g->ahead);
        for (int m0 = 0; m0 < g->M; m0 += step) {
            int two = step == 2 && g->M - m0 >= 2;
            if (nr == NR) { if (two) tile(g, fmt, gc, n, m0, NR, 2); else tile(g, fmt, gc, n, m0, NR, 1); }
            else for (int j = 0; j < nr; j++) {
                if (two) tile(g, fmt, gc, n + j, m0, 1, 2); else tile(g, fmt, gc, n + j, m0, 1, 1);
            }
        }
    }
}

/* f32, one row of x (batch-1 decode): each thread takes one contiguous run of output rows
 * and reads it front to back, one weight row after the other, so that its reads are a
 * single sequential stream. The tiles' 4 interleaved row streams plus software prefetch
 * reach about 26 GB/s on a 2-core EPYC where this loop reaches about 33 GB/s, what a
 * plain sum over the same bytes reads (nothing is widened, so there is no arithmetic to
 * share across rows; 4 accumulators of 8 lanes keep the FMAs ahead of the loads). */
static void f32_rows(const gemv_t *g, int nthreads) {
    const float *x = g->x;
    const int K = g->K, N = g->N;
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, T = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        T = omp_get_num_threads();
#endif
        int n1 = (int)((long long)N * (t + 1) / T);
        for (int n = (int)((long long)N * t / T); n < n1; n++) {
            const float *r = (const float *)g->w + (size_t)n * K;
            float s = 0.0f;
            int k = 0;
#ifdef LLMLAB_AVX2
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (; k + 32 <= K; k += 32) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r + k), _mm256_loadu_ps(x + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r + k + 8), _mm256_loadu_ps(x + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r + k + 16), _mm256_loadu_ps(x + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r + k + 24), _mm256_loadu_ps(x + k + 24), a3);
            }
            s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
            for (; k < K; k++) s += r[k] * x[k];
            g->y[n] = s;
        }
    }
}

static void run(gemv_t *g, int nthreads) {
    if (g->fmt == FMT_F32 && g->M == 1) {
        f32_rows(g, nthreads);
        return;
    }
    g->ahead = (int)((PREFETCH_BYTES / g->row_bytes + NR - 1) / NR * NR);
    if (g->ahead < NR) g->ahead = NR;
    int nb = (g->N + NBLOCK - 1) / NBLOCK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int b = 0; b < nb; b++) {
        int n0 = b * NBLOCK, n1 = n0 + NBLOCK < g->N ? n0 + NBLOCK : g->N;
        switch (g->fmt) {                         /* one specialised copy per format */
        case FMT_Q4:
            if (g->G == 32) tiles(g, FMT_Q4, 32, n0, n1);     /* Q4_1 and the default int4 */
            else tiles(g, FMT_Q4, 0, n0, n1);
            break;
        case FMT_Q8_0: tiles(g, FMT_Q8_0, 32, n0, n1); break;
        case FMT_FP8: tiles(g, FMT_FP8, 0, n0, n1); break;
        case FMT_F32: tiles(g, FMT_F32, 0, n0, n1); break;
        default: tiles(g, FMT_INT8, 0, n0, n1);
        }
    }
}

/* y = x W^T for any of the formats: fmt 0 int8 (scale), 1 q4 (d, m, G), 2 q8_0 (d),
 * 3 fp8 (scale), 4 f32; pointers a format does not use may be anything valid. Returns 0,
 * -1 for a layout this file does not take (see Limits), -2 when the q4 input copy finds
 * no memory. */
/* The sizes a format takes (see Limits); the group size is what the group formats divide
 * by, so it is checked here as well as in Python: 0 on a valid layout, -1 otherwise. */
static int check_layout(int fmt, int M, int N, int K, int G) {
    if (fmt < FMT_INT8 || fmt > FMT_F32 || M < 0 || N < 0 || K <= 0) return -1;
    if (PER_ROW(fmt)) return 0;
    if (G <= 0 || G % 32 != 0 || K % G != 0) return -1;
    return 0;
}

int llmlab_gemv(int fmt, const float *x, const uint8_t *w, const uint16_t *d, const uint16_t *m,
                const float *scale, float *y, int M, int N, int K, int G, int nthreads) {
    if (fmt == FMT_Q8_0) G = 32;
    if (check_layout(fmt, M, N, K, G)) return -1;
    if (PER_ROW(fmt)) G = 1;
    size_t groups = PER_ROW(fmt) ? 0 : (size_t)K / G;
    gemv_t g = {x, w, d, m, scale, 0, y, M, N, K, G, fmt,
                fmt == FMT_Q4 ? (size_t)K / 2 : fmt == FMT_F32 ? (size_t)K * 4 : (size_t)K,
                groups, 0};
    float *xe = 0, *xs = 0;
    if (fmt == FMT_Q4) {          /* x reordered per run of 16 (see How), and its group sums */
        xe = malloc(sizeof(float) * (size_t)M * K);
        xs = malloc(sizeof(float) * (size_t)M * groups);
        if (!xe || !xs) { free(xe); free(xs); return -2; }
        for (size_t i = 0; i < (size_t)M * K; i += 16)
            for (int j = 0; j < 8; j++) {
                xe[i + j] = x[i + 2 * j];
                xe[i + 8 + j] = x[i + 2 * j + 1];
            }
        for (size_t i = 0; i < (size_t)M * groups; i++) {
            float t = 0.0f;
            for (int j = 0; j < G; j++) t += x[i * G + j];
            xs[i] = t;
        }
        g.x = xe;
        g.xs = xs;
    }
    run(&g, nthreads);
    free(xe);
    free(xs);
    return 0;
}

/* ------------------------------------------------------------------------ dequantize
 * W [N, K] float32 from any of the formats, for many rows of x (prefill), where a float32
 * GEMM on the whole matrix beats re-widening the codes per row. Products and sums are
 * rounded separately (no FMA; built with -ffp-contract=off), so W is bit for bit what
 * llmlab.quant.formats' PyTorch dequantizers give. Returns 0, or -1 for a layout this file
 * does not take (see Limits; a group size that does not divide K, or 0). */
int llmlab_dequantize(int fmt, const uint8_t *w, const uint16_t *d, const uint16_t *m,
                      const float *scale, float *out, int N, int K, int G, int nthreads) {
    if (fmt == FMT_Q8_0) G = 32;
    if (fmt == FMT_F32 || check_layout(fmt, 0, N, K, G)) return -1;
    size_t row_bytes = fmt == FMT_Q4 ? (size_t)K / 2 : (size_t)K;
    size_t groups = fmt == FMT_Q4 ? (size_t)K / G : fmt == FMT_Q8_0 ? (size_t)K / 32 : 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        float *o = out + (size_t)n * K;
        const uint16_t *dn = d + (size_t)n * groups, *mn = m + (size_t)n * groups;
        float s = fmt == FMT_INT8 ? scale[n] : 1.0f;
        int k = 0;
#ifdef LLMLAB_AVX2
        for (; k + 16 <= K; k += 16) {
            __m256 w0, w1;
            load_unit(fmt, row, k, &w0, &w1);
            if (fmt == FMT_Q4) {                  /* codes * d + m, then back to input order */
                __m256 dv = _mm256_set1_ps(_cvtsh_ss(dn[k / G])), mv = _mm256_set1_ps(_cvtsh_ss(mn[k / G]));
                w0 = _mm256_add_ps(_mm256_mul_ps(w0, dv), mv);
                w1 = _mm256_add_ps(_mm256_mul_ps(w1, dv), mv);
                __m256 lo = _mm256_unpacklo_ps(w0, w1), hi = _mm256_unpackhi_ps(w0, w1);
                w0 = _mm256_permute2f128_ps(lo, hi, 0x20);
                w1 = _mm256_permute2f128_ps(lo, hi, 0x31);
            } else {
                __m256 sv = _mm256_set1_ps(fmt == FMT_Q8_0 ? _cvtsh_ss(dn[k / 32]) : s);
                if (fmt == FMT_FP8) {             /* (fp16 value * 256) * scale: one rounding */
                    w0 = _mm256_mul_ps(w0, _mm256_set1_ps(256.0f));
                    w1 = _mm256_mul_ps(w1, _mm256_set1_ps(256.0f));
                    sv = _mm256_set1_ps(scale[n]);
                }
                w0 = _mm256_mul_ps(w0, sv);
                w1 = _mm256_mul_ps(w1, sv);
            }
            _mm256_storeu_ps(o + k, w0);
            _mm256_storeu_ps(o + k + 8, w1);
        }
#endif
        for (; k < K; k++) {
            if (fmt == FMT_Q4) {                  /* natural order: byte k/2, nibble k%2 */
                uint8_t b = row[k / 2];
                float code = (float)(k % 2 ? b >> 4 : b & 15);
                o[k] = code * half_to_float(dn[k / G]) + half_to_float(mn[k / G]);
            } else if (fmt == FMT_FP8) {
                o[k] = weight_at(fmt, row, dn, mn, G, k) * 256.0f * scale[n];
            } else {
                o[k] = weight_at(fmt, row, dn, mn, G, k) * (fmt == FMT_Q8_0 ? 1.0f : s);
            }
        }
    }
    return 0;
}

/* which path this build took: 8 = AVX2/FMA/F16C lanes, 1 = plain C */
int llmlab_vector_width(void) {
#ifdef LLMLAB_AVX2
    return 8;
#else
    return 1;
#endif
}
