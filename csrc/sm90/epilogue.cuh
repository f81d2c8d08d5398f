// The epilogue of the sm90 kernel, per consumer and tile: O / l (zeros for rows past the valid ones), the lse, and
// O through this consumer's 64 rows of the staging buffer (stmatrix) to global memory by one TMA store per 64-column
// panel; and the zeros and lse = -inf of rows that see no key. With split-KV (p.num_splits > 1) a tile is one key
// range, and its normalised O (float32) and lse go to the range's partials instead (common/params.h), which
// common/split_combine.cuh merges.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "sm90/fragments.cuh"
#include "sm90/mainloop.cuh"  // ConsumerTile
#include "sm90/pingpong.cuh"  // sync_consumer, kLastKReadBarrier
#include "sm90/pipeline.cuh"
#include "sm90/ptx.cuh"
#include "sm90/shared_storage.cuh"

namespace jax_flash::sm90 {

template <class T, class V>
struct Epilogue {
  using Element = typename T::OutElement;  // O's (bfloat16 for FP8 inputs)

  // The tile's O rows and lse entries, formed where they are written (held across the key loop, the 64-bit pointers
  // cost registers the soft-capped variants do not have).
  __device__ __forceinline__ static Element* tile_o(const AttentionParams& p, const ConsumerTile& t) {
    return static_cast<Element*>(p.o) + t.batch * p.o_batch_stride + int64_t{t.row0} * p.o_seq_stride +
           t.head * p.o_head_stride;
  }
  __device__ __forceinline__ static float* tile_lse(const AttentionParams& p, const ConsumerTile& t) {
    return p.lse + t.batch * p.lse_batch_stride + t.head * p.lse_head_stride + t.row0;
  }

  // Packed GQA (tile_scheduler.cuh): tile row r is query position (row0 + r) / group of query head head + r % group.
  __device__ __forceinline__ static bool packed(const AttentionParams& p) { return V::kSplitPaged && p.pack_gqa > 1; }
  __device__ __forceinline__ static int row_position(const AttentionParams& p, const ConsumerTile& t, int r) {
    return packed(p) ? (t.row0 + r) >> (__ffs(p.pack_gqa) - 1) : t.row0 + r;
  }
  __device__ __forceinline__ static int row_head(const AttentionParams& p, const ConsumerTile& t, int r) {
    return packed(p) ? t.head + (r & (p.pack_gqa - 1)) : t.head;
  }
  // Tile row r's O row and lse entry in a packed tile (unpacked: tile_o + r * o_seq_stride and tile_lse + r, formed
  // from pointers hoisted out of the loops).
  __device__ __forceinline__ static Element* packed_o_row(const AttentionParams& p, const ConsumerTile& t, int r) {
    return static_cast<Element*>(p.o) + t.batch * p.o_batch_stride + int64_t{row_position(p, t, r)} * p.o_seq_stride +
           int64_t{row_head(p, t, r)} * p.o_head_stride;
  }
  __device__ __forceinline__ static float* packed_lse(const AttentionParams& p, const ConsumerTile& t, int r) {
    return p.lse + t.batch * p.lse_batch_stride + int64_t{row_head(p, t, r)} * p.lse_head_stride +
           row_position(p, t, r);
  }

  // Tile row r's index in (B, Hq, Sq) within key range `split`: the partial lse's, and times D the partial O's.
  __device__ __forceinline__ static int64_t partial_row(const AttentionParams& p, const ConsumerTile& t, int split,
                                                        int r) {
    return (int64_t{split} * p.batch + t.batch) * p.heads_q * p.seqlen_q + int64_t{row_head(p, t, r)} * p.seqlen_q +
           row_position(p, t, r);
  }

  // This consumer's rows inside the tensor: zeros and lse = -inf (a key range: lse = -inf only; the combine step
  // reads no O of a range whose lse is -inf).
  __device__ __forceinline__ static void write_zero_rows(const AttentionParams& p, const ConsumerTile& t, int split,
                                                         int consumer, int wg_tid) {
    if (V::kSplitPaged && p.num_splits > 1) {
      for (int r = 64 * consumer + wg_tid; r < min(t.q_rows, 64 * consumer + 64); r += 128) {
        p.partial_lse[partial_row(p, t, split, r)] = -INFINITY;
      }
      return;
    }
    constexpr int kRowChunks = T::kHeadDim / 8;  // 16-byte chunks per row
    Element* gO = tile_o(p, t);
    for (int i = wg_tid; i < 64 * kRowChunks; i += 128) {
      const int row = 64 * consumer + i / kRowChunks;
      if (row < t.q_rows) {
        Element* o = packed(p) ? packed_o_row(p, t, row) : gO + row * p.o_seq_stride;
        *reinterpret_cast<uint4*>(o + (i % kRowChunks) * 8) = make_uint4(0, 0, 0, 0);
      }
    }
    if (p.lse != nullptr) {
      float* gLse = tile_lse(p, t);
      for (int r = 64 * consumer + wg_tid; r < min(t.q_rows, 64 * consumer + 64); r += 128) {
        *(packed(p) ? packed_lse(p, t, r) : gLse + r) = -INFINITY;
      }
    }
  }

  // A key range's O / l and lse, float32 from the accumulators to its partials (each quad writes 32 bytes per n8
  // tile); rows past the valid ones: lse = -inf only.
  template <class Mainloop>
  __device__ __forceinline__ static void store_partial(Mainloop& m, const ConsumerTile& t, int split, SmemView<T> s,
                                                       int wg_tid) {
    const AttentionParams& p = m.p;
    const int lane = m.lane;
    bool row_valid[2];
    float row_lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_valid[h] = m.warp_row0 + lane / 4 + 8 * h < t.q_rows_valid;
    m.softmax.finalize(m.acc_o, row_valid, p.scale, row_lse);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m.warp_row0 + lane / 4 + 8 * h;
      if (row >= t.q_rows) continue;
      const int64_t index = partial_row(p, t, split, row);
      if (lane % 4 == 0) p.partial_lse[index] = row_valid[h] ? row_lse[h] : -INFINITY;
      if (!row_valid[h]) continue;
      float* o = p.partial_o + index * T::kHeadDim + 2 * (lane % 4);
#pragma unroll
      for (int n = 0; n < T::kOTiles; ++n) {
        *reinterpret_cast<float2*>(o + 8 * n) = make_float2(m.acc_o[0][n][2 * h], m.acc_o[0][n][2 * h + 1]);
      }
    }
    if constexpr (T::kOInKV) mbarrier_arrive(held_stage(m, s));  // (nothing was staged)
  }

  // T::kOInKV: the K (consumer 0) or V (consumer 1) of the tile's final key block, the last one computed
  // (Mainloop::final_block), where this consumer stages its O; the main loop left it to the epilogue to release
  // (mainloop.cuh, release_k / release_v).
  template <class Mainloop>
  __device__ __forceinline__ static uint64_t* held_stage(const Mainloop& m, SmemView<T> s) {
    const int stage = Pipeline<T, V>::stage_of(m.it - 1);
    return m.consumer == 0 ? s.k_empty(stage) : s.v_empty(stage);
  }
  // ... and its staging buffer once the other consumer has read it: this consumer's 64 rows of O as kOPanels panels
  // of [64][128 bytes]. Consumer 0 waits until consumer 1 has read the final K, then tells consumer 1 that its own
  // last P V (the last read of that V) is done; consumer 1 waits for that. Every tile with key blocks passes here
  // once per consumer, whichever way it stores O, so the barriers stay paired.
  template <class Mainloop>
  __device__ __forceinline__ static char* claim_stage(const Mainloop& m, SmemView<T> s) {
    const int stage = Pipeline<T, V>::stage_of(m.it - 1);
    if (m.consumer == 0) {
      named_barrier_sync(kLastKReadBarrier<T>, 256);
      named_barrier_arrive(kLastVReadBarrier<T>, 256);
      return s.k(stage);
    }
    named_barrier_sync(kLastVReadBarrier<T>, 256);
    return s.v(stage);
  }

  // A tile whose rows end inside this consumer's 64 while the rows after them lie in the tensor (a document tile,
  // segment_tiles.cuh: the next document's rows, another tile's): its rows are stored from the registers, each quad
  // 4 bytes per n8 tile, where one TMA box would overwrite those. (Other tiles end at a multiple of 64 rows or at
  // the tensor's end, where the TMA unit clips the box.)
  __device__ __forceinline__ static bool stores_rows(const AttentionParams& p, const ConsumerTile& t, int consumer) {
    return V::kSplitPaged && !V::kTensors && p.segment_tiles != nullptr && t.q_rows < 64 * consumer + 64 &&
           t.row0 + t.q_rows < p.seqlen_q;  // (tensor calls run query-block tiles: may_run_document_tiles)
  }
  template <class Mainloop>
  __device__ __forceinline__ static void store_rows(Mainloop& m, const ConsumerTile& t) {
    const AttentionParams& p = m.p;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m.warp_row0 + m.lane / 4 + 8 * h;
      if (row >= t.q_rows) continue;
      Element* o = tile_o(p, t) + row * p.o_seq_stride + 2 * (m.lane % 4);
#pragma unroll
      for (int n = 0; n < T::kOTiles; ++n) {
        *reinterpret_cast<uint32_t*>(o + 8 * n) = pack2<Element>(m.acc_o[0][n][2 * h], m.acc_o[0][n][2 * h + 1]);
      }
    }
  }

  // O / l and lse of the mainloop's rows, then O stored. `m`: the consumer's Mainloop after the tile's key blocks.
  template <class Mainloop>
  __device__ __forceinline__ static void store(Mainloop& m, const ConsumerTile& t, int split, SmemView<T> s,
                                               const CUtensorMap& tma_o, int wg_tid) {
    const AttentionParams& p = m.p;
    [[maybe_unused]] char* const sO_stage = T::kOInKV ? claim_stage(m, s) : nullptr;
    if (V::kSplitPaged && p.num_splits > 1) {
      store_partial(m, t, split, s, wg_tid);
      return;
    }
    const int consumer = m.consumer, lane = m.lane, warp_row0 = m.warp_row0;
    bool row_valid[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_valid[h] = warp_row0 + lane / 4 + 8 * h < t.q_rows_valid;
    if constexpr (V::kFastEpilogue) {
      float row_l[2];
      m.softmax.finalize_fast(m.acc_o, row_valid, warp_row0 + 16 <= t.q_rows_valid, row_l);
      if (p.lse != nullptr && lane % 4 == 0) {  // one lane of each quad owns the row
        float* gLse = tile_lse(p, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + lane / 4 + 8 * h;
          if (row < t.q_rows) {
            *(packed(p) ? packed_lse(p, t, row) : gLse + row) =
                row_valid[h] ? m.softmax.row_lse(h, row_l[h], m.scale()) : -INFINITY;
          }
        }
      }
    } else {
      float row_lse[2];
      m.softmax.finalize(m.acc_o, row_valid, m.scale(), row_lse);
      if (p.lse != nullptr && lane % 4 == 0) {  // one lane of each quad owns the row
        float* gLse = tile_lse(p, t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + lane / 4 + 8 * h;
          if (row < t.q_rows) *(packed(p) ? packed_lse(p, t, row) : gLse + row) = row_valid[h] ? row_lse[h] : -INFINITY;
        }
      }
    }
    if constexpr (T::kFp8) {  // O of the dequantised V: times the tile's v_descale
#pragma unroll
      for (int n = 0; n < T::kOTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) m.acc_o[0][n][e] *= m.fp8_v_descale;
    }
    if (stores_rows(p, t, consumer)) {
      store_rows(m, t);
      if constexpr (T::kOInKV) mbarrier_arrive(held_stage(m, s));  // (nothing was staged)
      return;
    }
    // O -> this consumer's 64 rows of the staging buffer (swizzled like Q) by stmatrix, then one TMA store per
    // 64-column panel by thread 0 of the consumer; the TMA unit clips rows past the tensor. That thread first waits
    // until its previous store has read the buffer. (T::kOInKV: a buffer of this consumer's rows alone, its panels
    // 64 rows apart.)
    char* const sO = T::kOInKV ? sO_stage : s.o();
    constexpr int kRow0 = T::kOInKV ? 0 : 64;  // this consumer's first row in the buffer, per consumer index
    constexpr int kPanelBytes = T::kOInKV ? 64 * T::kRowBytes : T::kOPanelBytes;
    if (wg_tid == 0) bulk_wait_group_read<0>();
    sync_consumer(consumer);  // ... and every thread of the consumer knows it
    // (T::kHoldTileSlot: the lane read afresh, so these addresses are formed here, not held through the key loop)
    const int e_lane = T::kHoldTileSlot ? lane_id_fresh() : lane;
    const uint32_t so_base =
        smem_address(sO) + (kRow0 * consumer + fragment_row_of(m.warp_in_wg, e_lane)) * T::kRowBytes;
#pragma unroll
    for (int k = 0; k < T::kHeadDim / 16; ++k) {  // O tiles 2k, 2k + 1: columns 16k .. 16k + 15
      uint32_t a[4];
      pack_k16<Element>(m.acc_o, k, a);
      stmatrix_x4(so_base + (k / 4) * kPanelBytes + fragment_chunk_of(k, e_lane) * 16, a);
    }
    fence_proxy_async_smem();  // the generic-proxy writes, visible to the TMA unit ...
    sync_consumer(consumer);   // ... from every thread of the consumer
    if (wg_tid == 0) {
      if (packed(p)) {  // the 5-D map: 64 / group positions of the group's heads (tensor_map.h)
        const int shift = __ffs(p.pack_gqa) - 1;
#pragma unroll
        for (int panel = 0; panel < T::kOPanels; ++panel) {
          tma_store_5d(&tma_o, sO + panel * kPanelBytes + kRow0 * consumer * T::kRowBytes, panel * 64, 0,
                       (t.row0 + 64 * consumer) >> shift, t.head >> shift, t.batch);
        }
      } else {
#pragma unroll
        for (int panel = 0; panel < T::kOPanels; ++panel) {
          tma_store_4d(&tma_o, sO + panel * kPanelBytes + kRow0 * consumer * T::kRowBytes, panel * 64,
                       t.row0 + 64 * consumer, t.head, t.batch);
        }
      }
      bulk_commit_group();
      if constexpr (T::kOInKV) {  // the stage may refill once the store has read O, for all 128 threads
        bulk_wait_group_read<0>();
        mbarrier_arrive(held_stage(m, s), 128);
      }
    }
  }
};

}  // namespace jax_flash::sm90
