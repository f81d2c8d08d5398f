// The sm80-family attention forward kernel (FlashAttention-2 structure on mma.sync, ldmatrix and cp.async).
// One thread block = one tile (sm80/tile.cuh: batch, query head or packed kv head, block of kBlockQ rows, key range);
// it streams K/V blocks of kBlockKV keys (contiguous or paged) through shared memory and keeps O, the row max and
// the row sum in registers; the epilogue (sm80/epilogue.cuh) writes O and the lse, or a split range's partial.
#pragma once

#include <cstdint>

#include "common/mask_fragment.cuh"
#include "common/page_index.h"
#include "common/params.h"
#include "common/visibility.h"
#include "sm80/epilogue.cuh"
#include "sm80/ptx.cuh"
#include "sm80/score_tensors.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/softmax.cuh"
#include "sm80/tile.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::sm80 {

// kMaskBlocks: some key block may be partly invisible (causal, window, kv_lengths, or seqlen_k not a multiple of
// kBlockKV); false compiles the mask out. kHasSoftcap: s = softcap * tanh(s * scale / softcap). kTensors (with
// kMaskBlocks): segment ids, bias or mask tensors (sm80/score_tensors.cuh), and key blocks skipped by segment.
template <class T, bool kMaskBlocks, bool kHasSoftcap, bool kTensors = false>
__global__ void __launch_bounds__(T::kNumThreads, kTensors ? 1 : T::kMinBlocksPerSm)
    attention_kernel(const __grid_constant__ AttentionParams p) {
  using Element = typename T::Element;
  extern __shared__ __align__(128) char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);  // (kBlockQ, D)
  Element* sK = sQ + T::kSmemQElems;                // (kBlockKV, D)
  Element* sV = sK + T::kSmemKVElems;               // (kBlockKV, D)

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const Tile t = locate_tile<T, kTensors>(p, blockIdx.x);
  const Epilogue<T> epilogue{p, t};
  if (t.block_begin >= t.block_end) {  // no row sees a key of this range: zeros and lse = -inf, no loads
    epilogue.write_zero_rows(tid);
    return;
  }

  // K / V rows of kv head t.kv_head: contiguous, or through the page table. Keys at or past kv_len are zeros and
  // their table entries are never read; a page id out of [0, num_pages) reads as zeros.
  const Element* gK = static_cast<const Element*>(p.k) + t.kv_head * p.k_head_stride;
  const Element* gV = static_cast<const Element*>(p.v) + t.kv_head * p.v_head_stride;
  const int* page_row = p.page_table != nullptr ? p.page_table + t.batch * p.page_table_stride : nullptr;
  if (page_row == nullptr) {
    gK += t.batch * p.k_batch_stride;
    gV += t.batch * p.v_batch_stride;
  }
  // Paged: lane i of every warp holds the id of page kv0 / page_size + i of the block being loaded (at most
  // kBlockKV / 8 + 1 pages: page sizes are multiples of 8), each row takes its page by a shuffle. The ids of block
  // j + 1 are loaded when block j's are taken, so no cp.async issue waits on the page table (a table read at the
  // block's first copy stalled the warp for a memory latency per block, with one block of K / V in flight).
  static_assert(T::kBlockKV / 8 + 1 <= kWarpSize, "a block's pages must fit one per lane");
  const PageDivider pages(page_row != nullptr ? p.page_size : 1);
  auto fetch_page_ids = [&](int j) {  // entries of pages at or past kv_len are never read
    const int page_index = pages.page(j * T::kBlockKV) + lane;
    return int64_t{page_index} * p.page_size < t.len.kv_len ? page_row[page_index] : -1;
  };
  // The key blocks this tile visits, in order: [block_begin, block_end), less those whose segment ids cannot meet
  // the tile's (kTensors).
  // This warp's rows of the tile and its slice of each key block (all of it unless the warps split keys: traits.cuh).
  const int warp_row0 = (T::kKeyWarps == 1 ? warp : warp % T::kRowWarps) * T::kRowsPerWarp;
  const int warp_key0 = T::kKeyWarps == 1 ? 0 : (warp / T::kRowWarps) * T::kWarpKeys;
  ScoreTensors<T> tensors(p, t, warp_row0, lane);
  VisibleBlocks visited{nullptr, 0, 0, t.block_end};
  if constexpr (kTensors) {
    tensors.load_query_segments();
    visited = tensors.visible_blocks(t.block_begin, t.block_end, lane);
  }
  const int block_begin = visited.following(t.block_begin - 1, lane), block_end = t.block_end;
  if (block_begin >= block_end) {
    epilogue.write_zero_rows(tid);
    return;
  }
  int lane_page = -1, next_lane_page = page_row != nullptr ? fetch_page_ids(block_begin) : -1;
  // Blocks are loaded in order, K_j before V_j: K_j's load takes block j's ids and fetches the next visited one's.
  auto load_kv_block = [&](Element* sTile, const Element* g, int64_t page_stride, int64_t seq_stride, int j,
                           bool next_block) {
    const int kv0 = j * T::kBlockKV;
    const Element* rows = g + kv0 * seq_stride;  // contiguous; paged: within the block's page, if it has one
    int rows_valid = t.len.kv_len - kv0;
    if (page_row != nullptr) {
      if (next_block) {
        lane_page = next_lane_page;
        next_lane_page = fetch_page_ids(visited.following(j, lane));
      }
      if (T::kBlockKV == kTwoPageBlockKV && 2 * p.page_size == T::kBlockKV) {  // two whole pages: a tile from each
        copy_two_pages_to_smem<T>(sTile, g, page_stride, seq_stride, lane_page, p.num_pages, rows_valid, tid);
        return;
      }
      if (p.page_size % T::kBlockKV != 0) {  // smaller pages (or not dividing the block): row by row
        copy_paged_rows_to_smem<T, T::kBlockKV>(sTile, g, page_stride, seq_stride, lane_page, kv0, pages,
                                                p.num_pages, rows_valid, tid);
        return;
      }
      const int page = __shfl_sync(0xffffffffu, lane_page, 0);  // the block lies in one page: a strided tile
      const bool page_valid = page >= 0 && page < p.num_pages;
      rows = page_valid ? g + page * page_stride + pages.row(kv0) * seq_stride : g;
      rows_valid = page_valid ? rows_valid : 0;
    }
    copy_tile_to_smem<T, T::kBlockKV>(sTile, rows, seq_stride, rows_valid, tid);
  };
  auto load_k_block = [&](int j) { load_kv_block(sK, gK, p.k_batch_stride, p.k_seq_stride, j, true); };
  auto load_v_block = [&](int j) { load_kv_block(sV, gV, p.v_batch_stride, p.v_seq_stride, j, false); };

  // ---- fragment loaders (shared -> registers), lane addressing of ldmatrix.x4 -------------------------------
  uint32_t rQ[T::kMTiles][T::kDSteps][4];                   // A of S = Q K^T
  uint32_t rK[T::kDSteps][T::kSTiles][2];                   // B of S = Q K^T
  uint32_t rP[T::kMTiles][T::kKVSteps][4];                  // A of O = P V (from the S accumulators)
  uint32_t rV[T::kKVSteps][T::kOTiles][2];                  // B of O = P V
  const int mat = lane / 8;  // which of the four 8x8 matrices of an ldmatrix.x4 this lane addresses
  // Q: matrices (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi) of each m16 tile.
  const LdmatrixAddresses<T> q_addr(sQ, warp_row0 + lane % 16, lane / 16);
  // K: two n8 tiles per x4: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi).
  const LdmatrixAddresses<T> k_addr(sK, warp_key0 + (mat / 2) * 8 + lane % 8, mat % 2);
  // V, transposed: (kv lo, d 0-7), (kv hi, d 0-7), (kv lo, d 8-15), (kv hi, d 8-15).
  const LdmatrixAddresses<T> v_addr(sV, warp_key0 + (mat % 2) * 8 + lane % 8, mat / 2);
  auto load_q = [&](int step) {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) ldmatrix_x4(rQ[m][step], q_addr(m * kMmaM, 2 * step));
  };
  auto load_k = [&](int step) {
#pragma unroll
    for (int np = 0; np < T::kSTiles / 2; ++np) {
      uint32_t r[4];
      ldmatrix_x4(r, k_addr(np * 16, 2 * step));
      rK[step][2 * np][0] = r[0];
      rK[step][2 * np][1] = r[1];
      rK[step][2 * np + 1][0] = r[2];
      rK[step][2 * np + 1][1] = r[3];
    }
  };
  auto load_v = [&](int step) {
#pragma unroll
    for (int np = 0; np < T::kOTiles / 2; ++np) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, v_addr(step * kMmaK, 2 * np));
      rV[step][2 * np][0] = r[0];
      rV[step][2 * np][1] = r[1];
      rV[step][2 * np + 1][0] = r[2];
      rV[step][2 * np + 1][1] = r[3];
    }
  };
  auto no_load = [](int) {};

  float acc_o[T::kMTiles][T::kOTiles][4];  // O (kRowsPerWarp, D) of this warp
  zero_fill(acc_o);
  OnlineSoftmax<T> softmax;
  const float max_growth = lazy_rescale_threshold(p.scale_log2);

  // Key j is visible to query position i when  i + lo_off <= j <= i + hi_off  and  j < kv_len
  // (common/visibility.h, with the unbounded sides mapped to +-kUnbounded). Two offsets per block keep the mask
  // cheap in registers.
  const int diag_offset = t.len.kv_len - t.len.q_len;
  // Masking (common/mask_fragment.cuh) tests the tile's rows with three compares per score: the sm90 family's
  // per-warp test and one-compare diagonal measured no gain here (median -1.2% causal, H200), since mma.sync and
  // ldmatrix bound this family, not the mask.
  constexpr bool kMaskOwnRows = false, kMaskRightOnly = false;
  const int lo_off = p.window_left >= kUnbounded ? -kUnbounded : diag_offset - p.window_left;
  const int hi_off = p.window_right >= kUnbounded ? kUnbounded : diag_offset + p.window_right;

  // Packed GQA: the query position of each of this lane's rows (m, h), and the tile's first and last valid ones.
  int positions[T::kMTiles][2];
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) positions[m][h] = t.position(warp_row0 + m * kMmaM + lane / 4 + 8 * h);
  const int first_position = t.position(0), last_position = t.position(t.q_rows_valid - 1);

  // ---- prologue: Q (and with eager loading K_0, V_0 as two cp.async groups) ---------------------------------
  const Element* gQ = static_cast<const Element*>(p.q) + t.batch * p.q_batch_stride;
  if (t.pack == 1) {
    copy_tile_to_smem<T, T::kBlockQ>(sQ, gQ + t.head0 * p.q_head_stride + int64_t{t.row0} * p.q_seq_stride,
                                     p.q_seq_stride, t.q_rows, tid);
  } else {
    auto q_row = [&](int r) { return gQ + t.head(r) * p.q_head_stride + int64_t{t.position(r)} * p.q_seq_stride; };
    copy_rows_to_smem<T, T::kBlockQ>(sQ, q_row, t.q_rows, gQ, tid);
  }
  if constexpr (T::kEagerLoad) {
    load_k_block(block_begin);
    cp_async_commit();  // group: Q, K_first
    load_v_block(block_begin);
    cp_async_commit();  // group: V_first
  } else if constexpr (T::kAsyncCopy) {
    cp_async_commit();
  }

  for (int j = block_begin, j_next; j < block_end; j = j_next) {
    j_next = visited.following(j, lane);
    bool uniform_block = false;  // (read before Q K^T, so its load's latency hides under the product)
    if constexpr (kTensors) uniform_block = visited.uniform(j);
    if constexpr (T::kEagerLoad) {
      cp_async_wait<1>();  // Q and K_j have landed (V_j may still be in flight)
    } else {
      load_k_block(j);
      load_v_block(j);
      if constexpr (T::kAsyncCopy) {
        cp_async_commit();
        cp_async_wait<0>();
      }
    }
    __syncthreads();  // K_j (and Q) visible to every warp

    if constexpr (T::kQInRegisters) {
      if (j == block_begin) {
#pragma unroll
        for (int s = 0; s < T::kDSteps; ++s) load_q(s);
      }
    }
    float acc_s[T::kMTiles][T::kSTiles][4];  // S (kRowsPerWarp, kWarpKeys)
    zero_fill(acc_s);
    // S = Q K_j^T
    if constexpr (T::kQInRegisters) {
      warp_gemm<Element, T::kDSteps, 0, T::kKChunk, T::kDoubleBuffer>(acc_s, rQ, rK, no_load, load_k);
    } else {
      warp_gemm<Element, T::kDSteps, T::kQChunk, T::kKChunk, T::kDoubleBuffer>(acc_s, rQ, rK, load_q, load_k);
    }

    if constexpr (T::kEagerLoad) {
      __syncthreads();  // every warp is done reading sK: K_{j+1} may overwrite it while softmax and P V run
      if (j_next < block_end) load_k_block(j_next);
      cp_async_commit();  // (possibly empty) group keeps the wait counts uniform
    }

    if constexpr (kHasSoftcap) {  // S = softcap * tanh(S * scale / softcap); the softmax then runs with scale 1
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
        for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[m][n][e] = p.softcap * tanhf(acc_s[m][n][e] * p.softcap_scale);
    }
    if constexpr (kMaskBlocks) {
      const int warp_kv0 = j * T::kBlockKV + warp_key0;
      if (t.pack == 1) {
        mask_key_block<T::kWarpKeys, kMaskOwnRows, kMaskRightOnly>(acc_s, warp_kv0, t.row0, t.q_rows_valid,
                                                                 warp_row0, lane, lo_off, hi_off, t.len.kv_len);
      } else {
        mask_key_block_packed<T::kWarpKeys>(acc_s, warp_kv0, first_position, last_position, positions, lane, lo_off,
                                            hi_off, t.len.kv_len);
      }
      if constexpr (kTensors) {
        tensors.load_key_segments(warp_kv0, lane, uniform_block);
        tensors.apply(acc_s, warp_kv0, lane);
      }
    }
    softmax.update(acc_s, acc_o, p.scale, p.scale_log2, max_growth);

    accumulators_to_a_fragments<Element>(acc_s, rP);  // P -> A fragments of P V

    if constexpr (T::kEagerLoad) {
      cp_async_wait<1>();  // V_j has landed (K_{j+1} may still be in flight)
      __syncthreads();
    }
    // O += P V_j
    warp_gemm<Element, T::kKVSteps, 0, T::kVChunk, T::kDoubleBuffer>(acc_o, rP, rV, no_load, load_v);
    __syncthreads();  // every warp is done reading sV (and sK) before they are refilled
    if constexpr (T::kEagerLoad) {
      if (j_next < block_end) load_v_block(j_next);
      cp_async_commit();
    }
  }
  if constexpr (T::kAsyncCopy) cp_async_wait<0>();  // no copy may land in smem after the epilogue reuses it
  if constexpr (T::kKeyWarps > 1) {  // (the loop's last barrier: no warp reads sK / sV any more)
    if (!merge_key_warps<T>(softmax, acc_o, reinterpret_cast<float*>(sK), warp, lane, p.scale_log2)) return;
  }

  softmax.finalize(acc_o);
  epilogue.store(softmax, acc_o, sQ, warp_row0, lane);
}

}  // namespace jax_flash::sm80
