// The sm90-family attention forward kernel: warp-specialised, wgmma for both products, TMA loads.
//
// Persistent thread blocks of kNumThreads threads, each walking tiles of kBlockQ = 64 * kConsumers query rows:
//   warpgroup 0, the producer: one thread issues TMA copies of Q (once per tile, into one of kQBuffers buffers) and
//     of K and V blocks into a kStages-deep
//     ring of shared-memory stages, each completing on its own mbarrier ("full"), and waits on the stage's "empty"
//     barrier before refilling it. setmaxnreg hands most of its registers to the consumers.
//   warpgroups 1..kConsumers, the consumers: each owns 64 query rows. Per key block: S = Q K^T by wgmma with both
//     operands in shared memory (or Q from registers, loaded once per tile: kQRegs), mask / softcap, the online
//     softmax in registers (exp2 with the scale folded in), and O += P V by wgmma with P from registers and V
//     (MN-major) from shared memory. The product of the previous block's P V is issued together with this block's
//     Q K^T, so the softmax overlaps it (intra-warpgroup overlap), and with pingpong the two consumers take turns on
//     the tensor cores. Without overlap (T::kOverlap false, a
//     measured alternative) each product is waited for at once and the turns cover the exponentials instead.
// Masked three-consumer kernels walk a tile's key blocks last first (kReverse), so a consumer whose rows see only
// the first half of its last block computes that block, its first, at half width (kHalfLast).
// The epilogue writes O through a shared-memory buffer of its own: stmatrix, then one TMA store per 64-column panel
// (T::kTmaStore; 16-byte coalesced stores from every thread otherwise).
#pragma once

#include <cstdint>
#include <type_traits>  // std::conditional_t

#include "common/mask_fragment.cuh"
#include "common/params.h"
#include "common/visibility.h"
#include "sm80/ptx.cuh"      // pack2, exp2_approx
#include "sm90/ptx.cuh"
#include "sm90/softmax.cuh"
#include "sm90/trace.cuh"
#include "sm90/traits.cuh"
#include "sm90/wgmma_ops.cuh"

namespace jax_flash::sm90 {

// One tile = one (batch, query head, block of kBlockQ query rows). Tile t -> (batch, head, query block):
//  - no right bound (every tile costs the same): query blocks innermost, so the tiles in flight share K/V in L2;
//  - a right bound (causal; a tile costs up to its last row's keys): the (batch, head) pairs are cut into sections of
//    p.section_heads (at most 16 at head dims 128 / 256, launch.cuh) whose K and V fit in L2 together, and inside
//    a section the tiles go query block by query block, the last (heaviest) first, over all its heads: heavy tiles
//    are handed out first and light ones fill the tail (longest-processing-time first), while K/V stay in L2.
struct TileWork {
  int batch, head, kv_head, row0;
  int q_rows;        // rows of this tile inside the tensor (the rest of the block is past seqlen_q)
  int q_rows_valid;  // rows that compute (below q_lengths[b]); the others write zeros
  BatchLengths len;
  int block_begin, block_end;  // key blocks some valid row can see; empty: the tile writes zeros and lse = -inf
};

// softcap * tanh(s * scale / softcap) as softcap - 2 softcap / (1 + 2^(s * exp2_scale)), exp2_scale = 2 log2(e) *
// scale / softcap: two MUFU operations (ex2, rcp) and three FMA-pipe ones instead of tanhf's branchy polynomial, whose
// temporaries made the wide-block variants spill. Absolute error ~1e-7 * softcap (the form loses relative accuracy
// only where tanh is near 0, i.e. where the score is near 0 anyway); +-inf exponentials give +-softcap exactly.
__device__ __forceinline__ float softcap_score(float s, float softcap, float exp2_scale) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + sm80::exp2_approx(s * exp2_scale)));
  return fmaf(-2.0f * softcap, r, softcap);
}

// Whether a kernel variant runs the split tail (traits.cuh, kSplitTail): not the masked one that takes Q from
// registers (its epilogue spilled 4 bytes with the split's partial and merge).
template <class T, bool kMaskBlocks, bool kHasSoftcap>
__host__ __device__ constexpr bool splits_tail() {
  return T::kSplitTail && !(kMaskBlocks && T::kQInRegs && !kHasSoftcap);
}

// Index: the tile numbers' type, int64_t, or int where the launcher has checked that they fit (T::kTileIndex32).
template <class T, class Index>
__device__ __forceinline__ TileWork tile_work(const AttentionParams& p, Index tile) {
  TileWork w;
  int q_block;
  Index batch_head;
  if (p.window_right < kUnbounded) {
    const Index batch_heads = static_cast<Index>(p.batch) * p.heads_q;
    const Index section_tiles = static_cast<Index>(p.section_heads) * p.num_q_blocks;
    const Index section = tile / section_tiles;
    const Index first = section * p.section_heads;
    const Index heads_here = min(static_cast<Index>(p.section_heads), batch_heads - first);
    const Index r = tile - section * section_tiles;
    q_block = p.num_q_blocks - 1 - static_cast<int>(r / heads_here);
    batch_head = first + r % heads_here;
  } else {
    q_block = static_cast<int>(tile % p.num_q_blocks);
    batch_head = tile / p.num_q_blocks;
  }
  w.head = static_cast<int>(batch_head % p.heads_q);
  w.batch = static_cast<int>(batch_head / p.heads_q);
  w.kv_head = w.head / p.q_heads_per_kv_head;
  // (p.q_block_shift: block 0 is the short one; launch.cuh sets it with three consumers only, and only they read
  // it: in the 40-register producers of head dim 256 the extra arithmetic spilled 4 bytes)
  const int shift = T::kConsumers == 3 ? p.q_block_shift : 0;
  w.row0 = q_block * T::kBlockQ - (q_block > 0 ? shift : 0);
  w.q_rows = min(q_block > 0 ? T::kBlockQ : T::kBlockQ - shift, p.seqlen_q - w.row0);
  w.len = batch_lengths(p, w.batch);
  w.q_rows_valid = max(0, min(T::kBlockQ, w.len.q_len - w.row0));
  const KeySpan keys = visible_keys_of_rows(p, w.len, w.row0, w.row0 + w.q_rows_valid);
  w.block_begin = keys.begin / T::kBlockKV;
  w.block_end = (keys.end + T::kBlockKV - 1) / T::kBlockKV;
  return w;
}

// A tile as the producer publishes it to the consumers (two slots in shared memory): its facts are worked out once,
// by the producer, off the consumers' path between one tile's last product and the next tile's first.
struct TileSlot {
  TileWork work;
  int more;  // 0: no tile is left, the block ends
};

// Persistent: gridDim.x blocks (at most one per SM) each start at tile blockIdx.x and then draw their next tile
// from p.tile_counter (gridDim.x + atomicAdd: a block that finishes early takes more tiles, which is what balances
// causal tiles of different cost), or walk blockIdx.x + k * gridDim.x when it is null. The producer draws the tiles
// and publishes each, with its facts (TileWork), in a two-slot shared-memory ring (sched_full / sched_empty
// barriers) that the consumers copy; a slot with more = 0 ends the block. The producer runs ahead across tile
// boundaries (the next tile's Q and first K/V land while the consumers finish the current tile), the K/V ring's
// stage and phase counters run on across tiles, Q is double-buffered where shared memory allows (the next tile's Q
// lands while this tile's is still read), and O leaves through its own shared-memory buffer.
template <class T, bool kMaskBlocks, bool kHasSoftcap>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    attention_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ CUtensorMap tma_q,
                     const __grid_constant__ CUtensorMap tma_k, const __grid_constant__ CUtensorMap tma_v,
                     const __grid_constant__ CUtensorMap tma_o, int64_t num_tiles) {
  static_assert(sizeof(TileSlot) <= T::kSchedSlotBytes, "tile slot larger than its shared-memory space");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename T::Element;
  extern __shared__ char smem_raw[];
  // The 128-byte swizzle is a function of address bits 4-9: tiles must start on 1024-byte boundaries.
  char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  char* sO = smem + T::kOOffset;
  auto sQ = [&](int buffer) { return smem + T::kQOffset + buffer * T::kQBytes; };
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + T::kBarrierOffset);
  constexpr int kQB = T::kQBuffers;
  uint64_t* q_full = bars;                                // [kQBuffers] the buffer's Q has landed
  uint64_t* q_empty = bars + kQB;                         // [kQBuffers] the consumers no longer read it
  uint64_t* k_full = bars + 2 * kQB;                      // [kStages]
  uint64_t* v_full = bars + 2 * kQB + T::kStages;         // [kStages]
  uint64_t* k_empty = bars + 2 * kQB + 2 * T::kStages;    // [kStages]
  uint64_t* v_empty = bars + 2 * kQB + 3 * T::kStages;    // [kStages]
  uint64_t* sched_full = bars + 2 * kQB + 4 * T::kStages;       // [2] the slot holds the block's next tile
  uint64_t* sched_empty = bars + 2 * kQB + 4 * T::kStages + 2;  // [2] the consumers have read it
  TileSlot* sched = reinterpret_cast<TileSlot*>(smem + T::kSchedOffset);  // [2]
  // The split tail (T::kSplitTail): what the block's tile n is, at n % 4 (written by the producer before it
  // publishes tile n, read by the consumers in its epilogue; the producer reaches tile n + 4 only after the consumers
  // have taken tile n + 2): 0, a whole tile; s < 0, the tile's last key blocks, whose partial goes to slot -s; s > 0,
  // its first key blocks, which finish it with the partial of slot s.
  int* const split_kind = reinterpret_cast<int*>(smem + T::kSplitStateOffset) + 4;
  auto sK = [&](int stage) { return smem + T::kKOffset + stage * T::kKVBytes; };
  auto sV = [&](int stage) { return smem + T::kVOffset + stage * T::kKVBytes; };
  constexpr int kRowChunks = T::kHeadDim / 8;  // 16-byte chunks per row
  const int tid = threadIdx.x;

  if (tid == 0) {
    for (int b = 0; b < kQB; ++b) {
      mbarrier_init(&q_full[b], 1);
      // every consumer thread releases Q after its last Q K^T; with O staged in Q (T::kOInQ), one thread per
      // consumer once the TMA store of its O has read it
      mbarrier_init(&q_empty[b], T::kOInQ ? T::kConsumers : T::kConsumers * 128);
    }
    for (int s = 0; s < T::kStages; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&k_empty[s], T::kConsumers * 128);  // every consumer thread releases the stage's K
      mbarrier_init(&v_empty[s], T::kConsumers * 128);  // ... and, later, its V
    }
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&sched_full[s], 1);
      mbarrier_init(&sched_empty[s], T::kConsumers * 128);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // Key block j of a tile is pipeline step it (counted over all of this block's tiles); it lives in stage
  // it % kStages, filled for the (it / kStages)-th time: that fill completes the phase of parity (it / kStages) & 1.
  // The session-7 switches (traits.cuh); JAX_FLASH_SM90_VARIANT overrides them in the A/B builds of
  // tests/harness/sm90_ab.cu (bit 0: the exponentials' ring, bit 1: early K/V tests, bit 3: the warp-uniform
  // consumer index; bit 2, speculative exponentials, was measured and removed: docs/NOTES.md, session 7).
#ifdef JAX_FLASH_SM90_VARIANT
  constexpr bool kExpTurns = (JAX_FLASH_SM90_VARIANT & 1) && T::kPingpong && T::kOverlap && T::kConsumers == 2;
  constexpr bool kEarlyTest = (JAX_FLASH_SM90_VARIANT & 2) != 0;
  constexpr bool kUniformConsumer = (JAX_FLASH_SM90_VARIANT & 8) != 0;
  constexpr bool kTmaStore = (JAX_FLASH_SM90_VARIANT & 16) != 0;
#else
  // The consumer index as a warp-uniform value (below): -1 to -4% time at both head dims (with 192-key blocks the
  // soft-capped variant spilled 80 bytes with it)
  constexpr bool kUniformConsumer = !(kHasSoftcap && T::kBlockKV > 128);
  // (with 192-key blocks the soft-capped variant spilled 68 bytes with the ring)
  constexpr bool kExpTurns = T::kExpTurns && !(kHasSoftcap && T::kBlockKV > 128);
  constexpr bool kEarlyTest = T::kEarlyKVTest;
  constexpr bool kTmaStore = T::kTmaStore;
#endif
  static_assert(kTmaStore || !T::kOInQ, "O staged in Q needs the TMA-store epilogue (it releases Q)");
  // Each consumer stops at its own rows' last key block (traits.cuh); masked kernels only (unmasked, every row sees
  // every key). JAX_FLASH_AB_TRIM_TAIL overrides it in A/B builds.
#ifdef JAX_FLASH_AB_TRIM_TAIL
  constexpr bool kTrimTail = (JAX_FLASH_AB_TRIM_TAIL != 0) && kMaskBlocks && !kExpTurns;  // (where it may)
#else
  constexpr bool kTrimTail = T::kTrimConsumerTail && kMaskBlocks;
#endif
  // A consumer's last key block at half width where its rows see only the block's first half (below, half_last):
  // masked kernels with the overlapped key loop and 128-key blocks (the m64n64 product exists; traits.cuh).
#ifdef JAX_FLASH_AB_HALF_LAST  // A/B builds: 0 off, 1 as shipped, 2 with two consumers too
  constexpr bool kHalfLast = (JAX_FLASH_AB_HALF_LAST == 2 ? T::kBlockKV == 128
                                                          : JAX_FLASH_AB_HALF_LAST == 1 && T::kHalfLastBlock) &&
                             kMaskBlocks && T::kOverlap && !kHasSoftcap;
#else
  // (not in the soft-capped kernels: ptxas serialised the wgmma of some of them with it, C7511, at head dim 64 with
  // the exponentials' ring and at head dim 128 without pingpong)
  constexpr bool kHalfLast = T::kHalfLastBlock && kMaskBlocks && T::kOverlap && !kHasSoftcap;
#endif
  // ... which needs the key blocks last first (kernel.cuh, the overlapped key loop; the producer loads them so)
  constexpr bool kReverse = kHalfLast;
  // The producer loads K of the next key block before V of this one (traits.cuh, kKAhead); JAX_FLASH_AB_K_AHEAD
  // overrides it in A/B builds (0 off, 1 every config).
#ifdef JAX_FLASH_AB_K_AHEAD
  constexpr bool kKAhead = JAX_FLASH_AB_K_AHEAD != 0;
#else
  constexpr bool kKAhead = T::kKAhead;
#endif
  // (the exponentials' ring counts one turn per computed key block: a consumer that skips blocks would leave the
  // other waiting; seen as a hang in an A/B build that trimmed at head dim 64, docs/NOTES.md session 10)
  static_assert(!(kTrimTail && kExpTurns), "a consumer's own last key block and the exponentials' ring exclude each other");
  // Q from registers for S = Q K^T (traits.cuh, kQInRegs), except in the soft-capped kernels (they spilled with it)
  constexpr bool kQRegs = T::kQInRegs && !kHasSoftcap;
  // Masking (common/mask_fragment.cuh, session 19): whether a key block is tested score by score is decided on each
  // warp's own rows, and blocks cut only by the right bound (the causal diagonal) take one compare per score. The
  // per-score test had cost about as much as the block's softmax: causal head dim 64 512 / 1024 / 2048 keys +5.0 /
  // +3.0 / +1.6% (Nsight Compute -6.7 / -4.3% time at 512 / 1024), head dims 128 / 256 +0.6 to +1.5% (A/B harness,
  // H200, three rounds; docs/NOTES.md). JAX_FLASH_AB_MASK overrides them in A/B builds: 0 neither (the tile's rows,
  // three compares per score, as before), 1 own rows only, 2 both.
#ifdef JAX_FLASH_AB_MASK
  constexpr bool kMaskOwnRows = JAX_FLASH_AB_MASK >= 1;
  constexpr bool kMaskRightOnly = JAX_FLASH_AB_MASK >= 2;
#else
  constexpr bool kMaskOwnRows = true;
  constexpr bool kMaskRightOnly = true;
#endif
  // The split tail (traits.cuh, kSplitTail; launch.cuh sets p.split_tiles only where it may)
  constexpr bool kSplit = splits_tail<T, kMaskBlocks, kHasSoftcap>();

  static_assert(!(kQRegs && T::kOInQ), "O staged in Q: Q stays in shared memory until the epilogue");
  // P through shared memory (wgmma SS for P V) instead of registers (traits.cuh)
  constexpr bool kPSmem = T::kPInSmem || (kHasSoftcap && T::kPSmemIfSoftcap);
  // kLeanStep: the three session-20 changes below (docs/NOTES.md, session 20: Nsight Compute -4.9 / -3.2 / -3.2% time
  // at head dim 128 non-causal 1024 / 2048 / 4096 keys, -2.2% at head dim 64 causal 1024). Not in the causal head-dim-
  // 256 config (80-key blocks without pingpong), where they cost +2.7 / +8.2% time at causal 1024 / 4096 keys.
  constexpr bool kLeanStep = !(T::kHeadDim == 256 && !T::kPingpong);
  // P packed among the exponentials: the overlapped key loop waits for the previous P V before its exponentials
  // rather than after them, so each k16 step of P goes into the A fragments as soon as it is made and the
  // conversions run beside the MUFU instead of on the consumer's path to its next turn (P from registers, no
  // exponentials' ring). JAX_FLASH_AB_PACK_IN_EXP overrides it in A/B builds.
#ifdef JAX_FLASH_AB_PACK_IN_EXP
  constexpr bool kPackInExp = JAX_FLASH_AB_PACK_IN_EXP != 0 && !kPSmem && !kExpTurns && T::kOverlap;
#else
  constexpr bool kPackInExp = kLeanStep && !kPSmem && !kExpTurns && T::kOverlap;
#endif
  // The epilogue's normalisation with less work (softmax.cuh, finalize_fast; session 20); JAX_FLASH_AB_FAST_EPILOGUE.
#ifdef JAX_FLASH_AB_FAST_EPILOGUE
  constexpr bool kFastEpilogue = JAX_FLASH_AB_FAST_EPILOGUE != 0;
#else
  constexpr bool kFastEpilogue = kLeanStep;
#endif
  // The early K / V tests (kEarlyTest) issued before the row maxima (session 20); JAX_FLASH_AB_TESTS_EARLY.
#ifdef JAX_FLASH_AB_TESTS_EARLY
  constexpr bool kTestsEarly = JAX_FLASH_AB_TESTS_EARLY != 0;
#else
  constexpr bool kTestsEarly = kLeanStep;
#endif
  auto stage_of = [](int it) {
    if constexpr (kEarlyTest) return static_cast<int>(static_cast<uint32_t>(it) % T::kStages);
    return it % T::kStages;
  };
  auto parity_of = [](int it) {
    if constexpr (kEarlyTest) return (static_cast<uint32_t>(it) / T::kStages) & 1;
    return static_cast<uint32_t>((it / T::kStages) & 1);
  };
  // Likewise the block's loaded tile number t (tiles with nothing to load are not counted) uses Q buffer
  // t % kQBuffers, filled for the (t / kQBuffers)-th time.
  auto q_buffer_of = [](int t) { return t % kQB; };
  auto q_parity_of = [](int t) { return static_cast<uint32_t>((t / kQB) & 1); };

  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    // ---------------------------------------- producer ----------------------------------------------------------
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0) {
      JAX_FLASH_TRACE_START(0, true);  // (A/B builds with -DJAX_FLASH_TRACE only: trace.cuh)
      prefetch_tensor_map(&tma_q);
      prefetch_tensor_map(&tma_k);
      prefetch_tensor_map(&tma_v);
      int it = 0, tiles_done = 0;
      // (32-bit tile arithmetic where it suffices: the 64-bit divisions of tile_work spilled a 32-register producer)
      using TileIndex = std::conditional_t<T::kTileIndex32, int, int64_t>;
      TileIndex next = blockIdx.x;
      // The split tail (p.split_tiles > 0, with the static stride): the tiles below p.split_whole_tiles go whole,
      // then this block takes its share of the last tiles' key blocks, counted over those tiles (launch.cuh): a
      // share that starts inside a tile gives that tile's last key blocks, whose partial goes to slot blockIdx.x; one
      // that ends inside a tile, that tile's first, merged with slot blockIdx.x + 1. Every share holds at least a
      // tile's key blocks, so no piece is both. The position lives in shared memory (split_at: the tile, inside
      // the split ones, its first key block, the share's key blocks left): this thread has 40 registers.
      int* const split_at = reinterpret_cast<int*>(smem + T::kSplitStateOffset);
      if (kSplit && p.split_tiles > 0) {
        const int b = static_cast<int>(blockIdx.x);
        const int start = b * p.split_share + min(b, p.split_extra);
        split_at[0] = start / p.split_blocks;
        split_at[1] = start - split_at[0] * p.split_blocks;
        split_at[2] = p.split_share + (b < p.split_extra ? 1 : 0);
      } else if (kSplit) {
        split_at[2] = 0;
      }
      for (int n = 0;; ++n) {
        const int slot = n & 1;
        const bool whole = next < (kSplit ? p.split_whole_tiles : num_tiles);
        const bool more = whole || (kSplit && split_at[2] > 0);
        mbarrier_wait(&sched_empty[slot], ((n >> 1) & 1) ^ 1);  // the consumers have read this slot's last tile
        if (more) {
          sched[slot].work = tile_work<T, TileIndex>(p, whole ? next : p.split_whole_tiles + split_at[0]);
        }
        if (kSplit && more) {
          int kind = 0;
          if (!whole) {
            const int first = split_at[1];
            const int last = min(p.split_blocks, first + split_at[2]);
            sched[slot].work.block_begin = first;  // (equal-cost tiles see key blocks 0 .. split_blocks - 1)
            sched[slot].work.block_end = last;
            const int block = static_cast<int>(blockIdx.x);
            kind = first > 0 ? -block : last < p.split_blocks ? block + 1 : 0;
            split_at[0] += 1;
            split_at[1] = 0;
            split_at[2] -= last - first;
          }
          split_kind[n & 3] = kind;
        }
        sched[slot].more = more;
        mbarrier_arrive(&sched_full[slot]);
        JAX_FLASH_TRACE_EVENT(kTraceProducerTile, n);
        if (!more) break;
        // (read back from the slot, which only this thread writes until it arrives on sched_full again: holding the
        // whole TileWork in registers spilled the producer's 40)
        const TileWork& w = sched[slot].work;
        // Drawn now, used at the next iteration: the atomic's latency hides under this tile's loads.
        next = p.tile_counter != nullptr
                   ? static_cast<TileIndex>(gridDim.x) + static_cast<TileIndex>(atomicAdd(p.tile_counter, 1ull))
                   : next + static_cast<TileIndex>(gridDim.x);
        if (w.block_begin >= w.block_end) continue;  // the consumers write zeros; nothing to load
        const int qb = q_buffer_of(tiles_done);
        mbarrier_wait(&q_empty[qb], q_parity_of(tiles_done) ^ 1);  // the buffer's last tile's last Q K^T is done
        mbarrier_arrive_expect_tx(&q_full[qb], T::kQBytes);
#pragma unroll
        for (int panel = 0; panel < T::kPanels; ++panel) {
          tma_load_4d(sQ(qb) + panel * T::kQPanelBytes, &tma_q, &q_full[qb], panel * 64, w.row0, w.head, w.batch);
        }
        JAX_FLASH_TRACE_EVENT(kTraceProducerQ, n);
        ++tiles_done;
        // (kReverse: last key block first, the consumers' order)
        const int j_first = kReverse ? w.block_end - 1 : w.block_begin;
        const int j_step = kReverse ? -1 : 1;
        auto in_tile = [&](int j) { return kReverse ? j >= w.block_begin : j < w.block_end; };
        auto load_k = [&](int j, int step) {  // key block j into the stage of pipeline step `step`
          const int stage = stage_of(step);
          mbarrier_wait(&k_empty[stage], parity_of(step) ^ 1);  // the consumers are done with this stage's last K
          JAX_FLASH_TRACE_EVENT(kTraceProducerK, j);
          mbarrier_arrive_expect_tx(&k_full[stage], T::kKVBytes);
#pragma unroll
          for (int panel = 0; panel < T::kPanels; ++panel) {
            tma_load_4d(sK(stage) + panel * T::kKVPanelBytes, &tma_k, &k_full[stage], panel * 64, j * T::kBlockKV,
                        w.kv_head, w.batch);
          }
        };
        auto load_v = [&](int j, int step) {
          const int stage = stage_of(step);
          mbarrier_wait(&v_empty[stage], parity_of(step) ^ 1);  // ... and with its last V
          JAX_FLASH_TRACE_EVENT(kTraceProducerV, j);
          mbarrier_arrive_expect_tx(&v_full[stage], T::kKVBytes);
#pragma unroll
          for (int panel = 0; panel < T::kPanels; ++panel) {
            tma_load_4d(sV(stage) + panel * T::kKVPanelBytes, &tma_v, &v_full[stage], panel * 64, j * T::kBlockKV,
                        w.kv_head, w.batch);
          }
        };
        if constexpr (kKAhead) {  // K_first, then per block j: K_{j+1} (if any), V_j
          load_k(j_first, it);
          for (int j = j_first; in_tile(j); j += j_step, ++it) {
            if (in_tile(j + j_step)) load_k(j + j_step, it + 1);
            load_v(j, it);
          }
        } else {  // per block j: K_j, V_j (the test written out keeps these kernels' PTX as before session 14)
          for (int j = j_first; kReverse ? j >= w.block_begin : j < w.block_end; j += j_step, ++it) {
            load_k(j, it);
            load_v(j, it);
          }
        }
      }
    }
    return;
  }

  // ------------------------------------------ consumers -----------------------------------------------------------
  setmaxnreg_inc<T::kConsumerRegs>();
  // rows [64 * consumer, 64 * consumer + 64) of each tile; kUniformConsumer: read through a shuffle from lane 0,
  // which tells ptxas the value is warp-uniform (CUTLASS's canonical_warp_group_idx), so what derives from it (the
  // Q descriptor) can live in uniform registers instead of moving there (R2UR) before each HGMMA
  const int consumer = kUniformConsumer ? __shfl_sync(0xffffffffu, warpgroup, 0) - 1 : warpgroup - 1;
  const int wg_tid = tid % 128;
  const int warp_in_wg = wg_tid / 32;
  const int lane = tid % 32;
  const int warp_row0 = 64 * consumer + 16 * warp_in_wg;  // this warp's 16 rows within the tile
  JAX_FLASH_TRACE_START(consumer + 1, wg_tid == 0);  // (A/B builds with -DJAX_FLASH_TRACE only: trace.cuh)

  float acc_o[1][T::kOTiles][4];  // O (16 rows of this warp, D): the wgmma m64nD fragment
  auto& acc_o_flat = *reinterpret_cast<float(*)[T::kHeadDim / 2]>(&acc_o[0][0][0]);
  float acc_s[1][T::kSTiles][4];  // S of the current key block
  auto& acc_s_flat = *reinterpret_cast<float(*)[T::kBlockKV / 2]>(&acc_s[0][0][0]);
  uint32_t rP[T::kKVSteps][4];    // P of the previous key block as wgmma A fragments
  uint32_t rQ[kQRegs ? T::kDSteps : 1][4];  // kQRegs: this consumer's 64 rows of Q as wgmma A fragments
  auto& rP_flat = *reinterpret_cast<uint32_t(*)[T::kKVSteps * 4]>(&rP[0][0]);
  float alpha[2];
  const float max_growth = sm80::lazy_rescale_threshold(p.scale_log2);

  // Pingpong: the consumers take turns issuing their GEMMs in a ring (consumer c waits on named barrier
  // kTurnBarrier + c, then hands the turn to consumer (c + 1) % kConsumers), so one warpgroup's softmax runs while
  // another's products occupy the tensor cores. The last consumer hands on once before anyone issues, so it hands on
  // once more than consumer 0 waits inside the loop: consumer 0 takes that last turn after the loop, and no arrival
  // is left pending when the block exits. Every consumer takes the same turns (one per product group of each tile,
  // idle ones included), so the ring never waits on a consumer that has left.
  constexpr int kTurnBarrier = 1 + T::kConsumers;  // ids 1 .. kConsumers are the consumers' epilogue barriers
  // kExpTurns: a second ring (ids kTurnBarrier + kConsumers ...) around the exponentials, beside the first one on the
  // product issue. ptxas moves register-only instructions across bar.sync / bar.arrive, so what the turn covers is
  // its choice: in the measured build the scaling FFMAs and the first exponentials (docs/NOTES.md, session 7; tying
  // all of them to the turn through shared memory was slower).
  constexpr int kExpBarrier = kTurnBarrier + T::kConsumers;
  auto wait_exp_turn = [&] {
    if constexpr (kExpTurns) named_barrier_sync(kExpBarrier + consumer, 256);
  };
  auto pass_exp_turn = [&] {
    if constexpr (kExpTurns) named_barrier_arrive(kExpBarrier + (consumer + 1) % T::kConsumers, 256);
  };
  if constexpr (kExpTurns) {
    if (consumer == T::kConsumers - 1) named_barrier_arrive(kExpBarrier, 256);
  }
  auto wait_turn = [&] {
    if constexpr (T::kPingpong) named_barrier_sync(kTurnBarrier + consumer, 256);
  };
  auto pass_turn = [&] {
    if constexpr (T::kPingpong) named_barrier_arrive(kTurnBarrier + (consumer + 1) % T::kConsumers, 256);
  };
  if constexpr (T::kPingpong) {
    if (consumer == T::kConsumers - 1) named_barrier_arrive(kTurnBarrier, 256);  // consumer 0 goes first
  }

  int it = 0, tiles_done = 0;
  for (int n = 0;; ++n) {
    const int slot = n & 1;
    mbarrier_wait(&sched_full[slot], (n >> 1) & 1);
    JAX_FLASH_TRACE_EVENT(kTraceTileStart, n);
    // (the flag through a lane-0 shuffle: warp-uniform for ptxas, which serialises wgmma issued under a branch it
    // cannot prove uniform)
    const bool more = __shfl_sync(0xffffffffu, sched[slot].more, 0) != 0;
    const TileWork w = sched[slot].work;
    // T::kHoldTileSlot: the slot is released at the end of the tile, and the epilogue reads the tile's facts back
    // from it (reload_tile) instead of holding them in registers across the key loop. The producer loses nothing:
    // it publishes tile n + 2 into this slot only after tile n + 1's loads, which wait on this tile's stages anyway.
    auto release_slot = [&] { mbarrier_arrive(&sched_empty[slot]); };
    if (!T::kHoldTileSlot || !more) release_slot();
    if (!more) break;
    int batch = w.batch, head = w.head;
    int row0 = w.row0, q_rows = w.q_rows, q_rows_valid = w.q_rows_valid;
    auto reload_tile = [&] {
      if constexpr (T::kHoldTileSlot) {  // (after the key loop's barriers, whose asm clobbers memory: a fresh load)
        const TileWork& ws = sched[slot].work;
        batch = ws.batch, head = ws.head, row0 = ws.row0, q_rows = ws.q_rows, q_rows_valid = ws.q_rows_valid;
      }
    };
    auto end_tile = [&] {
      if constexpr (T::kHoldTileSlot) release_slot();
    };
    const int block_begin = w.block_begin, block_end = w.block_end;
    const BatchLengths len = w.len;
    // The tile's O rows and lse entries, formed where they are written (held across the key loop, the 64-bit
    // pointers cost registers the softcap variants do not have).
    auto tile_o = [&] {
      return static_cast<Element*>(p.o) + batch * p.o_batch_stride + int64_t{row0} * p.o_seq_stride +
             head * p.o_head_stride;
    };
    auto tile_lse = [&] { return p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + row0; };

    auto write_zero_rows = [&] {  // this consumer's rows inside the tensor: zeros and lse = -inf
      Element* gO = tile_o();
      for (int i = wg_tid; i < 64 * kRowChunks; i += 128) {
        const int row = 64 * consumer + i / kRowChunks;
        if (row < q_rows) *reinterpret_cast<uint4*>(gO + row * p.o_seq_stride + (i % kRowChunks) * 8) = make_uint4(0, 0, 0, 0);
      }
      if (p.lse != nullptr) {
        float* gLse = tile_lse();
        for (int r = 64 * consumer + wg_tid; r < min(q_rows, 64 * consumer + 64); r += 128) gLse[r] = -INFINITY;
      }
    };
    if (block_begin >= block_end) {  // no row sees a key (nothing was loaded)
      write_zero_rows();
      end_tile();
      continue;
    }
    if (T::kConsumers > 2 && 64 * consumer >= q_rows_valid) {
      // Every row of this consumer is past the tile's valid rows (the last query block of a length that is not a
      // multiple of kBlockQ, or a padded batch entry): no math, but the consumer still takes part in the pipeline:
      // it releases each K/V stage and Q once the producer's fill of them has landed (an arrival before that would
      // count toward the barrier's previous phase) and takes its pingpong turns. (Three consumers only: with two,
      // the extra path made ptxas spill in the D = 128 kernels, and 192-row tiles are the ones that waste a third.)
      const int qb = q_buffer_of(tiles_done);
      mbarrier_wait(&q_full[qb], q_parity_of(tiles_done));
      ++tiles_done;
      for (int j = block_begin; j <= block_end; ++j, ++it) {  // turn j: S_j (j < block_end) and P_{j-1} V_{j-1}
        if (T::kOverlap || j < block_end) {  // without overlap one turn per key block (its exponentials)
          wait_turn();
          pass_turn();
        }
        if (j < block_end) {
          mbarrier_wait(&k_full[stage_of(it)], parity_of(it));
          mbarrier_arrive(&k_empty[stage_of(it)]);
          if (j == block_end - 1) mbarrier_arrive(&q_empty[qb]);
        }
        if (j > block_begin) {
          mbarrier_wait(&v_full[stage_of(it - 1)], parity_of(it - 1));
          mbarrier_arrive(&v_empty[stage_of(it - 1)]);
        }
      }
      --it;  // the loop ran block_end - block_begin + 1 times; the math path advances it once per key block
      reload_tile();
      write_zero_rows();
      end_tile();
      continue;
    }

#pragma unroll
    for (int t = 0; t < T::kOTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][t][e] = 0.0f;
    SplitSoftmax<T::kSTiles, T::kOTiles> softmax;

    const int diag_offset = len.kv_len - len.q_len;
    const int lo_off = p.window_left >= kUnbounded ? -kUnbounded : diag_offset - p.window_left;
    const int hi_off = p.window_right >= kUnbounded ? kUnbounded : diag_offset + p.window_right;
    // kTrimTail: this consumer's own last key block. Its 64 rows can see fewer keys than the tile's last row (causal:
    // consumer 0's rows end 64 rows above consumer 1's), and the key blocks past them would be computed fully
    // masked; it skips their math but still waits for and releases their stages and takes their turns (below). At
    // least one block is computed, so rows that see no key come out as before (zeros, lse = -inf).
    int my_end = block_end;
    // kHalfLast: this consumer's rows see none of the second half of its last key block (the causal diagonal: in a
    // 128 x 128 diagonal block consumer 0's rows end at key 64; a key length that ends in a block's first half),
    // so that block's two products run at half width (S = Q K^T over its first 64 keys, P V over 4 k16 steps) and
    // its softmax over half the scores. (Warp-uniform for ptxas through a lane-0 shuffle, like `more`: wgmma under
    // a branch it cannot prove uniform is serialised.)
    bool half_last = false;
    if constexpr (kTrimTail || kHalfLast) {
      const KeySpan mine = visible_keys_of_rows(p, len, row0 + 64 * consumer, row0 + min(64 * consumer + 64, q_rows_valid));
      if constexpr (kTrimTail) my_end = max(block_begin + 1, min(block_end, (mine.end + T::kBlockKV - 1) / T::kBlockKV));
      if constexpr (kHalfLast) {
        half_last = __shfl_sync(0xffffffffu, mine.end <= (my_end - 1) * T::kBlockKV + T::kBlockKV / 2 ? 1 : 0, 0) != 0;
      }
    }

    // Descriptors. Q (A, K-major): this consumer's 64 rows of each panel; k16 step kk is panel kk/4, byte 32*(kk%4)
    // of the swizzled row. K (B, K-major): the same stepping over kBlockKV rows. V (B, MN-major): k16 step t is rows
    // 16t..16t+15 (2048 bytes in), the N = D columns span the panels kKVPanelBytes apart (LBO).
    // Each is a base descriptor (stage 0, step 0) plus a byte offset added to its start-address field (smem_offset:
    // the per-step masks and shifts of a full descriptor were a fifth of the key loop's instructions).
    const int qb = q_buffer_of(tiles_done);
    const uint32_t sQ_addr = smem_u32(sQ(qb)) + consumer * 64 * T::kRowBytes;
    const uint64_t q_desc0 = smem_descriptor(sQ_addr, 16, 1024);
    const uint64_t k_desc0 = smem_descriptor(smem_u32(sK(0)), 16, 1024);
    const uint64_t v_desc0 = smem_descriptor(smem_u32(sV(0)), T::kKVPanelBytes, 1024);
    auto q_desc = [&](int kk) { return smem_offset(q_desc0, (kk / 4) * T::kQPanelBytes + (kk % 4) * 32); };
    auto k_desc = [&](int stage, int kk) {
      return smem_offset(k_desc0, stage * T::kKVBytes + (kk / 4) * T::kKVPanelBytes + (kk % 4) * 32);
    };
    auto v_desc = [&](int stage, int t) { return smem_offset(v_desc0, stage * T::kKVBytes + t * 16 * T::kRowBytes); };
    // The products and the softmax steps take kKeys, the keys of the block that are computed: kBlockKV, or its
    // first half (kHalfLast). S's first kKeys / 8 n-tiles are the m64n(kKeys) accumulator.
    auto issue_s = [&]<int kKeys = T::kBlockKV>(int stage) {  // S = Q K^T, one commit group
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < T::kDSteps; ++kk) {
        if constexpr (kQRegs) {
          wgmma_rs_k<Element, kKeys>(*reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]), rQ[kk],
                                     k_desc(stage, kk), kk > 0);
        } else {
          wgmma_ss<Element, kKeys>(*reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]), q_desc(kk),
                                   k_desc(stage, kk), kk > 0);
        }
      }
      wgmma_commit();
    };
    // P (kPSmem): this consumer's (64, kBlockKV) tile, A operand stepped like Q.
    const uint32_t sP_addr = smem_u32(smem + T::kPOffset) + consumer * T::kPBytes;
    const uint64_t p_desc0 = smem_descriptor(sP_addr, 16, 1024);
    auto p_desc = [&](int t) { return smem_offset(p_desc0, (t / 4) * T::kPPanelBytes + (t % 4) * 32); };
    auto issue_pv = [&]<int kKeys = T::kBlockKV>(int stage) {  // O += P V, one commit group
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kKeys / 16; ++t) {
        if constexpr (kPSmem) {
          wgmma_ss_tb<Element, T::kHeadDim>(acc_o_flat, p_desc(t), v_desc(stage, t), 1);
        } else {
          wgmma_rs<Element, T::kHeadDim>(acc_o_flat, rP[t], v_desc(stage, t), 1);
        }
      }
      wgmma_commit();
    };
    const float softcap_exp2_scale = p.softcap_scale * 2.0f * 1.4426950408889634f;  // 2 log2(e) * scale / softcap
    // softcap, mask and the running max of S_j; alpha for the O rescale and whether it is needed
    auto scores_to_max = [&]<int kKeys = T::kBlockKV>(int j) {
      if constexpr (kHasSoftcap) {  // S = softcap * tanh(S * scale / softcap); the softmax then runs with scale 1
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[0][n][e] = softcap_score(acc_s[0][n][e], p.softcap, softcap_exp2_scale);
      }
      if constexpr (kMaskBlocks) {
        mask_key_block<kKeys, kMaskOwnRows, kMaskRightOnly>(*reinterpret_cast<float(*)[1][kKeys / 8][4]>(&acc_s[0][0][0]),
                                                            j * T::kBlockKV, row0, q_rows_valid, warp_row0, lane,
                                                            lo_off, hi_off, len.kv_len);
      }
      return softmax.template update_max<kKeys / 8>(acc_s, p.scale_log2, max_growth, alpha);
    };
    // P = exp2(...) in place, inside the exponentials' turn (kExpTurns)
    auto exponentiate_in_turn = [&]<int kKeys = T::kBlockKV>() {
      [[maybe_unused]] auto& s_flat = *reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]);
      wait_exp_turn();
      if constexpr (kExpTurns) fence_registers(s_flat);
      softmax.template exponentiate<kKeys / 8>(acc_s, p.scale_log2);
      if constexpr (kExpTurns) fence_registers(s_flat);
      pass_exp_turn();
    };
    auto scores_to_probabilities = [&]<int kKeys = T::kBlockKV>(int j) {  // scores_to_max, then P
      const bool rescale = scores_to_max.template operator()<kKeys>(j);
      exponentiate_in_turn.template operator()<kKeys>();
      return rescale;
    };
    // stmatrix addresses (kPSmem): lane l gives row l%8 of 8x8 matrix l/8 of each k16 step t, i.e. row
    // 16 * warp + l%8 + 8 * ((l/8) % 2), 16-byte chunk 2t + (l/8)/2 of the keys (panel t/4, chunk 2(t%4) + (l/8)/2
    // inside it, XOR-swizzled by the row's low 3 bits, which are l%8).
    auto st_row_of = [&](int l) { return 16 * warp_in_wg + l % 8 + 8 * ((l / 8) % 2); };
    auto st_chunk_of = [](int t, int l) { return static_cast<uint32_t>((2 * (t % 4) + (l / 8) / 2) ^ (l % 8)); };
    const int st_row = st_row_of(lane);
    const uint32_t st_base = sP_addr + st_row * T::kRowBytes;
    auto st_chunk = [&](int t) { return st_chunk_of(t, lane); };
    // Accumulator n-tiles 2t and 2t + 1 (this warp's 16 rows x columns 16t .. 16t + 15) packed to 16 bits: the four
    // 8x8 matrices of one stmatrix.x4, which are also the wgmma A fragment of k16 step t
    auto pack_k16 = [&](const auto& acc, int t, uint32_t (&a)[4]) {
      a[0] = sm80::pack2<Element>(acc[0][2 * t][0], acc[0][2 * t][1]);
      a[1] = sm80::pack2<Element>(acc[0][2 * t][2], acc[0][2 * t][3]);
      a[2] = sm80::pack2<Element>(acc[0][2 * t + 1][0], acc[0][2 * t + 1][1]);
      a[3] = sm80::pack2<Element>(acc[0][2 * t + 1][2], acc[0][2 * t + 1][3]);
    };
    // P (fp32) -> A fragments: k16 step t covers S tiles 2t and 2t+1
    auto pack_probabilities = [&]<int kKeys = T::kBlockKV>() {
#pragma unroll
      for (int t = 0; t < kKeys / 16; ++t) {
        uint32_t a[4];
        pack_k16(acc_s, t, a);
        if constexpr (kPSmem) {
          stmatrix_x4(st_base + (t / 4) * T::kPPanelBytes + st_chunk(t) * 16, a);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) rP[t][e] = a[e];
        }
      }
      if constexpr (kPSmem) {  // the whole warpgroup's P is written and visible to wgmma (the async proxy)
        fence_proxy_async_smem();
        named_barrier_sync(1 + consumer, 128);
      }
    };
    auto fence_p = [&] {  // P V has completed: the compiler may now reuse P's registers
      if constexpr (!kPSmem) fence_registers(rP_flat);
    };
    // kPackInExp: P = exp2(...) with each k16 step packed into the A fragments as it is made
    auto exponentiate_packed = [&]<int kKeys = T::kBlockKV>() {
      softmax.template exponentiate_packed<kKeys / 8>(acc_s, p.scale_log2, [&](int t) {
        uint32_t a[4];
        pack_k16(acc_s, t, a);
#pragma unroll
        for (int e = 0; e < 4; ++e) rP[t][e] = a[e];
      });
    };
    // After the tile's last Q K^T the producer may refill the Q buffer, unless O is staged there (T::kOInQ: the
    // epilogue releases it once the TMA store has read this consumer's rows).
    auto release_q = [&] {
      if constexpr (!T::kOInQ && !kQRegs) mbarrier_arrive(&q_empty[qb]);
    };
    // kTrimTail: the key blocks past this consumer's rows (after its math, or before it in kReverse order): no math,
    // but the consumer waits for and releases their stages and takes their turns.
    auto skip_blocks = [&] {
      for (int j = my_end; j < block_end; ++j, ++it) {
        wait_turn();  // (one turn per key block, with or without overlap)
        pass_turn();
        mbarrier_wait(&k_full[stage_of(it)], parity_of(it));  // (an arrival before the fill would count toward
        mbarrier_arrive(&k_empty[stage_of(it)]);              // the barrier's previous phase)
        mbarrier_wait(&v_full[stage_of(it)], parity_of(it));
        mbarrier_arrive(&v_empty[stage_of(it)]);
      }
    };
    mbarrier_wait(&q_full[qb], q_parity_of(tiles_done));
    ++tiles_done;
    if constexpr (kQRegs) {
      // this consumer's 64 rows of Q -> A fragments (k16 step kk: panel kk / 4, the stmatrix addresses of P above,
      // which are ldmatrix's too), then the buffer is free: every read of it is in registers
#pragma unroll
      for (int kk = 0; kk < T::kDSteps; ++kk) {
        sm80::ldmatrix_x4(rQ[kk], sQ_addr + (kk / 4) * T::kQPanelBytes + st_row * T::kRowBytes + st_chunk(kk) * 16);
      }
      mbarrier_arrive(&q_empty[qb]);
    }
    JAX_FLASH_TRACE_EVENT(kTraceQReady, n);
    if constexpr (!T::kOverlap) {
      // No intra-warpgroup overlap (cuDNN's schedule, read from its SASS: docs/NOTES.md, session 6). Per key block:
      // S_j = Q K_j^T waited for at once, its row max, then the turn: exponentials, O rescale and P packing, pass
      // the turn, O += P_j V_j waited for at once. With pingpong the consumers' exponentials (MUFU) never run at
      // the same time, and each one's products run under the other's exponentials.
      for (int j = block_begin; j < my_end; ++j, ++it) {
        mbarrier_wait(&k_full[stage_of(it)], parity_of(it));
        issue_s(stage_of(it));
        wgmma_wait<0>();
        fence_registers(acc_s_flat);
        mbarrier_arrive(&k_empty[stage_of(it)]);
        if (j == my_end - 1) release_q();  // the tile's last read of Q
        const bool rescale_o = scores_to_max(j);
        wait_turn();
        softmax.exponentiate(acc_s, p.scale_log2);
        if (rescale_o) decltype(softmax)::rescale(acc_o, alpha);
        pack_probabilities();
        pass_turn();
        mbarrier_wait(&v_full[stage_of(it)], parity_of(it));
        issue_pv(stage_of(it));
        wgmma_wait<0>();
        fence_registers(acc_o_flat);
        fence_p();
        mbarrier_arrive(&v_empty[stage_of(it)]);
      }
    } else {
      // kReverse: the key blocks come last first (block_end - 1 down to block_begin, the producer's order), so a
      // consumer's half-width block (kHalfLast) is its first, and the key blocks past its own rows (kTrimTail) come
      // before its math. (A half-width S = Q K^T in the steady loop, issued beside a full P V, made ptxas serialise
      // every wgmma of the kernel, C7511; in the prologue it does not.)
      if constexpr (kTrimTail && kReverse) skip_blocks();
      // Key blocks in this consumer's order: block first_j first, then each block toward last_j.
      const int first_j = kReverse ? my_end - 1 : block_begin;
      const int last_j = kReverse ? block_begin : my_end - 1;
      constexpr int kDir = kReverse ? -1 : 1;
      // Prologue: S of the first block and its softmax (O is still zero: no rescale). kKeys: the keys of the block
      // computed (kBlockKV, or its first half).
      auto prologue = [&]<int kKeys>() {
        mbarrier_wait(&k_full[stage_of(it)], parity_of(it));
        JAX_FLASH_TRACE_EVENT(kTraceKReady, first_j);
        wait_turn();
        JAX_FLASH_TRACE_EVENT(kTraceTurn, first_j);
        issue_s.template operator()<kKeys>(stage_of(it));
        pass_turn();
        wgmma_wait<0>();
        fence_registers(*reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]));
        JAX_FLASH_TRACE_EVENT(kTraceSDone, first_j);
        mbarrier_arrive(&k_empty[stage_of(it)]);
        if (first_j == last_j) release_q();  // the tile's last read of Q
        if constexpr (kPackInExp) {
          scores_to_max.template operator()<kKeys>(first_j);
          exponentiate_packed.template operator()<kKeys>();
        } else {
          scores_to_probabilities.template operator()<kKeys>(first_j);
          pack_probabilities.template operator()<kKeys>();
        }
        JAX_FLASH_TRACE_EVENT(kTraceSoftmaxDone, first_j);
        ++it;
      };
      // Steady state (intra-warpgroup overlap): issue S_j = Q K_j^T and O += P_prev V_prev back to back; the
      // softmax of S_j runs while P_prev V_prev is still on the tensor cores; O is rescaled once it is done.
      // kPrevKeys: the keys of the previous block computed.
      bool kv_ready = false;  // kEarlyTest: K_j and V_prev were seen complete during the last block's softmax
      auto step = [&]<int kPrevKeys>(int j) {
        if (!kv_ready) {
          mbarrier_wait(&k_full[stage_of(it)], parity_of(it));
          mbarrier_wait(&v_full[stage_of(it - 1)], parity_of(it - 1));
        }
        JAX_FLASH_TRACE_EVENT(kTraceKReady, j);
        wait_turn();
        JAX_FLASH_TRACE_EVENT(kTraceTurn, j);
        issue_s(stage_of(it));
        issue_pv.template operator()<kPrevKeys>(stage_of(it - 1));
        pass_turn();
        wgmma_wait<1>();  // the older group, S_j, is done
        fence_registers(acc_s_flat);
        JAX_FLASH_TRACE_EVENT(kTraceSDone, j);
        mbarrier_arrive(&k_empty[stage_of(it)]);
        if (j == last_j) release_q();  // the tile's last read of Q: its buffer may refill
        // kEarlyTest: whether the next K and this V have landed, tested during the softmax (kTestsEarly: both
        // tests before the row maxima, so their latency hides under them, and no branch between them)
        [[maybe_unused]] bool k_next_landed = false, v_landed = false;
        if constexpr (kEarlyTest && kTestsEarly) {
          k_next_landed = mbarrier_test(&k_full[stage_of(it + 1)], parity_of(it + 1));
          v_landed = mbarrier_test(&v_full[stage_of(it)], parity_of(it));
        }
        const bool rescale_o = scores_to_max(j);
        if constexpr (kEarlyTest && kTestsEarly) {
          kv_ready = k_next_landed & v_landed;
        } else if constexpr (kEarlyTest) {
          kv_ready = mbarrier_test(&k_full[stage_of(it + 1)], parity_of(it + 1)) &&
                     mbarrier_test(&v_full[stage_of(it)], parity_of(it));
        }
        if constexpr (kPackInExp) {
          wgmma_wait<0>();  // P_prev V_prev is done: its P fragments may be rewritten as the exponentials go
          fence_registers(acc_o_flat);
          fence_p();
          JAX_FLASH_TRACE_EVENT(kTracePVDone, j);
          mbarrier_arrive(&v_empty[stage_of(it - 1)]);
          exponentiate_packed();
          JAX_FLASH_TRACE_EVENT(kTraceSoftmaxDone, j);
          if (rescale_o) decltype(softmax)::rescale(acc_o, alpha);
        } else {
          exponentiate_in_turn();
          JAX_FLASH_TRACE_EVENT(kTraceSoftmaxDone, j);
          wgmma_wait<0>();  // P_prev V_prev is done: O and the P fragments may change
          fence_registers(acc_o_flat);
          fence_p();
          JAX_FLASH_TRACE_EVENT(kTracePVDone, j);
          mbarrier_arrive(&v_empty[stage_of(it - 1)]);
          if (rescale_o) decltype(softmax)::rescale(acc_o, alpha);
          pack_probabilities();
        }
        ++it;
      };
      // Drain: O += P_last V_last (kKeys: the keys of the last block computed).
      auto drain = [&]<int kKeys>() {
        mbarrier_wait(&v_full[stage_of(it - 1)], parity_of(it - 1));
        wait_turn();
        JAX_FLASH_TRACE_EVENT(kTraceDrainTurn, n);
        issue_pv.template operator()<kKeys>(stage_of(it - 1));
        pass_turn();
        wgmma_wait<0>();
        fence_registers(acc_o_flat);
        fence_p();
        JAX_FLASH_TRACE_EVENT(kTracePVDone, -1);
        mbarrier_arrive(&v_empty[stage_of(it - 1)]);
      };
      // The key loop whose first block computes kFirstKeys keys. (Each path issues and waits for all of its
      // products itself: wgmma issued in one branch and waited for after the paths join is serialised by ptxas.)
      auto in_range = [&](int j) { return kReverse ? j >= last_j : j <= last_j; };
      auto key_loop = [&]<int kFirstKeys>() {
        constexpr bool kHalfFirst = kFirstKeys < T::kBlockKV;
        prologue.template operator()<kFirstKeys>();
        if constexpr (kHalfFirst) {  // the next step's P V is the half-width one (or the drain's, if none)
          if (first_j == last_j) {
            drain.template operator()<kFirstKeys>();
            return;
          }
          step.template operator()<kFirstKeys>(first_j + kDir);
        }
        for (int j = first_j + (kHalfFirst ? 2 : 1) * kDir; in_range(j); j += kDir) {
          step.template operator()<T::kBlockKV>(j);
        }
        drain.template operator()<T::kBlockKV>();
      };
      if constexpr (kHalfLast) {
        if (half_last) {
          key_loop.template operator()<T::kBlockKV / 2>();
        } else {
          key_loop.template operator()<T::kBlockKV>();
        }
      } else {
        key_loop.template operator()<T::kBlockKV>();
      }
      if constexpr (kTrimTail && !kReverse) skip_blocks();
    }  // kOverlap
    if constexpr (kTrimTail && !T::kOverlap) skip_blocks();

    // ---- the split tail: a tile's last key blocks leave their partial, its first ones merge it -----------------
    if constexpr (kSplit) {
      const int split = split_kind[n & 3];  // (written before the tile was published; see split_kind)
      // slot s, this consumer, chunk c at float4 (s * kConsumers + consumer) * kSplitChunks * 128 + c * 128 + wg_tid:
      // O's n-tile c for c < kOTiles (this thread's 4 accumulators of it), then (row maxima, row sums)
      const int split_slot = split < 0 ? -split : split;
      float4* const partial = reinterpret_cast<float4*>(p.split_partials) +
                              (int64_t{split_slot} * T::kConsumers + consumer) * T::kSplitChunks * 128 + wg_tid;
      unsigned* const flag = p.split_flags + split_slot * T::kConsumers + consumer;
      if (split < 0) {  // (the scores' row maxima and this thread's partial row sums, as the softmax holds them)
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {
          __stcg(partial + n * 128, make_float4(acc_o[0][n][0], acc_o[0][n][1], acc_o[0][n][2], acc_o[0][n][3]));
        }
        __stcg(partial + T::kOTiles * 128, make_float4(softmax.row_max[0], softmax.row_max[1], softmax.row_sum[0],
                                                       softmax.row_sum[1]));
        __threadfence();
        named_barrier_sync(1 + consumer, 128);  // every thread's partial is written ...
        if (wg_tid == 0) {
          flag_store_release(flag, 1u);  // ... before the flag
          // (O staged in Q: the epilogue would release Q after its store; this consumer's products, the last
          // readers of its rows, are complete)
          if constexpr (T::kOInQ) mbarrier_arrive(&q_empty[qb]);
        }
        end_tile();
        continue;
      }
      if (split > 0) {
        // The other block wrote this partial at the start of its share, which holds more key blocks than this
        // piece: the flag is set by now unless that block started late (it never waits on this one).
        if (wg_tid == 0) {
          while (flag_load_acquire(flag) == 0) __nanosleep(256);
        }
        named_barrier_sync(1 + consumer, 128);
        const float4 stats = __ldcg(partial + T::kOTiles * 128);
        const float other_max[2] = {stats.x, stats.y}, other_sum[2] = {stats.z, stats.w};
        float mine_scale[2], other_scale[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // m = max(m_a, m_b); O = O_a 2^((m_a - m) s) + O_b 2^((m_b - m) s), l likewise
          const float m = fmaxf(softmax.row_max[h], other_max[h]);
          const float m_scaled = (m == -INFINITY ? 0.0f : m) * p.scale_log2;  // (a row that saw no key: zeros)
          mine_scale[h] = sm80::exp2_approx(softmax.row_max[h] * p.scale_log2 - m_scaled);
          other_scale[h] = sm80::exp2_approx(other_max[h] * p.scale_log2 - m_scaled);
          softmax.row_max[h] = m;
          softmax.row_sum[h] = softmax.row_sum[h] * mine_scale[h] + other_sum[h] * other_scale[h];
        }
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {
          const float4 o = __ldcg(partial + n * 128);
          acc_o[0][n][0] = fmaf(acc_o[0][n][0], mine_scale[0], o.x * other_scale[0]);
          acc_o[0][n][1] = fmaf(acc_o[0][n][1], mine_scale[0], o.y * other_scale[0]);
          acc_o[0][n][2] = fmaf(acc_o[0][n][2], mine_scale[1], o.z * other_scale[1]);
          acc_o[0][n][3] = fmaf(acc_o[0][n][3], mine_scale[1], o.w * other_scale[1]);
        }
      }
    }

    // ---- epilogue: O / l (zeros for rows past q_rows_valid) and lse -------------------------------------------
    reload_tile();
    bool row_valid[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_valid[h] = warp_row0 + lane / 4 + 8 * h < q_rows_valid;
    if constexpr (kFastEpilogue) {
      float row_l[2];
      softmax.finalize_fast(acc_o, row_valid, warp_row0 + 16 <= q_rows_valid, row_l);
      if (p.lse != nullptr && lane % 4 == 0) {  // one lane of each quad owns the row
        float* gLse = tile_lse();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + lane / 4 + 8 * h;
          if (row < q_rows) gLse[row] = row_valid[h] ? softmax.row_lse(h, row_l[h], p.scale) : -INFINITY;
        }
      }
    } else {
      float row_lse[2];
      softmax.finalize(acc_o, row_valid, p.scale, row_lse);
      if (p.lse != nullptr && lane % 4 == 0) {  // one lane of each quad owns the row
        float* gLse = tile_lse();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = warp_row0 + lane / 4 + 8 * h;
          if (row < q_rows) gLse[row] = row_valid[h] ? row_lse[h] : -INFINITY;
        }
      }
    }
    // O -> this consumer's 64 rows of sO (swizzled like Q) -> global
    if constexpr (kTmaStore) {
      // stmatrix (the addresses as for P above), then one TMA store per 64-column panel by thread 0 of the consumer;
      // the TMA unit clips rows past the tensor. That thread first waits until its previous store has read sO.
      if (wg_tid == 0) bulk_wait_group_read0();
      named_barrier_sync(1 + consumer, 128);  // ... and every thread of the consumer knows it
      // (kHoldTileSlot: the lane read afresh, so these addresses are formed here, not held through the key loop)
      const int e_lane = T::kHoldTileSlot ? lane_id_fresh() : lane;
      const uint32_t so_base = smem_u32(sO) + (64 * consumer + st_row_of(e_lane)) * T::kRowBytes;
#pragma unroll
      for (int t = 0; t < T::kHeadDim / 16; ++t) {  // O tiles 2t, 2t + 1: columns 16t .. 16t + 15
        uint32_t a[4];
        pack_k16(acc_o, t, a);
        stmatrix_x4(so_base + (t / 4) * T::kQPanelBytes + st_chunk_of(t, e_lane) * 16, a);
      }
      fence_proxy_async_smem();               // the generic-proxy writes, visible to the TMA unit ...
      named_barrier_sync(1 + consumer, 128);  // ... from every thread of the consumer
      if (wg_tid == 0) {
#pragma unroll
        for (int panel = 0; panel < T::kPanels; ++panel) {
          tma_store_4d(&tma_o, sO + panel * T::kQPanelBytes + 64 * consumer * T::kRowBytes, panel * 64,
                       row0 + 64 * consumer, head, batch);
        }
        bulk_commit_group();
        if constexpr (T::kOInQ) {  // O was staged in this consumer's rows of Q: they may refill once read
          bulk_wait_group_read0();
          mbarrier_arrive(&q_empty[qb]);
        }
      }
      JAX_FLASH_TRACE_EVENT(kTraceEpilogueDone, n);
    } else {  // 16-byte coalesced stores from every thread
      named_barrier_sync(1 + consumer, 128);  // every thread of this consumer is done reading the last tile's sO rows
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + lane / 4 + 8 * h;
#pragma unroll
        for (int n = 0; n < T::kOTiles; ++n) {  // columns 8n + 2*(lane%4) + {0, 1}: chunk n of the row
          char* dst = sO + (n / 8) * T::kQPanelBytes + row * T::kRowBytes + (((n % 8) ^ (row % 8)) * 16) + 4 * (lane % 4);
          *reinterpret_cast<uint32_t*>(dst) = sm80::pack2<Element>(acc_o[0][n][2 * h], acc_o[0][n][2 * h + 1]);
        }
      }
      named_barrier_sync(1 + consumer, 128);  // this consumer's rows are complete in sO
      Element* gO = tile_o();
      for (int i = wg_tid; i < 64 * kRowChunks; i += 128) {
        const int row = 64 * consumer + i / kRowChunks, chunk = i % kRowChunks;
        if (row < q_rows) {
          const char* src = sO + (chunk / 8) * T::kQPanelBytes + row * T::kRowBytes + (((chunk % 8) ^ (row % 8)) * 16);
          *reinterpret_cast<uint4*>(gO + row * p.o_seq_stride + chunk * 8) = *reinterpret_cast<const uint4*>(src);
        }
      }
    }
    end_tile();
  }
  if constexpr (kTmaStore) {
    if (wg_tid == 0) bulk_wait_group0();  // the last O store has completed before the block's shared memory goes
  }
  if constexpr (T::kPingpong) {
    if (consumer == 0) named_barrier_sync(kTurnBarrier, 256);  // the last consumer's last hand-over
  }
  if constexpr (kExpTurns) {
    if (consumer == 0) named_barrier_sync(kExpBarrier, 256);
  }
#endif
}

}  // namespace jax_flash::sm90
