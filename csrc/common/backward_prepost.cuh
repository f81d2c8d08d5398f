// The steps around the backward kernels of both GPU families: before it, delta = rowsum(dO o O) - d_lse per row,
// dq_accum = 0 and the deterministic dQ turns = 0; after it, dq = dq_accum in the input dtype. Both are
// memory-bound passes over (B, Sq, Hq, D).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/backward_params.h"
#include "common/backward_rows.cuh"  // lse2_of
#include "common/fragment_ops.cuh"  // pack2

namespace jax_flash {

inline constexpr int kPrepostThreads = 256;
inline constexpr int kVectorElems = 8;  // one 16-byte vector of 16-bit elements

template <class Element>
__device__ __forceinline__ float to_float(Element x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// One group of D / 8 lanes per (b, i, h) row, 8 elements per lane: rows are flat over q's contiguous layout.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) attention_bwd_preprocess(const __grid_constant__ BackwardParams bp) {
  constexpr int kLanesPerRow = kHeadDim / kVectorElems;  // 8, 16 or 32: a power of two inside one warp
  constexpr int kRowsPerBlock = kPrepostThreads / kLanesPerRow;
  const AttentionParams& p = bp.p;
  const int64_t rows = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int chunk = threadIdx.x % kLanesPerRow;
  const bool valid = row < rows;  // every lane reaches the shuffles; only valid rows load and store
  const int64_t offset = valid ? row * kHeadDim + chunk * kVectorElems : 0;
  float dot = 0.0f;
  if (valid) {
    const uint4 o_raw = *reinterpret_cast<const uint4*>(static_cast<const Element*>(bp.t.out) + offset);
    const uint4 do_raw = *reinterpret_cast<const uint4*>(static_cast<const Element*>(bp.t.d_out) + offset);
    const Element* o = reinterpret_cast<const Element*>(&o_raw);
    const Element* d_o = reinterpret_cast<const Element*>(&do_raw);
#pragma unroll
    for (int e = 0; e < kVectorElems; ++e) dot += to_float(o[e]) * to_float(d_o[e]);
  }
#pragma unroll
  for (int width = kLanesPerRow / 2; width > 0; width /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, width);
  if (!valid) return;
  float4* dq_accum = reinterpret_cast<float4*>(bp.dq_accum + offset);
  dq_accum[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  dq_accum[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const int64_t h = row % p.heads_q, bi = row / p.heads_q;
  const int64_t i = bi % p.seqlen_q, b = bi / p.seqlen_q;
  if (chunk == 0) {  // row = (b * Sq + i) * Hq + h  ->  delta / lse index (b, h, i)
    const int64_t stat = b * p.lse_batch_stride + h * p.lse_head_stride + i;
    const float delta = dot - (bp.t.d_lse != nullptr ? bp.t.d_lse[stat] : 0.0f);
    bp.delta[stat] = delta;
    if (bp.dq_turns != nullptr && row < bp.dq_turn_count) bp.dq_turns[row] = 0;  // (there are fewer than rows)
    if (bp.row_stats != nullptr) {
      const int64_t at = (b * p.heads_q + h) * bp.stats_rows + i;
      bp.row_stats[at] = i < batch_lengths(p, b).q_len ? lse2_of(bp.t.lse[stat]) : INFINITY;
      bp.row_stats[int64_t{p.batch} * p.heads_q * bp.stats_rows + at] = p.softcap > 0.0f ? delta : delta * p.scale;
    }
  }
  if (chunk == 1 && bp.row_stats != nullptr) {  // the padding rows Sq.. of (b, h), spread over its rows
    const int64_t base = (b * p.heads_q + h) * bp.stats_rows;
    for (int64_t pad = p.seqlen_q + i; pad < bp.stats_rows; pad += p.seqlen_q) {
      bp.row_stats[base + pad] = INFINITY;
      bp.row_stats[int64_t{p.batch} * p.heads_q * bp.stats_rows + base + pad] = 0.0f;
    }
  }
}

// dq = dq_accum, 8 elements per thread.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kPrepostThreads) attention_bwd_convert_dq(const __grid_constant__ BackwardParams bp) {
  const AttentionParams& p = bp.p;
  const int64_t vectors = int64_t{p.batch} * p.seqlen_q * p.heads_q * (kHeadDim / kVectorElems);
  const int64_t v = int64_t{blockIdx.x} * kPrepostThreads + threadIdx.x;
  if (v >= vectors) return;
  const float4* src = reinterpret_cast<const float4*>(bp.dq_accum) + 2 * v;
  const float4 lo = src[0], hi = src[1];
  uint4 packed;
  packed.x = pack2<Element>(lo.x, lo.y);
  packed.y = pack2<Element>(lo.z, lo.w);
  packed.z = pack2<Element>(hi.x, hi.y);
  packed.w = pack2<Element>(hi.z, hi.w);
  reinterpret_cast<uint4*>(bp.t.dq)[v] = packed;
}

}  // namespace jax_flash
