// Compile-time facts of one sm90-family kernel, derived from its KernelKey: warpgroup roles and registers, tile
// sizes, the shared-memory layout, and every schedule choice with the measurement behind it (Traits for the whole
// config, Variant for what differs between its masked / soft-capped variants). Host-compilable (the registry reads
// kSmemBytes). Measurements: H200, bf16, A/B harness or Nsight Compute (docs/PERFORMANCE.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/kernel_key.h"
#include "sm90/shared_storage.cuh"

namespace jax_flash::sm90 {

template <KernelKey kKey>
struct Traits {
  static_assert(kKey.family == 90, "sm90 traits need a family-90 key");
  // FP8 (float8_e4m3fn q, k, v; launch_fp8.cuh): both products by e4m3 wgmma (k32 steps), P rounded to e4m3, V
  // read as V^T (K-major, as FP8 wgmma requires of B), the output in bfloat16.
  static constexpr bool kFp8 = kKey.dtype == static_cast<int>(DType::kFloat8E4M3);
  using Element = std::conditional_t<kFp8, __nv_fp8_e4m3,
                                     std::conditional_t<kKey.dtype == static_cast<int>(DType::kBFloat16),
                                                        __nv_bfloat16, __half>>;
  using OutElement = std::conditional_t<kFp8, __nv_bfloat16, Element>;  // O's element
  // FP8: P's largest entry is 2^8 (softmax.cuh, kPOffsetLog2) against the running maximum, which moves once a row
  // has grown by 2^0.75 (the lazy rescale's threshold, mainloop.cuh): P <= 2^8.75 < e4m3's 448.
  static constexpr int kPOffsetLog2 = kFp8 ? 8 : 0;
  static constexpr int kElementBytes = static_cast<int>(sizeof(Element));

  // ---- shape -------------------------------------------------------------------------------------------------------
  static constexpr int kHeadDim = kKey.head_dim;
  static constexpr int kBlockKV = kKey.block_kv;
  static constexpr int kStages = kKey.stages;
  static constexpr int kConsumers = kKey.consumer_warpgroups;  // math warpgroups
  static constexpr int kBlockQ = 64 * kConsumers;              // each consumer owns 64 query rows (one wgmma M)
  static constexpr int kNumThreads = 128 * (kConsumers + 1);   // warpgroup 0 is the producer
  static constexpr bool kPingpong = kKey.pingpong;  // consumers take turns on the tensor cores (pingpong.cuh)
  // Intra-warpgroup overlap: S_j = Q K_j^T issued with O += P_{j-1} V_{j-1}, the softmax under the product. Without
  // it each product is waited for at once and the turns cover the exponentials (cuDNN's schedule; 9-17% slower).
  static constexpr bool kOverlap = kKey.overlap;
  static_assert(kKey.block_q == kBlockQ, "block_q must be 64 * consumer_warpgroups");
  static_assert(kConsumers == 2 || kConsumers == 3, "sm90 family: 2 or 3 consumer warpgroups");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "sm90 family: head_dim 64, 128 or 256");
  static_assert(kBlockKV == 64 || kBlockKV == 80 || kBlockKV == 128 || kBlockKV == 160 || kBlockKV == 192 ||
                    kBlockKV == 208,
                "sm90 family: block_kv 64, 80, 128, 160, 192 or 208 (the S = Q K^T wgmma N of "
                "csrc/sm90/wgmma_ops.cuh)");

  // The accumulators per consumer warp, in the m16n8 fragment layout (a wgmma m64nN accumulator is, per warp, that
  // layout repeated N/8 times): S is [1][kBlockKV/8][4], O [1][D/8][4].
  static constexpr int kSTiles = kBlockKV / 8;
  static constexpr int kOTiles = kHeadDim / 8;
  // The products' k steps cover 32 bytes of a swizzled row: k16 for 16-bit elements, k32 for FP8.
  static constexpr int kStepElems = 32 / kElementBytes;
  static constexpr int kKVSteps = kBlockKV / kStepElems;  // k steps of P V
  static constexpr int kDSteps = kHeadDim / kStepElems;   // k steps of Q K^T
  // FP8: O += P V in parts, each into a fresh fp32 accumulator added into O (mainloop.cuh, fold_pv). 64-column
  // parts take 32 registers beside O's D / 2; whole, the accumulator took D / 2 more and the consumers spilled
  // 132-2160 bytes per thread, 2-10x the time (H200). Head dim 128 with the overlap runs one part of 128 columns
  // with Q from shared memory (kQInRegs), 8-16 bytes spilled: no second product to wait for after the key loop's
  // own. H200, A/B harness, three rounds, against two parts with Q in registers, 512-16384 keys: +0.0 to +6.5%
  // non-causal, +0.9 to +5.2% causal (two parts with Q from shared memory: -1.5 to +1.3%).
  static constexpr int kPvParts = kFp8 ? (kHeadDim == 128 && kOverlap ? 1 : kHeadDim / 64) : 1;
  static_assert(!kFp8 || ((kHeadDim == 128 || kHeadDim == 256) && kBlockKV % 64 == 0 && kConsumers == 2),
                "sm90 FP8: head_dim 128 or 256 (rows of 128 one-byte elements), block_kv a multiple of 64 (V^T "
                "panels of 128 keys, the last one's second half unread at 64 and 192), two consumers");

  // ---- schedule: choices every variant of this config shares --------------------------------------------------
  // A second ring of turns on the exponentials, so the two consumers' MUFU phases do not coincide: D = 64 -4 to -6%
  // time, D = 128 none.
  static constexpr bool kExpTurns = kHeadDim == 64 && kPingpong && kOverlap && kConsumers == 2;
  // The next key block's K / V barriers tested (mbarrier.test_wait) during this block's softmax, so the blocking
  // waits at the top of the step are usually skipped: D = 128 -1 to -3% time, D = 64 none (it cancelled the ring).
  static constexpr bool kEarlyKVTest = kHeadDim >= 128;
  // In masked kernels each consumer stops at its own 64 rows' last visible key block instead of the tile's: with
  // 80-key blocks and with 192-row tiles a block boundary falls between the consumers' last rows on the diagonal
  // (three consumers, causal D = 64 1024 / 2048 keys +6 / +2%); 128-key two-consumer tiles never gain.
  static constexpr bool kTrimConsumerTail = kHeadDim == 256 || kConsumers == 3;
  // A consumer whose rows see only the first kNarrowKeys keys of its last key block computes that block at that
  // width (the key blocks then run last first, so it is the consumer's first): three consumers' 128-key blocks at
  // half width (m64n64, 4 k16 steps), causal D = 64 512 / 1024 keys +5 / +3%; two consumers at D = 128: no gain.
  // Head dim 256's pingpong config (calls without a right bound) at 48 of 80 keys (m64n48, 3 k16 steps): 512 /
  // 1024 / 2048 keys +3.8 / +1.4 / +2.6%, none from 4096 (32 keys gained less, 512 keys +2.9%). Its causal config
  // gained nothing (-4.1 to +0.4% over two measurements).
  static constexpr int kNarrowKeys =
      kBlockKV == 128 && kConsumers == 3 ? 64 : (kHeadDim == 256 && kBlockKV == 80 && kPingpong ? 48 : 0);
  // The producer issues K of key block j + 1 before V of block j (in one thread's in-order loads the next K waited
  // behind a V stage that frees a softmax later): head dim 256 causal +2-4%; 64 / 128 within noise.
  static constexpr bool kKAhead = kHeadDim == 256;
  // P through shared memory (wgmma SS) in the soft-capped kernels of 192-key blocks and of three consumers: S + P
  // and the softcap's temporaries spilled 16-124 bytes with P in registers there.
  static constexpr bool kPSmemIfSoftcap = (kBlockKV > 128 && kHeadDim == 64) || kConsumers == 3;
  // Three consumers (160 registers each) keep their tile's facts in its slot until the epilogue and read them back
  // there instead of holding them through the key loop (60-216 bytes spilled otherwise).
  static constexpr bool kHoldTileSlot = kConsumers == 3;
  // Q loaded into registers once per tile (ldmatrix into the wgmma A layout) and S = Q K^T as wgmma RS: a third less
  // shared-memory traffic per S product; +1.1 / +1.3 / +2.7% at non-causal D = 128 1024 / 4096 / 16384 keys. Not
  // causal (-1.0% at 512 keys), not three consumers (96-144 bytes spilled), not D = 256 (64 more registers). FP8 at
  // D = 256 with 64-key blocks (32 registers; 12 bytes spilled unmasked): 16 of the 48 KB a consumer read from
  // shared memory per key block; +3-5% (H200, 1024-16384 keys, two machine starts). (FP8 at D = 256 now runs
  // 128-key blocks without the overlap, Q in shared memory: jax_flash/config.py, FP8_CONFIGS.) Not FP8 at D = 128
  // with the overlap, whose registers hold P V whole (kPvParts).
  static constexpr bool kQInRegs =
      ((kHeadDim == 128 && !(kFp8 && kOverlap)) || (kFp8 && kBlockKV == 64)) && kPingpong && kConsumers == 2;
  // The split tail (split_tail.cuh): a partial last wave of equal-cost tiles is cut into equal key-block shares and
  // merged; through the package (H200, 2048 tiles over 132 SMs) bf16 non-causal 2048 / 4096 / 16384 keys +2.0-2.5 /
  // +1.0-2.2 / +0.9-1.6%, FP8 16384 keys +1.6-2.4%.
  static constexpr bool kSplitTail = kHeadDim == 128 && kConsumers == 2 && kPingpong;
  // ... from this many key blocks per tile: at 4 (512 keys) it cost 2.7%, each share running 2-3 tile boundaries.
  static constexpr int kMinSplitBlocks = 16;
  // The producer numbers tiles in 32 bits where its registers are tight (the 64-bit divisions of tile_work spilled
  // the 32-register producer of three consumers, and the 40-register one beside the split tail's bookkeeping); the
  // launcher refuses more than INT_MAX tiles there.
  static constexpr bool kTileIndex32 = kConsumers == 3 || kSplitTail;
  // Tiles of equal cost (every row sees every key) walk a static stride of the grid instead of the tile counter:
  // 1.5-4.7% faster at 512-4096 keys at head dims 128 / 256; head dim 64 moved -1.5 to +1.7% and keeps the counter.
  static constexpr bool kStaticStrideIfEqualCost = kHeadDim >= 128;
  // Causal sections of at most 16 (batch, head) pairs at head dims 128 / 256: a section's first tiles fetch all of
  // their pairs' K and V at once, and 16 pairs spread those fetches (causal D = 128 512-2048 keys +2-5%). Head dim 64
  // (three consumers, key blocks last first) lost 17% at 512 keys with the cap: its sections stay L2-sized.
  static constexpr int64_t kMaxSectionHeads = kHeadDim >= 128 ? 16 : INT64_MAX;
  // Right-bounded masks with three consumers align the query blocks to the end of the rows, so the short block of a
  // length that is not a multiple of 192 is the first (lightest) instead of the last (heaviest): +1.0 / +1.2% at
  // causal D = 64 1024 / 2048 keys, -5.6% at 512 (three tiles per pair, whose costs it spreads), hence from 1024 rows.
  static constexpr bool kEndAlignedQueryBlocks = kConsumers == 3;
  static constexpr int kEndAlignedMinRows = 1024;

  // ---- registers ---------------------------------------------------------------------------------------------------
  // Registers per thread after setmaxnreg: the producer gives its share to the consumers. setmaxnreg.inc only draws
  // on what setmaxnreg.dec released inside this block, so the roles must fit the block's launch allocation (the 64K
  // register file over the block's threads, a multiple of 8: 168 for 384 threads, 128 for 512); asking for more
  // blocks the consumers forever (every launch hung with 32 / 240).
  static constexpr int kLaunchRegs = (65536 / kNumThreads) / 8 * 8;
  // 40 with two consumers (32 spilled the tile scheduler's bookkeeping); 32 with three, so each consumer gets 160
  // (152 left no room for P in registers)
  static constexpr int kProducerRegs = kConsumers == 3 ? 32 : 40;
  static constexpr int kConsumerRegs = (kNumThreads * kLaunchRegs / 128 - kProducerRegs) / kConsumers / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kNumThreads * kLaunchRegs,
                "setmaxnreg split exceeds the block's register allocation");

  // ---- shared memory ---------------------------------------------------------------------------------------------
  // Every tile is stored as panels of [rows][128 bytes] with the 128-byte TMA / wgmma swizzle (16-byte chunk c of
  // row r sits at chunk c ^ (r % 8)): head_dim / kPanelCols panels of Q, K and V (64 elements a row, 128 for FP8),
  // and of O head_dim / 64 (16-bit); FP8's V^T (D, kBlockKV) is kBlockKV / 128 panels of [D][128 keys].
  static constexpr int kRowBytes = 128;
  static constexpr int kPanelCols = kRowBytes / kElementBytes;
  static constexpr int kPanels = kHeadDim / kPanelCols;
  static constexpr int kQPanelBytes = kBlockQ * kRowBytes;
  static constexpr int kKVPanelBytes = kBlockKV * kRowBytes;
  static constexpr int kVtPanelBytes = kHeadDim * kRowBytes;
  static constexpr int kQBytes = kQPanelBytes * kPanels;    // (kBlockQ, D)
  static constexpr int kKBytes = kKVPanelBytes * kPanels;  // (kBlockKV, D): one K stage's bytes
  // FP8's V^T stage: ceil(kBlockKV / 128) panels of [D][128 keys]. A 192-key block fills the first half of its
  // second panel's rows (the other half is never written or read): a 64-key panel would need the 64-byte swizzle
  // and descriptors of their own.
  static constexpr int kVtPanels = (kBlockKV + 127) / 128;
  static constexpr int kVBytes = kFp8 ? kVtPanels * kVtPanelBytes : kKBytes;  // one V stage's bytes
  static constexpr int kOPanels = kHeadDim / 64;
  static constexpr int kOPanelBytes = kQPanelBytes;
  static constexpr int kOBytes = kOPanelBytes * kOPanels;  // (kBlockQ, D) of OutElement
  // P of one consumer where it goes through shared memory: (64, kBlockKV) as ceil(kBlockKV/64) panels of [64][64],
  // swizzled like Q (wgmma's A).
  static constexpr int kPPanelBytes = 64 * kRowBytes;
  static constexpr int kPBytes = kPSmemIfSoftcap ? (kBlockKV + 63) / 64 * kPPanelBytes : 0;
  // FP8: two buffers of V as loaded, (kBlockKV, D) like a K stage, which warps 1-3 of the producer warpgroup
  // transpose into the V^T stage (v_transpose.cuh); a buffer's copy is issued as soon as its block before is
  // transposed, so the copy of block j + 1 overlaps the transpose of block j. Against one buffer (H200, FP8 GPU
  // probe, non-causal, 512 / 1024 / 2048 keys): +6 / +10 / +4%, from 4096 keys +1-2%; the 192-key config then
  // keeps one Q buffer (230,688 bytes).
  static constexpr int kVRawBytes = kFp8 ? kKBytes : 0;
  static constexpr int kVRawBuffers = kFp8 ? 2 : 0;
  static constexpr int kMaxSmemBytes = 227 * 1024;  // opt-in dynamic shared memory per block on sm_90
  static constexpr SmemShape kShape1{kQBytes, 1,          false,      kKBytes, kVBytes,    kStages,
                                     kPBytes, kConsumers, kSplitTail, kOBytes, kVRawBytes, kVRawBuffers};
  // Where even one Q buffer and a separate O buffer do not fit (head dim 256: Q and O are 64 KB each; FP8 at head
  // dim 256 with 128-key blocks, whose raw V buffers take the room), each consumer stages its 64 rows of O in the
  // stage of the tile's final key block, consumer 0 in its K and consumer 1 in its V (FP8: its V^T stage, which the
  // transposing warps refill only after its release), and that K / V is released once the TMA store has read them.
  // Q is released at the tile's last Q K^T as everywhere else, so the next tile's Q loads under the last P V and the
  // epilogue (staged in the Q buffer, O held Q until the store had read it and the next tile waited for the whole
  // load).
  static constexpr bool kOInKV = kSmemBytesOf<kShape1> > kMaxSmemBytes;
  // Q is double-buffered where it fits beside O's buffer (the producer loads the next tile's Q while the consumers
  // still read this one's: D = 128 with 128-key blocks fits with 1.9 KB to spare). Not FP8's 192-key blocks, where
  // two fit beside the raw V buffers: H200, one against two, TFLOP/s at 2048 / 4096 / 16384 keys 741 / 785 / 835
  // against 702 / 770 / 825 non-causal and 613 / 708 / 786 against 600 / 697 / 760 causal, one round each (the same
  // 128-key kernel at 1024 keys read 677 against 648 in that order, so part of it is the order).
  static constexpr int kQBuffers =
      !kOInKV && !(kFp8 && kBlockKV > 128) && kSmemBytesOf<with_q_buffers(kShape1, 2, false)> <= kMaxSmemBytes ? 2 : 1;
  static constexpr SmemShape kShape = with_q_buffers(kShape1, kQBuffers, kOInKV);
  using Storage = SharedStorage<kShape>;
  static constexpr int kSmemBytes = kSmemBytesOf<kShape>;
  static_assert(kSmemBytes <= kMaxSmemBytes, "sm90 config does not fit in 227 KB of shared memory");
  static_assert(!kOInKV || (kConsumers == 2 && kKBytes >= kOBytes / 2 && kVBytes >= kOBytes / 2),
                "O staged in K / V: two consumers, each one's 64 rows of O no larger than a K or V stage");
  static_assert(!(kSplitTail && kOInKV),
                "a split tile's partial leaves before the epilogue that releases the last K / V stage");

  // The split tail's scratch: a consumer thread's partial is its O fragment (kHeadDim / 2 floats) and its two rows'
  // maxima and sums, as float4 chunks stored chunk-major (128 threads write 2 KB contiguous per chunk); a slot holds
  // every consumer's; each block of the grid (at most one per SM) has one slot and one flag per consumer.
  static constexpr int kSplitChunks = kHeadDim / 8 + 1;
  static constexpr int kSplitSlotBytes = kConsumers * kSplitChunks * 128 * 16;
  static constexpr int kSplitBytesPerSm = kSplitTail ? kSplitSlotBytes + kConsumers * 4 : 0;
};

// The schedule of one compiled variant: the config's traits refined by the runtime facts the launcher picks a
// variant by (kMaskBlocks: some key block may be partly invisible; kHasSoftcap; kSplitPaged: split key ranges,
// paged K/V, packed GQA or segment ids, always with kMaskBlocks; kTensors: bias or mask tensors, with kSplitPaged).
template <class T, bool kMaskBlocks_, bool kHasSoftcap_, bool kSplitPaged_ = false, bool kTensors_ = false>
struct Variant {
  static constexpr bool kMaskBlocks = kMaskBlocks_;
  static constexpr bool kHasSoftcap = kHasSoftcap_;
  // The split-KV epilogue, the paged loads and the packed GQA rows are compiled into variants of their own, and the
  // other variants keep
  // the instructions they had before either existed: chunked prefill (512 x 16384 keys, causal, D = 128, H100) ran
  // at 266 instead of 212 us when only the producer's K / V loads went through the shared helper (the same copies,
  // differently scheduled), with the key loop unchanged.
  static constexpr bool kSplitPaged = kSplitPaged_;
  static_assert(!kSplitPaged || kMaskBlocks, "split, paged and packed calls run the masked variant");
  // Bias and mask tensors: the split / paged variant plus the per-score loads (mainloop.cuh, apply_tensors), in a
  // variant of their own (in that one they spilled up to 444 more bytes: 144 -> 588 in the three-consumer head dim
  // 64 kernel).
  static constexpr bool kTensors = kTensors_;
  static_assert(!kTensors || kSplitPaged, "tensor calls run the split / paged variant's tile scheduler");
  // The soft-capped 192-key-block kernels have the fewest registers to spare: S (96), P (48) and the softcap.
  static constexpr bool kTightSoftcap = kHasSoftcap && T::kBlockKV > 128;
  // The consumer index through a lane-0 shuffle, warp-uniform for ptxas, so the Q descriptor lives in uniform
  // registers: -1 to -4% time (the tight soft-capped kernels spilled 80 bytes with it).
  static constexpr bool kUniformConsumer = !kTightSoftcap;
  static constexpr bool kExpTurns = T::kExpTurns && !kTightSoftcap;  // (68 bytes spilled there)
  static constexpr bool kEarlyTest = T::kEarlyKVTest;
  static constexpr bool kTrimTail = T::kTrimConsumerTail && kMaskBlocks;  // (unmasked, every row sees every key)
  // (not soft-capped: ptxas serialised the wgmma of some soft-capped kernels with it, C7511, as it did in head dim
  // 256's tensor variant)
  static constexpr bool kNarrowLast =
      T::kNarrowKeys > 0 && kMaskBlocks && T::kOverlap && !kHasSoftcap && !(kTensors && T::kHeadDim == 256);
  static constexpr bool kReverse = kNarrowLast;  // key blocks last first: the narrow block is a consumer's first
  static constexpr bool kKAhead = T::kKAhead;
  static constexpr bool kQRegs = T::kQInRegs && !kHasSoftcap;  // (24-68 bytes spilled with the softcap)
  static constexpr bool kPSmem = kHasSoftcap && T::kPSmemIfSoftcap;
  // Masking decided on each warp's own 16 rows, and one compare per score on blocks cut only by the right bound
  // (common/mask_fragment.cuh): causal D = 64 512 / 1024 / 2048 keys +5.0 / +3.0 / +1.6%, D = 128 / 256 +0.6-1.5%.
  static constexpr bool kMaskOwnRows = true;
  static constexpr bool kMaskRightOnly = true;
  // (not in the masked 16-bit Q-from-registers kernel: its epilogue spilled 4 bytes with the partial and the merge;
  // the FP8 one spills none)
  static constexpr bool kSplit =
      T::kSplitTail && !(kMaskBlocks && T::kQInRegs && !kHasSoftcap && !T::kFp8) && !kSplitPaged;
  // The lean step: the previous P V waited for before the exponentials and P packed into the A fragments among
  // them; the early K / V tests issued before the row maxima without a branch; the epilogue's 1 / l by MUFU.RCP and
  // its selects and logf only where needed. D = 128 non-causal 1024 / 2048 / 4096 keys -4.9 / -3.2 / -3.2% time, D = 64
  // causal 1024 -2.2%; but +2.7 / +8.2% at causal D = 256 1024 / 4096 keys (80-key blocks without pingpong): off there.
  static constexpr bool kLeanStep = !(T::kHeadDim == 256 && !T::kPingpong);
  static constexpr bool kPackInExp = kLeanStep && !kPSmem && !kExpTurns && T::kOverlap;
  static constexpr bool kTestsEarly = kLeanStep;
  static constexpr bool kFastEpilogue = kLeanStep;
  // (the exponentials' ring counts one turn per computed key block: a consumer that skips blocks would leave the
  // other waiting)
  static_assert(!(kTrimTail && kExpTurns),
                "a consumer's own last key block and the exponentials' ring exclude each other");
};

}  // namespace jax_flash::sm90
