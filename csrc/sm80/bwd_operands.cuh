// mma.sync m16n8k16 operand fragments read with ldmatrix from swizzled shared-memory tiles (sm80/smem_tile.cuh), in
// the four storage orders the backward's products need, and the warp product over them.
//   A (m x k):  RowMajorA reads a tile stored (m rows, k cols); TransposedA one stored (k rows, m cols).
//   B (k x n):  RowMajorB reads a tile stored (n rows, k cols) (B^T row-major, as K in S = Q K^T);
//               TransposedB one stored (k rows, n cols) (as V in O = P V).
// Row offsets are multiples of 8 and chunk offsets even, so each address is one of four bases plus an immediate.
#pragma once

#include <cstdint>

#include "sm80/ptx.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/warp_gemm.cuh"  // zero_fill

namespace jax_flash::sm80 {

template <class Tile>
struct RowMajorA {
  LdmatrixAddresses<Tile> addr;
  // matrices (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi) = a0..a3
  __device__ __forceinline__ RowMajorA(const void* tile, int lane) : addr(tile, lane % 16, lane / 16) {}
  __device__ __forceinline__ void operator()(uint32_t (&r)[4], int m0, int step) const {
    ldmatrix_x4(r, addr(m0, 2 * step));
  }
};

template <class Tile>
struct TransposedA {
  LdmatrixAddresses<Tile> addr;
  // a0..a3 are the transposes of the stored blocks (k lo, m lo), (k lo, m hi), (k hi, m lo), (k hi, m hi)
  __device__ __forceinline__ TransposedA(const void* tile, int lane)
      : addr(tile, (lane / 16) * 8 + lane % 8, (lane / 8) % 2) {}
  __device__ __forceinline__ void operator()(uint32_t (&r)[4], int m0, int step) const {
    ldmatrix_x4_trans(r, addr(step * kMmaK, m0 / kChunkElems));
  }
};

// B loaders fill two n8 tiles: r[0], r[1] for columns n0..n0+7 and r[2], r[3] for n0+8..n0+15.
template <class Tile>
struct RowMajorB {
  LdmatrixAddresses<Tile> addr;
  // (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi)
  __device__ __forceinline__ RowMajorB(const void* tile, int lane)
      : addr(tile, (lane / 16) * 8 + lane % 8, (lane / 8) % 2) {}
  __device__ __forceinline__ void operator()(uint32_t (&r)[4], int n0, int step) const {
    ldmatrix_x4(r, addr(n0, 2 * step));
  }
};

template <class Tile>
struct TransposedB {
  LdmatrixAddresses<Tile> addr;
  // stored (k lo, n 0-7), (k hi, n 0-7), (k lo, n 8-15), (k hi, n 8-15), each transposed
  __device__ __forceinline__ TransposedB(const void* tile, int lane)
      : addr(tile, ((lane / 8) % 2) * 8 + lane % 8, lane / 16) {}
  __device__ __forceinline__ void operator()(uint32_t (&r)[4], int n0, int step) const {
    ldmatrix_x4_trans(r, addr(step * kMmaK, n0 / kChunkElems));
  }
};

// acc (kMTiles x kNTiles n8 tiles, fp32) += A (rows m0.., kKSteps * 16) B (kKSteps * 16, cols n0..), one k16 step
// of fragments at a time.
template <typename Element, int kKSteps, int kMTiles, int kNTiles, class LoadA, class LoadB>
__device__ __forceinline__ void smem_gemm(float (&acc)[kMTiles][kNTiles][4], const LoadA& load_a, int m0,
                                          const LoadB& load_b, int n0) {
  static_assert(kNTiles % 2 == 0, "B fragments load in pairs of n8 tiles");
#pragma unroll
  for (int step = 0; step < kKSteps; ++step) {
    uint32_t a[kMTiles][4];
    uint32_t b[kNTiles][2];
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) load_a(a[m], m0 + m * kMmaM, step);
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t r[4];
      load_b(r, n0 + np * 2 * kMmaN, step);
      b[2 * np][0] = r[0];
      b[2 * np][1] = r[1];
      b[2 * np + 1][0] = r[2];
      b[2 * np + 1][1] = r[3];
    }
#pragma unroll
    for (int m = 0; m < kMTiles; ++m)
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) mma_16816<Element>(acc[m][n], a[m], b[n][0], b[n][1]);
  }
}

}  // namespace jax_flash::sm80
