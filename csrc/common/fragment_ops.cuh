// Register-level helpers both GPU families use on the mma.sync m16n8 fragment layout (which is also, per warp, the
// layout of a wgmma m64nN accumulator): shared-memory addresses, ldmatrix, 16-bit packing and exp2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace jax_flash {

// The 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 b16 matrices; lane l supplies the shared-memory address of matrix l/8, row l%8. `volatile` so the issue
// order the sm80 fragment-load knobs choose survives compilation.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row_address)
               : "memory");
}

// Two fp32 values -> one register of two 16-bit elements (low half = first).
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// One register of two 16-bit elements -> two fp32 values (pack2's inverse).
template <typename Element>
__device__ __forceinline__ float2 unpack2(uint32_t packed) {
  if constexpr (std::is_same_v<Element, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  }
}

// 2^x in one MUFU.EX2 (flushes subnormal results to zero, which a softmax weight can afford).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace jax_flash
