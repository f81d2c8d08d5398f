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

// Whether the current device runs programmatic dependent launches (compute capability 9.0+): a kernel launched
// with cudaLaunchAttributeProgrammaticStreamSerialization starts while the previous kernel on the stream drains,
// and waits for its results at griddepcontrol.wait. Read once per device.
inline bool programmatic_launch_supported() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && cached[device].load(std::memory_order_relaxed) != 0) return cached[device].load() == 2;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  if (device < kMaxDevices) cached[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

// The current device's SM count, read once per device (0 where it cannot be read).
inline int device_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 unknown
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device < kMaxDevices && cached[device].load(std::memory_order_relaxed) != 0) return cached[device].load();
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (device < kMaxDevices) cached[device].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace jax_flash
