// Host-only view of the sm90 family: the run function every generated sm90 instantiation defines.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/kernel_key.h"
#include "common/params.h"

namespace jax_flash::sm90 {

// Runs one attention forward on `stream` (compute capability 9.0 only). Returns "" on success, else what failed.
template <KernelKey kKey>
std::string run_attention_sm90(const AttentionParams& params, cudaStream_t stream);

}  // namespace jax_flash::sm90
