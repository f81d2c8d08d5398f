// The producer role of the sm90 kernel: one thread of warpgroup 0 draws the block's tiles, publishes each with its
// facts in a tile slot, and issues the TMA copies of its Q (once per tile, into one of kQBuffers buffers) and of its
// K and V blocks into the kStages-deep ring, each completing on its stage's "full" barrier after the consumers have
// released the stage on its "empty" one. It runs ahead across tile boundaries: the next tile's Q and first K/V land
// while the consumers finish the current tile.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/params.h"
#include "sm90/pipeline.cuh"
#include "sm90/ptx.cuh"
#include "sm90/shared_storage.cuh"
#include "sm90/split_tail.cuh"
#include "sm90/tile_scheduler.cuh"
#include "sm90/trace.cuh"

namespace jax_flash::sm90 {

// Rows per TMA box of a paged K / V block: the largest count dividing both the page size and kBlockKV, so every box
// lies inside one page (page sizes are multiples of 8: a box holds whole 8-row swizzle atoms). Host and device.
template <class T>
__host__ __device__ __forceinline__ int page_box_rows(int page_size) {
  int a = page_size, b = T::kBlockKV;
  while (b != 0) {
    const int r = a % b;
    a = b;
    b = r;
  }
  return a;
}

// log2(n) where n is a power of two, else -1.
__device__ __forceinline__ int log2_if_power_of_two(int n) {
  if (n <= 0 || (n & (n - 1)) != 0) return -1;
  int shift = 0;
  while ((1 << shift) < n) ++shift;
  return shift;
}

template <class T, class V>
struct Producer {
  using P = Pipeline<T, V>;
  const AttentionParams& p;
  SmemView<T> s;
  const CUtensorMap& tma_q;
  const CUtensorMap& tma_k;
  const CUtensorMap& tma_v;
  Tracer trace;
  // Paged: rows per TMA box (page_box_rows) and log2 of the page size where it is a power of two (else -1),
  // computed once; only the paged variants read them.
  const int box_rows = V::kSplitPaged ? page_box_rows<T>(p.page_size) : 0;
  const int page_shift = V::kSplitPaged ? log2_if_power_of_two(p.page_size) : -1;
  int key_shift = 0;  // (kSplitPaged) the current tile's, tile_work's: a document tile's blocks start key_shift early

  // A paged key block's first box: its page's index in the table row and its first key's row in that page, and the
  // ids of the block's first kIdBatch boxes. The producer is one thread, and each step below is a dependent chain
  // in it: the ids are read back to back, and before the producer waits for the block's stage, so their latency
  // hides under the wait; the boxes step through the pages by addition (a division by the run-time page size,
  // about 20 dependent instructions, once per block, and a shift for the usual powers of two). Two ids cover a
  // 128-key block over pages of 64 keys or more; an 80-key block (head dim 256) is five 16-row boxes at any
  // power-of-two page size, all read at once (5-11% faster than two at a time on an H100, though the producer then
  // spills about 100 bytes).
  static constexpr int kIdBatch = T::kBlockKV % 64 == 0 ? 2 : T::kBlockKV / 16;
  struct PagedBlock {
    int page_index, in_page;
    int ids[kIdBatch];
  };
  __device__ __forceinline__ void advance_box(int& page_index, int& in_page) const {
    in_page += box_rows;
    page_index += in_page == p.page_size ? 1 : 0;
    in_page = in_page == p.page_size ? 0 : in_page;
  }
  // Ids of the kIdBatch boxes from row r0 of the block at key0 on (-1 from kv_len on: no table entry is read).
  __device__ __forceinline__ void read_page_ids(const TileWork& w, int key0, int r0, int page_index, int in_page,
                                                int (&ids)[kIdBatch]) const {
    const int* table = p.page_table + w.batch * p.page_table_stride;
#pragma unroll
    for (int b = 0; b < kIdBatch; ++b) {
      const int r = r0 + b * box_rows;
      ids[b] = r < T::kBlockKV && key0 + r < w.len.kv_len ? table[page_index] : -1;
      advance_box(page_index, in_page);
    }
  }
  __device__ __forceinline__ PagedBlock paged_block(const TileWork& w, int j) const {
    PagedBlock block;
    const int key0 = j * T::kBlockKV;
    block.page_index = page_shift >= 0 ? key0 >> page_shift : key0 / p.page_size;
    block.in_page = key0 - block.page_index * p.page_size;
    read_page_ids(w, key0, 0, block.page_index, block.in_page, block.ids);
    return block;
  }

  // Key block j of K or V (`map`) into `dst`, completing on `bar`. Contiguous: one box per 64-column panel. Paged
  // (the map spans the pages, launch.cuh; `block` from paged_block): boxes of page_box_rows rows, each inside one
  // page; a box whose first key is at or past kv_len loads zeros (page -1 lies outside the map; an id outside the
  // pool does too). The TMA unit counts a box's bytes toward the barrier whether or not they were inside the tensor.
  __device__ __forceinline__ void load_block(char* dst, const CUtensorMap& map, uint64_t* bar, const TileWork& w,
                                             int j, PagedBlock& block) {
    if (p.page_table == nullptr) {  // (a document tile's blocks start at its document's first key: key_shift)
      const int key0 = j * T::kBlockKV - key_shift;
#pragma unroll
      for (int panel = 0; panel < T::kPanels; ++panel) {
        tma_load_4d(dst + panel * T::kKVPanelBytes, &map, bar, panel * 64, key0, w.kv_head, w.batch);
      }
      return;
    }
    for (int r0 = 0;;) {
#pragma unroll
      for (int b = 0; b < kIdBatch; ++b) {
        const int r = r0 + b * box_rows;
        if (r >= T::kBlockKV) break;
#pragma unroll
        for (int panel = 0; panel < T::kPanels; ++panel) {
          tma_load_4d(dst + panel * T::kKVPanelBytes + r * T::kRowBytes, &map, bar, panel * 64, block.in_page,
                      w.kv_head, block.ids[b]);
        }
        advance_box(block.page_index, block.in_page);
      }
      r0 += kIdBatch * box_rows;
      if (r0 >= T::kBlockKV) break;
      read_page_ids(w, j * T::kBlockKV, r0, block.page_index, block.in_page, block.ids);  // (boxes under half a block)
    }
  }

  // Key block j of the tile into the stage of pipeline step `step`.
  __device__ __forceinline__ void load_k(const TileWork& w, int j, int step) {
    const int stage = P::stage_of(step);
    PagedBlock pages{};
    if constexpr (V::kSplitPaged) {
      if (p.page_table != nullptr) pages = paged_block(w, j);  // (before the wait: see paged_block)
    }
    mbarrier_wait(s.k_empty(stage), P::parity_of(step) ^ 1);  // the consumers are done with this stage's last K
    trace(kTraceProducerK, j);
    mbarrier_arrive_expect_tx(s.k_full(stage), T::kKBytes);
    // (the contiguous copies written out here, not through load_block: see Variant::kSplitPaged)
    if constexpr (V::kSplitPaged) {
      load_block(s.k(stage), tma_k, s.k_full(stage), w, j, pages);
    } else {
#pragma unroll
      for (int panel = 0; panel < T::kPanels; ++panel) {
        tma_load_4d(s.k(stage) + panel * T::kKVPanelBytes, &tma_k, s.k_full(stage), panel * T::kPanelCols,
                    j * T::kBlockKV, w.kv_head, w.batch);
      }
    }
  }
  __device__ __forceinline__ void load_v(const TileWork& w, int j, int step) {
    const int stage = P::stage_of(step);
    PagedBlock pages{};
    if constexpr (V::kSplitPaged) {
      if (p.page_table != nullptr) pages = paged_block(w, j);
    }
    mbarrier_wait(s.v_empty(stage), P::parity_of(step) ^ 1);  // ... and with its last V
    trace(kTraceProducerV, j);
    mbarrier_arrive_expect_tx(s.v_full(stage), T::kVBytes);
    if constexpr (T::kFp8) {  // V^T (B, Hk, D, keys): panel n is keys 128n .. 128n + 127 of the block, all D rows
#pragma unroll
      for (int panel = 0; panel < T::kVtPanels; ++panel) {
        tma_load_4d(s.v(stage) + panel * T::kVtPanelBytes, &tma_v, s.v_full(stage), j * T::kBlockKV + 128 * panel, 0,
                    w.kv_head, w.batch);
      }
    } else if constexpr (V::kSplitPaged) {
      load_block(s.v(stage), tma_v, s.v_full(stage), w, j, pages);
    } else {
#pragma unroll
      for (int panel = 0; panel < T::kPanels; ++panel) {
        tma_load_4d(s.v(stage) + panel * T::kKVPanelBytes, &tma_v, s.v_full(stage), panel * 64, j * T::kBlockKV,
                    w.kv_head, w.batch);
      }
    }
  }

  // The tile's key blocks in the consumers' order (V::kReverse: last first), from pipeline step `it` on.
  __device__ __forceinline__ void load_key_blocks(const TileWork& w, int& it) {
    const int j_first = V::kReverse ? w.block_end - 1 : w.block_begin;
    const int j_step = V::kReverse ? -1 : 1;
    auto in_tile = [&](int j) { return V::kReverse ? j >= w.block_begin : j < w.block_end; };
    if constexpr (V::kKAhead) {  // K_first, then per block j: K_{j+1} (if any), V_j
      load_k(w, j_first, it);
      for (int j = j_first; in_tile(j); j += j_step, ++it) {
        if (in_tile(j + j_step)) load_k(w, j + j_step, it + 1);
        load_v(w, j, it);
      }
    } else {  // per block j: K_j, V_j
      for (int j = j_first; V::kReverse ? j >= w.block_begin : j < w.block_end; j += j_step, ++it) {
        load_k(w, j, it);
        load_v(w, j, it);
      }
    }
  }

  // Walks the block's tiles: each start at tile blockIdx.x, then the counter or the static stride
  // (tile_scheduler.cuh); with the split tail, the whole tiles, then this block's share of the split ones.
  __device__ __forceinline__ void run(int64_t num_tiles) {
    trace.start(0, true);
    prefetch_tensor_map(&tma_q);
    prefetch_tensor_map(&tma_k);
    prefetch_tensor_map(&tma_v);
    int it = 0, tiles_done = 0;
    // (32-bit tile arithmetic where it suffices: the 64-bit divisions of tile_work spilled a 32-register producer)
    using TileIndex = std::conditional_t<T::kTileIndex32, int, int64_t>;
    TileIndex next = blockIdx.x;
    // Segment ids: the rows' tiles (segment_tiles.cuh), as many per head unit as the row with the most
    if constexpr (V::kSplitPaged) {
      if (p.segment_tiles != nullptr) {  // (segment ids: no packed GQA)
        num_tiles = int64_t{*p.segment_tile_count} * p.heads_q * p.batch * p.num_splits;
      }
    }
    TileSlot* const sched = s.sched();
    SplitState* const split = s.split();
    if constexpr (V::kSplit) begin_split_share(p, *split);
    for (int n = 0;; ++n) {
      const int slot = n & 1;
      const bool whole = next < (V::kSplit ? p.split_whole_tiles : num_tiles);
      const bool more = whole || (V::kSplit && split->blocks_left > 0);
      mbarrier_wait(s.sched_empty(slot), ((n >> 1) & 1) ^ 1);  // the consumers have read this slot's last tile
      int key_range = 0;
      if (more) {
        sched[slot].work =
            tile_work<T, TileIndex, V::kSplitPaged, V::kTensors>(p, whole ? next : p.split_whole_tiles + split->tile,
                                                                 key_range, key_shift);
      }
      if (V::kSplit && more) take_split_piece(p, *split, sched[slot].work, whole, n);
      if (V::kSplitPaged && more) s.tile_split()[n & 3] = key_range;
      sched[slot].more = more;
      mbarrier_arrive(s.sched_full(slot));
      trace(kTraceProducerTile, n);
      if (!more) break;
      // (read back from the slot, which only this thread writes until it arrives on sched_full again: holding the
      // whole TileWork in registers spilled the producer's 40)
      const TileWork& w = sched[slot].work;
      // Drawn now, used at the next iteration: the atomic's latency hides under this tile's loads.
      next = p.tile_counter != nullptr
                 ? static_cast<TileIndex>(gridDim.x) + static_cast<TileIndex>(atomicAdd(p.tile_counter, 1ull))
                 : next + static_cast<TileIndex>(gridDim.x);
      if (w.block_begin >= w.block_end) continue;  // the consumers write zeros; nothing to load
      const int qb = P::q_buffer_of(tiles_done);
      mbarrier_wait(s.q_empty(qb), P::q_parity_of(tiles_done) ^ 1);  // the buffer's last tile's last Q K^T is done
      mbarrier_arrive_expect_tx(s.q_full(qb), T::kQBytes);
      if (V::kSplitPaged && p.pack_gqa > 1) {  // packed GQA: the 5-D map (group, position) of w.kv_head
        const int position0 = w.row0 >> (__ffs(p.pack_gqa) - 1);
#pragma unroll
        for (int panel = 0; panel < T::kPanels; ++panel) {
          tma_load_5d(s.q(qb) + panel * T::kQPanelBytes, &tma_q, s.q_full(qb), panel * 64, 0, position0, w.kv_head,
                      w.batch);
        }
      } else {
#pragma unroll
        for (int panel = 0; panel < T::kPanels; ++panel) {
          tma_load_4d(s.q(qb) + panel * T::kQPanelBytes, &tma_q, s.q_full(qb), panel * T::kPanelCols, w.row0, w.head,
                      w.batch);
        }
      }
      trace(kTraceProducerQ, n);
      ++tiles_done;
      load_key_blocks(w, it);
    }
  }
};

}  // namespace jax_flash::sm90
