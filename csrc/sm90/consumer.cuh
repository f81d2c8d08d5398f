// The consumer role of the sm90 kernel: warpgroups 1 .. kConsumers each own 64 query rows of every tile. Per tile:
// take the tile the producer published, run the main loop over its key blocks (mainloop.cuh), leave or merge a split
// tile's partial (split_tail.cuh), and store O and the lse (epilogue.cuh).
#pragma once

#include <cstdint>

#include "common/params.h"
#include "sm90/epilogue.cuh"
#include "sm90/mainloop.cuh"
#include "sm90/pingpong.cuh"
#include "sm90/ptx.cuh"
#include "sm90/shared_storage.cuh"
#include "sm90/split_tail.cuh"
#include "sm90/trace.cuh"

namespace jax_flash::sm90 {

template <class T, class V>
__device__ __forceinline__ void run_consumer(const AttentionParams& p, SmemView<T> s,
                                             const CUtensorMap& tma_o, int warpgroup, int tid) {
  using E = Epilogue<T, V>;
  setmaxnreg_inc<T::kConsumerRegs>();
  // rows [64 * consumer, 64 * consumer + 64) of each tile; V::kUniformConsumer: read through a shuffle from lane 0,
  // which tells ptxas the value is warp-uniform (CUTLASS's canonical_warp_group_idx), so what derives from it (the
  // Q descriptor) can live in uniform registers instead of moving there (R2UR) before each HGMMA
  const int consumer = V::kUniformConsumer ? __shfl_sync(0xffffffffu, warpgroup, 0) - 1 : warpgroup - 1;
  const int wg_tid = tid % 128;
  const int warp_in_wg = wg_tid / 32;
  const int lane = tid % 32;
  Tracer trace;
  trace.start(consumer + 1, wg_tid == 0);
  ConsumerRegisters<T, V> r;
  Mainloop<T, V> mainloop(p, s, consumer, warp_in_wg, lane, trace, r);
  mainloop.turns.start();

  for (int n = 0;; ++n) {
    const int slot = n & 1;
    mbarrier_wait(s.sched_full(slot), (n >> 1) & 1);
    trace(kTraceTileStart, n);
    // (the flag through a lane-0 shuffle: warp-uniform for ptxas, which serialises wgmma issued under a branch it
    // cannot prove uniform)
    const bool more = __shfl_sync(0xffffffffu, s.sched()[slot].more, 0) != 0;
    const TileWork w = s.sched()[slot].work;
    // T::kHoldTileSlot: the slot is released at the end of the tile, and the epilogue reads the tile's facts back
    // from it (reload) instead of holding them in registers across the key loop. The producer loses nothing: it
    // publishes tile n + 2 into this slot only after tile n + 1's loads, which wait on this tile's stages anyway.
    auto release_slot = [&] { mbarrier_arrive(s.sched_empty(slot)); };
    if (!T::kHoldTileSlot || !more) release_slot();
    if (!more) break;
    ConsumerTile tile{w.batch, w.head, w.row0, w.q_rows, w.q_rows_valid, w.block_begin, w.block_end, w.len};
    auto reload = [&] {
      if constexpr (T::kHoldTileSlot) {  // (after the key loop's barriers, whose asm clobbers memory: a fresh load)
        const TileWork& ws = s.sched()[slot].work;
        tile.batch = ws.batch, tile.head = ws.head, tile.row0 = ws.row0, tile.q_rows = ws.q_rows;
        tile.q_rows_valid = ws.q_rows_valid;
      }
    };
    auto end_tile = [&] {
      if constexpr (T::kHoldTileSlot) release_slot();
    };
    // the tile's key range (split-KV), read where the epilogue needs it
    auto key_range = [&] { return V::kSplitPaged && p.num_splits > 1 ? s.tile_split()[n & 3] : 0; };
    if (tile.block_begin >= tile.block_end) {  // no row sees a key (nothing was loaded)
      E::write_zero_rows(p, tile, key_range(), consumer, wg_tid);
      end_tile();
      continue;
    }
    if constexpr (T::kConsumers > 2) {
      if (64 * consumer >= tile.q_rows_valid) {  // every row of this consumer is past the valid ones
        mainloop.run_idle(tile);
        reload();
        E::write_zero_rows(p, tile, key_range(), consumer, wg_tid);
        end_tile();
        continue;
      }
    }
    mainloop.run(tile, n);

    if constexpr (V::kSplit) {  // a split tile's last key blocks leave their partial; its first ones merge it
      const int split = s.split()->kind[n & 3];  // (written before the tile was published)
      const SplitPartial<T> partial(p, split, consumer, wg_tid);
      if (split < 0) {
        partial.leave(r.acc_o, r.softmax, consumer, wg_tid);
        end_tile();
        continue;
      }
      if (split > 0) partial.merge(r.acc_o, r.softmax, mainloop.scale_log2(), consumer, wg_tid);
    }

    reload();
    E::store(mainloop, tile, key_range(), s, tma_o, wg_tid);
    trace(kTraceEpilogueDone, n);
    end_tile();
  }
  if (wg_tid == 0) bulk_wait_group0();  // the last O store has completed before the block's shared memory goes
  mainloop.turns.finish();
}

}  // namespace jax_flash::sm90
