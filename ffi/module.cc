// The nanobind module jax_flash._jax_flash: hands the FFI handlers to Python as capsules, loads the CPU handler's
// OpenBLAS, and reports which GPU kernels the registry holds (supported_configs() reads this; no config list is
// typed twice).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common/split_plan.h"
#include "cpu/blas.h"
#include "ffi/handlers.h"
#ifdef JAX_FLASH_WITH_CUDA
#include "common/registry.h"
#endif

namespace nb = nanobind;

NB_MODULE(_jax_flash, m) {
  m.doc() = "jax_flash native module: XLA FFI handlers and the GPU kernel registry";

  // Loads the OpenBLAS of the CPU handler from the scipy-openblas32 wheel's library path; returns the name of the
  // kernels OpenBLAS chose for this processor. RuntimeError when it cannot be loaded.
  m.def("load_openblas", &jax_flash::cpu::load_openblas, nb::arg("path"));

  // {target name: {platform: handler capsule}}: the forward and the backward, on CPU and CUDA; the FP8 forward on
  // CUDA.
  m.def("registrations", []() {
    nb::dict forward, backward, targets;
    forward["cpu"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionCpu));
#ifdef JAX_FLASH_WITH_CUDA
    forward["CUDA"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionCuda));
#endif
    backward["cpu"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionBackwardCpu));
#ifdef JAX_FLASH_WITH_CUDA
    backward["CUDA"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionBackwardCuda));
#endif
    targets["jax_flash_attention"] = forward;
    targets["jax_flash_attention_bwd"] = backward;
#ifdef JAX_FLASH_WITH_CUDA
    nb::dict fp8;
    fp8["CUDA"] = nb::capsule(reinterpret_cast<void*>(jax_flash::AttentionFp8Cuda));
    targets["jax_flash_attention_fp8"] = fp8;
#endif
    return targets;
  });

  // The split-KV plan of the CUDA handler (common/split_plan.h), for tests: the decode tiles' rule
  // (memory_bound) or the 128-row tiles' wave rule, for a grid of `tiles` blocks on a GPU of `num_sms` SMs holding
  // `slots` of them at once; a decode tile's key block holds `kv_block_bytes` of K and V.
  m.def("split_plan", [](int64_t tiles, int64_t slots, int64_t num_sms, int64_t key_blocks, bool memory_bound,
                         int64_t kv_block_bytes) {
    return memory_bound ? jax_flash::choose_decode_splits(tiles, slots, num_sms, key_blocks, kv_block_bytes)
                        : jax_flash::choose_num_splits(tiles, slots, key_blocks);
  }, nb::arg("tiles"), nb::arg("slots"), nb::arg("num_sms"), nb::arg("key_blocks"), nb::arg("memory_bound"),
        nb::arg("kv_block_bytes"));

#ifdef JAX_FLASH_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.attr("kernel_set") = jax_flash::kKernelSet;
#else
  m.attr("built_with_cuda") = false;
  m.attr("kernel_set") = "none";
#endif

  // One dict per compiled GPU kernel: the KernelKey fields (family as its number), the dynamic shared memory it
  // needs and, for sm90, the registers per consumer thread (Python checks its own mirror of both against these).
  m.def("gpu_kernels", []() {
    nb::list kernels;
#ifdef JAX_FLASH_WITH_CUDA
    for (int i = 0; i < jax_flash::kRegistrySize; ++i) {
      const auto& e = jax_flash::kRegistry[i];
      const auto& k = e.key;
      nb::dict d;
      d["dtype"] = jax_flash::dtype_name(k.dtype);
      d["head_dim"] = k.head_dim;
#define JAX_FLASH_REPORT_FIELD(type, name) d[#name] = k.name;
      JAX_FLASH_CONFIG_FIELDS(JAX_FLASH_REPORT_FIELD)
#undef JAX_FLASH_REPORT_FIELD
      d["smem_bytes"] = e.smem_bytes;
      d["consumer_registers"] = e.consumer_registers;
      kernels.append(d);
    }
#endif
    return kernels;
  });
}
