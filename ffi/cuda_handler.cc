// XLA FFI handler for the CUDA platform: validates, looks the kernel up in the generated registry and runs it on
// the stream XLA provides. Every failure comes back as an ffi::Error whose message reaches Python intact.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <optional>
#include <string>

#include "ffi/attention_attrs.h"
#include "ffi/cuda_device.h"
#include "ffi/handlers.h"
#include "ffi/validate.h"
#include "common/mask_blocks.h"
#include "common/registry.h"
#include "common/split_plan.h"
#include "sm90/segment_tiles.h"

namespace jax_flash {
namespace {

std::string available_for(int dtype, int head_dim) {
  std::string list;
  for (int i = 0; i < kRegistrySize; ++i) {
    const KernelKey& key = kRegistry[i].key;
    if (key.dtype == dtype && key.head_dim == head_dim) list += "\n  " + describe(key);
  }
  return list.empty() ? std::string(" none for this dtype and head_dim") : list;
}

// Split-KV: the range count (attrs.num_splits, or the plan of common/split_plan.h for 0) and its float32 scratch
// (common/params.h, partial_o / partial_lse). A planned split that cannot get its scratch runs unsplit; a forced one
// reports it.
ffi::Error plan_splits(AttentionParams& params, const RegistryEntry& entry, const DeviceLimits& limits,
                       int64_t forced, ffi::ScratchAllocator& scratch) {
  const KernelKey& key = entry.key;
  const int64_t rows = int64_t{params.seqlen_q} * params.pack_gqa;
  const int64_t head_units = params.pack_gqa > 1 ? params.heads_k : params.heads_q;
  const int64_t tiles = (rows + key.block_q - 1) / key.block_q * head_units * params.batch;
  const int64_t key_blocks = (int64_t{params.seqlen_k} + key.block_kv - 1) / key.block_kv;
  const int64_t slots = int64_t{limits.num_sms} * entry.resident_blocks();
  const bool memory_bound = key.block_q <= 64;  // the decode tiles
  const int64_t kv_block_bytes = int64_t{2} * key.block_kv * key.head_dim * 2;  // K and V, 16-bit elements
  const int splits = forced > 0      ? static_cast<int>(forced)
                     : memory_bound ? choose_decode_splits(tiles, slots, limits.num_sms, key_blocks, kv_block_bytes)
                                    : choose_num_splits(tiles, slots, key_blocks);
  params.num_splits = 1;
  if (splits <= 1) return ffi::Error::Success();
  const size_t row_count = static_cast<size_t>(params.batch) * params.heads_q * params.seqlen_q * splits;
  std::optional<void*> partial_o = scratch.Allocate(row_count * params.head_dim * sizeof(float), kScratchAlignment);
  std::optional<void*> partial_lse = scratch.Allocate(row_count * sizeof(float), kScratchAlignment);
  if (!partial_o.has_value() || !partial_lse.has_value()) {
    if (forced <= 0) return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_flash: could not allocate " + std::to_string(row_count * (params.head_dim + 1) * 4) +
                          " bytes of scratch memory for num_splits=" + std::to_string(splits) +
                          " (a float32 partial O and lse per range); choose fewer splits");
  }
  params.num_splits = splits;
  params.partial_o = static_cast<float*>(*partial_o);
  params.partial_lse = static_cast<float*>(*partial_lse);
  return ffi::Error::Success();
}

ffi::Error attention_cuda_impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_lengths,
                               ffi::AnyBuffer kv_lengths, ffi::AnyBuffer page_table, ffi::AnyBuffer q_segment_ids,
                               ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                               ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, AttentionAttrs attrs) {
  if (auto err = check_buffers(q, k, v, q_lengths, kv_lengths, &page_table, *o, *lse, attrs)) {
    return std::move(*err);
  }
  int dtype;
  switch (q.element_type()) {
    case ffi::DataType::F16: dtype = static_cast<int>(DType::kFloat16); break;
    case ffi::DataType::BF16: dtype = static_cast<int>(DType::kBFloat16); break;
    default: return invalid("the GPU kernels support float16 and bfloat16 inputs (float32 runs on CPU only)");
  }
  const int head_dim = static_cast<int>(q.dimensions()[3]);
  KernelKey key{};
  key.dtype = dtype;
  key.head_dim = head_dim;
#define JAX_FLASH_COPY_FIELD(type, name) key.name = static_cast<type>(attrs.name);
  JAX_FLASH_CONFIG_FIELDS(JAX_FLASH_COPY_FIELD)
#undef JAX_FLASH_COPY_FIELD
  const RegistryEntry* entry = find_kernel(key);
  if (entry == nullptr) {
    return ffi::Error(ffi::ErrorCode::kNotFound, "jax_flash: no compiled GPU kernel for " + describe(key) +
                                                     "; compiled configs for this dtype and head_dim:" +
                                                     available_for(dtype, head_dim));
  }
  // Every block writes all its rows (zeros and lse = -inf for rows that see no key), also when Sk = 0.
  AttentionParams params = params_from_buffers(q, k, v, q_lengths, kv_lengths, &page_table, *o, *lse, attrs);
  if (auto err = check_segment_buffers(q, params.seqlen_k, q_segment_ids, kv_segment_ids)) return std::move(*err);
  set_segments(params, q_segment_ids, kv_segment_ids);
  if (auto err = check_tensor_buffers(q, params.seqlen_k, bias, mask, attrs.alibi != 0)) return std::move(*err);
  set_tensors(params, bias, mask, attrs.alibi != 0);
  if (q.element_count() == 0) return ffi::Error::Success();  // nothing to compute: no launch

  DeviceLimits limits;
  if (ffi::Error err = current_device_limits(limits); err.failure()) return err;
  if (key.family == 90 && (params.bias != nullptr || params.mask != nullptr) && params.pack_gqa > 1) {
    return invalid("pack_gqa=True with bias / mask tensors needs a family='sm80' config; " + describe(key) +
                   " packs calls without tensors only");
  }
  if (key.family == 90 && params.q_segment_ids != nullptr && params.pack_gqa > 1) {
    return invalid("pack_gqa=True with segment ids needs a family='sm80' config; " + describe(key) +
                   " packs calls without segment ids only");
  }
  if (key.family == 90 && params.pack_gqa > 1 && 64 % params.pack_gqa != 0) {
    return invalid("pack_gqa=True on " + describe(key) + " packs groups of 2, 4, 8, 16, 32 or 64 query heads per kv "
                   "head; this call has " + std::to_string(params.pack_gqa) + " (use a family='sm80' config)");
  }
  if (limits.major < 8) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: the GPU kernels need compute capability 8.0 or newer; this device is " +
                          std::to_string(limits.major) + "." + std::to_string(limits.minor));
  }
  if (key.family == 90 && limits.major != 9) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: " + describe(key) + " uses Hopper-only instructions (wgmma, TMA) and needs compute "
                      "capability 9.0 (H100/H200); this device is " + std::to_string(limits.major) + "." +
                          std::to_string(limits.minor) + ". Use a family='sm80' config (or cfg=None).");
  }
  if (entry->smem_bytes > limits.max_smem_optin) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: kernel " + describe(key) + " needs " + std::to_string(entry->smem_bytes) +
                          " bytes of shared memory per block; this device allows " +
                          std::to_string(limits.max_smem_optin) + ". Choose a config with smaller blocks.");
  }
  if (params.kv_segment_ids != nullptr && params.seqlen_k > 0) {  // the segment pre-pass's (min, max) per key block
    const size_t bytes = size_t{2} * sizeof(int) * params.batch * ((params.seqlen_k + key.block_kv - 1) / key.block_kv);
    std::optional<void*> ranges = scratch.Allocate(bytes, kScratchAlignment);
    if (!ranges.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jax_flash: could not allocate " + std::to_string(bytes) +
                                                                " bytes of scratch memory for the segment id ranges");
    }
    params.kv_block_segments = static_cast<int*>(*ranges);
    if (key.family == 90 && params.seqlen_q > 0) {  // ... and the sm90 forward's tiles per row (sm90/segment_tiles.cuh)
      params.segment_tile_slots = sm90::segment_tile_slots(params.seqlen_q, key.block_q);
      const size_t tile_bytes = sm90::segment_tile_bytes(params.batch, params.seqlen_q, key.block_q);
      std::optional<void*> tiles = scratch.Allocate(tile_bytes, kScratchAlignment);
      std::optional<void*> count = scratch.Allocate(sizeof(int), kScratchAlignment);
      if (!tiles.has_value() || !count.has_value()) {
        return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                          "jax_flash: could not allocate " + std::to_string(tile_bytes + sizeof(int)) +
                              " bytes of scratch memory for the segment id tiles");
      }
      params.segment_tiles = static_cast<int*>(*tiles);
      params.segment_tile_count = static_cast<int*>(*count);
    }
  }
  if (params.mask != nullptr && params.pack_gqa == 1) {  // the mask pre-pass's flag per (query block, key block)
    const MaskBlockShape shape = MaskBlockShape::of(params, key.block_q, key.block_kv);
    const int64_t bytes = shape.bytes();
    // sm80: whether each mask tile holds a nonzero entry; sm90: whether it holds a zero one, and each query block's
    // range of key blocks (common/params.h)
    const int64_t range_bytes = key.family == 90 ? 2 * sizeof(int) * (bytes / std::max(shape.key_blocks, 1)) : 0;
    std::optional<void*> flags = bytes > 0 ? scratch.Allocate(bytes, kScratchAlignment) : std::nullopt;
    std::optional<void*> ranges = range_bytes > 0 ? scratch.Allocate(range_bytes, kScratchAlignment) : std::nullopt;
    if ((bytes > 0 && !flags.has_value()) || (range_bytes > 0 && !ranges.has_value())) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_flash: could not allocate " + std::to_string(bytes + range_bytes) +
                            " bytes of scratch memory for the mask tile flags");
    }
    uint8_t* const flag_bytes = bytes > 0 ? static_cast<uint8_t*>(*flags) : nullptr;
    (key.family == 90 ? params.mask_partial : params.mask_blocks) = flag_bytes;
    params.mask_ranges = range_bytes > 0 ? static_cast<int*>(*ranges) : nullptr;
  }
  if (ffi::Error err = plan_splits(params, *entry, limits, attrs.num_splits, scratch); err.failure()) return err;
  if (key.family == 90) {
    if (ffi::Error err = allocate_tile_counter(scratch, params); err.failure()) return err;
    allocate_split_tail(scratch, entry->split_bytes_per_sm, limits, params);
  }
  if (std::string failure = entry->run(params, stream); !failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jax_flash: " + failure);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCuda, attention_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // q_lengths
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths
                                  .Arg<ffi::AnyBuffer>()  // page_table (batch, pages_per_seq); (batch, 0) unpaged
                                  .Arg<ffi::AnyBuffer>()  // q_segment_ids (batch, seq_q); (batch, 0): none
                                  .Arg<ffi::AnyBuffer>()  // kv_segment_ids (batch, seq_k); (batch, 0): none
                                  .Arg<ffi::AnyBuffer>()  // bias float32 (B|1, Hq|1, Sq|1, Sk|1); (0, 0, 0, 0): none
                                  .Arg<ffi::AnyBuffer>()  // mask bool, the same shapes
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Attrs<AttentionAttrs>());

}  // namespace jax_flash
