// Compile-time shape of one sm80-family kernel, derived from its KernelKey. Every size the kernel uses comes
// from here; divisibility assumptions are static_asserts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/kernel_key.h"

namespace jax_flash::sm80 {

inline constexpr int kWarpSize = 32;
inline constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;  // mma.sync.m16n8k16
inline constexpr int kChunkElems = 8;                    // one 16-byte vector of 16-bit elements

template <KernelKey kKey>
struct Traits {
  static constexpr KernelKey key = kKey;
  using Element = std::conditional_t<kKey.dtype == static_cast<int>(DType::kBFloat16), __nv_bfloat16, __half>;

  static constexpr int kHeadDim = kKey.head_dim;
  static constexpr int kBlockQ = kKey.block_q;
  static constexpr int kBlockKV = kKey.block_kv;
  static constexpr int kNumWarps = kKey.num_warps;
  static constexpr int kNumThreads = kNumWarps * kWarpSize;
  static constexpr bool kAsyncCopy = kKey.async_copy;
  static constexpr bool kEagerLoad = kKey.eager_load_blocks;
  static constexpr bool kSwizzled = kKey.swizzled;
  static constexpr bool kDoubleBuffer = kKey.mma_double_buffer_loads;
  static constexpr bool kOptimizedSoftmax = kKey.optimized_softmax;
  // Thread blocks per SM the kernel is compiled for (__launch_bounds__). The 64-row four-warp decode tile at D = 64
  // holds 221-243 registers in its masked variants unbounded (two blocks per SM, one K / V block in flight each);
  // bounded for three it holds 168 with no spill. At D = 128 the same bound spills 28-60 bytes, and so do the
  // tensor variants (252 registers unbounded, 144-148 bytes spilled bounded): those keep one.
  static constexpr int kMinBlocksPerSm = (kBlockQ == 64 && kNumWarps == 4 && kHeadDim <= 64) ? 3 : 1;

  // Warp tiling: kRowWarps row groups of kRowsPerWarp consecutive query rows (at least 16, one m16 tile). Each row
  // group has kKeyWarps warps, which split every key block into slices of kWarpKeys keys: warp w takes row group
  // w % kRowWarps and slice w / kRowWarps, runs its own online softmax, and the slices' states merge after the last
  // block (softmax.cuh, merge_key_warps). kKeyWarps > 1 only when block_q < 16 x num_warps: a 32-row MQA decode tile
  // on one warp per 16 rows would leave two of four warps computing padding, and each warp's chain of dependent
  // mma / softmax steps per block, not the loads, bounds a tile that is alone on its SM.
  static constexpr int kRowWarps = kBlockQ >= kMmaM * kNumWarps ? kNumWarps : kBlockQ / kMmaM;
  static constexpr int kKeyWarps = kNumWarps / kRowWarps;
  static constexpr int kRowsPerWarp = kBlockQ / kRowWarps;
  static constexpr int kWarpKeys = kBlockKV / kKeyWarps;
  static constexpr int kMTiles = kRowsPerWarp / kMmaM;  // m16 tiles per warp
  static constexpr int kSTiles = kWarpKeys / kMmaN;     // n8 tiles of S = Q K^T
  static constexpr int kOTiles = kHeadDim / kMmaN;      // n8 tiles of O = P V
  static constexpr int kDSteps = kHeadDim / kMmaK;      // k16 steps of Q K^T
  static constexpr int kKVSteps = kWarpKeys / kMmaK;    // k16 steps of P V

  // Fragment-load chunks (0 in the config = everything at once). Q with 0 stays in registers for the whole kernel.
  static constexpr bool kQInRegisters = kKey.q_mma_load_k_fragments == 0;
  static constexpr int kQChunk = kQInRegisters ? kDSteps : kKey.q_mma_load_k_fragments;
  static constexpr int kKChunk = kKey.k_mma_load_k_fragments == 0 ? kDSteps : kKey.k_mma_load_k_fragments;
  static constexpr int kVChunk = kKey.v_mma_load_k_fragments == 0 ? kKVSteps : kKey.v_mma_load_k_fragments;

  // Shared memory: sQ (kBlockQ, D), sK (kBlockKV, D), sV (kBlockKV, D), rows of kRowChunks 16-byte chunks.
  static constexpr int kRowChunks = kHeadDim / kChunkElems;
  static constexpr int kSmemQElems = kBlockQ * kHeadDim;
  static constexpr int kSmemKVElems = kBlockKV * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQElems + 2 * kSmemKVElems) * static_cast<int>(sizeof(Element));
  // merge_key_warps: slices 1.. of each row group leave (row max, row sum) x 2 x kMTiles and O, fp32 per lane, in
  // sK / sV (free after the last block).
  static constexpr int kMergeFloats = kMTiles * (4 + kOTiles * 4);
  static constexpr int kMergeBytes = (kKeyWarps - 1) * kRowWarps * kMergeFloats * kWarpSize * 4;

  static_assert(kBlockQ % kMmaM == 0 && kNumWarps % kRowWarps == 0, "each row group needs a multiple of 16 rows");
  static_assert(kWarpKeys % kMmaK == 0 && kWarpKeys * kKeyWarps == kBlockKV, "each warp needs a multiple of 16 keys");
  static_assert(kMergeBytes <= 2 * kSmemKVElems * static_cast<int>(sizeof(Element)), "merge state must fit sK + sV");
  static_assert(kHeadDim % kMmaK == 0, "head_dim must be a multiple of 16");
  static_assert(!kSwizzled || kRowChunks >= 8, "the XOR swizzle permutes 8 chunks: head_dim must be >= 64");
  static_assert(kDSteps % kQChunk == 0 && kDSteps % kKChunk == 0, "q/k fragment chunks must divide head_dim/16");
  static_assert(kKVSteps % kVChunk == 0, "v fragment chunk must divide the warp's keys / 16");
  static_assert(!kEagerLoad || kAsyncCopy, "eager loads need cp.async");
};

}  // namespace jax_flash::sm80
