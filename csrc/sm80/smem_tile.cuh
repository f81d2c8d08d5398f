// Shared-memory tiles of shape (rows, kHeadDim) stored as 16-byte chunks, optionally XOR-swizzled, and the
// cooperative global->shared copy that fills them (cp.async or plain 16-byte loads, zeros past the sequence end).
#pragma once

#include <cstdint>

#include "sm80/ptx.cuh"
#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

// Element offset of (row, 16-byte chunk) in a tile. Swizzled: chunk ^ (row % 8), so the 8 rows one ldmatrix
// phase reads land in 8 different 16-byte bank groups instead of one (an 8-way conflict for D >= 64).
template <class T>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  const int physical_chunk = T::kSwizzled ? (chunk ^ (row & 7)) : chunk;
  return row * T::kHeadDim + physical_chunk * kChunkElems;
}

// Copies rows [0, kRows) of a (rows, D) global tile into shared memory; rows >= rows_valid become zeros so masked
// keys and padding query rows never carry garbage (or NaN) into the matrix products.
template <class T, int kRows>
__device__ __forceinline__ void copy_tile_to_smem(typename T::Element* sTile, const typename T::Element* gTile,
                                                  int64_t row_stride, int rows_valid, int tid) {
  using Element = typename T::Element;
  constexpr int kChunks = kRows * T::kRowChunks;
  static_assert(kChunks % T::kNumThreads == 0, "tile chunks must split evenly over the threads");
  constexpr int kIters = kChunks / T::kNumThreads;
  if constexpr (T::kAsyncCopy) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int idx = i * T::kNumThreads + tid;
      const int row = idx / T::kRowChunks, chunk = idx % T::kRowChunks;
      const bool valid = row < rows_valid;
      const Element* src = gTile + (valid ? row * row_stride + chunk * kChunkElems : 0);
      cp_async_16(sTile + tile_offset<T>(row, chunk), src, valid);
    }
  } else {
    // All loads first, then all stores, so kIters loads are in flight at once.
    uint4 staged[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int idx = i * T::kNumThreads + tid;
      const int row = idx / T::kRowChunks, chunk = idx % T::kRowChunks;
      staged[i] = row < rows_valid
                      ? *reinterpret_cast<const uint4*>(gTile + row * row_stride + chunk * kChunkElems)
                      : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int idx = i * T::kNumThreads + tid;
      const int row = idx / T::kRowChunks, chunk = idx % T::kRowChunks;
      *reinterpret_cast<uint4*>(sTile + tile_offset<T>(row, chunk)) = staged[i];
    }
  }
}

}  // namespace jax_flash::sm80
