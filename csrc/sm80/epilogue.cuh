// The sm80 kernel's epilogue: O / l and the lse of each tile row, written to the output (rows past q_lengths[b] as
// zeros, lse -inf) or, for a split tile, to its range's partial (float32 O and lse, merged by
// common/split_combine.cuh); and the rows of a tile that sees no key.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "sm80/smem_tile.cuh"
#include "sm80/softmax.cuh"
#include "sm80/tile.cuh"
#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

template <class T>
struct Epilogue {
  using Element = typename T::Element;
  const AttentionParams& p;
  const Tile& t;

  __device__ __forceinline__ bool split() const { return p.num_splits > 1; }
  // Index of tile row r in (B, Hq, Sq) (the lse's layout and, times D, the partial O's within its range).
  __device__ __forceinline__ int64_t row_index(int r) const {
    return (t.batch * p.heads_q + t.head(r)) * p.seqlen_q + t.position(r);
  }
  __device__ __forceinline__ int64_t partial_row(int r) const {
    return (int64_t{t.split} * p.batch * p.heads_q * p.seqlen_q) + row_index(r);
  }
  __device__ __forceinline__ Element* o_row(int r) const {
    return static_cast<Element*>(p.o) + t.batch * p.o_batch_stride + t.head(r) * p.o_head_stride +
           int64_t{t.position(r)} * p.o_seq_stride;
  }
  __device__ __forceinline__ void store_lse(int r, float value) const {
    if (split()) {
      p.partial_lse[partial_row(r)] = value;
    } else if (p.lse != nullptr) {
      p.lse[t.batch * p.lse_batch_stride + t.head(r) * p.lse_head_stride + t.position(r)] = value;
    }
  }

  // No row of the tile sees a key of its range: zeros and lse = -inf (a split range: lse = -inf only; the combine
  // step reads no O of a range whose lse is -inf).
  __device__ __forceinline__ void write_zero_rows(int tid) const {
    if (!split()) {
      for (int i = tid; i < t.q_rows * T::kRowChunks; i += T::kNumThreads) {
        *reinterpret_cast<uint4*>(o_row(i / T::kRowChunks) + (i % T::kRowChunks) * kChunkElems) =
            make_uint4(0, 0, 0, 0);
      }
    }
    for (int r = tid; r < t.q_rows; r += T::kNumThreads) store_lse(r, -INFINITY);
  }

  // After softmax.finalize(acc_o): the lse of this warp's rows, then O.
  __device__ __forceinline__ void store(const OnlineSoftmax<T>& softmax, float (&acc_o)[T::kMTiles][T::kOTiles][4],
                                        Element* sQ, int warp_row0, int lane) const {
    if ((split() || p.lse != nullptr) && lane % 4 == 0) {  // one lane of each quad owns the row
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + m * kMmaM + lane / 4 + 8 * h;
          if (row < t.q_rows) store_lse(row, row < t.q_rows_valid ? softmax.lse(m, h, p.scale) : -INFINITY);
        }
    }
    if (split()) {
      store_partial_o(acc_o, warp_row0, lane);
    } else {
      store_o(acc_o, sQ, warp_row0, lane);
    }
  }

  // O -> this warp's rows of sQ (only this warp read them) -> 16-byte coalesced global stores.
  __device__ __forceinline__ void store_o(float (&acc_o)[T::kMTiles][T::kOTiles][4], Element* sQ, int warp_row0,
                                          int lane) const {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + m * kMmaM + lane / 4 + 8 * h;
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {
          *reinterpret_cast<uint32_t*>(sQ + tile_offset<T>(row, n) + 2 * (lane % 4)) =
              pack2<Element>(acc_o[m][n][2 * h], acc_o[m][n][2 * h + 1]);
        }
      }
    __syncwarp();
    constexpr int kWarpChunks = T::kRowsPerWarp * T::kRowChunks;
#pragma unroll
    for (int i = lane; i < kWarpChunks; i += kWarpSize) {
      const int row = warp_row0 + i / T::kRowChunks, chunk = i % T::kRowChunks;
      if (row < t.q_rows) {  // rows past q_lengths[b] are zeros
        *reinterpret_cast<uint4*>(o_row(row) + chunk * kChunkElems) =
            row < t.q_rows_valid ? *reinterpret_cast<const uint4*>(sQ + tile_offset<T>(row, chunk))
                                 : make_uint4(0, 0, 0, 0);
      }
    }
  }

  // A split range's normalised O, float32, straight from the accumulators (each quad writes 32 bytes per n8 tile).
  __device__ __forceinline__ void store_partial_o(float (&acc_o)[T::kMTiles][T::kOTiles][4], int warp_row0,
                                                  int lane) const {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + m * kMmaM + lane / 4 + 8 * h;
        if (row >= t.q_rows_valid) continue;  // lse -inf: never read
        float* o = p.partial_o + partial_row(row) * T::kHeadDim + 2 * (lane % 4);
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {
          *reinterpret_cast<float2*>(o + n * kMmaN) = make_float2(acc_o[m][n][2 * h], acc_o[m][n][2 * h + 1]);
        }
      }
  }
};

}  // namespace jax_flash::sm80
