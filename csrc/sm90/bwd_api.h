// Host-only view of the sm90-family backward: the run function each generated backward instantiation defines.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/backward_params.h"

namespace jax_flash::sm90 {

// Runs one attention backward on `stream` (kDType: DType of common/kernel_key.h). Returns "" on success, else what
// failed. bwd_smem_bytes_sm90: the main kernel's dynamic shared memory per block.
template <int kDType, int kHeadDim>
std::string run_attention_bwd_sm90(const BackwardParams& params, cudaStream_t stream);

template <int kDType, int kHeadDim>
int bwd_smem_bytes_sm90();

}  // namespace jax_flash::sm90
