// The consumers' register fragments as 16-bit matrices: a pair of accumulator n-tiles packed into the four 8x8
// matrices of one stmatrix.x4 / ldmatrix.x4 (which are also the wgmma A fragment of one k16 step), and the lane
// addressing of those instructions over a swizzled [rows][64] panel.
#pragma once

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

}  // namespace jax_flash::sm90
