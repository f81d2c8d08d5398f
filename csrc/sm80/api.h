// Host-only view of the sm80 family: the run function every generated instantiation defines, and the registry
// (csrc/instantiations/registry.cu, generated) that maps a KernelKey to it. Included by ffi/*.cc (no device code).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/kernel_key.h"
#include "common/params.h"

namespace jax_flash::sm80 {

// Runs one attention forward on `stream`. Returns "" on success, else what failed (a launch or attribute error).
template <KernelKey kKey>
std::string run_attention_sm80(const AttentionParams& params, cudaStream_t stream);

using RunFn = std::string (*)(const AttentionParams&, cudaStream_t);

struct RegistryEntry {
  KernelKey key;
  RunFn run;
  int smem_bytes;  // dynamic shared memory per block
};

// The generated table.
extern const RegistryEntry kRegistry[];
extern const int kRegistrySize;
extern const char* const kKernelSet;  // "shipped", "sweep" or "all": which list of jax_flash/config.py was built

// nullptr when the key was not compiled in.
inline const RegistryEntry* find_kernel(const KernelKey& key) {
  for (int i = 0; i < kRegistrySize; ++i) {
    if (kRegistry[i].key == key) return &kRegistry[i];
  }
  return nullptr;
}

}  // namespace jax_flash::sm80
