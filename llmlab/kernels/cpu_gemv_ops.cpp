/* The decode kernels of cpu_gemv.c as C++ kernels of PyTorch's dispatcher.
 *
 * llmlab::int8_gemv, q4_gemv, q8_0_gemv, fp8_gemv and f32_gemv (and static_attend, at
 * the end of this file) are defined in Python
 * (cpu_gemv.py: schemas, fake kernels, and Python CPU kernels that call the C library
 * through ctypes). Where this file builds, cpu_gemv.py removes those Python CPU kernels
 * and loads this library, whose static registration below puts these in their place;
 * llmlab_ops_init then hands over the C library's llmlab_gemv. A call then goes
 * dispatcher -> C++ -> C, about 3 us on a 2-core CPU, where the Python kernel's route
 * (dispatcher -> Python -> ctypes -> C) costs about 9 us: a float32 SmolLM2 decode step
 * makes 211 of these calls, an int4 one 121.
 *
 * Layouts are cpu_gemv.c's (its header): x [..., K] float32 (made contiguous here),
 * codes [N, row bytes], y [..., N] float32. Like the Python kernels these check only
 * what is cheap (x's dtype and last dimension); the tensors are the quantized layers'
 * own, valid by construction. A layout the C code refuses raises ValueError.
 *
 * Built by cpu_gemv.py with the machine's C++ compiler against the installed torch's
 * headers and libraries (-O3 -march=native, C++20 or else C++17), cached like the C library.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using gemv_fn = int (*)(int fmt, const float *x, const void *w, const void *d, const void *m,
                        const void *scale, float *y, int M, int N, int K, int G, int nthreads);
gemv_fn GEMV = nullptr;

enum Format { INT8 = 0, Q4 = 1, Q8_0 = 2, FP8 = 3, F32 = 4 };  /* cpu_gemv.c's numbers */
const char *NAMES[] = {"int8", "q4", "q8_0", "fp8", "f32"};

/* y = x W^T for format fmt; K = k, N = codes' rows; d, m, scale as the C function takes
 * them (an unused one: any valid pointer, here the codes'). */
at::Tensor gemv(Format fmt, const at::Tensor &x_in, const at::Tensor &codes, int64_t k,
                const void *d, const void *m, const void *scale, int64_t group_size) {
    TORCH_CHECK(GEMV != nullptr, "llmlab::", NAMES[fmt], "_gemv: the C kernels are not loaded");
    TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) == k,
                      "llmlab::", NAMES[fmt], "_gemv: x must be float32 [..., ", k, "]; got ",
                      x_in.scalar_type(), " ", x_in.sizes());
    at::Tensor x = x_in.contiguous();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = codes.size(0);
    at::Tensor y = at::empty(shape, x.options());
    int rc = GEMV(fmt, x.data_ptr<float>(), codes.data_ptr(), d, m, scale, y.data_ptr<float>(),
                  static_cast<int>(x.numel() / k), static_cast<int>(codes.size(0)),
                  static_cast<int>(k), static_cast<int>(group_size), at::get_num_threads());
    TORCH_CHECK(rc != -2, "llmlab::", NAMES[fmt], "_gemv: no memory for the input's copy");
    TORCH_CHECK_VALUE(rc == 0, NAMES[fmt], " gemv refused x ", x.sizes(), ", codes ",
                      codes.sizes(), ", group_size=", group_size, " (code ", rc, ")");
    return y;
}

at::Tensor int8_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale) {
    const void *w = codes.data_ptr();
    return gemv(INT8, x, codes, codes.size(1), w, w, scale.data_ptr(), 32);
}

at::Tensor q4_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &d,
                   const at::Tensor &m, int64_t group_size) {
    return gemv(Q4, x, codes, 2 * codes.size(1), d.data_ptr(), m.data_ptr(), codes.data_ptr(),
                group_size);
}

at::Tensor q8_0_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &d) {
    const void *w = codes.data_ptr();
    return gemv(Q8_0, x, codes, codes.size(1), d.data_ptr(), w, w, 32);
}

at::Tensor fp8_gemv(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale) {
    const void *w = codes.data_ptr();
    return gemv(FP8, x, codes, codes.size(1), w, w, scale.data_ptr(), 32);
}

at::Tensor f32_gemv(const at::Tensor &x, const at::Tensor &w) {
    const void *p = w.data_ptr();
    return gemv(F32, x, w, w.size(1), p, p, p, 32);
}

/* ---------------------------------------------------------------- static_attend
 * llmlab::static_attend(k_cache!, v_cache!, slots, q, k, v): the static KV cache's write and
 * read for one layer (llmlab.cache.static.static_attend is its PyTorch reference and its
 * kernel where this file does not build). Layouts: k_cache, v_cache [batch, kv_heads, S,
 * head_dim] float32 contiguous, written in place; slots [batch, s] int64, where each new
 * token goes (S - 1 is the bin for padding); q [batch, s, heads, head_dim]; k, v [batch, s,
 * kv_heads, head_dim]. Query i of row b sees slot j iff j <= slots[b, i] and j < S - 1.
 *
 * Why a kernel: in a compiled decode step the reference is a functional scatter (Inductor
 * writes each layer's cache into a copy and copies it back) and SDPA over all S slots, of
 * which a decode step of context c fills c. Here the new K/V are written in place and each
 * query reads only its visible slots: softmax(q K^T / sqrt(d)) V in float32, the running
 * maximum subtracted. For one SmolLM2 layer at batch 1 (9 heads, 3 KV heads, 257 slots) on a
 * 2-core EPYC: 6.4 us at 33 positions and 30 us at 256, against 35 us for SDPA over all
 * 257 slots; a compiled int4 step's Inductor loops went from 2.3 to 1.4 ms without the
 * cache copies. Query heads are parallel over
 * torch's threads once the work is worth a fork. */
inline float dot(const float *a, const float *b, int64_t d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};      /* 8 partial sums: the compiler's vectors */
    int64_t x = 0;
    for (; x + 8 <= d; x += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[x + u] * b[x + u];
    float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; x < d; x++) sum += a[x] * b[x];
    return sum;
}

at::Tensor static_attend(const at::Tensor &k_cache, const at::Tensor &v_cache,
                         const at::Tensor &slots_in, const at::Tensor &q_in, const at::Tensor &k_in,
                         const at::Tensor &v_in) {
    TORCH_CHECK_VALUE(k_cache.dim() == 4 && q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4
                      && slots_in.dim() == 2, "llmlab::static_attend: caches, q, k, v must be 4-D "
                      "and slots 2-D; got ", k_cache.sizes(), ", ", q_in.sizes(), ", ",
                      k_in.sizes(), ", ", v_in.sizes(), ", ", slots_in.sizes());
    const int64_t b = q_in.size(0), s = q_in.size(1), h = q_in.size(2), d = q_in.size(3);
    const int64_t kv = k_cache.size(1), S = k_cache.size(2);
    TORCH_CHECK_VALUE(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat
                      && q_in.scalar_type() == at::kFloat && k_cache.is_contiguous()
                      && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
                      "llmlab::static_attend: the caches must be contiguous float32 of one shape "
                      "and q float32; got ", k_cache.scalar_type(), " ", k_cache.sizes(), ", ",
                      v_cache.scalar_type(), " ", v_cache.sizes(), ", q ", q_in.scalar_type());
    TORCH_CHECK_VALUE(S >= 2 && kv > 0 && h % kv == 0 && k_cache.size(0) == b && k_cache.size(3) == d
                      && k_in.sizes() == v_in.sizes() && k_in.size(0) == b && k_in.size(1) == s
                      && k_in.size(2) == kv && k_in.size(3) == d && slots_in.size(0) == b
                      && slots_in.size(1) == s, "llmlab::static_attend: shapes do not match: "
                      "caches ", k_cache.sizes(), ", q ", q_in.sizes(), ", k ", k_in.sizes(),
                      ", slots ", slots_in.sizes());
    at::Tensor q = q_in.contiguous(), k = k_in.to(at::kFloat).contiguous();
    at::Tensor v = v_in.to(at::kFloat).contiguous(), slots = slots_in.to(at::kLong).contiguous();
    float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
    const int64_t *sl = slots.data_ptr<int64_t>();
    const float *kn = k.data_ptr<float>(), *vn = v.data_ptr<float>(), *qp = q.data_ptr<float>();
    int64_t most = 1;                               /* the most slots any query sees */
    for (int64_t r = 0; r < b * s; r++) {
        const int64_t p = sl[r];
        TORCH_CHECK_VALUE(p >= 0 && p < S, "llmlab::static_attend: slot ", p, " outside [0, ", S, ")");
        most = std::max(most, std::min(p, S - 2) + 1);
        for (int64_t g = 0; g < kv; g++) {          /* the write: row r's token into slot p */
            const int64_t src = (r * kv + g) * d, dst = (((r / s) * kv + g) * S + p) * d;
            std::memcpy(kc + dst, kn + src, d * sizeof(float));
            std::memcpy(vc + dst, vn + src, d * sizeof(float));
        }
    }
    at::Tensor out = at::empty({b, s, h, d}, q.options());
    float *op = out.data_ptr<float>();
    const int64_t groups = h / kv, queries = b * s * h;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const int64_t grain = queries * most * d < (1 << 16) ? queries : 1;   /* small: one thread */
    at::parallel_for(0, queries, grain, [&](int64_t lo, int64_t hi) {
        std::vector<float> w(static_cast<size_t>(most));
        for (int64_t i = lo; i < hi; i++) {         /* i = (row * s + t) * h + head */
            const int64_t r = i / h, head = i % h, g = head / groups;
            const int64_t n = std::min(sl[r], S - 2) + 1;
            const float *qi = qp + i * d;
            const float *K = kc + ((r / s) * kv + g) * S * d, *V = vc + ((r / s) * kv + g) * S * d;
            float mx = -std::numeric_limits<float>::infinity(), total = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                w[j] = dot(qi, K + j * d, d) * scale;
                mx = std::max(mx, w[j]);
            }
            float *o = op + i * d;
            std::fill(o, o + d, 0.0f);
            for (int64_t j = 0; j < n; j++) {
                const float e = std::exp(w[j] - mx);
                total += e;
                const float *vj = V + j * d;
                for (int64_t x = 0; x < d; x++) o[x] += e * vj[x];
            }
            const float inv = 1.0f / total;
            for (int64_t x = 0; x < d; x++) o[x] *= inv;
        }
    });
    return out;
}

}  // namespace

/* The C library's llmlab_gemv, from cpu_gemv.py (ctypes) once this library is loaded. */
extern "C" void llmlab_ops_init(void *gemv) { GEMV = reinterpret_cast<gemv_fn>(gemv); }

TORCH_LIBRARY_IMPL(llmlab, CPU, m) {
    m.impl("int8_gemv", &int8_gemv);
    m.impl("q4_gemv", &q4_gemv);
    m.impl("q8_0_gemv", &q8_0_gemv);
    m.impl("fp8_gemv", &fp8_gemv);
    m.impl("f32_gemv", &f32_gemv);
    m.impl("static_attend", &static_attend);
}
