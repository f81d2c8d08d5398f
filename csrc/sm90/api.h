// Host-only view of the sm90 family: the run functions the generated sm90 instantiations define.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/kernel_key.h"
#include "common/params.h"

namespace jax_flash::sm90 {

// Runs one attention forward on `stream` (compute capability 9.0 only). Returns "" on success, else what failed.
template <KernelKey kKey>
std::string run_attention_sm90(const AttentionParams& params, cudaStream_t stream);

// The FP8 forward (float8_e4m3fn q, k and V^T; launch_fp8.cuh), likewise.
template <KernelKey kKey>
std::string run_attention_sm90_fp8(const AttentionParams& params, cudaStream_t stream);

// Thread blocks one SM holds at once: the persistent kernel's shared memory allows one.
template <KernelKey kKey>
int resident_blocks_sm90() {
  return 1;
}

}  // namespace jax_flash::sm90
