// run_attention_sm90: picks the compile-time variant (block masking, softcap) from runtime facts, encodes the TMA
// tensor maps of q, k, v and o, plans the tile order (tile_scheduler.cuh) and the split tail (split_tail.cuh), and
// launches the persistent grid on XLA's stream; with split key ranges, the combine step after it.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "common/mask_blocks.cuh"
#include "common/split_combine.cuh"
#include "sm90/api.h"
#include "sm90/kernel.cuh"
#include "sm90/segment_tiles.cuh"
#include "sm90/split_tail.cuh"
#include "sm90/tensor_map.h"
#include "sm90/tile_scheduler.cuh"
#include "sm90/traits.cuh"

namespace jax_flash::sm90 {

template <class T, bool kMaskBlocks, bool kHasSoftcap, bool kSplitPaged = false, bool kTensors = false>
std::string launch_sm90(AttentionParams p, const CUtensorMap& map_q, const CUtensorMap& map_k,
                        const CUtensorMap& map_v, const CUtensorMap& map_o, cudaStream_t stream) {
  using V = Variant<T, kMaskBlocks, kHasSoftcap, kSplitPaged, kTensors>;
  auto kernel = attention_kernel<T, kMaskBlocks, kHasSoftcap, kSplitPaged, kTensors>;
  // A persistent grid, one block per SM (the shared memory allows no second); causal tiles differ by up to the whole
  // key range, so the blocks draw them from a counter, heaviest first (a static stride left some SMs all the heavy
  // ones: causal 16384 keys fell from 631 to 416 TFLOP/s).
  const int64_t units = p.pack_gqa > 1 ? p.heads_k : p.heads_q;  // query heads, or kv heads when packed
  // (with segment ids: every slot of a row, an upper bound; the producer reads the pre-pass's count)
  const int unit_tiles = p.segment_tiles != nullptr ? p.segment_tile_slots : p.num_q_blocks;
  const int64_t num_tiles = static_cast<int64_t>(unit_tiles) * units * p.batch * p.num_splits;
  if (T::kTileIndex32 && num_tiles > INT_MAX) {
    return "sm90 kernel with " + std::to_string(T::kConsumers) + " consumer warpgroups: " + std::to_string(num_tiles) +
           " tiles (batch x head units x query blocks x key ranges) exceed its 32-bit tile index (at most " +
           std::to_string(INT_MAX) + ")";
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
  plan_tile_order<T>(p, l2_bytes);
  const bool static_stride = walks_static_stride<T>(p);
  if (static_stride) p.tile_counter = nullptr;
  if (p.tile_counter != nullptr) {
    if (cudaError_t err = cudaMemsetAsync(p.tile_counter, 0, sizeof(unsigned long long), stream); err != cudaSuccess) {
      return cuda_failure("cudaMemsetAsync(tile counter)", err);
    }
  }
  const unsigned grid = static_cast<unsigned>(num_tiles < num_sms ? num_tiles : num_sms);
  if (std::string failure = plan_split_tail<T, V>(p, static_stride, num_tiles, grid, stream); !failure.empty()) {
    return failure;
  }
  static std::atomic<uint64_t> opted_in_devices{0};  // above 48 KB of shared memory a kernel opts in per device
  if (std::string failure = opt_in_shared_memory(kernel, T::kSmemBytes, opted_in_devices); !failure.empty()) {
    return failure;
  }
  kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(p, map_q, map_k, map_v, map_o, num_tiles);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("attention kernel launch", err);
  if constexpr (!T::kFp8) {  // (FP8 calls run unsplit: launch_fp8.cuh)
    if (p.num_splits > 1) return launch_split_combine<typename T::Element, T::kHeadDim>(p, stream);
  }
  return {};
}

template <KernelKey kKey>
std::string run_attention_sm90(const AttentionParams& params, cudaStream_t stream) {
  using T = Traits<kKey>;
  AttentionParams p = params;
  // Softcap: the kernels keep tanh(s * scale / softcap) as the scores and the factor softcap in the softmax's scale
  // (mainloop.cuh, softcap_tanh), so the lse comes out as scale * max + log(sum) as without it.
  if (p.softcap > 0.0f) {
    p.scale = p.softcap;
    p.scale_log2 = p.softcap * 1.4426950408889634f;  // log2(e)
  }
  // Packed GQA: tiles of kBlockQ rows = kBlockQ / group positions of the group's heads, Q and O through 5-D maps
  // (tensor_map.h), each consumer's 64 rows a whole number of positions: the group divides 64.
  const bool packed = p.pack_gqa > 1;
  if (packed && 64 % p.pack_gqa != 0) {
    return "the sm90 family packs GQA groups of 2, 4, 8, 16, 32 or 64 query heads per kv head, got " +
           std::to_string(p.pack_gqa) + "; use pack_gqa=False or a family='sm80' config";
  }
  if (packed && int64_t{p.seqlen_q} * p.pack_gqa > INT_MAX) {  // (the kernels number a unit's rows in 32 bits)
    return "pack_gqa=True packs seqlen_q x group = " + std::to_string(int64_t{p.seqlen_q} * p.pack_gqa) +
           " rows per kv head, more than 2^31 - 1; use pack_gqa=False";
  }
  const bool segments = p.q_segment_ids != nullptr;
  if (segments && packed) return "the sm90 family does not pack GQA with segment ids; use pack_gqa=False";
  if (segments && p.seqlen_q > 0 && p.seqlen_k > 0 && (p.segment_tiles == nullptr || p.kv_block_segments == nullptr)) {
    return "the sm90 family's segment ids need scratch memory for their tiles (segment_tiles, kv_block_segments)";
  }
  const bool tensors = p.bias != nullptr || p.mask != nullptr;
  if (tensors && packed) return "the sm90 family does not pack GQA with bias / mask tensors; use pack_gqa=False";
  p.num_q_blocks = static_cast<int>((int64_t{p.seqlen_q} * p.pack_gqa + T::kBlockQ - 1) / T::kBlockQ);
  constexpr bool kBf16 = kKey.dtype == static_cast<int>(DType::kBFloat16);
  CUtensorMap map_q{}, map_k{}, map_v{}, map_o{};
  std::string failure =
      packed ? encode_packed_map(&map_q, p.q, kBf16, p.batch, p.seqlen_q, p.heads_k, p.pack_gqa, p.head_dim,
                                 p.q_batch_stride, p.q_seq_stride, p.q_head_stride, T::kBlockQ / p.pack_gqa)
             : encode_bshd_map(&map_q, p.q, kBf16, p.batch, p.seqlen_q, p.heads_q, p.head_dim, p.q_batch_stride,
                               p.q_seq_stride, p.q_head_stride, T::kBlockQ);
  // seqlen_k = 0: every block writes zeros without loading, and an empty tensor has no map. Paged K / V: the map
  // spans the pool (num_pages, page_size, Hk, D), whose batch stride steps a page, in boxes inside one page.
  const bool paged = p.page_table != nullptr;
  const int64_t kv_outer = paged ? p.num_pages : p.batch, kv_rows = paged ? p.page_size : p.seqlen_k;
  const int kv_box_rows = paged ? page_box_rows<T>(p.page_size) : T::kBlockKV;
  if (paged && p.num_pages == 0 && p.seqlen_k > 0) {
    return "the sm90 family needs a non-empty page pool (k and v have 0 pages); use a family='sm80' config";
  }
  if (failure.empty() && p.seqlen_k > 0 && kv_outer > 0) {
    failure = encode_bshd_map(&map_k, p.k, kBf16, kv_outer, kv_rows, p.heads_k, p.head_dim, p.k_batch_stride,
                              p.k_seq_stride, p.k_head_stride, kv_box_rows);
  }
  if (failure.empty() && p.seqlen_k > 0 && kv_outer > 0) {
    failure = encode_bshd_map(&map_v, p.v, kBf16, kv_outer, kv_rows, p.heads_k, p.head_dim, p.v_batch_stride,
                              p.v_seq_stride, p.v_head_stride, kv_box_rows);
  }
  // O: each consumer stores its 64 rows of a tile, one 64 x 64 box per panel (epilogue.cuh)
  if (failure.empty()) {
    failure = packed ? encode_packed_map(&map_o, p.o, kBf16, p.batch, p.seqlen_q, p.heads_k, p.pack_gqa, p.head_dim,
                                         p.o_batch_stride, p.o_seq_stride, p.o_head_stride, 64 / p.pack_gqa)
                     : encode_bshd_map(&map_o, p.o, kBf16, p.batch, p.seqlen_q, p.heads_q, p.head_dim,
                                       p.o_batch_stride, p.o_seq_stride, p.o_head_stride, 64);
  }
  if (!failure.empty()) return failure;
  // Segment ids: each key block's (min, max) kv id and each row's tiles (segment_tiles.cuh)
  if (std::string pre = launch_segment_tiles(p, T::kBlockQ, T::kBlockKV, stream); !pre.empty()) return pre;
  // Mask tensor: each mask tile's flags and each query block's key blocks with a visible entry (mask_blocks.cuh)
  if (std::string pre = launch_mask_blocks(p, T::kBlockQ, T::kBlockKV, stream); !pre.empty()) return pre;
  p.batch_inner = tensors_shared_by_batch(p);  // (common/params.h; tile_scheduler.cuh)
  const bool mask_blocks = p.window_left < kUnbounded || p.window_right < kUnbounded || p.kv_lengths != nullptr ||
                           p.seqlen_k % T::kBlockKV != 0;
  const bool softcap = p.softcap > 0.0f;
  if (tensors) {  // (a variant of its own: the per-score loads spilled the split / paged one's registers)
    return softcap ? launch_sm90<T, true, true, true, true>(p, map_q, map_k, map_v, map_o, stream)
                   : launch_sm90<T, true, false, true, true>(p, map_q, map_k, map_v, map_o, stream);
  }
  if (p.num_splits > 1 || paged || packed || segments) {
    return softcap ? launch_sm90<T, true, true, true>(p, map_q, map_k, map_v, map_o, stream)
                   : launch_sm90<T, true, false, true>(p, map_q, map_k, map_v, map_o, stream);
  }
  if (mask_blocks) {
    return softcap ? launch_sm90<T, true, true>(p, map_q, map_k, map_v, map_o, stream)
                   : launch_sm90<T, true, false>(p, map_q, map_k, map_v, map_o, stream);
  }
  return softcap ? launch_sm90<T, false, true>(p, map_q, map_k, map_v, map_o, stream)
                 : launch_sm90<T, false, false>(p, map_q, map_k, map_v, map_o, stream);
}

}  // namespace jax_flash::sm90
