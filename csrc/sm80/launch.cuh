// run_attention_sm80: picks the compile-time variant from runtime facts (can any key block be partly masked? is
// there a softcap?) and launches it: grid, shared-memory opt-in, launch on XLA's stream, error check.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "sm80/api.h"
#include "sm80/kernel.cuh"
#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

template <class T, bool kMaskBlocks, bool kHasSoftcap>
std::string launch_sm80(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = attention_kernel<T, kMaskBlocks, kHasSoftcap>;
  // One 1-D grid of (batch * heads * query blocks): grid.x allows 2^31 - 1, so no axis can overflow the way a
  // (q_blocks, heads, batch) grid's 65535-limited y/z axes would.
  const int64_t num_blocks = static_cast<int64_t>(p.num_q_blocks) * p.heads_q * p.batch;
  if (num_blocks > INT_MAX) {
    return "grid of " + std::to_string(num_blocks) + " thread blocks exceeds 2^31-1; split the batch";
  }
  if constexpr (T::kSmemBytes > 48 * 1024) {
    // Above 48 KB a kernel must opt in, once per device.
    static std::atomic<uint64_t> opted_in_devices{0};
    if (std::string failure = opt_in_shared_memory(kernel, T::kSmemBytes, opted_in_devices); !failure.empty()) {
      return failure;
    }
  }
  kernel<<<static_cast<unsigned>(num_blocks), T::kNumThreads, T::kSmemBytes, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("attention kernel launch", err);
  return {};
}

template <KernelKey kKey>
std::string run_attention_sm80(const AttentionParams& params, cudaStream_t stream) {
  using T = Traits<kKey>;
  AttentionParams p = params;
  p.num_q_blocks = (p.seqlen_q + T::kBlockQ - 1) / T::kBlockQ;
  // Blocks can be partly masked by a window (causal included), kv_lengths, or a ragged last key block.
  const bool mask_blocks = p.window_left < kUnbounded || p.window_right < kUnbounded || p.kv_lengths != nullptr ||
                           p.seqlen_k % T::kBlockKV != 0;
  const bool softcap = p.softcap > 0.0f;
  if (mask_blocks) {
    return softcap ? launch_sm80<T, true, true>(p, stream) : launch_sm80<T, true, false>(p, stream);
  }
  return softcap ? launch_sm80<T, false, true>(p, stream) : launch_sm80<T, false, false>(p, stream);
}

}  // namespace jax_flash::sm80
