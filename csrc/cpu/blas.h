// The matrix products of the CPU attention come from OpenBLAS, loaded at run time from the scipy-openblas32 wheel
// (the build needs no BLAS headers or libraries; OpenBLAS picks its kernels for the processor when it loads).
#pragma once

#include <string>

namespace jax_flash::cpu {

// Row-major C = alpha op(A) op(B) + beta C with the cblas_sgemm signature (enums as int: 101 row-major, 111 no
// transpose, 112 transpose; 32-bit integers as in an LP64 OpenBLAS).
using SgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc);
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

// Loads the OpenBLAS shared library at `path` (once; later calls with any path return the first result) and sets
// its own thread count to 1: the attention runs one product per worker thread, and a threaded OpenBLAS would
// serialise concurrent callers on its level-3 lock. Returns OpenBLAS's name for the kernels it chose ("Haswell",
// "SkylakeX", ...). Throws std::runtime_error naming the path and the loader's message on failure.
std::string load_openblas(const std::string& path);

// The loaded sgemm, or nullptr before a successful load_openblas.
SgemmFn openblas_sgemm();

}  // namespace jax_flash::cpu
