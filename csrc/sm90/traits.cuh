// Compile-time shape of one sm90-family kernel, derived from its KernelKey: warpgroup roles, tile sizes and the
// shared-memory map. Host-compilable (the registry reads kSmemBytes).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/kernel_key.h"

namespace jax_flash::sm90 {

template <KernelKey kKey>
struct Traits {
  static_assert(kKey.family == 90, "sm90 traits need a family-90 key");
  using Element = std::conditional_t<kKey.dtype == static_cast<int>(DType::kBFloat16), __nv_bfloat16, __half>;

  static constexpr int kHeadDim = kKey.head_dim;
  static constexpr int kBlockKV = kKey.block_kv;
  static constexpr int kStages = kKey.stages;
  static constexpr int kConsumers = kKey.consumer_warpgroups;  // math warpgroups
  static constexpr int kBlockQ = 64 * kConsumers;              // each consumer owns 64 query rows (one wgmma M)
  static constexpr int kNumThreads = 128 * (kConsumers + 1);   // warpgroup 0 is the producer
  static constexpr bool kPingpong = kKey.pingpong;             // consumers take turns (named barriers)
  // Intra-warpgroup overlap: S_j = Q K_j^T issued with O += P_{j-1} V_{j-1}, the softmax under the product, and the
  // pingpong turns on the product issue. Without it each product is waited for at once and the turns cover the
  // softmax's exponentials (cuDNN's schedule, docs/NOTES.md session 6).
  static constexpr bool kOverlap = kKey.overlap;
  // Session 7 (docs/NOTES.md; measured per head dim with tests/harness/sm90_ab.cu on the H200, Nsight Compute):
  // a second ring of turns on the exponentials, so the two consumers start them staggered (D = 64: -4 to -6% time;
  // D = 128: none) ...
  static constexpr bool kExpTurns = kHeadDim == 64 && kPingpong && kOverlap && kConsumers == 2;
  // ... and the next key block's K / V barriers tested (mbarrier.test_wait) during this block's softmax, with
  // unsigned pipeline counters, so the waits at the top of the loop are usually skipped (D = 128: -1 to -3%; D = 64:
  // none, and with the ring it cancelled the ring's gain).
#ifdef JAX_FLASH_AB_EARLY_TEST_3C  // A/B builds: three consumers too
  static constexpr bool kEarlyKVTest = kHeadDim >= 128 || kConsumers == 3;
#else
  static constexpr bool kEarlyKVTest = kHeadDim >= 128;
#endif  // (head dim 256 taken with 128: the tensor cores dominate)
  // Session 9: the epilogue stores O with stmatrix into shared memory and one TMA store per 64-column panel (16-byte
  // stores from every thread before).
  static constexpr bool kTmaStore = true;
  // Session 10: in masked kernels each consumer stops at its own 64 rows' last visible key block instead of the
  // tile's (kernel.cuh, kTrimTail). On the causal diagonal consumer 0's last block differs from consumer 1's when a
  // key-block boundary falls between their last rows: always with 80-key blocks (head dim 256), never with 128-key
  // blocks and equal lengths; 192-key blocks (head dim 64) are left as they are (their soft-capped kernels are at
  // the edge of spilling). Session 12: with three consumers (192-row tiles over 128-key blocks) too, where causal
  // D = 64 1024 / 2048 keys measured 314 / 393 TFLOP/s with it against 295 / 387 without (docs/NOTES.md).
  static constexpr bool kTrimConsumerTail = kHeadDim == 256 || kConsumers == 3;
  // Session 13: in masked kernels a consumer whose rows see only the first half of its last key block computes that
  // block at half width (kernel.cuh, kHalfLast; the key blocks then run last first): S = Q K^T as m64n64, P V over 4
  // k16 steps, the softmax over half the scores. With 192-row tiles over 128-key blocks that is every other
  // consumer's last block on the causal diagonal: causal D = 64 512 / 1024 / 2048 keys measured 250 / 324 / 408
  // TFLOP/s with it against 238 / 316 / 402 (two consumers at 512 / 1024, docs/NOTES.md). With two consumers
  // (consumer 0's diagonal block in every 128 x 128 tile) it measured -1 to +1.5% timed and +2 to +5% time in Nsight
  // Compute at D = 128: off. 128-key blocks only (80 / 192 have no wgmma of half their N).
  static constexpr bool kHalfLastBlock = kBlockKV == 128 && kConsumers == 3;
  // Session 14: the producer issues K of key block j + 1 before V of block j (kernel.cuh, kKAhead). K's stage frees
  // when S = Q K^T is done, V's only after P V, a softmax later; in one thread's in-order loads the next K waited
  // behind that V. Head dim 256 (two stages of 80-key blocks, 40 KB per K or V): causal 512 / 1024 / 2048 / 4096 keys
  // +2.4 / +0-2.6 / +3.1-3.7 / +3.1-3.9% timed in two A/B runs, non-causal unchanged; head dims 64 and 128 moved
  // by -2.7 to +2.6% (within the runs' noise), so they keep the plain order (docs/NOTES.md, session 14).
  static constexpr bool kKAhead = kHeadDim == 256;
  // P (the softmax's probabilities, the A operand of O += P V) from registers (wgmma RS), with three consumers too
  // since session 12: at 160 registers each (producer 32) S + O + P (64 + 32 + 32 at D = 64, 128 keys) fit once the
  // tile's facts stay in shared memory (kHoldTileSlot) and the producer numbers tiles in 32 bits (kTileIndex32).
  // Sessions 3-11 sent P through shared memory with three consumers (wgmma SS; -DJAX_FLASH_AB_P_SMEM_3C rebuilds
  // that): measured 5-9% slower at D = 64 from 2048 keys (docs/NOTES.md, session 12).
#ifdef JAX_FLASH_AB_P_SMEM_3C
  static constexpr bool kPInSmem = kConsumers == 3;
#else
  static constexpr bool kPInSmem = false;
#endif
  // ... but through shared memory in the soft-capped kernels of 192-key blocks (kernel.cuh, kPSmem): S (96
  // registers), P (48) and the softcap's temporaries left no room for the session-9 epilogue (16-76 bytes spilled
  // however it was arranged); and in the soft-capped three-consumer kernels (the softcap's temporaries beside
  // S + O + P spilled 64-124 bytes at 160 registers). More than 128 keys per block: head dim 64 only (at 128 the
  // 160 / 192-key sweep configs have no shared memory left for P).
  static constexpr bool kPSmemIfSoftcap = (kBlockKV > 128 && kHeadDim == 64) || kConsumers == 3;
  // Session 12: the consumers hold their tile's slot (kernel.cuh, TileSlot) until the epilogue and read the tile's
  // facts back from it there, instead of holding them in registers across the key loop: with three consumers (160
  // registers each) and P in registers they spilled 60-216 bytes otherwise.
#ifdef JAX_FLASH_AB_HOLD_SLOT_ALL  // A/B builds: every config
  static constexpr bool kHoldTileSlot = true;
#else
  static constexpr bool kHoldTileSlot = kConsumers == 3;
#endif
  // ... and the producer (32 registers beside three 160-register consumers) numbers tiles in 32 bits: tile_work's
  // 64-bit divisions spilled it. The launcher refuses more than INT_MAX tiles (no tensor that fits on a GPU has them).
  // (kTileIndex32: below, after kSplitTail)
  // Session 17: each consumer loads its 64 rows of Q into registers once per tile (ldmatrix, in the wgmma A fragment
  // layout) and S = Q K^T reads only K from shared memory (wgmma RS; kernel.cuh, kQRegs): a third less shared-memory
  // traffic per S product (A 2 KB + B 4 KB per m64n128k16 -> B only), and the Q buffer frees at the tile's start.
  // Costs kDSteps * 4 registers: 32 at head dim 128, where the pingpong config (non-causal) measured +1.1 / +1.3 /
  // +2.7% at 1024 / 4096 / 16384 keys and -0.1% at 512 (A/B harness, four rounds; Nsight Compute at its locked clock:
  // -1.7 / -2.1% time at 4096 / 16384), the causal config -1.0% at 512 keys and +0.2 to +0.6% from 1024, with or
  // without pingpong: it stays off there (docs/NOTES.md, session 17). Not in the soft-capped kernels (24-68 bytes
  // spilled), not with three consumers (160 registers: 96-144 bytes spilled at head dim 64), not at head dim 256 (64
  // registers).
#ifdef JAX_FLASH_AB_Q_REGS  // A/B builds: 0 off; 1 every head-dim-128 config; 2 and head dim 64 with two consumers
  static constexpr bool kQInRegs =
      JAX_FLASH_AB_Q_REGS != 0 && kConsumers == 2 && (kHeadDim == 128 || (JAX_FLASH_AB_Q_REGS == 2 && kHeadDim == 64));
#else
  static constexpr bool kQInRegs = kHeadDim == 128 && kPingpong && kConsumers == 2;
#endif
  // Session 18: the split tail (kernel.cuh, launch.cuh). Tiles of equal cost walked by a static stride end in a
  // partial wave: 2048 tiles (every head-dim-128 shape of the benchmark) over 132 SMs leave 64 blocks idle through
  // the 16th tile (a 3% loss; 33 heads instead of 16, exactly 32 waves, read 1-4% more TFLOP/s on the H200). The
  // last tiles are cut into equal shares of key blocks instead, and a tile cut between two blocks is merged from a
  // partial in scratch memory. The non-causal head-dim-128 config only (launch.cuh decides per call).
#ifdef JAX_FLASH_AB_SPLIT_TAIL  // A/B builds: 0 off, 1 on, 2 and at head dim 256 (unmeasured: run 8 did not split)
  static constexpr bool kSplitTail = JAX_FLASH_AB_SPLIT_TAIL != 0 && kConsumers == 2 && kPingpong &&
                                     (kHeadDim == 128 || (JAX_FLASH_AB_SPLIT_TAIL == 2 && kHeadDim == 256));
#else
  static constexpr bool kSplitTail = kHeadDim == 128 && kConsumers == 2 && kPingpong;
#endif
  // A consumer thread's partial: its O fragment (kHeadDim / 2 floats) and its two rows' maxima and sums, as float4
  // chunks stored chunk-major (128 threads write 2 KB contiguous per chunk); a slot holds every consumer's.
  static constexpr int kSplitChunks = kHeadDim / 8 + 1;
  static constexpr int kSplitSlotBytes = kConsumers * kSplitChunks * 128 * 16;
  // Scratch per block of the grid (at most one per SM): one slot, and one flag per consumer.
  static constexpr int kSplitBytesPerSm = kSplitTail ? kSplitSlotBytes + kConsumers * 4 : 0;
  // (kTileIndex32, above: with the split tail's bookkeeping the 40-register producer of two consumers spilled 4-8
  // bytes unless it too numbers tiles in 32 bits)
#ifdef JAX_FLASH_AB_TILE32_ALL  // A/B builds: every config
  static constexpr bool kTileIndex32 = true;
#else
  static constexpr bool kTileIndex32 = kConsumers == 3 || kSplitTail;
#endif
  static_assert(kKey.block_q == kBlockQ, "block_q must be 64 * consumer_warpgroups");
  static_assert(kConsumers == 2 || kConsumers == 3, "sm90 family: 2 or 3 consumer warpgroups");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "sm90 family: head_dim 64, 128 or 256");
  static_assert(kBlockKV == 64 || kBlockKV == 80 || kBlockKV == 128 || kBlockKV == 160 || kBlockKV == 192,
                "sm90 family: block_kv 64, 80, 128, 160 or 192 (the S = Q K^T wgmma N of csrc/sm90/wgmma_ops.cuh)");

  // Registers per thread after setmaxnreg: the producer gives its share to the consumers. setmaxnreg.inc only draws
  // on what setmaxnreg.dec released inside this block, so the roles must fit the block's launch allocation:
  // 128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kNumThreads * kLaunchRegs, with kLaunchRegs the 64K
  // register file over the block's threads rounded down to a multiple of 8 (168 for 384 threads, 128 for 512: the
  // consumers get 232 with two consumers, 160 with three). Asking for more blocks the consumers
  // forever (seen on the H200 with 32 / 240: every launch hung).
  static constexpr int kLaunchRegs = (65536 / kNumThreads) / 8 * 8;
  // 40 with two consumers (32 spilled the tile scheduler's bookkeeping); 32 with three, so each consumer gets 160
  // (with 40: 152, too few for P in registers), its tile numbers in 32 bits (kTileIndex32)
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : 40;
  static constexpr int kConsumerRegs = (kNumThreads * kLaunchRegs / 128 - kProducerRegs) / kConsumers / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kNumThreads * kLaunchRegs,
                "setmaxnreg split exceeds the block's register allocation");

  // Shared memory, every tile stored as head_dim/64 panels of [rows][64] elements with the 128-byte TMA / wgmma
  // swizzle (16-byte chunk c of row r sits at chunk c ^ (r % 8)); panels and tiles are 1024-byte aligned.
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kRowBytes = 128;  // 64 elements of 2 bytes
  static constexpr int kQPanelBytes = kBlockQ * kRowBytes;
  static constexpr int kKVPanelBytes = kBlockKV * kRowBytes;
  static constexpr int kQBytes = kQPanelBytes * kPanels;    // (kBlockQ, D)
  static constexpr int kKVBytes = kKVPanelBytes * kPanels;  // (kBlockKV, D), one K or V stage
  // P of each consumer (kPInSmem): (64, kBlockKV) as ceil(kBlockKV/64) panels of [64][64] (the last one partly
  // used when kBlockKV = 160), swizzled like Q (wgmma's A).
  static constexpr int kPPanelBytes = 64 * kRowBytes;
  static constexpr int kPBytes = kPInSmem || kPSmemIfSoftcap ? (kBlockKV + 63) / 64 * kPPanelBytes : 0;  // per consumer
  // Everything but Q and O's staging buffer: the K/V ring, P, barriers (at most 2 x 2 for Q, 4 per stage, 4 for the
  // tile slots), two tile slots, and 1024 bytes so the kernel can round the dynamic shared-memory base up to the
  // 1024-byte swizzle atom.
  static constexpr int kMaxSmemBytes = 227 * 1024;  // opt-in dynamic shared memory per block on sm_90
  static constexpr int kSchedSlotBytes = 48;        // one published tile (kernel.cuh, TileSlot)
  // The split tail's shared state (kernel.cuh): the producer's position in its share (3 ints) and the pieces' kinds
  // for the consumers (4 ints, a ring by tile number)
  static constexpr int kSplitStateBytes = kSplitTail ? 32 : 0;
  static constexpr int kRingBytes = 2 * kStages * kKVBytes + kConsumers * kPBytes + 8 * (4 + 4 * kStages + 4) +
                                    2 * kSchedSlotBytes + kSplitStateBytes + 1024;
  // Q is double-buffered where it fits (227 KB) beside O's staging buffer: the producer then loads the next tile's
  // Q while the consumers still read this tile's, instead of after their last Q K^T (at 4-8 key blocks per tile
  // that wait was a visible part of each tile). D = 128 with 128-key blocks fits with 1.9 KB to spare; 160-key
  // blocks do not.
  static constexpr int kQBuffers = kRingBytes + 3 * kQBytes <= kMaxSmemBytes ? 2 : 1;
  // Where even one Q buffer and a separate O buffer do not fit (head dim 256: Q and O are 64 KB each), O is staged
  // in the Q buffer: each consumer writes its O into its own 64 rows of Q, which only its own (finished) Q K^T
  // products read, and Q is released to the producer once the TMA store has read them, not at the tile's last
  // Q K^T (the next tile's Q then loads after the epilogue instead of under the last key blocks).
  static constexpr bool kOInQ = kRingBytes + 2 * kQBytes > kMaxSmemBytes;
  static constexpr int kQOffset = 0;                                 // [kQBuffers] (kBlockQ, D)
  static constexpr int kOOffset = kOInQ ? kQOffset : kQBuffers * kQBytes;  // O's staging buffer, (kBlockQ, D) like Q
  static constexpr int kKOffset = kQBuffers * kQBytes + (kOInQ ? 0 : kQBytes);
  static constexpr int kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr int kPOffset = kVOffset + kStages * kKVBytes;
  static constexpr int kBarrierOffset = kPOffset + kConsumers * kPBytes;
  static_assert(!kOInQ || kConsumers == 2, "O staged in Q: two consumers (three have no registers for D = 256)");
  // Q full and Q empty per Q buffer; K full, V full, K empty, V empty per stage; tile-slot full and empty, 2 each
  static constexpr int kNumBarriers = 2 * kQBuffers + 4 * kStages + 4;
  static constexpr int kSchedOffset = kBarrierOffset + 8 * kNumBarriers;  // two tile slots (kernel.cuh, TileSlot)
  static constexpr int kSplitStateOffset = kSchedOffset + 2 * kSchedSlotBytes;
  static constexpr int kSmemBytes = kSplitStateOffset + kSplitStateBytes + 1024;

  // The online softmax of the sm80 family, on one warp's 16 rows of the wgmma accumulator: the m64nN fp32
  // fragment is, per warp, the mma.sync m16n8 layout repeated N/8 times, so S is [1][kBlockKV/8][4] and O
  // [1][D/8][4] in that family's terms.
  static constexpr int kMTiles = 1;
  static constexpr int kSTiles = kBlockKV / 8;
  static constexpr int kOTiles = kHeadDim / 8;
  static constexpr bool kOptimizedSoftmax = true;
  static constexpr int kKVSteps = kBlockKV / 16;  // k16 steps of P V
  static constexpr int kDSteps = kHeadDim / 16;   // k16 steps of Q K^T
};

}  // namespace jax_flash::sm90
