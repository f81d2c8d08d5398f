// The compile-time identity of one GPU kernel: data type, head dim and the KernelConfig knobs.
// It is both the registry key and the template parameter of the sm80 family (a C++20 structural type), so the
// generated instantiations and the lookup share one definition. Field names equal jax_flash/config.py's.
#pragma once

#include <cstdint>
#include <string>

namespace jax_flash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

struct KernelKey {
  int dtype;  // DType value
  int head_dim;
  int block_q;
  int block_kv;
  int num_warps;
  bool async_copy;
  bool eager_load_blocks;
  bool swizzled;
  int q_mma_load_k_fragments;
  int k_mma_load_k_fragments;
  int v_mma_load_k_fragments;
  bool mma_double_buffer_loads;
  bool optimized_softmax;
  // The kernel family (80: mma.sync / ldmatrix / cp.async, any sm_80+; 90: wgmma / TMA / warp-specialised, sm_90a)
  // and the sm90 family's own knobs (the sm80 family ignores them).
  int family = 80;
  int stages = 2;               // K/V shared-memory pipeline depth
  int consumer_warpgroups = 2;  // math warpgroups, 64 query rows each (block_q = 64 * consumer_warpgroups)
  bool pingpong = true;         // the consumers take turns (named barriers): on their products, or without overlap on
                                // their softmax exponentials
  bool overlap = true;          // intra-warpgroup overlap: the next Q K^T issued with this block's P V

  constexpr bool operator==(const KernelKey&) const = default;
};

inline const char* dtype_name(int dtype) {
  return dtype == static_cast<int>(DType::kBFloat16) ? "bfloat16" : "float16";
}

// "bfloat16 D=128 block_q=128 block_kv=64 ..." for error messages.
inline std::string describe(const KernelKey& key) {
  auto b = [](bool x) { return x ? "True" : "False"; };
  if (key.family == 90) {
    return std::string("family=sm90 ") + dtype_name(key.dtype) + " head_dim=" + std::to_string(key.head_dim) +
           " block_q=" + std::to_string(key.block_q) + " block_kv=" + std::to_string(key.block_kv) +
           " stages=" + std::to_string(key.stages) + " consumer_warpgroups=" + std::to_string(key.consumer_warpgroups) +
           " pingpong=" + b(key.pingpong) + " overlap=" + b(key.overlap);
  }
  return std::string("family=sm80 ") + dtype_name(key.dtype) + " head_dim=" + std::to_string(key.head_dim) +
         " block_q=" + std::to_string(key.block_q) + " block_kv=" + std::to_string(key.block_kv) +
         " num_warps=" + std::to_string(key.num_warps) + " async_copy=" + b(key.async_copy) +
         " eager_load_blocks=" + b(key.eager_load_blocks) + " swizzled=" + b(key.swizzled) +
         " q/k/v_mma_load_k_fragments=" + std::to_string(key.q_mma_load_k_fragments) + "/" +
         std::to_string(key.k_mma_load_k_fragments) + "/" + std::to_string(key.v_mma_load_k_fragments) +
         " mma_double_buffer_loads=" + b(key.mma_double_buffer_loads) +
         " optimized_softmax=" + b(key.optimized_softmax);
}

}  // namespace jax_flash
