// run_attention_sm90: picks the compile-time variant (block masking, softcap) from runtime facts, encodes the TMA
// tensor maps of q, k and v, and launches on XLA's stream.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "sm90/api.h"
#include "sm90/kernel.cuh"
#include "sm90/tensor_map.h"
#include "sm90/traits.cuh"

namespace jax_flash::sm90 {

template <class T, bool kMaskBlocks, bool kHasSoftcap>
std::string launch_sm90(AttentionParams p, const CUtensorMap& map_q, const CUtensorMap& map_k,
                        const CUtensorMap& map_v, const CUtensorMap& map_o, cudaStream_t stream) {
  auto kernel = attention_kernel<T, kMaskBlocks, kHasSoftcap>;
  // A persistent grid, one block per SM (the shared memory allows no second). Causal tiles differ by up to the whole
  // key range and a static stride left some SMs with all the heavy ones (H200: causal S=16384 fell from 631 to 416
  // TFLOP/s with it): with a tile counter the blocks draw tiles dynamically, heaviest first (kernel.cuh, tile_work).
  // Tiles of equal cost take the static stride where it measured faster (below).
  const int64_t num_tiles = static_cast<int64_t>(p.num_q_blocks) * p.heads_q * p.batch;
  if (T::kTileIndex32 && num_tiles > INT_MAX) {
    return "sm90 kernel with " + std::to_string(T::kConsumers) + " consumer warpgroups: " + std::to_string(num_tiles) +
           " tiles (batch x heads_q x query blocks) exceed its 32-bit tile index (at most " + std::to_string(INT_MAX) +
           ")";
  }
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_failure("cudaGetDevice", err);
  int num_sms = 0, l2_bytes = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess) {
    return cuda_failure("cudaDeviceGetAttribute(MultiProcessorCount)", err);
  }
  if (cudaError_t err = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device); err != cudaSuccess) {
    return cuda_failure("cudaDeviceGetAttribute(L2CacheSize)", err);
  }
  // (batch, head) pairs per heaviest-first section: their K and V together fill at most half the L2 (+ 1 byte keeps
  // seqlen_k = 0 from dividing by zero), and at head dims 128 / 256 at most kMaxSectionHeads; at least 1, at most
  // all pairs. The cap: a section's first tiles are its heaviest, one per pair, and each fetches all of its pair's K
  // and V from DRAM, so a wide section asks for them all at once (H200, D = 128, 512 keys: 96 pairs, 25 MB). With 16
  // pairs the fetches spread over the section's tiles: causal D = 128 +2-5% at 512-2048 keys in three A/B runs,
  // D = 256 0 to +2%; from 4096 keys at D = 128 the L2 bound is the smaller one. Not at head dim 64: its causal
  // config (three consumers, key blocks last first) lost 17% at 512 keys with it in the benchmark (docs/NOTES.md,
  // session 15).
  constexpr int64_t kMaxSectionHeads = T::kHeadDim >= 128 ? 16 : INT64_MAX;
  const int64_t kv_bytes_per_head = 2 * int64_t{p.seqlen_k} * p.head_dim * 2 + 1;
  const int64_t batch_heads = int64_t{p.batch} * p.heads_q;
  const int64_t section =
      std::min<int64_t>(std::min<int64_t>((l2_bytes / 2) / kv_bytes_per_head, kMaxSectionHeads), batch_heads);
  p.section_heads = static_cast<int>(std::max<int64_t>(section, 1));
  // Right-bounded masks with three consumers (192-row tiles), from 1024 query rows: the query blocks are aligned to
  // the end of the rows, so the short block of a length that is not a multiple of 192 is the first (kernel.cuh,
  // tile_work). Aligned to the start, the last block, whose rows see the most keys under a causal mask, held 64 rows
  // at 1024 / 4096 keys and 128 at 2048: one or two consumers idle through the heaviest tile of every (batch, head)
  // pair. Measured (A/B harness, causal D = 64, four rounds): +1.0 / +1.2 / 0% at 1024 / 2048 / 4096 keys, but -5.6%
  // at 512 (three tiles per pair, whose costs it spreads from 3 / 7.5 / 7.5 to 1.5 / 6 / 10.5 key blocks of 64
  // rows), hence the threshold (docs/NOTES.md, session 17). The shift is a multiple of 64, so every consumer's rows
  // lie wholly inside or outside block 0 (an idle consumer writes nothing; a TMA store of a partly valid one would
  // overwrite block 1's rows); two consumers have no idle path and keep 0.
  p.q_block_shift = 0;
#ifndef JAX_FLASH_AB_NO_Q_SHIFT  // A/B builds: the blocks aligned to the start of the rows, as before session 17
  if (T::kConsumers == 3 && p.window_right < kUnbounded && p.seqlen_q >= 1024) {
    p.q_block_shift = (p.num_q_blocks * T::kBlockQ - p.seqlen_q) / 64 * 64;
  }
#endif
  // Tiles of equal cost (every row of every tile sees every key) at head dim 128 / 256 walk a static stride of the
  // grid: 1.5-4.7% faster than drawing them at 512-4096 keys in three A/B runs on the H200 (docs/NOTES.md,
  // session 11), -1.4 to +1.2% at 16384; head dim 64 moved -1.5 to +1.7% and keeps the counter.
  const bool equal_cost_tiles = has_equal_cost_tiles(p);
  // Measurement switch (docs/NOTES.md, sm90 v4, session 11): JAX_FLASH_SM90_SCHEDULE=static walks tiles with a
  // fixed stride of the grid, =dynamic draws them from the counter, =per_tile launches one block per tile (the v2
  // launch); unset or anything else, the rule above.
  static const int schedule = [] {
    const char* s = std::getenv("JAX_FLASH_SM90_SCHEDULE");
    const std::string v = s == nullptr ? "" : s;
    return v == "static" ? 1 : v == "per_tile" ? 2 : v == "dynamic" ? 3 : 0;
  }();
  int64_t max_grid = num_sms;
  const bool static_stride =
      schedule == 1 || schedule == 2 || (schedule == 0 && equal_cost_tiles && T::kHeadDim >= 128);
  if (static_stride) p.tile_counter = nullptr;
  if (schedule == 2) max_grid = INT_MAX;
  if (p.tile_counter != nullptr) {
    if (cudaError_t err = cudaMemsetAsync(p.tile_counter, 0, sizeof(unsigned long long), stream); err != cudaSuccess) {
      return cuda_failure("cudaMemsetAsync(tile counter)", err);
    }
  }
  const unsigned grid = static_cast<unsigned>(num_tiles < max_grid ? num_tiles : max_grid);
  // The split tail (traits.cuh, kSplitTail; kernel.cuh): with the static stride and a partial last wave, the last
  // grid + num_tiles % grid tiles are cut into grid equal shares of key blocks, each at least a tile's (so a tile is
  // cut at most once), where the caller gave the scratch memory, from kMinSplitBlocks key blocks per tile: each
  // block then runs one more (shorter) tile, and the flags cost a memset. Measured (A/B harness, H200, bf16, four
  // rounds; 2048 tiles over 132 SMs): 512 / 1024 / 2048 / 4096 / 16384 keys -2.7 / 0 / +0.5 / +1.9 / +0.8%
  // (docs/NOTES.md, session 18).
#ifdef JAX_FLASH_AB_SPLIT_MIN_BLOCKS
  constexpr int kMinSplitBlocks = JAX_FLASH_AB_SPLIT_MIN_BLOCKS;
#else
  constexpr int kMinSplitBlocks = 16;
#endif
  p.split_tiles = p.split_blocks = p.split_share = p.split_extra = 0;
  p.split_whole_tiles = num_tiles;
  const int64_t key_blocks = (int64_t{p.seqlen_k} + T::kBlockKV - 1) / T::kBlockKV;
  if (splits_tail<T, kMaskBlocks, kHasSoftcap>() && static_stride && schedule == 0 && num_tiles > grid &&
      num_tiles % grid != 0 && key_blocks >= kMinSplitBlocks &&
      p.split_workspace_bytes >= int64_t{grid} * T::kSplitBytesPerSm &&
      (grid + num_tiles % grid) * key_blocks <= INT_MAX) {
    p.split_tiles = static_cast<int>(grid + num_tiles % grid);
    p.split_blocks = static_cast<int>(key_blocks);
    p.split_whole_tiles = num_tiles - p.split_tiles;
    p.split_share = static_cast<int>(p.split_tiles * key_blocks / grid);
    p.split_extra = static_cast<int>(p.split_tiles * key_blocks % grid);
    p.split_partials = static_cast<float*>(p.split_workspace);
    p.split_flags = reinterpret_cast<unsigned*>(static_cast<char*>(p.split_workspace) +
                                                int64_t{grid} * T::kSplitSlotBytes);
    if (cudaError_t err = cudaMemsetAsync(p.split_flags, 0, sizeof(unsigned) * grid * T::kConsumers, stream);
        err != cudaSuccess) {
      return cuda_failure("cudaMemsetAsync(split-tail flags)", err);
    }
  }
  static std::atomic<uint64_t> opted_in_devices{0};  // above 48 KB of shared memory a kernel opts in per device
  if (std::string failure = opt_in_shared_memory(kernel, T::kSmemBytes, opted_in_devices); !failure.empty()) {
    return failure;
  }
  kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(p, map_q, map_k, map_v, map_o, num_tiles);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("attention kernel launch", err);
  return {};
}

template <KernelKey kKey>
std::string run_attention_sm90(const AttentionParams& params, cudaStream_t stream) {
  using T = Traits<kKey>;
  AttentionParams p = params;
  p.num_q_blocks = (p.seqlen_q + T::kBlockQ - 1) / T::kBlockQ;
  constexpr bool kBf16 = kKey.dtype == static_cast<int>(DType::kBFloat16);
  CUtensorMap map_q{}, map_k{}, map_v{}, map_o{};
  std::string failure = encode_bshd_map(&map_q, p.q, kBf16, p.batch, p.seqlen_q, p.heads_q, p.head_dim,
                                        p.q_batch_stride, p.q_seq_stride, p.q_head_stride, T::kBlockQ);
  // seqlen_k = 0: every block writes zeros without loading, and an empty tensor has no map.
  if (failure.empty() && p.seqlen_k > 0) {
    failure = encode_bshd_map(&map_k, p.k, kBf16, p.batch, p.seqlen_k, p.heads_k, p.head_dim, p.k_batch_stride,
                              p.k_seq_stride, p.k_head_stride, T::kBlockKV);
  }
  if (failure.empty() && p.seqlen_k > 0) {
    failure = encode_bshd_map(&map_v, p.v, kBf16, p.batch, p.seqlen_k, p.heads_k, p.head_dim, p.v_batch_stride,
                              p.v_seq_stride, p.v_head_stride, T::kBlockKV);
  }
  // O (T::kTmaStore): each consumer stores its 64 rows of a tile, one 64 x 64 box per panel (kernel.cuh, epilogue)
  if (failure.empty()) {
    failure = encode_bshd_map(&map_o, p.o, kBf16, p.batch, p.seqlen_q, p.heads_q, p.head_dim, p.o_batch_stride,
                              p.o_seq_stride, p.o_head_stride, 64);
  }
  if (!failure.empty()) return failure;
  const bool mask_blocks = p.window_left < kUnbounded || p.window_right < kUnbounded || p.kv_lengths != nullptr ||
                           p.seqlen_k % T::kBlockKV != 0;
  const bool softcap = p.softcap > 0.0f;
  if (mask_blocks) {
    return softcap ? launch_sm90<T, true, true>(p, map_q, map_k, map_v, map_o, stream)
                   : launch_sm90<T, true, false>(p, map_q, map_k, map_v, map_o, stream);
  }
  return softcap ? launch_sm90<T, false, true>(p, map_q, map_k, map_v, map_o, stream)
                 : launch_sm90<T, false, false>(p, map_q, map_k, map_v, map_o, stream);
}

}  // namespace jax_flash::sm90
