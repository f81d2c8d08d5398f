// run_attention_bwd_sm80: common/backward_launch.cuh's three launches around the sm80 backward kernel
// (sm80/bwd_kernel.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "common/backward_launch.cuh"
#include "common/kernel_key.h"
#include "sm80/bwd_api.h"
#include "sm80/bwd_kernel.cuh"
#include "sm80/bwd_traits.cuh"

namespace jax_flash::sm80 {

// (segment ids alone run the tensor variant here; the sm90 family has one of its own for them)
template <class T>
struct BwdKernels {
  template <bool kMask, bool kSoftcap, bool kDeterministic, BwdTensors kTensors = BwdTensors::kNone>
  static auto get() {
    return attention_bwd_kernel<T, kMask, kSoftcap, kDeterministic, kTensors != BwdTensors::kNone>;
  }
};

template <int kDType>
using BwdElement = std::conditional_t<kDType == static_cast<int>(DType::kBFloat16), __nv_bfloat16, __half>;

template <int kDType, int kHeadDim>
std::string run_attention_bwd_sm80(const BackwardParams& bp, cudaStream_t stream) {
  using T = BwdTraits<BwdElement<kDType>, kHeadDim>;
  return run_backward<T, BwdKernels<T>>(bp, stream);
}

template <int kDType, int kHeadDim>
int bwd_smem_bytes_sm80() {
  return BwdTraits<BwdElement<kDType>, kHeadDim>::kSmemBytes;
}

}  // namespace jax_flash::sm80
