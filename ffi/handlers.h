// The FFI handler symbols the nanobind module hands to jax (one target name, one handler per platform).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_flash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCpu);
#ifdef JAX_FLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCuda);
#endif

}  // namespace jax_flash
