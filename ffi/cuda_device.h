// CUDA facts the CUDA handlers (forward, FP8 forward, backward) read: the current device's limits, cached per device,
// error text, the alignment asked of XLA's scratch allocator, and the sm90 tile counter taken from it.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <optional>
#include <string>

#include "common/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = ::xla::ffi;

// The alignment asked of XLA's scratch allocator: XLA refuses more than 16 bytes ("Unsupported alignment"), and
// 16 covers every vector access of the scratch users (float4 partials, float2 split-KV partials, the counter).
inline constexpr size_t kScratchAlignment = 16;

inline ffi::Error cuda_error(const std::string& what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, "jax_flash: " + what + " failed: " + cudaGetErrorName(err) + " (" +
                                                   cudaGetErrorString(err) + ")");
}

struct DeviceLimits {
  int major = 0, minor = 0;
  int max_smem_optin = 0;
  int num_sms = 0;
};

// Compute capability, shared-memory limit and SM count of the current device, read once per device.
inline ffi::Error current_device_limits(DeviceLimits& out) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cached_major{}, cached_minor{}, cached_smem{}, cached_sms{};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_error("cudaGetDevice", err);
  if (device < kMaxDevices && cached_major[device].load() != 0) {
    out = {cached_major[device].load(), cached_minor[device].load(), cached_smem[device].load(),
           cached_sms[device].load()};
    return ffi::Error::Success();
  }
  DeviceLimits limits;
  cudaError_t err = cudaDeviceGetAttribute(&limits.major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&limits.minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&limits.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&limits.num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return cuda_error("cudaDeviceGetAttribute", err);
  if (device < kMaxDevices) {
    cached_minor[device] = limits.minor;
    cached_smem[device] = limits.max_smem_optin;
    cached_sms[device] = limits.num_sms;
    cached_major[device] = limits.major;
  }
  out = limits;
  return ffi::Error::Success();
}

// The sm90 family's dynamic tile scheduler counter (common/params.h, tile_counter): 8 bytes of XLA scratch memory,
// ordered on the call's stream.
inline ffi::Error allocate_tile_counter(ffi::ScratchAllocator& scratch, AttentionParams& params) {
  std::optional<void*> counter = scratch.Allocate(sizeof(unsigned long long), kScratchAlignment);
  if (!counter.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_flash: could not allocate the 8-byte tile counter from XLA's scratch memory");
  }
  params.tile_counter = static_cast<unsigned long long*>(*counter);
  return ffi::Error::Success();
}

// The sm90 split tail (csrc/sm90/split_tail.cuh): num_sms x split_bytes_per_sm (the registry entry's; 0: the kernel
// never splits) of scratch for the partials of the last wave's cut tiles; the launcher splits only where that wave
// is partial. Without the scratch the kernel runs unsplit.
inline void allocate_split_tail(ffi::ScratchAllocator& scratch, int split_bytes_per_sm, const DeviceLimits& limits,
                                AttentionParams& params) {
  if (split_bytes_per_sm <= 0 || params.num_splits > 1) return;
  const size_t bytes = static_cast<size_t>(limits.num_sms) * split_bytes_per_sm;
  if (std::optional<void*> workspace = scratch.Allocate(bytes, kScratchAlignment); workspace.has_value()) {
    params.split_workspace = *workspace;
    params.split_workspace_bytes = static_cast<int64_t>(bytes);
  }
}

}  // namespace jax_flash
