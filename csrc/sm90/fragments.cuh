// The consumers' register fragments as 16-bit matrices: a pair of accumulator n-tiles packed into the four 8x8
// matrices of one stmatrix.x4 / ldmatrix.x4 (which are also the wgmma A fragment of one k16 step), and the lane
// addressing of those instructions over a swizzled [rows][64] panel; FP8's k32 A fragment of P (pack_k32_e4m3).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "common/fragment_ops.cuh"  // pack2

namespace jax_flash::sm90 {

// Lane l gives the address of row l%8 of 8x8 matrix l/8 of k16 step t: row 16 * warp + l%8 + 8 * ((l/8) % 2) of the
// warpgroup's 64 (this returns it without the warp's 16 * warp), 16-byte chunk 2t + (l/8)/2 of the row (panel t/4,
// chunk 2(t%4) + (l/8)/2 inside it, XOR-swizzled by the row's low 3 bits, which are l%8).
__device__ __forceinline__ int fragment_row_of(int warp_in_wg, int l) {
  return 16 * warp_in_wg + l % 8 + 8 * ((l / 8) % 2);
}
__device__ __forceinline__ uint32_t fragment_chunk_of(int t, int l) {
  return static_cast<uint32_t>((2 * (t % 4) + (l / 8) / 2) ^ (l % 8));
}

// Accumulator n-tiles 2t and 2t + 1 (this warp's 16 rows x columns 16t .. 16t + 15) packed to 16 bits.
template <class Element, int kTiles>
__device__ __forceinline__ void pack_k16(const float (&acc)[1][kTiles][4], int t, uint32_t (&a)[4]) {
  a[0] = pack2<Element>(acc[0][2 * t][0], acc[0][2 * t][1]);
  a[1] = pack2<Element>(acc[0][2 * t][2], acc[0][2 * t][3]);
  a[2] = pack2<Element>(acc[0][2 * t + 1][0], acc[0][2 * t + 1][1]);
  a[3] = pack2<Element>(acc[0][2 * t + 1][2], acc[0][2 * t + 1][3]);
}

// FP8: accumulator n-tiles 4t .. 4t + 3 (columns 32t .. 32t + 31) rounded to e4m3 (saturating) as the A fragment of
// k32 step t. Byte i of register 0 (2) holds k position 4 * (lane % 4) + i (+ 16) of row lane / 4, registers 1 / 3
// the row 8 below, while the accumulator holds columns 2 * (lane % 4) + {0, 1} of each n-tile: register 0 takes
// tiles 4t and 4t + 1, register 2 tiles 4t + 2 and 4t + 3, with no exchange between lanes. So k position
// p = 16h + 4c + 2u + v (c = lane % 4) carries column 16h + 8u + 2c + v, and V^T holds its keys in that order within
// each 32 (v_transpose.cuh).
__device__ __forceinline__ uint32_t pack4_e4m3(float c0, float c1, float c2, float c3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(c0, c1), __NV_SATFINITE, __NV_E4M3);  // c0: byte 0
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c2, c3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}
template <int kTiles>
__device__ __forceinline__ void pack_k32_e4m3(const float (&acc)[1][kTiles][4], int t, uint32_t (&a)[4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // row half h: elements 2h, 2h + 1 of each tile
    a[h] = pack4_e4m3(acc[0][4 * t][2 * h], acc[0][4 * t][2 * h + 1], acc[0][4 * t + 1][2 * h],
                      acc[0][4 * t + 1][2 * h + 1]);
    a[2 + h] = pack4_e4m3(acc[0][4 * t + 2][2 * h], acc[0][4 * t + 2][2 * h + 1], acc[0][4 * t + 3][2 * h],
                          acc[0][4 * t + 3][2 * h + 1]);
  }
}

// P's A fragment of k step t: pack_k16 for 16-bit elements, pack_k32_e4m3 for FP8.
template <class Element, int kTiles>
__device__ __forceinline__ void pack_p_step(const float (&acc)[1][kTiles][4], int t, uint32_t (&a)[4]) {
  if constexpr (sizeof(Element) == 1) {
    pack_k32_e4m3(acc, t, a);
  } else {
    pack_k16<Element>(acc, t, a);
  }
}

}  // namespace jax_flash::sm90
