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

// Attribute kAttribute of the current device, read once per device (0 where it cannot be read).
template <cudaDeviceAttr kAttribute>
inline int current_device_attribute() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // the value + 1; 0 unknown
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < kMaxDevices) {
    if (const int known = cached[device].load(std::memory_order_relaxed); known != 0) return known - 1;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess) return 0;
  if (device < kMaxDevices) cached[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

// Whether the current device runs programmatic dependent launches (compute capability 9.0+): a kernel launched
// with cudaLaunchAttributeProgrammaticStreamSerialization starts while the previous kernel on the stream drains,
// and waits for its results at griddepcontrol.wait.
inline bool programmatic_launch_supported() {
  return current_device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9;
}

// The current device's SM count (0 where it cannot be read).
inline int device_sm_count() { return current_device_attribute<cudaDevAttrMultiProcessorCount>(); }

}  // namespace jax_flash
