// The producer role of the sm90 kernel: one thread of warpgroup 0 (all of warp 0 for paged K / V: kWarp) draws the
// block's tiles, publishes each with its facts in a tile slot, and issues the TMA copies of its Q (once per tile,
// into one of kQBuffers buffers) and of its K and V blocks into the kStages-deep ring, each completing on its
// stage's "full" barrier after the consumers have released the stage on its "empty" one. It runs ahead across tile
// boundaries: the next tile's Q and first K/V land while the consumers finish the current tile.
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

// kLanes: this producer is warp 0 sharing paged boxes (lanes_for); else one thread, whose instantiation carries no
// lane test.
template <class T, class V, bool kLanes = false>
struct Producer {
  using P = Pipeline<T, V>;
  const AttentionParams& p;
  SmemView<T> s;
  const CUtensorMap& tma_q;
  const CUtensorMap& tma_k;
  const CUtensorMap& tma_v;
  Tracer trace;
  // Paged calls whose boxes are under 64 rows (pages of 16 or 32 keys; head dim 256's 80-key blocks at any page
  // size) run the split / paged variants of two consumers on all of warp 0 (kWarp, kLanes; kernel.cuh): lane 0
  // alone draws and publishes the tiles, loads Q and waits on the stages, and the lanes share each K / V block's
  // copies. One thread issues about one TMA box per 200 ns whatever its size (H200, a microbenchmark of 32 KB
  // stages over every SM: 16-row boxes 1.4 TB/s from one thread, 64-row 4.8), and a paged block is a box per page
  // per 64 columns. H200, against contiguous K / V: 16-key pages 2.4-2.7x -> 1.8x (chunked prefill, 32 / 8 heads x
  // 512 rows x 16384 keys) and 2.2x -> 1.6x (MQA, 8 rows, 64 x 4096 keys); head dim 256 at 64-key pages 1.97x ->
  // 1.78x. 64-row boxes went slower from the lanes (1.1-1.2x -> 1.2-1.4x), and a producer of three consumers has
  // 32 registers: those keep one thread, as do contiguous calls.
  static constexpr bool kWarp = V::kSplitPaged && T::kConsumers == 2 && !T::kFp8;  // (FP8: no paged K / V)
  __host__ __device__ static bool lanes_for(const AttentionParams& params) {
    return kWarp && params.page_table != nullptr && page_box_rows<T>(params.page_size) < 64;
  }
  static_assert(!kLanes || kWarp, "only the split / paged variants of two consumers run the producer on warp 0");
  const int lane = kLanes ? static_cast<int>(threadIdx.x % 32) : 0;
  // Paged: rows per TMA box (page_box_rows) and log2 of the page size where it is a power of two (else -1),
  // computed once; only the paged variants read them.
  const int box_rows = V::kSplitPaged ? page_box_rows<T>(p.page_size) : 0;
  const int page_shift = V::kSplitPaged ? log2_if_power_of_two(p.page_size) : -1;
  int key_shift = 0;  // (kSplitPaged) the current tile's, tile_work's: a document tile's blocks start key_shift early

  // A paged key block's first box: its page's index in the table row and its first key's row in that page, and the
  // ids of the block's first kIdBatch boxes. With one thread (not kLanes) each step below is a dependent chain in
  // it: the ids are read back to back, and before the producer waits for the block's stage, so their latency hides
  // under the wait; the boxes step through the pages by addition (a division by the run-time page size, about 20
  // dependent instructions, once per block, and a shift for the usual powers of two). Two ids cover a 128-key block
  // over pages of 64 keys or more; an 80-key block (head dim 256) is five 16-row boxes at any power-of-two page
  // size, all read at once (5-11% faster than two at a time on an H100, though the producer then spills about 100
  // bytes). With the lanes, each reads its own box's id (ids[0]) before lane 0's wait.
  static constexpr int kIdBatch = T::kBlockKV % 64 == 0 ? 2 : T::kBlockKV / 16;
  struct PagedBlock {
    int page_index, in_page;
    int ids[kIdBatch];
  };
  // The index in a table row of the page that holds key `key` (a shift for power-of-two page sizes).
  __device__ __forceinline__ int page_index_of(int key) const {
    return page_shift >= 0 ? key >> page_shift : key / p.page_size;
  }
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
    block.page_index = page_index_of(key0);
    block.in_page = key0 - block.page_index * p.page_size;
    read_page_ids(w, key0, 0, block.page_index, block.in_page, block.ids);
    return block;
  }
  // (kLanes) A block is kBlockKV / box_rows row groups x kPanels boxes, box b being row group b / kPanels, panel
  // b % kPanels; lane l issues boxes l, l + 32, ... Only the id lives across the wait, the box's row in its page is
  // recomputed after it (kept, it doubled the 40-register producer's spills).
  __device__ __forceinline__ int paged_boxes() const { return T::kBlockKV / box_rows * T::kPanels; }
  __device__ __forceinline__ int box_key(int j, int b) const { return j * T::kBlockKV + b / T::kPanels * box_rows; }
  __device__ __forceinline__ int box_page_id(const TileWork& w, int j, int b) const {
    const int key = box_key(j, b);
    return b < paged_boxes() && key < w.len.kv_len ? p.page_table[w.batch * p.page_table_stride + page_index_of(key)]
                                                    : -1;
  }
  // The ids a block's loads need before the stage wait: one thread's first boxes, or this lane's first box.
  __device__ __forceinline__ PagedBlock first_paged_box(const TileWork& w, int j) const {
    if constexpr (kLanes) {
      PagedBlock block;
      block.ids[0] = box_page_id(w, j, lane);
      return block;
    }
    return paged_block(w, j);
  }
  __device__ __forceinline__ void sync_lanes() const {
    if constexpr (kLanes) __syncwarp();
  }

  // Key block j of K or V (`map`) into `dst`, completing on `bar`. Contiguous: one box per 64-column panel. Paged
  // (the map spans the pages, launch.cuh; `block` from first_paged_box): boxes of page_box_rows rows, each inside
  // one page; a box whose first key is at or past kv_len loads zeros (page -1 lies outside the map; an id outside
  // the pool does too). The TMA unit counts a box's bytes toward the barrier whether or not they were inside the
  // tensor.
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
    if constexpr (kLanes) {
      for (int b = lane, id = block.ids[0];;) {
        if (b >= paged_boxes()) return;
        const int key = box_key(j, b), panel = b % T::kPanels;
        tma_load_4d(dst + panel * T::kKVPanelBytes + (key - j * T::kBlockKV) * T::kRowBytes, &map, bar, panel * 64,
                    key - page_index_of(key) * p.page_size, w.kv_head, id);
        b += 32;
        if (b >= paged_boxes()) return;
        id = box_page_id(w, j, b);  // (over 32 boxes: 8-key pages at head dim 256)
      }
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
      if (p.page_table != nullptr) pages = first_paged_box(w, j);  // (before the wait: see paged_block)
    }
    if (lane == 0) {  // (the other lanes wait at sync_lanes, not spinning beside the consumers' warps)
      mbarrier_wait(s.k_empty(stage), P::parity_of(step) ^ 1);  // the consumers are done with this stage's last K
      trace(kTraceProducerK, j);
      mbarrier_arrive_expect_tx(s.k_full(stage), T::kKBytes);
    }
    sync_lanes();  // (the stage is free before any lane's copy)
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
    if constexpr (T::kFp8) {  // V as loaded, into a raw buffer that v_transpose.cuh writes the stage's V^T from
      VRawState* const raw = s.vraw_state();
      const int b = P::vraw_buffer_of(step);
      mbarrier_wait(&raw->empty[b], P::vraw_parity_of(step) ^ 1);  // the buffer's block before is transposed
      trace(kTraceProducerV, j);
      mbarrier_arrive_expect_tx(&raw->full[b], T::kKBytes);
#pragma unroll
      for (int panel = 0; panel < T::kPanels; ++panel) {
        tma_load_4d(s.vraw(b) + panel * T::kKVPanelBytes, &tma_v, &raw->full[b], panel * T::kPanelCols,
                    j * T::kBlockKV, w.kv_head, w.batch);
      }
      return;
    }
    const int stage = P::stage_of(step);
    PagedBlock pages{};
    if constexpr (V::kSplitPaged) {
      if (p.page_table != nullptr) pages = first_paged_box(w, j);
    }
    if (lane == 0) {
      mbarrier_wait(s.v_empty(stage), P::parity_of(step) ^ 1);  // ... and with its last V
      trace(kTraceProducerV, j);
      mbarrier_arrive_expect_tx(s.v_full(stage), T::kVBytes);
    }
    sync_lanes();
    if constexpr (V::kSplitPaged) {
      load_block(s.v(stage), tma_v, s.v_full(stage), w, j, pages);
    } else {
#pragma unroll
      for (int panel = 0; panel < T::kPanels; ++panel) {
        tma_load_4d(s.v(stage) + panel * T::kKVPanelBytes, &tma_v, s.v_full(stage), panel * 64, j * T::kBlockKV,
                    w.kv_head, w.batch);
      }
    }
  }

  // The tile's Q into its buffer (lane 0).
  __device__ __forceinline__ void load_q(const TileWork& w, int n, int tiles_done) {
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
    trace.start(0, lane == 0);
    if (lane == 0) {
      prefetch_tensor_map(&tma_q);
      prefetch_tensor_map(&tma_k);
      prefetch_tensor_map(&tma_v);
    }
    int it = 0, tiles_done = 0;
    // (32-bit tile arithmetic where it suffices: the 64-bit divisions of tile_work spilled a 32-register producer)
    using TileIndex = std::conditional_t<T::kTileIndex32, int, int64_t>;
    TileIndex next = blockIdx.x;  // (lane 0's)
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
      bool more = false;
      if (lane == 0) {
        const bool whole = next < (V::kSplit ? p.split_whole_tiles : num_tiles);
        more = whole || (V::kSplit && split->blocks_left > 0);
        mbarrier_wait(s.sched_empty(slot), ((n >> 1) & 1) ^ 1);  // the consumers have read this slot's last tile
        int key_range = 0;
        if (more) {
          sched[slot].work = tile_work<T, TileIndex, V::kSplitPaged, V::kTensors>(
              p, whole ? next : p.split_whole_tiles + split->tile, key_range, key_shift);
        }
        if (V::kSplit && more) take_split_piece(p, *split, sched[slot].work, whole, n);
        if (V::kSplitPaged && more) s.tile_split()[n & 3] = key_range;
        sched[slot].more = more;
        mbarrier_arrive(s.sched_full(slot));
        trace(kTraceProducerTile, n);
      }
      if constexpr (kLanes) {  // lane 0's tile to every lane (the slot is written before the __syncwarp)
        more = __shfl_sync(0xffffffffu, more, 0);
        key_shift = __shfl_sync(0xffffffffu, key_shift, 0);
        __syncwarp();
      }
      if (!more) break;
      // (read back from the slot, which only lane 0 writes until it arrives on sched_full again: holding the
      // whole TileWork in registers spilled the producer's 40)
      const TileWork& w = sched[slot].work;
      // Drawn now, used at the next iteration: the atomic's latency hides under this tile's loads.
      if (lane == 0) {
        next = p.tile_counter != nullptr
                   ? static_cast<TileIndex>(gridDim.x) + static_cast<TileIndex>(atomicAdd(p.tile_counter, 1ull))
                   : next + static_cast<TileIndex>(gridDim.x);
      }
      if (w.block_begin >= w.block_end) continue;  // the consumers write zeros; nothing to load
      if (lane == 0) load_q(w, n, tiles_done);
      ++tiles_done;
      load_key_blocks(w, it);
    }
    if constexpr (T::kFp8) {  // the end, to the transposing warps: an arrival on the next raw buffer with no block
      // every buffer's last block transposed first: the transposing warps read `done` after each wait
      VRawState* const raw = s.vraw_state();
      for (int k = it; k < it + T::kVRawBuffers; ++k) {
        mbarrier_wait(&raw->empty[P::vraw_buffer_of(k)], P::vraw_parity_of(k) ^ 1);
      }
      raw->done = 1;
      mbarrier_arrive(&raw->full[P::vraw_buffer_of(it)]);
    }
  }
};

}  // namespace jax_flash::sm90
