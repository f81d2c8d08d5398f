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

// The three launches at traits T, whose kernel is compiled in kVariants.
template <class T, BwdVariants kVariants>
std::string run_bwd_at(const BackwardParams& bp, cudaStream_t stream) {
  constexpr int kHeadDim = T::kHeadDim;
  constexpr bool kBf16 = std::is_same_v<typename T::Element, __nv_bfloat16>;
  const AttentionParams& p = bp.p;
  CUtensorMap dq_map{}, q_map{}, do_map{}, dk_map{}, dv_map{};
  if (int64_t{p.batch} * p.seqlen_q * p.heads_q > 0) {
    if (bp.row_stats == nullptr || bp.stats_rows % 16 != 0 || bp.stats_rows < padded_stats_rows(p.seqlen_q)) {
      return "the sm90 backward needs the padded row statistics (BackwardParams::row_stats, stats_rows)";
    }
    std::string failure = encode_dq_accum_map(&dq_map, bp.dq_accum, p.batch, p.seqlen_q, p.heads_q, kHeadDim,
                                              T::kDQRowsPerWarpgroup);
    if (!failure.empty()) return failure;
    // Q and dO (dO laid out as q) in boxes of 64 columns x kBlockQ rows, the item tiles' panels
    for (auto [map, base] : {std::pair{&q_map, p.q}, std::pair{&do_map, bp.t.d_out}}) {
      failure = encode_bshd_map(map, base, kBf16, p.batch, p.seqlen_q, p.heads_q, kHeadDim, p.q_batch_stride,
                                p.q_seq_stride, p.q_head_stride, T::kBlockQ);
      if (!failure.empty()) return failure;
    }
  }
  if (int64_t{p.batch} * p.seqlen_k * p.heads_k > 0) {
    // dK and dV (laid out as k and v) in boxes of 64 columns x kBlockKV rows, the K / V tiles' panels
    std::string failure = encode_bshd_map(&dk_map, bp.t.dk, kBf16, p.batch, p.seqlen_k, p.heads_k, kHeadDim,
                                          p.k_batch_stride, p.k_seq_stride, p.k_head_stride, T::kBlockKV);
    if (failure.empty()) {
      failure = encode_bshd_map(&dv_map, bp.t.dv, kBf16, p.batch, p.seqlen_k, p.heads_k, kHeadDim,
                                p.v_batch_stride, p.v_seq_stride, p.v_head_stride, T::kBlockKV);
    }
    if (!failure.empty()) return failure;
  }
  return run_backward<T, BwdKernels<T>, kVariants>(bp, stream, dq_map, q_map, do_map, dk_map, dv_map);
}

// Head dim 128 calls without tensors or determinism run 80-row items (BwdTraits kSwapDQ), causal and soft-capped
// ones too (FlashAttention-3 keeps 64 rows for causal calls; on an H200 80 ran causal 1024-16384 keys 1.4-9.1%
// faster, soft-capped non-causal +5.1 to +7.9% and causal -0.4 to +5.7%).
inline bool wide_items(const BackwardParams& bp) {
  const AttentionParams& p = bp.p;
  return bp.dq_turns == nullptr && p.q_segment_ids == nullptr && p.bias == nullptr && p.mask == nullptr;
}

template <int kDType, int kHeadDim>
std::string run_attention_bwd_sm90(const BackwardParams& bp, cudaStream_t stream) {
  using Element = BwdElement<kDType>;
  if constexpr (kHeadDim == 128) {
    if (wide_items(bp)) return run_bwd_at<BwdTraits<Element, kHeadDim, 80>, BwdVariants::kPlain>(bp, stream);
    return run_bwd_at<BwdTraits<Element, kHeadDim>, BwdVariants::kOthers>(bp, stream);
  } else {
    return run_bwd_at<BwdTraits<Element, kHeadDim>, BwdVariants::kAll>(bp, stream);
  }
}

template <int kDType, int kHeadDim>
int bwd_smem_bytes_sm90() {  // the larger of the two tiles' at head dim 128
  constexpr int kDefault = BwdTraits<BwdElement<kDType>, kHeadDim>::kSmemBytes;
  if constexpr (kHeadDim == 128) {
    constexpr int kWide = BwdTraits<BwdElement<kDType>, kHeadDim, 80>::kSmemBytes;
    return kWide > kDefault ? kWide : kDefault;
  }
  return kDefault;
}

}  // namespace jax_flash::sm90
