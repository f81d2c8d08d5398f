// The FFI attributes of the jax_flash_attention custom call, decoded by XLA into one struct.
// Member names equal the Python KernelConfig field names (jax_flash/config.py) and the lowering's keyword names.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_flash {

struct AttentionAttrs {
  int64_t block_q;
  int64_t block_kv;
  int64_t num_warps;
  int64_t async_copy;
  int64_t eager_load_blocks;
  int64_t swizzled;
  int64_t q_mma_load_k_fragments;
  int64_t k_mma_load_k_fragments;
  int64_t v_mma_load_k_fragments;
  int64_t mma_double_buffer_loads;
  int64_t optimized_softmax;
  int64_t family;  // 80 or 90 (KernelKey::family)
  int64_t stages;
  int64_t consumer_warpgroups;
  int64_t pingpong;
  int64_t overlap;
  float softmax_scale;
  int64_t causal;          // bottom-right aligned
  int64_t window_left;     // -1 = unbounded
  int64_t window_right;    // -1 = unbounded
  float softcap;           // 0 = off
  int64_t has_q_lengths;   // read the q_lengths operand (else every row is valid)
  int64_t has_kv_lengths;  // read the kv_lengths operand (else every key is valid)
  int64_t return_lse;      // write the lse result
};

}  // namespace jax_flash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_flash::AttentionAttrs,
                                      ::xla::ffi::StructMember<int64_t>("block_q"),
                                      ::xla::ffi::StructMember<int64_t>("block_kv"),
                                      ::xla::ffi::StructMember<int64_t>("num_warps"),
                                      ::xla::ffi::StructMember<int64_t>("async_copy"),
                                      ::xla::ffi::StructMember<int64_t>("eager_load_blocks"),
                                      ::xla::ffi::StructMember<int64_t>("swizzled"),
                                      ::xla::ffi::StructMember<int64_t>("q_mma_load_k_fragments"),
                                      ::xla::ffi::StructMember<int64_t>("k_mma_load_k_fragments"),
                                      ::xla::ffi::StructMember<int64_t>("v_mma_load_k_fragments"),
                                      ::xla::ffi::StructMember<int64_t>("mma_double_buffer_loads"),
                                      ::xla::ffi::StructMember<int64_t>("optimized_softmax"),
                                      ::xla::ffi::StructMember<int64_t>("family"),
                                      ::xla::ffi::StructMember<int64_t>("stages"),
                                      ::xla::ffi::StructMember<int64_t>("consumer_warpgroups"),
                                      ::xla::ffi::StructMember<int64_t>("pingpong"),
                                      ::xla::ffi::StructMember<int64_t>("overlap"),
                                      ::xla::ffi::StructMember<float>("softmax_scale"),
                                      ::xla::ffi::StructMember<int64_t>("causal"),
                                      ::xla::ffi::StructMember<int64_t>("window_left"),
                                      ::xla::ffi::StructMember<int64_t>("window_right"),
                                      ::xla::ffi::StructMember<float>("softcap"),
                                      ::xla::ffi::StructMember<int64_t>("has_q_lengths"),
                                      ::xla::ffi::StructMember<int64_t>("has_kv_lengths"),
                                      ::xla::ffi::StructMember<int64_t>("return_lse"));
