// Shared-memory tiles of shape (rows, kHeadDim) stored as 16-byte chunks, optionally XOR-swizzled, and the
// cooperative global->shared copy that fills them (cp.async or plain 16-byte loads, zeros past the sequence end).
#pragma once

#include <cstdint>

#include "common/page_index.h"
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

// The ldmatrix row addresses of one lane over a tile, as 4 registers: lane_row / lane_chunk are this lane's part of
// (row, chunk); callers add a row offset that is a multiple of 8 and an even chunk offset, both compile-time
// constants. Under the swizzle (row % 8 is then fixed per lane) the physical chunk is
//   (chunk0 & ~7) + ((chunk0 & 6) ^ lane_chunk ^ lane_row % 8)
// so one base per value of chunk0 & 6 turns every address into base + immediate. Without this the compiler hoists
// each of the dozens of loop-invariant addresses into its own register.
template <class T>
struct LdmatrixAddresses {
  uint32_t base[4];

  __device__ __forceinline__ LdmatrixAddresses(const void* tile, int lane_row, int lane_chunk) {
    const uint32_t row_address = smem_address(tile) + lane_row * kRowBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int chunk = 2 * i + lane_chunk;
      base[i] = row_address + (T::kSwizzled ? (chunk ^ (lane_row & 7)) : chunk) * 16;
    }
  }

  __device__ __forceinline__ uint32_t operator()(int row0, int chunk0) const {
    return base[(chunk0 & 7) >> 1] + row0 * kRowBytes + (chunk0 & ~7) * 16;
  }

  static constexpr int kRowBytes = T::kHeadDim * static_cast<int>(sizeof(typename T::Element));
};

// Copies rows [0, kRows) of a (rows, D) global tile into shared memory; rows >= rows_valid become zeros so masked
// keys and padding query rows never carry garbage (or NaN) into the matrix products. Each thread copies one chunk
// column of rows tid/kRowChunks + i*kRowsPerStep: one base pointer and one stride, so the compiler has no per-step
// 64-bit offsets to hoist (and spill) across the KV loop.
template <class T, int kRows>
__device__ __forceinline__ void copy_tile_to_smem(typename T::Element* sTile, const typename T::Element* gTile,
                                                  int64_t row_stride, int rows_valid, int tid) {
  using Element = typename T::Element;
  static_assert(T::kNumThreads % T::kRowChunks == 0, "threads must cover whole rows");
  constexpr int kRowsPerStep = T::kNumThreads / T::kRowChunks;
  static_assert(kRows % kRowsPerStep == 0, "tile rows must split evenly over the threads");
  constexpr int kSteps = kRows / kRowsPerStep;
  const int row = tid / T::kRowChunks, chunk = tid % T::kRowChunks;
  const Element* src = gTile + row * row_stride + chunk * kChunkElems;
  const int64_t src_step = kRowsPerStep * row_stride;
  // Destination of step i; when kRowsPerStep is a multiple of 8 the swizzle phase repeats and this folds to
  // one base plus immediates.
  auto dst = [&](int i) { return sTile + tile_offset<T>(row + i * kRowsPerStep, chunk); };
  if constexpr (T::kAsyncCopy) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const bool valid = row + i * kRowsPerStep < rows_valid;
      cp_async_16(dst(i), valid ? src : gTile, valid);
      src += src_step;
    }
  } else {
    // All loads first, then all stores, so kSteps loads are in flight at once.
    uint4 staged[kSteps];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      staged[i] = row + i * kRowsPerStep < rows_valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
      src += src_step;
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      *reinterpret_cast<uint4*>(dst(i)) = staged[i];
    }
  }
}

}  // namespace jax_flash::sm80

namespace jax_flash::sm80 {

// copy_tile_to_smem for tiles whose rows have no single stride (packed GQA query rows, paged keys): row r of the
// tile starts at row_at(r), or is zeros where row_at gives nullptr (a page id out of range) or r >= rows_valid.
// Every lane calls row_at for every step, valid row or not (it may shuffle within the warp). `fallback`: any valid
// global address, the source operand of a zero-filling cp.async.
template <class T, int kRows, class RowAt>
__device__ __forceinline__ void copy_rows_to_smem(typename T::Element* sTile, RowAt row_at, int rows_valid,
                                                  const typename T::Element* fallback, int tid) {
  using Element = typename T::Element;
  static_assert(T::kNumThreads % T::kRowChunks == 0, "threads must cover whole rows");
  constexpr int kRowsPerStep = T::kNumThreads / T::kRowChunks;
  static_assert(kRows % kRowsPerStep == 0, "tile rows must split evenly over the threads");
  constexpr int kSteps = kRows / kRowsPerStep;
  const int row = tid / T::kRowChunks, chunk = tid % T::kRowChunks;
  auto src = [&](int i) -> const Element* {
    const int r = row + i * kRowsPerStep;
    const Element* start = row_at(r);
    return start != nullptr && r < rows_valid ? start + chunk * kChunkElems : nullptr;
  };
  auto dst = [&](int i) { return sTile + tile_offset<T>(row + i * kRowsPerStep, chunk); };
  if constexpr (T::kAsyncCopy) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const Element* from = src(i);
      cp_async_16(dst(i), from != nullptr ? from : fallback, from != nullptr);
    }
  } else {
    uint4 staged[kSteps];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const Element* from = src(i);
      staged[i] = from != nullptr ? *reinterpret_cast<const uint4*>(from) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) *reinterpret_cast<uint4*>(dst(i)) = staged[i];
  }
}

}  // namespace jax_flash::sm80

namespace jax_flash::sm80 {

// copy_tile_to_smem for a block of paged keys kv0 .. kv0 + kRows - 1: key kv0 + r is row (kv0 + r) % page_size of
// the page whose id lane (kv0 + r) / page_size - kv0 / page_size holds in lane_page (a page in [0, num_pages), else
// the row is zeros, as are rows r >= rows_valid). `g` is the kv head's row 0 of page 0; pages are page_stride
// elements apart. Each thread walks its rows by adding the row step to its offset in the page, wrapping into the
// next page: two page lookups per block (common/page_index.h, a multiply-high and a shift each) instead of two
// divisions per row (a division by a run-time page size is about 20 instructions, and the one-warp decode tile
// copies 32 rows per thread per block). Its copy loop is its own: written as a stateful row_at for
// copy_rows_to_smem, the one-warp decode tile compiled to 4.5% more instructions.
template <class T, int kRows>
__device__ __forceinline__ void copy_paged_rows_to_smem(typename T::Element* sTile, const typename T::Element* g,
                                                        int64_t page_stride, int64_t row_stride, int lane_page,
                                                        int kv0, const PageDivider& pages, int num_pages,
                                                        int rows_valid, int tid) {
  using Element = typename T::Element;
  static_assert(T::kNumThreads % T::kRowChunks == 0, "threads must cover whole rows");
  constexpr int kRowsPerStep = T::kNumThreads / T::kRowChunks;
  static_assert(kRows % kRowsPerStep == 0, "tile rows must split evenly over the threads");
  constexpr int kSteps = kRows / kRowsPerStep;
  const int row = tid / T::kRowChunks, chunk = tid % T::kRowChunks;
  const int first_key = kv0 + row;
  int slot = pages.page(first_key) - pages.page(kv0);  // which lane holds this row's page id
  int offset = pages.row(first_key);                  // the row within its page
  auto dst = [&](int i) { return sTile + tile_offset<T>(row + i * kRowsPerStep, chunk); };
  auto src = [&](int i) -> const Element* {  // (every lane shuffles, valid row or not)
    const int page = __shfl_sync(0xffffffffu, lane_page, slot);
    const bool valid = row + i * kRowsPerStep < rows_valid && page >= 0 && page < num_pages;
    const Element* from = valid ? g + page * page_stride + offset * row_stride + chunk * kChunkElems : nullptr;
    // Next row: into the next page at most once per 8 rows (page sizes are multiples of 8), without a branch, so
    // the copies of all steps issue back to back.
    offset += kRowsPerStep;
#pragma unroll
    for (int wrap = 0; wrap < (kRowsPerStep + 7) / 8; ++wrap) {
      const bool next_page = offset >= pages.size;
      offset -= next_page ? pages.size : 0;
      slot += next_page ? 1 : 0;
    }
    return from;
  };
  if constexpr (T::kAsyncCopy) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const Element* from = src(i);
      cp_async_16(dst(i), from != nullptr ? from : g, from != nullptr);
    }
  } else {
    uint4 staged[kSteps];
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const Element* from = src(i);
      staged[i] = from != nullptr ? *reinterpret_cast<const uint4*>(from) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) *reinterpret_cast<uint4*>(dst(i)) = staged[i];
  }
}

}  // namespace jax_flash::sm80

namespace jax_flash::sm80 {

// A block of kBlockKV paged keys that is two whole pages (page_size = kBlockKV / 2; key blocks start at multiples
// of kBlockKV, so at a page's first row): each half copied as one strided tile from the page whose id lane 0 / 1
// holds in lane_page (out of [0, num_pages): zeros), as a block inside one page is. Walked row by row instead, a
// 128-key block over 64-key pages cost the four-warp D = 128 decode tile 5-7% over contiguous (H100): a shuffle,
// two wide multiplies and the page wrap per row copied.
template <class T>
__device__ __forceinline__ void copy_two_pages_to_smem(typename T::Element* sTile, const typename T::Element* g,
                                                       int64_t page_stride, int64_t row_stride, int lane_page,
                                                       int num_pages, int rows_valid, int tid) {
  constexpr int kHalf = T::kBlockKV / 2;
  static_assert(kHalf % (T::kNumThreads / T::kRowChunks) == 0, "half a block must split evenly over the threads");
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int page = __shfl_sync(0xffffffffu, lane_page, half);
    const bool page_valid = page >= 0 && page < num_pages;
    copy_tile_to_smem<T, kHalf>(sTile + half * kHalf * T::kHeadDim, page_valid ? g + page * page_stride : g,
                                row_stride, page_valid ? rows_valid - half * kHalf : 0, tid);
  }
}

}  // namespace jax_flash::sm80
