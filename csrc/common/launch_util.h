// Host helpers shared by the families' launchers: CUDA error text and the per-device opt-in to more than 48 KB of
// dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace jax_flash {

inline std::string cuda_failure(const char* what, cudaError_t err) {
  return std::string(what) + " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` once per device; `opted_in_devices` is the caller's
// per-kernel bit set (one static per kernel instantiation: kernels of one signature share a function type).
template <class Kernel>
std::string opt_in_shared_memory(Kernel kernel, int bytes, std::atomic<uint64_t>& opted_in_devices) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_failure("cudaGetDevice", err);
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (opted_in_devices.load(std::memory_order_relaxed) & bit) return {};
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      err != cudaSuccess) {
    return cuda_failure(("cudaFuncSetAttribute(MaxDynamicSharedMemorySize=" + std::to_string(bytes) + ")").c_str(),
                        err);
  }
  opted_in_devices.fetch_or(bit, std::memory_order_relaxed);
  return {};
}

}  // namespace jax_flash
