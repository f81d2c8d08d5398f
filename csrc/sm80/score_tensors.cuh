// Segment ids, bias and mask tensors on one warp's score fragments (common/params.h): s += bias[b, h, i, j] after
// the softcap, and -inf where mask[b, h, i, j] is 0 or the query's and the key's segment ids differ. Element e of
// tile (m, n) is row 16m + lane/4 + 8*(e/2) of the warp, key kv0 + 8n + 2*(lane%4) + e%2 (mma m16n8 layout).
// The bias and mask are read straight from global memory (broadcast dimensions have stride 0). A block's kv segment
// ids are loaded into registers once per warp; read per element instead (each m-tile again, from L1) the 128-row
// tiles spilled twice as many bytes.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/alibi.h"
#include "common/mask_blocks.cuh"
#include "common/params.h"
#include "common/segment_blocks.cuh"
#include "sm80/tile.cuh"
#include "sm80/traits.cuh"

namespace jax_flash::sm80 {

template <class T>
struct ScoreTensors {
  const AttentionParams& p;
  const Tile& t;
  int first_row;  // this lane's first row in the tile: warp_row0 + lane / 4
  int q_segment[T::kMTiles][2];
  int kv_segment[T::kSTiles][2];
  bool test_segments = false;  // this block's scores need the per-element segment test

  // Tile row r (valid or past the tensor's end: clamped to the last row, whose results are dropped) as
  // (query position, query head).
  __device__ __forceinline__ void locate(int r, int& position, int64_t& head) const {
    const int row = min(t.row0 + r, t.row0 + max(t.q_rows - 1, 0));
    if (t.pack == 1) {  // (no division: the common case)
      position = row;
      head = t.head0;
      return;
    }
    position = row / t.pack;
    head = t.head0 + (row - position * t.pack);
  }

  __device__ __forceinline__ ScoreTensors(const AttentionParams& params, const Tile& tile, int warp_row0, int lane)
      : p(params), t(tile), first_row(warp_row0 + lane / 4) {}

  // f(m, h, position, head) for each of this lane's rows: row first_row + 16m + 8h of the tile, located.
  template <class F>
  __device__ __forceinline__ void for_each_row(F f) const {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int position;
        int64_t head;
        locate(first_row + 16 * m + 8 * h, position, head);
        f(m, h, position, head);
      }
  }

  // The q segment ids of this lane's rows (once per tile).
  __device__ __forceinline__ void load_query_segments() {
    if (p.q_segment_ids == nullptr) return;
    for_each_row([&](int m, int h, int position, int64_t) {
      q_segment[m][h] = __ldg(p.q_segment_ids + t.batch * p.q_segment_stride + position);
    });
  }

  // The key blocks of [begin, end) the tile visits: with segment ids and their pre-pass, those whose kv id range
  // meets the range of the tile's valid rows; with the mask pre-pass, those whose mask tile holds a nonzero entry
  // (each warp computes it whole, so every warp walks the same blocks). The pre-pass flags tiles of kBlockQ query
  // positions of one head; a packed tile (pack heads x its positions) uses them where the mask is shared by the heads
  // and its positions lie in one such tile (a superset of its rows: a flag can only keep a block, never drop one).
  __device__ __forceinline__ VisibleBlocks visible_blocks(int begin, int end, int lane) const {
    VisibleBlocks blocks{nullptr, 0, 0, end};
    if (p.mask_blocks != nullptr) {
      const int q_block = t.pack == 1 ? t.row0 / T::kBlockQ : t.row0 / t.pack / T::kBlockQ;
      const bool one_tile =
          t.pack == 1 || (p.mask_strides[1] == 0 && (t.row0 + max(t.q_rows, 1) - 1) / t.pack / T::kBlockQ == q_block);
      if (one_tile) {
        const MaskBlockShape shape = MaskBlockShape::of(p, T::kBlockQ, T::kBlockKV);
        blocks.mask_flags = p.mask_blocks + shape.row(p.mask_strides[0] != 0 ? t.batch : 0,
                                                      p.mask_strides[1] != 0 ? t.head0 : 0,
                                                      p.mask_strides[2] != 0 ? q_block : 0);
      }
    }
    const bool segments = p.kv_block_segments != nullptr && p.q_segment_ids != nullptr;
    if (!segments && blocks.mask_flags == nullptr) return blocks;
    blocks.base = begin;
    if (!segments) {
      blocks.refill(begin, lane);
      return blocks;
    }
    int lo = INT_MAX, hi = INT_MIN;
    for (int r = lane; r < t.q_rows_valid; r += kWarpSize) {
      int position;
      int64_t head;
      locate(r, position, head);
      const int id = __ldg(p.q_segment_ids + t.batch * p.q_segment_stride + position);
      lo = min(lo, id);
      hi = max(hi, id);
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
      hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    }
    const int key_blocks = segment_key_blocks(p, T::kBlockKV);
    blocks.ranges = p.kv_block_segments + t.batch * key_blocks * 2;
    blocks.q_min = lo;
    blocks.q_max = hi;
    blocks.refill(begin, lane);
    return blocks;
  }

  // The kv segment ids of this lane's keys of block [kv0, kv0 + kBlockKV) (keys past seqlen_k read nothing); none
  // when `uniform` (VisibleBlocks::uniform: one id for the tile's rows and the block's keys).
  __device__ __forceinline__ void load_key_segments(int kv0, int lane, bool uniform) {
    test_segments = p.kv_segment_ids != nullptr && !uniform;
    if (!test_segments) return;
    const int* ids = p.kv_segment_ids + t.batch * p.kv_segment_stride;
#pragma unroll
    for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // (keys past seqlen_k are hidden already: they read the last key's id)
        kv_segment[n][c] = __ldg(ids + min(kv0 + 8 * n + 2 * (lane % 4) + c, p.seqlen_k - 1));
      }
  }

  // f(score, entry) for each of this lane's scores of the block whose keys start at col0 (this lane's first key)
  // and its entry of a (B, H, Sq, Sk) tensor with these element strides: one row address per query row, keys
  // stepped by the key stride (1, or 0 when broadcast) and clamped to last_key.
  template <class Entry, class F>
  __device__ __forceinline__ void for_each_entry(float (&acc_s)[T::kMTiles][T::kSTiles][4], const Entry* tensor,
                                                 const int64_t (&strides)[4], int col0, int last_key, F f) const {
    const int step = static_cast<int>(strides[3]);
    for_each_row([&](int m, int h, int position, int64_t head) {
      const Entry* row = tensor + (t.batch * strides[0] + head * strides[1] + position * strides[2]);
#pragma unroll
      for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) f(acc_s[m][n][2 * h + c], __ldg(row + min(col0 + 8 * n + c, last_key) * step));
    });
  }

  // ALiBi (common/alibi.h): s += -slope |i + kv_len - q_len - j| / scale for each of this lane's scores (keys col0 +
  // 8n + c): the slope of the row's head, the distance an FADD from a float key index, then an FFMA.
  __device__ __forceinline__ void apply_alibi(float (&acc_s)[T::kMTiles][T::kSTiles][4], int col0) const {
    const float inv_scale = 1.0f / p.scale, key0 = static_cast<float>(col0);
    for_each_row([&](int m, int h, int position, int64_t head) {
      const float neg_slope = -alibi_slope(p, t.batch, head) * inv_scale;
      const float distance0 = alibi_diagonal(position, t.len) - key0;  // to key col0
#pragma unroll
      for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          acc_s[m][n][2 * h + c] += neg_slope * fabsf(distance0 - static_cast<float>(8 * n + c));
        }
    });
  }

  // s += bias * inv_scale (the kernels keep raw scores; the softmax multiplies by scale), then -inf where the mask
  // or the segment ids hide the key. Each tensor is one branch per block and none per score, so the compiler
  // issues a row's loads together (a branch per score serialised their latencies: 4x slower, H100). Keys past
  // seqlen_k are -inf already (mask_key_block) and read the last key's entry. A key steps by its stride, 1 or 0.
  // Call load_key_segments(kv0, lane, uniform) first.
  __device__ __forceinline__ void apply(float (&acc_s)[T::kMTiles][T::kSTiles][4], int kv0, int lane) const {
    const int col0 = kv0 + 2 * (lane % 4), last_key = p.seqlen_k - 1;
    if (p.bias != nullptr && p.alibi) {
      apply_alibi(acc_s, col0);
    } else if (p.bias != nullptr) {
      const float inv_scale = 1.0f / p.scale;
      for_each_entry(acc_s, p.bias, p.bias_strides, col0, last_key,
                     [inv_scale](float& s, float bias) { s += bias * inv_scale; });
    }
    if (p.mask != nullptr) {
      for_each_entry(acc_s, p.mask, p.mask_strides, col0, last_key,
                     [](float& s, uint8_t visible) { s = visible == 0 ? -INFINITY : s; });
    }
    if (test_segments) {
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& s = acc_s[m][n][2 * h + c];
              s = kv_segment[n][c] != q_segment[m][h] ? -INFINITY : s;
            }
    }
  }
};

}  // namespace jax_flash::sm80
