// What both CPU handlers (forward and backward) take from XLA before they compute: the element type, the tile
// sizes, the loaded OpenBLAS and the intra-op thread pool, each checked with a clear error.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "cpu/attention_cpu.h"
#include "ffi/attention_attrs.h"
#include "ffi/validate.h"

namespace jax_flash {

// The element type of q (float16, bfloat16, float32) and valid tiles, or the error.
inline std::optional<ffi::Error> cpu_element(const ffi::AnyBuffer& q, const AttentionAttrs& attrs, CpuElement& out) {
  switch (q.element_type()) {
    case ffi::DataType::F16: out = CpuElement::kFloat16; break;
    case ffi::DataType::BF16: out = CpuElement::kBFloat16; break;
    case ffi::DataType::F32: out = CpuElement::kFloat32; break;
    default: return invalid("the CPU handler supports float16, bfloat16 and float32 inputs");
  }
  if (attrs.block_q < 1 || attrs.block_kv < 1 || attrs.block_q > 4096 || attrs.block_kv > 4096) {
    return invalid("block_q and block_kv must be in [1, 4096]; got " + std::to_string(attrs.block_q) + " and " +
                   std::to_string(attrs.block_kv));
  }
  return std::nullopt;
}

// OpenBLAS and XLA's threads as a CpuRuntime, or the error when OpenBLAS is not loaded. The caller works too:
// XLA's pool threads take the other workers' tasks (or the caller runs them itself). The runtime holds a reference
// to thread_pool: use it inside the handler only.
inline std::optional<ffi::Error> cpu_runtime(ffi::ThreadPool& thread_pool, CpuRuntime& out) {
  out.sgemm = cpu::openblas_sgemm();
  if (out.sgemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash's CPU attention needs OpenBLAS from the scipy-openblas32 package, and it is not "
                      "loaded (importing jax_flash loads it; install it with `pip install scipy-openblas32`)");
  }
  const int64_t pool_threads = thread_pool.num_threads();
  out.num_threads = static_cast<int>(std::clamp<int64_t>(pool_threads, 1, 1024));
  if (pool_threads > 1) {
    out.schedule = [&thread_pool](std::function<void()> task) { thread_pool.Schedule(std::move(task)); };
  }
  return std::nullopt;
}

}  // namespace jax_flash
