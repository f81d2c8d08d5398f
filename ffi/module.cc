// The nanobind module jax_flash._jax_flash: hands the FFI handlers to Python as capsules and reports which GPU
// kernels the registry holds (supported_configs() reads this; no config list is typed twice).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "ffi/handlers.h"
#ifdef JAX_FLASH_WITH_CUDA
#include "common/registry.h"
#endif

namespace nb = nanobind;

NB_MODULE(_jax_flash, m) {
  m.doc() = "jax_flash native module: XLA FFI handlers and the GPU kernel registry";

  m.def("registrations", []() {
    nb::dict targets;
    targets["cpu"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionCpu));
#ifdef JAX_FLASH_WITH_CUDA
    targets["CUDA"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionCuda));
#endif
    return targets;
  });

#ifdef JAX_FLASH_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.attr("kernel_set") = jax_flash::kKernelSet;
#else
  m.attr("built_with_cuda") = false;
  m.attr("kernel_set") = "none";
#endif

  // One dict per compiled GPU kernel: the KernelKey fields plus the dynamic shared memory it needs.
  m.def("gpu_kernels", []() {
    nb::list kernels;
#ifdef JAX_FLASH_WITH_CUDA
    for (int i = 0; i < jax_flash::kRegistrySize; ++i) {
      const auto& e = jax_flash::kRegistry[i];
      const auto& k = e.key;
      nb::dict d;
      d["family"] = k.family == 90 ? "sm90" : "sm80";
      d["dtype"] = jax_flash::dtype_name(k.dtype);
      d["head_dim"] = k.head_dim;
      d["block_q"] = k.block_q;
      d["block_kv"] = k.block_kv;
      d["num_warps"] = k.num_warps;
      d["async_copy"] = k.async_copy;
      d["eager_load_blocks"] = k.eager_load_blocks;
      d["swizzled"] = k.swizzled;
      d["q_mma_load_k_fragments"] = k.q_mma_load_k_fragments;
      d["k_mma_load_k_fragments"] = k.k_mma_load_k_fragments;
      d["v_mma_load_k_fragments"] = k.v_mma_load_k_fragments;
      d["mma_double_buffer_loads"] = k.mma_double_buffer_loads;
      d["optimized_softmax"] = k.optimized_softmax;
      d["stages"] = k.stages;
      d["consumer_warpgroups"] = k.consumer_warpgroups;
      d["pingpong"] = k.pingpong;
      d["overlap"] = k.overlap;
      d["smem_bytes"] = e.smem_bytes;
      kernels.append(d);
    }
#endif
    return kernels;
  });
}
