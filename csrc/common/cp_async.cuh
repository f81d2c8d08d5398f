// cp.async (sm_80+): 16-byte global -> shared copies that land asynchronously, in commit groups. Both GPU families'
// kernels that load tiles with the threads themselves (the sm80 family, the backward kernels) use these.
#pragma once

#include <cstdint>

#include "common/fragment_ops.cuh"  // smem_address

namespace jax_flash {

// 16 bytes from gmem_src to the shared-memory address smem_dst; valid = false writes zeros (rows past the sequence
// end: src_bytes = 0 reads nothing).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  cp_async_16(smem_address(smem_dst), gmem_src, valid);
}

// 4 bytes through L1 (cp.async's smallest copy: one int32 id), zeros where !valid.
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace jax_flash
