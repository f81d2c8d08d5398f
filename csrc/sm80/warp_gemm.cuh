// One warp's share of a block matrix product on mma.sync.m16n8k16, with the fragment-load schedule the config
// asks for: fragments come from shared memory in chunks of kAChunk / kBChunk k16-steps (0 = operand already in
// registers), and with double buffering the next chunk's ldmatrix is issued before the current chunk's mma.
#pragma once

#include <cstdint>

#include "sm80/ptx.cuh"

namespace jax_flash::sm80 {

// acc (kMTiles x kNTiles n8-tiles, fp32) += A (kMTiles*16, kKSteps*16) B (kKSteps*16, kNTiles*8).
// load_a(step) fills rA[.][step]; load_b(step) fills rB[step]. Both are called with compile-time-constant steps
// after unrolling, so the register arrays stay in registers.
template <typename Element, int kKSteps, int kAChunk, int kBChunk, bool kDoubleBuffer, int kMTiles, int kNTiles,
          class LoadA, class LoadB>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMTiles][kNTiles][4], uint32_t (&rA)[kMTiles][kKSteps][4],
                                          uint32_t (&rB)[kKSteps][kNTiles][2], LoadA&& load_a, LoadB&& load_b) {
  static_assert(kKSteps % (kAChunk > 0 ? kAChunk : 1) == 0, "A chunk must divide the k steps");
  static_assert(kBChunk > 0 && kKSteps % kBChunk == 0, "B chunk must divide the k steps");
  auto load_a_chunk = [&](int first) {
#pragma unroll
    for (int s = 0; s < kAChunk; ++s) load_a(first + s);
  };
  auto load_b_chunk = [&](int first) {
#pragma unroll
    for (int s = 0; s < kBChunk; ++s) load_b(first + s);
  };
#pragma unroll
  for (int step = 0; step < kKSteps; ++step) {
    if constexpr (kDoubleBuffer) {
      // Prologue loads chunk 0; at the first step of each chunk, the next chunk is requested before any mma.
      if (step == 0) {
        if constexpr (kAChunk > 0) load_a_chunk(0);
        load_b_chunk(0);
      }
      if constexpr (kAChunk > 0) {
        if (step % kAChunk == 0 && step + kAChunk < kKSteps) load_a_chunk(step + kAChunk);
      }
      if (step % kBChunk == 0 && step + kBChunk < kKSteps) load_b_chunk(step + kBChunk);
    } else {
      if constexpr (kAChunk > 0) {
        if (step % kAChunk == 0) load_a_chunk(step);
      }
      if (step % kBChunk == 0) load_b_chunk(step);
    }
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) mma_16816<Element>(acc[m][n], rA[m][step], rB[step][n][0], rB[step][n][1]);
    }
  }
}

// Accumulator tiles set to zero.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero_fill(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
}

// The A fragments of P V from the fp32 accumulators of S (the mma.sync accumulator layout of n8 tiles 2t and 2t + 1
// is the A fragment layout of k16 step t), rounded to Element.
template <typename Element, int kMTiles, int kSTiles>
__device__ __forceinline__ void accumulators_to_a_fragments(const float (&acc_s)[kMTiles][kSTiles][4],
                                                            uint32_t (&rP)[kMTiles][kSTiles / 2][4]) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int t = 0; t < kSTiles / 2; ++t) {
      rP[m][t][0] = pack2<Element>(acc_s[m][2 * t][0], acc_s[m][2 * t][1]);
      rP[m][t][1] = pack2<Element>(acc_s[m][2 * t][2], acc_s[m][2 * t][3]);
      rP[m][t][2] = pack2<Element>(acc_s[m][2 * t + 1][0], acc_s[m][2 * t + 1][1]);
      rP[m][t][3] = pack2<Element>(acc_s[m][2 * t + 1][2], acc_s[m][2 * t + 1][3]);
    }
}

}  // namespace jax_flash::sm80
