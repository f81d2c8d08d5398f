// run_attention_sm90_fp8: the sm90 forward of float8_e4m3fn q, k and v (common/params.h, qk_descale): the TMA
// maps (q, k and v in boxes of 128 one-byte columns, v's blocks transposed in shared memory, v_transpose.cuh;
// o bfloat16 in boxes of 64 columns), then the masked or unmasked variant of the same kernel as the 16-bit calls
// (launch.cuh). Calls run unsplit, on contiguous K / V, without packed GQA, segment ids,
// bias / mask tensors or a softcap: jax_flash/fp8.py runs those on the 16-bit kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "sm90/launch.cuh"

namespace jax_flash::sm90 {

template <KernelKey kKey>
std::string run_attention_sm90_fp8(const AttentionParams& params, cudaStream_t stream) {
  using T = Traits<kKey>;
  static_assert(T::kFp8, "run_attention_sm90_fp8 takes a float8_e4m3fn key");
  AttentionParams p = params;
  if (p.softcap > 0.0f || p.pack_gqa > 1 || p.num_splits > 1 || p.page_table != nullptr ||
      p.q_segment_ids != nullptr || p.bias != nullptr || p.mask != nullptr || p.qk_descale == nullptr ||
      p.v_descale == nullptr) {
    return "the sm90 FP8 kernel takes contiguous K / V and descale factors, without softcap, packed GQA, split key "
           "ranges, segment ids or bias / mask tensors";
  }
  p.num_q_blocks = static_cast<int>((int64_t{p.seqlen_q} + T::kBlockQ - 1) / T::kBlockQ);
  constexpr CUtensorMapDataType kU8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  CUtensorMap map_q{}, map_k{}, map_v{}, map_o{};
  std::string failure = encode_bshd_map(&map_q, p.q, kU8, 1, p.batch, p.seqlen_q, p.heads_q, p.head_dim,
                                        p.q_batch_stride, p.q_seq_stride, p.q_head_stride, T::kBlockQ);
  if (failure.empty() && p.seqlen_k > 0 && p.batch > 0) {
    failure = encode_bshd_map(&map_k, p.k, kU8, 1, p.batch, p.seqlen_k, p.heads_k, p.head_dim, p.k_batch_stride,
                              p.k_seq_stride, p.k_head_stride, T::kBlockKV);
  }
  if (failure.empty() && p.seqlen_k > 0 && p.batch > 0) {
    failure = encode_bshd_map(&map_v, p.v, kU8, 1, p.batch, p.seqlen_k, p.heads_k, p.head_dim, p.v_batch_stride,
                              p.v_seq_stride, p.v_head_stride, T::kBlockKV);
  }
  if (failure.empty()) {
    failure = encode_bshd_map(&map_o, p.o, true, p.batch, p.seqlen_q, p.heads_q, p.head_dim, p.o_batch_stride,
                              p.o_seq_stride, p.o_head_stride, 64);
  }
  if (!failure.empty()) return failure;
  p.batch_inner = 0;
  const bool mask_blocks = p.window_left < kUnbounded || p.window_right < kUnbounded || p.kv_lengths != nullptr ||
                           p.seqlen_k % T::kBlockKV != 0;
  return mask_blocks ? launch_sm90<T, true, false>(p, map_q, map_k, map_v, map_o, stream)
                     : launch_sm90<T, false, false>(p, map_q, map_k, map_v, map_o, stream);
}

}  // namespace jax_flash::sm90
