// run_attention_bwd_sm80: the backward's three launches on XLA's stream (sm80/bwd_prepost.cuh's preprocess, the
// kernel of sm80/bwd_kernel.cuh in the variant the call needs, the dq conversion), with grid and shared-memory checks.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "common/backward_params.h"
#include "common/launch_util.h"
#include "sm80/bwd_api.h"
#include "sm80/bwd_kernel.cuh"
#include "sm80/bwd_prepost.cuh"
#include "sm80/bwd_traits.cuh"

namespace jax_flash::sm80 {

template <class T, bool kMask, bool kSoftcap>
std::string launch_bwd_kernel(const BackwardParams& bp, int64_t num_blocks, cudaStream_t stream) {
  auto kernel = attention_bwd_kernel<T, kMask, kSoftcap>;
  static std::atomic<uint64_t> opted_in_devices{0};
  if (std::string failure = opt_in_shared_memory(kernel, T::kSmemBytes, opted_in_devices); !failure.empty()) {
    return failure;
  }
  kernel<<<static_cast<unsigned>(num_blocks), T::kNumThreads, T::kSmemBytes, stream>>>(bp);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("backward kernel launch", err);
  return {};
}

template <int kDType, int kHeadDim>
std::string run_attention_bwd_sm80(const BackwardParams& bp, cudaStream_t stream) {
  using Element = std::conditional_t<kDType == static_cast<int>(DType::kBFloat16), __nv_bfloat16, __half>;
  using T = BwdTraits<Element, kHeadDim>;
  const AttentionParams& p = bp.p;
  const int64_t rows = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  const int64_t kv_blocks = (int64_t{p.seqlen_k} + T::kBlockKV - 1) / T::kBlockKV * p.heads_k * p.batch;
  constexpr int kRowsPerPreBlock = kPrepostThreads / (kHeadDim / kChunkElems);
  const int64_t pre_blocks = (rows + kRowsPerPreBlock - 1) / kRowsPerPreBlock;
  const int64_t convert_blocks = (rows * (kHeadDim / kChunkElems) + kPrepostThreads - 1) / kPrepostThreads;
  if (convert_blocks > INT_MAX || kv_blocks > INT_MAX) {
    return "backward grid of " + std::to_string(convert_blocks > kv_blocks ? convert_blocks : kv_blocks) +
           " thread blocks exceeds 2^31-1; split the batch";
  }
  if (pre_blocks > 0) {
    attention_bwd_preprocess<Element, kHeadDim><<<static_cast<unsigned>(pre_blocks), kPrepostThreads, 0, stream>>>(bp);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("backward preprocess", err);
  }
  if (kv_blocks > 0) {
    const bool mask = p.window_left < kUnbounded || p.window_right < kUnbounded || p.kv_lengths != nullptr ||
                      p.q_lengths != nullptr || p.seqlen_k % T::kBlockKV != 0;
    const bool softcap = p.softcap > 0.0f;
    std::string failure =
        mask ? (softcap ? launch_bwd_kernel<T, true, true>(bp, kv_blocks, stream)
                        : launch_bwd_kernel<T, true, false>(bp, kv_blocks, stream))
             : (softcap ? launch_bwd_kernel<T, false, true>(bp, kv_blocks, stream)
                        : launch_bwd_kernel<T, false, false>(bp, kv_blocks, stream));
    if (!failure.empty()) return failure;
  }
  if (convert_blocks > 0) {
    attention_bwd_convert_dq<Element, kHeadDim>
        <<<static_cast<unsigned>(convert_blocks), kPrepostThreads, 0, stream>>>(bp);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("backward dq conversion", err);
  }
  return {};
}

template <int kDType, int kHeadDim>
int bwd_smem_bytes_sm80() {
  using Element = std::conditional_t<kDType == static_cast<int>(DType::kBFloat16), __nv_bfloat16, __half>;
  return BwdTraits<Element, kHeadDim>::kSmemBytes;
}

}  // namespace jax_flash::sm80
