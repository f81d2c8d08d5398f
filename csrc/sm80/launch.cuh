// run_attention_sm80: picks the compile-time variant from runtime facts (can any key block be partly masked? is
// there a softcap? segment ids, bias or mask tensors?) and launches it: grid, shared-memory opt-in, launch on XLA's stream, error check; with split
// key ranges, the combine step after it.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "common/mask_blocks.cuh"
#include "common/segment_blocks.cuh"
#include "common/split_combine.cuh"
#include "sm80/api.h"
#include "sm80/kernel.cuh"
#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

template <class T, bool kMaskBlocks, bool kHasSoftcap, bool kTensors = false>
std::string launch_sm80(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = attention_kernel<T, kMaskBlocks, kHasSoftcap, kTensors>;
  // One 1-D grid of (batch * head units * key ranges * query blocks): grid.x allows 2^31 - 1, so no axis can
  // overflow the way a (q_blocks, heads, batch) grid's 65535-limited y/z axes would.
  const int64_t head_units = p.pack_gqa > 1 ? p.heads_k : p.heads_q;
  const int64_t num_blocks = static_cast<int64_t>(p.num_q_blocks) * p.num_splits * head_units * p.batch;
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
  if constexpr (kTensors) {
    if (std::string failure = launch_kv_block_segments(p, T::kBlockKV, stream); !failure.empty()) return failure;
    if (std::string failure = launch_mask_blocks(p, T::kBlockQ, T::kBlockKV, stream); !failure.empty()) return failure;
  }
  kernel<<<static_cast<unsigned>(num_blocks), T::kNumThreads, T::kSmemBytes, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("attention kernel launch", err);
  if (p.num_splits > 1) return launch_split_combine<typename T::Element, T::kHeadDim>(p, stream);
  return {};
}

template <KernelKey kKey>
std::string run_attention_sm80(const AttentionParams& params, cudaStream_t stream) {
  using T = Traits<kKey>;
  AttentionParams p = params;
  p.num_q_blocks = static_cast<int>((int64_t{p.seqlen_q} * p.pack_gqa + T::kBlockQ - 1) / T::kBlockQ);
  // Blocks can be partly masked by a window (causal included), kv_lengths, or a ragged last key block.
  const bool mask_blocks = p.window_left < kUnbounded || p.window_right < kUnbounded || p.kv_lengths != nullptr ||
                           p.seqlen_k % T::kBlockKV != 0;
  const bool softcap = p.softcap > 0.0f;
  if (p.q_segment_ids != nullptr || p.bias != nullptr || p.mask != nullptr) {  // (masked blocks included)
    p.batch_inner = tensors_shared_by_batch(p);  // (common/params.h)
    return softcap ? launch_sm80<T, true, true, true>(p, stream) : launch_sm80<T, true, false, true>(p, stream);
  }
  if (mask_blocks) {
    return softcap ? launch_sm80<T, true, true>(p, stream) : launch_sm80<T, true, false>(p, stream);
  }
  return softcap ? launch_sm80<T, false, true>(p, stream) : launch_sm80<T, false, false>(p, stream);
}

// Thread blocks of this kernel one SM holds at once (the split-KV plan's unit), read once per device.
template <KernelKey kKey>
int resident_blocks_sm80() {
  using T = Traits<kKey>;
  auto kernel = attention_kernel<T, true, false>;  // (the variants differ by a few registers at most)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  static std::atomic<int> cached[64] = {};
  if (device < 64 && cached[device].load(std::memory_order_relaxed) > 0) return cached[device].load();
  if constexpr (T::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> opted_in_devices{0};
    if (!opt_in_shared_memory(kernel, T::kSmemBytes, opted_in_devices).empty()) return 1;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, T::kNumThreads, T::kSmemBytes) != cudaSuccess) {
    cudaGetLastError();  // (clear it: the call still runs, planned as one block per SM)
    return 1;
  }
  blocks = blocks > 0 ? blocks : 1;
  if (device < 64) cached[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

}  // namespace jax_flash::sm80
