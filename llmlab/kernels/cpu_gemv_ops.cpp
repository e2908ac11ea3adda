/* The decode kernels of cpu_gemv.c as C++ kernels of PyTorch's dispatcher.
 *
 * llmlab::int8_gemv, q4_gemv, q8_0_gemv, fp8_gemv and f32_gemv are defined in Python
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
 * headers and libraries (-O2, C++20 or else C++17), cached like the C library.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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

}  // namespace

/* The C library's llmlab_gemv, from cpu_gemv.py (ctypes) once this library is loaded. */
extern "C" void llmlab_ops_init(void *gemv) { GEMV = reinterpret_cast<gemv_fn>(gemv); }

TORCH_LIBRARY_IMPL(llmlab, CPU, m) {
    m.impl("int8_gemv", &int8_gemv);
    m.impl("q4_gemv", &q4_gemv);
    m.impl("q8_0_gemv", &q8_0_gemv);
    m.impl("fp8_gemv", &fp8_gemv);
    m.impl("f32_gemv", &f32_gemv);
}
