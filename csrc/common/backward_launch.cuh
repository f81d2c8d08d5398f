// run_backward: the backward's three launches on XLA's stream (common/backward_prepost.cuh's preprocess, the
// family's kernel in the variant the call needs, the dq conversion), with grid and shared-memory checks. The kernel
// takes the BackwardParams and then the family's `extra` launch arguments (sm90: the dQ, Q, dO, dK and dV tensor maps).
// Kernels<T> names the family's kernel template: Kernels::template get<kMask, kSoftcap, kDeterministic>() (and
// get<true, kSoftcap, false, BwdTensors::kSegments or kAny>() for segment ids alone, or with bias / mask tensors and
// ALiBi slopes). The deterministic variants (p.dq_turns set) are compiled with the mask only, which handles every
// call: they are slow anyway, and a run-time switch in the one kernel cost the default 13-20% (H200).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "common/backward_blocks.cuh"
#include "common/backward_params.h"
#include "common/backward_prepost.cuh"
#include "common/launch_util.h"

namespace jax_flash {

template <class T, class Kernels, bool kMask, bool kSoftcap, bool kDeterministic = false,
          BwdTensors kTensors = BwdTensors::kNone, class... Extra>
std::string launch_backward_kernel(const BackwardParams& bp, int64_t num_blocks, cudaStream_t stream,
                                   const Extra&... extra) {
  auto kernel = [] {
    if constexpr (kTensors != BwdTensors::kNone) {
      return Kernels::template get<kMask, kSoftcap, kDeterministic, kTensors>();
    } else {
      return Kernels::template get<kMask, kSoftcap, kDeterministic>();
    }
  }();
  static std::atomic<uint64_t> opted_in_devices{0};
  if (std::string failure = opt_in_shared_memory(kernel, T::kSmemBytes, opted_in_devices); !failure.empty()) {
    return failure;
  }
  kernel<<<static_cast<unsigned>(num_blocks), T::kNumThreads, T::kSmemBytes, stream>>>(bp, extra...);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("backward kernel launch", err);
  return {};
}

// Calls with segment ids, bias / mask tensors or ALiBi slopes: the block-skipping pre-passes at the family's tiles,
// then its tensor variant (segment ids alone: the kSegments one), with atomic dQ only.
template <class T, class Kernels, class... Extra>
std::string launch_tensor_backward(const BackwardParams& bp, int64_t num_blocks, bool softcap, cudaStream_t stream,
                                   const Extra&... extra) {
  if (bp.dq_turns != nullptr) return "deterministic=True with segment ids or bias / mask tensors has no GPU kernel";
  static_assert(T::kBlockQ % kBackwardBlockMin == 0 && T::kBlockKV % kBackwardBlockMin == 0,
                "the block-skipping scratch is sized for tiles of at least kBackwardBlockMin rows and keys");
  if (std::string failure = launch_backward_blocks(bp.p, T::kBlockQ, T::kBlockKV, stream); !failure.empty()) {
    return failure;
  }
  const AttentionParams& p = bp.p;
  if (p.bias == nullptr && p.mask == nullptr) {
    constexpr BwdTensors kSeg = BwdTensors::kSegments;
    return softcap ? launch_backward_kernel<T, Kernels, true, true, false, kSeg>(bp, num_blocks, stream, extra...)
                   : launch_backward_kernel<T, Kernels, true, false, false, kSeg>(bp, num_blocks, stream, extra...);
  }
  constexpr BwdTensors kAny = BwdTensors::kAny;
  return softcap ? launch_backward_kernel<T, Kernels, true, true, false, kAny>(bp, num_blocks, stream, extra...)
                 : launch_backward_kernel<T, Kernels, true, false, false, kAny>(bp, num_blocks, stream, extra...);
}

// Which of its variants a traits' kernel is compiled in: all of them; the plain ones only (no tensors, no
// determinism: masked or not, soft-capped or not); or the others only (tensors or determinism), where a family routes
// the plain calls to other traits.
enum class BwdVariants { kAll, kPlain, kOthers };

// T: the family's traits (Element, kHeadDim, kBlockKV, kNumThreads, kSmemBytes); kVariants: which of T's kernels
// are compiled (the caller routes every call to traits that have its variant).
template <class T, class Kernels, BwdVariants kVariants = BwdVariants::kAll, class... Extra>
std::string run_backward(const BackwardParams& bp, cudaStream_t stream, const Extra&... extra) {
  using Element = typename T::Element;
  constexpr int kHeadDim = T::kHeadDim;
  const AttentionParams& p = bp.p;
  const int64_t rows = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  const int64_t kv_blocks = (int64_t{p.seqlen_k} + T::kBlockKV - 1) / T::kBlockKV * p.heads_k * p.batch;
  constexpr int kRowsPerPreBlock = kPrepostThreads / (kHeadDim / kVectorElems);
  const int64_t pre_blocks = (rows + kRowsPerPreBlock - 1) / kRowsPerPreBlock;
  const int64_t convert_blocks = (rows * (kHeadDim / kVectorElems) + kPrepostThreads - 1) / kPrepostThreads;
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
    const bool tensors = p.q_segment_ids != nullptr || p.bias != nullptr || p.mask != nullptr;
    const bool plain = !tensors && bp.dq_turns == nullptr;
    std::string failure = "internal error: a backward call reached traits compiled without its variant";
    if constexpr (kVariants != BwdVariants::kOthers) {
      if (plain) {
        failure = mask ? (softcap ? launch_backward_kernel<T, Kernels, true, true>(bp, kv_blocks, stream, extra...)
                                  : launch_backward_kernel<T, Kernels, true, false>(bp, kv_blocks, stream, extra...))
                       : (softcap ? launch_backward_kernel<T, Kernels, false, true>(bp, kv_blocks, stream, extra...)
                                  : launch_backward_kernel<T, Kernels, false, false>(bp, kv_blocks, stream, extra...));
      }
    }
    if constexpr (kVariants != BwdVariants::kPlain) {
      if (!plain) {
        failure = tensors ? launch_tensor_backward<T, Kernels>(bp, kv_blocks, softcap, stream, extra...)
                  : softcap ? launch_backward_kernel<T, Kernels, true, true, true>(bp, kv_blocks, stream, extra...)
                            : launch_backward_kernel<T, Kernels, true, false, true>(bp, kv_blocks, stream, extra...);
      }
    }
    if (!failure.empty()) return failure;
  }
  if (convert_blocks > 0) {
    attention_bwd_convert_dq<Element, kHeadDim>
        <<<static_cast<unsigned>(convert_blocks), kPrepostThreads, 0, stream>>>(bp);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("backward dq conversion", err);
  }
  return {};
}

}  // namespace jax_flash
