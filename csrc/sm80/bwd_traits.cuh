// Compile-time shape of the sm80-family backward kernel (csrc/sm80/bwd_kernel.cuh) for one dtype and head dim.
// One thread block owns kBlockKV keys of one kv head and walks the query blocks (of every query head of the group)
// that see them: S^T, dP^T (kBlockKV x kBlockQ), then dV, dK (kBlockKV x D) and dQ (kBlockQ x D), each product with
// its own grid of warps over shared-memory operands.
#pragma once

#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

// A (kRows, kCols) shared-memory tile of 16-bit elements, kCols >= 64, in the swizzled layout of sm80/smem_tile.cuh
// (whose helpers read the members below under the names the forward's Traits give them).
template <class Element_, int kCols, int kThreads>
struct SmemTileShape {
  using Element = Element_;
  static constexpr int kHeadDim = kCols;  // the row width in elements
  static constexpr bool kSwizzled = true;
  static constexpr bool kAsyncCopy = true;
  static constexpr int kNumThreads = kThreads;
  static constexpr int kRowChunks = kCols / kChunkElems;
  static_assert(kCols >= 64 && kCols % 64 == 0, "the XOR swizzle permutes 8 chunks of 8 elements");
};

// Warps laid out kWarpsM x kWarpsN over a (kRows x kCols) product; each warp holds kMTiles m16 x kNTiles n8 tiles.
template <int kRows, int kCols, int kNumWarps>
struct WarpGrid {
  static constexpr int kWarpsM = kRows / 16 >= kNumWarps ? kNumWarps : kRows / 16;
  static constexpr int kWarpsN = kNumWarps / kWarpsM;
  static constexpr int kWarpRows = kRows / kWarpsM;
  static constexpr int kWarpCols = kCols / kWarpsN;
  static constexpr int kMTiles = kWarpRows / kMmaM;
  static constexpr int kNTiles = kWarpCols / kMmaN;
  static_assert(kWarpsM * kWarpsN == kNumWarps && kRows % (16 * kWarpsM) == 0 && kCols % (16 * kWarpsN) == 0,
                "each warp needs whole m16 tiles and pairs of n8 tiles");
  __device__ __forceinline__ static int row0(int warp) { return (warp / kWarpsN) * kWarpRows; }
  __device__ __forceinline__ static int col0(int warp) { return (warp % kWarpsN) * kWarpCols; }
};

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // 128 keys x 64 queries up to D = 128 (dK and dV: 2 x 16 x D fp32 accumulators per thread = 128 registers at
  // D = 128); 64 keys at D = 256 keep the same count.
  static constexpr int kBlockKV = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kBlockQ = 64;
  static constexpr int kNumWarps = 8;
  static constexpr int kNumThreads = kNumWarps * kWarpSize;

  using ScoreGrid = WarpGrid<kBlockKV, kBlockQ, kNumWarps>;   // S^T, dP^T
  using KVGrid = WarpGrid<kBlockKV, kHeadDim, kNumWarps>;     // dK, dV
  using QGrid = WarpGrid<kBlockQ, kHeadDim, kNumWarps>;       // dQ
  // dQ in column chunks of at most 64 per warp, so its accumulators (transient beside dK and dV) stay <= 32.
  static constexpr int kDQChunks = QGrid::kWarpCols > 64 ? QGrid::kWarpCols / 64 : 1;

  using RowTile = SmemTileShape<Element, kHeadDim, kNumThreads>;  // Q, dO, K, V: (rows, D)
  using ScoreTile = SmemTileShape<Element, kBlockQ, kNumThreads>;  // P^T, dS^T: (kBlockKV, kBlockQ)

  // Shared memory (elements): K, V; Q and dO twice (the next query block loads during this one); P^T, dS^T; then
  // float32 log2-lse and delta of the two query blocks.
  static constexpr int kKVElems = kBlockKV * kHeadDim;
  static constexpr int kQElems = kBlockQ * kHeadDim;
  static constexpr int kScoreElems = kBlockKV * kBlockQ;
  static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
  static constexpr int kSmemBytes = (2 * kKVElems + 4 * kQElems + 2 * kScoreElems) * kElemBytes + 4 * kBlockQ * 4;
};

}  // namespace jax_flash::sm80
