// Helpers shared by the standalone GPU programs of tests/harness/: CUDA error checks and 16-bit element conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/kernel_key.h"

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

namespace jax_flash::harness {

// float <-> the bits of a bf16 or fp16 element (dtype: a DType value)
inline uint16_t to_bits(float x, int dtype) {
  if (dtype == static_cast<int>(DType::kBFloat16)) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  __half h = __float2half_rn(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

inline float from_bits(uint16_t b, int dtype) {
  if (dtype == static_cast<int>(DType::kBFloat16)) {
    __nv_bfloat16 h;
    std::memcpy(&h, &b, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}

}  // namespace jax_flash::harness
