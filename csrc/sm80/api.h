// Host-only view of the sm80 family: the run function every generated sm80 instantiation defines.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/kernel_key.h"
#include "common/params.h"

namespace jax_flash::sm80 {

// Runs one attention forward on `stream`. Returns "" on success, else what failed (a launch or attribute error).
template <KernelKey kKey>
std::string run_attention_sm80(const AttentionParams& params, cudaStream_t stream);

// Thread blocks of the kernel that one SM of the current device holds at once (at least 1).
template <KernelKey kKey>
int resident_blocks_sm80();

}  // namespace jax_flash::sm80
