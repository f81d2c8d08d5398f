"""jax_flash: FlashAttention kernels (CUDA C++ and a native CPU path) as XLA FFI custom calls."""

from jax_flash.native import CompiledKernel, supported_configs
from jax_flash.attention import attention
from jax_flash._autodiff import CHECKPOINT_NAMES  # (importing _autodiff registers attention's differentiation rules)
from jax_flash.autotune import autotune
from jax_flash.config import KernelConfig
from jax_flash.fp8 import quantize_fp8
from jax_flash.reference import attention_reference
from jax_flash.ring import ring_attention, zigzag_indices
from jax_flash.jax_nn import dot_product_attention
from jax_flash import flax  # noqa: F401  (jax_flash.flax.attention_fn)
from jax_flash.timing import time_attention

__all__ = ["attention", "KernelConfig", "supported_configs", "CompiledKernel", "attention_reference", "time_attention",
           "autotune", "ring_attention", "zigzag_indices", "dot_product_attention", "quantize_fp8",
           "CHECKPOINT_NAMES"]
__version__ = "0.1.0"
