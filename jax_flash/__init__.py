"""jax_flash: FlashAttention forward kernels (CUDA C++ and a native CPU path) as XLA FFI custom calls."""

from jax_flash._ffi import CompiledKernel, supported_configs
from jax_flash.attention import attention
from jax_flash.config import KernelConfig
from jax_flash.reference import attention_reference

__all__ = ["attention", "KernelConfig", "supported_configs", "CompiledKernel", "attention_reference"]
__version__ = "0.1.0"
