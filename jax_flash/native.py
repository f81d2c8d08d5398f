"""Loads the native module, registers its FFI handlers with jax once, loads the CPU handler's OpenBLAS, and reads the
GPU kernel registry."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

try:
    from jax_flash import _jax_flash
except ImportError as error:  # the source tree shadows the installed package, or the build failed
    raise ImportError(
        f"jax_flash's native module _jax_flash could not be imported from {__file__.rsplit('/', 1)[0]}: {error}. "
        "Install the package with `pip install .` and run from outside the source tree (plain `pytest` works; "
        "`python -m pytest` in the repository root puts the unbuilt source first on sys.path).") from error
from jax_flash.config import KernelConfig

TARGET_NAME = "jax_flash_attention"          # the forward custom call (CPU and CUDA)
BACKWARD_TARGET_NAME = "jax_flash_attention_bwd"  # the backward custom call (CPU and CUDA)
FP8_TARGET_NAME = "jax_flash_attention_fp8"  # the FP8 forward on Hopper (CUDA)

for _target, _handlers in _jax_flash.registrations().items():
    for _platform, _capsule in _handlers.items():
        jax.ffi.register_ffi_target(_target, _capsule, platform=_platform)



def _load_openblas() -> tuple[str | None, str | None]:
    """(OpenBLAS's kernel name, None) once the CPU handler's OpenBLAS is loaded, else (None, why not).

    The library comes from the scipy-openblas32 wheel (a dependency); without it the GPU path still works and the CPU
    handler reports this reason.
    """
    try:
        import scipy_openblas32
    except ImportError as error:
        return None, f"the scipy-openblas32 package is not installed ({error})"
    path = os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(fullname=True))
    try:
        return _jax_flash.load_openblas(path), None
    except RuntimeError as error:
        return None, str(error)


# OPENBLAS_CORE: the kernels OpenBLAS chose for this processor ("Haswell", "SkylakeX", ...), or None.
OPENBLAS_CORE, OPENBLAS_ERROR = _load_openblas()

BUILT_WITH_CUDA: bool = bool(_jax_flash.built_with_cuda)
KERNEL_SET: str = str(_jax_flash.kernel_set)  # "shipped", "sweep", "all" ("none" without CUDA)


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One GPU kernel the compiled module contains, with the shared memory per block it needs and, for the sm90
    family, the registers per consumer thread after setmaxnreg (0 for sm80), as the C++ traits derive them."""

    family: str
    dtype: str
    head_dim: int
    config: KernelConfig
    smem_bytes: int
    consumer_registers: int


@functools.cache
def supported_configs() -> tuple[CompiledKernel, ...]:
    """The GPU kernels compiled into this build, read from the C++ registry (empty in a CPU-only build).

    The CPU handler accepts any valid KernelConfig (it uses only block_q and block_kv, as its tile sizes).
    """
    kernels = []
    for entry in _jax_flash.gpu_kernels():
        cfg = KernelConfig.from_attrs(entry)
        kernels.append(CompiledKernel(cfg.family, entry["dtype"], entry["head_dim"], cfg, entry["smem_bytes"],
                                      entry["consumer_registers"]))
    return tuple(kernels)


def device_arch(device) -> int:
    """Compute capability of a jax device as 80, 90, ...; 90 when the device does not say."""
    try:
        major, minor = str(device.compute_capability).split(".")
        return int(major) * 10 + int(minor)
    except (AttributeError, ValueError):
        return 90


def gpu_head_dims(dtype: str) -> list[int]:
    return sorted({k.head_dim for k in supported_configs() if k.dtype == dtype})


def compiled_configs_for(dtype: str, head_dim: int) -> list[KernelConfig]:
    return [k.config for k in supported_configs() if k.dtype == dtype and k.head_dim == head_dim]
