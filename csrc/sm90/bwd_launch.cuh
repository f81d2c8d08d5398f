// run_attention_bwd_sm90: common/backward_launch.cuh's three launches around the sm90 backward kernel
// (sm90/bwd_kernel.cuh), which also takes the tensor maps its dQ reduce-adds and its Q / dO loads go through.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>
#include <utility>

#include "common/backward_launch.cuh"
#include "common/kernel_key.h"
#include "sm90/bwd_api.h"
#include "sm90/bwd_kernel.cuh"
#include "sm90/tensor_map.h"

namespace jax_flash::sm90 {

template <class T>
struct BwdKernels {
  template <bool kMask, bool kSoftcap, bool kDeterministic, BwdTensors kTensors = BwdTensors::kNone>
  static auto get() { return attention_bwd_kernel<T, kMask, kSoftcap, kDeterministic, kTensors>; }
};

template <int kDType>
using BwdElement = std::conditional_t<kDType == static_cast<int>(DType::kBFloat16), __nv_bfloat16, __half>;

template <int kDType, int kHeadDim>
std::string run_attention_bwd_sm90(const BackwardParams& bp, cudaStream_t stream) {
  using T = BwdTraits<BwdElement<kDType>, kHeadDim>;
  const AttentionParams& p = bp.p;
  CUtensorMap dq_map{}, q_map{}, do_map{}, dk_map{}, dv_map{};
  if (int64_t{p.batch} * p.seqlen_q * p.heads_q > 0) {
    if (bp.row_stats == nullptr || bp.stats_rows % kStatsRowAlign != 0 || bp.stats_rows < p.seqlen_q) {
      return "the sm90 backward needs the padded row statistics (BackwardParams::row_stats, stats_rows)";
    }
    std::string failure = encode_dq_accum_map(&dq_map, bp.dq_accum, p.batch, p.seqlen_q, p.heads_q, kHeadDim,
                                              T::kDQRowsPerWarpgroup);
    if (!failure.empty()) return failure;
    // Q and dO (dO laid out as q) in boxes of 64 columns x kBlockQ rows, the item tiles' panels
    constexpr bool kBf16 = kDType == static_cast<int>(DType::kBFloat16);
    for (auto [map, base] : {std::pair{&q_map, p.q}, std::pair{&do_map, bp.t.d_out}}) {
      failure = encode_bshd_map(map, base, kBf16, p.batch, p.seqlen_q, p.heads_q, kHeadDim, p.q_batch_stride,
                                p.q_seq_stride, p.q_head_stride, T::kBlockQ);
      if (!failure.empty()) return failure;
    }
  }
  if (int64_t{p.batch} * p.seqlen_k * p.heads_k > 0) {
    // dK and dV (laid out as k and v) in boxes of 64 columns x kBlockKV rows, the K / V tiles' panels
    constexpr bool kBf16 = kDType == static_cast<int>(DType::kBFloat16);
    std::string failure = encode_bshd_map(&dk_map, bp.t.dk, kBf16, p.batch, p.seqlen_k, p.heads_k, kHeadDim,
                                          p.k_batch_stride, p.k_seq_stride, p.k_head_stride, T::kBlockKV);
    if (failure.empty()) {
      failure = encode_bshd_map(&dv_map, bp.t.dv, kBf16, p.batch, p.seqlen_k, p.heads_k, kHeadDim,
                                p.v_batch_stride, p.v_seq_stride, p.v_head_stride, T::kBlockKV);
    }
    if (!failure.empty()) return failure;
  }
  return run_backward<T, BwdKernels<T>>(bp, stream, dq_map, q_map, do_map, dk_map, dv_map);
}

template <int kDType, int kHeadDim>
int bwd_smem_bytes_sm90() {
  return BwdTraits<BwdElement<kDType>, kHeadDim>::kSmemBytes;
}

}  // namespace jax_flash::sm90
