// Host-only view of the generated kernel registry (csrc/instantiations/registry.cu): every compiled GPU kernel of
// both families, keyed by KernelKey, with its run function. Included by ffi/*.cc and the harness (no device code).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/backward_params.h"
#include "common/kernel_key.h"
#include "common/params.h"

namespace jax_flash {

// Runs one attention forward on `stream`. Returns "" on success, else what failed (a launch or attribute error).
using RunFn = std::string (*)(const AttentionParams&, cudaStream_t);

// Thread blocks of the kernel one SM of the current device holds at once (split-KV plans in these units).
using ResidentBlocksFn = int (*)();

struct RegistryEntry {
  KernelKey key;
  RunFn run;
  ResidentBlocksFn resident_blocks;
  int smem_bytes;  // dynamic shared memory per block
  // Scratch memory per SM the kernel's split tail can use (sm90/split_tail.cuh; 0: it never splits): the caller passes
  // num_sms times this in AttentionParams::split_workspace, or nothing, and the launcher decides per call.
  int split_bytes_per_sm;
  int consumer_registers;  // sm90: registers per consumer thread after setmaxnreg (0 for sm80)
};

// The backward of one dtype and head dim: the sm80 family's (any device) and the sm90 family's (Hopper; nullptr where
// it has no tiles for the head dim).
using BackwardRunFn = std::string (*)(const BackwardParams&, cudaStream_t);
struct BackwardEntry {
  int dtype;  // DType value
  int head_dim;
  BackwardRunFn run_sm80;
  int (*smem_bytes_sm80)();  // dynamic shared memory per block of the main kernel
  BackwardRunFn run_sm90;
  int (*smem_bytes_sm90)();
};

// The generated table.
extern const RegistryEntry kRegistry[];
extern const int kRegistrySize;
extern const char* const kKernelSet;
extern const BackwardEntry kBackwardRegistry[];
extern const int kBackwardRegistrySize;  // "shipped", "sweep" or "all": which list of jax_flash/config.py was built
// The sm90 FP8 forward kernels (float8_e4m3fn, sm90/launch_fp8.cuh; resident_blocks: nullptr).
extern const RegistryEntry kFp8Registry[];
extern const int kFp8RegistrySize;

// nullptr when the key was not compiled in.
inline const RegistryEntry* find_kernel(const KernelKey& key) {
  for (int i = 0; i < kRegistrySize; ++i) {
    if (kRegistry[i].key == key) return &kRegistry[i];
  }
  return nullptr;
}

inline const RegistryEntry* find_fp8_kernel(const KernelKey& key) {
  for (int i = 0; i < kFp8RegistrySize; ++i) {
    if (kFp8Registry[i].key == key) return &kFp8Registry[i];
  }
  return nullptr;
}

inline const BackwardEntry* find_backward_kernel(int dtype, int head_dim) {
  for (int i = 0; i < kBackwardRegistrySize; ++i) {
    if (kBackwardRegistry[i].dtype == dtype && kBackwardRegistry[i].head_dim == head_dim) return &kBackwardRegistry[i];
  }
  return nullptr;
}

}  // namespace jax_flash
