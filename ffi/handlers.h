// The FFI handler symbols the nanobind module hands to jax: the forward ("jax_flash_attention", CPU and CUDA)
// the backward ("jax_flash_attention_bwd", CPU and CUDA) and the FP8 forward ("jax_flash_attention_fp8", CUDA).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_flash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBackwardCpu);
#ifdef JAX_FLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionFp8Cuda);
#endif

}  // namespace jax_flash
