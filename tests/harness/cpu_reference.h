// The CPU implementation as the GPU programs' reference: a plain triple-loop sgemm (the programs run where
// scipy-openblas32 may be absent, and the reference's speed does not matter) and detached threads as the pool.
#pragma once

#include <thread>

#include "cpu/attention_cpu.h"

namespace jax_flash::harness {

// Row-major C = alpha op(A) op(B) + beta C (C is not read when beta = 0), as cblas_sgemm.
inline void naive_sgemm(int /*order: row-major*/, int trans_a, int trans_b, int m, int n, int k, float alpha,
                        const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float dot = 0.0f;
      for (int x = 0; x < k; ++x) {
        const float a_ix = trans_a == cpu::kTrans ? a[static_cast<int64_t>(x) * lda + i] : a[int64_t{i} * lda + x];
        const float b_xj = trans_b == cpu::kTrans ? b[static_cast<int64_t>(j) * ldb + x] : b[int64_t{x} * ldb + j];
        dot += a_ix * b_xj;
      }
      float& out = c[int64_t{i} * ldc + j];
      out = beta == 0.0f ? alpha * dot : alpha * dot + beta * out;
    }
  }
}

inline CpuRuntime reference_runtime(int threads = 8) {
  return CpuRuntime{naive_sgemm, [](std::function<void()> task) { std::thread(std::move(task)).detach(); },
                    threads};
}

}  // namespace jax_flash::harness
