// XLA FFI handler of the backward pass on the CUDA platform: validates, takes float32 scratch for dQ's accumulator
// and the per-row delta from XLA, and runs the backward of the device's family (common/backward_launch.cuh) on XLA's
// stream.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>
#include <string>

#include "common/mask_blocks.h"
#include "common/registry.h"
#include "ffi/attention_attrs.h"
#include "ffi/cuda_device.h"
#include "ffi/handlers.h"
#include "ffi/validate.h"

namespace jax_flash {
namespace {

// Scratch for the block-skipping pre-passes of a call with segment ids or a mask tensor (common/params.h:
// kv_block_segments and q_block_segments, mask_blocks and mask_partial), sized for tiles of kBackwardBlockMin.
ffi::Error allocate_backward_blocks(ffi::ScratchAllocator& scratch, AttentionParams& p) {
  constexpr int kMin = kBackwardBlockMin;
  const int64_t key_blocks = (int64_t{p.seqlen_k} + kMin - 1) / kMin;
  const int64_t q_blocks = (int64_t{p.seqlen_q} + kMin - 1) / kMin;
  const int64_t mask_bytes = p.mask != nullptr ? MaskBlockShape::of(p, kMin, kMin).bytes() : 0;
  const int64_t segments = p.q_segment_ids != nullptr ? p.batch : 0;
  const int64_t bytes[4] = {segments * key_blocks * 2 * 4, segments * q_blocks * 4 * 4, mask_bytes, mask_bytes};
  void* taken[4] = {};
  for (int i = 0; i < 4; ++i) {
    if (bytes[i] == 0) continue;
    std::optional<void*> block = scratch.Allocate(static_cast<size_t>(bytes[i]), kScratchAlignment);
    if (!block.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_flash: could not allocate " + std::to_string(bytes[i]) +
                            " bytes of scratch memory for the backward's block skipping (segment ids / mask tiles)");
    }
    taken[i] = *block;
  }
  p.kv_block_segments = static_cast<int*>(taken[0]);
  p.q_block_segments = static_cast<int*>(taken[1]);
  p.mask_blocks = static_cast<uint8_t*>(taken[2]);
  p.mask_partial = static_cast<uint8_t*>(taken[3]);
  return ffi::Error::Success();
}

ffi::Error attention_bwd_cuda_impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                   ffi::AnyBuffer d_out, ffi::AnyBuffer d_lse, ffi::AnyBuffer q_lengths,
                                   ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                                   ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                                   ffi::Result<ffi::AnyBuffer> dq,
                                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                   AttentionAttrs attrs) {
  if (auto err = check_buffers(q, k, v, q_lengths, kv_lengths, nullptr, out, lse, attrs)) return std::move(*err);
  if (auto err = check_backward_buffers(q, k, d_out, d_lse, lse, *dq, *dk, *dv)) return std::move(*err);
  int dtype;
  switch (q.element_type()) {
    case ffi::DataType::F16: dtype = static_cast<int>(DType::kFloat16); break;
    case ffi::DataType::BF16: dtype = static_cast<int>(DType::kBFloat16); break;
    default: return invalid("the GPU backward supports float16 and bfloat16 inputs (float32 runs on CPU only)");
  }
  const int head_dim = static_cast<int>(q.dimensions()[3]);
  const BackwardEntry* entry = find_backward_kernel(dtype, head_dim);
  if (entry == nullptr) {
    return ffi::Error(ffi::ErrorCode::kNotFound,
                      "jax_flash: no compiled GPU backward kernel for " + std::string(dtype_name(dtype)) +
                          " head_dim=" + std::to_string(head_dim) + " (head dims 64, 128 and 256 are built)");
  }
  if (q.element_count() == 0 && k.element_count() == 0) return ffi::Error::Success();  // nothing to write
  DeviceLimits limits;
  if (ffi::Error err = current_device_limits(limits); err.failure()) return err;
  if (limits.major < 8) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: the GPU backward needs compute capability 8.0 or newer; this device is " +
                          std::to_string(limits.major) + "." + std::to_string(limits.minor));
  }
  BackwardParams params{};
  params.p = params_from_buffers(q, k, v, q_lengths, kv_lengths, nullptr, out, lse, attrs);
  if (auto err = check_segment_buffers(q, params.p.seqlen_k, q_segment_ids, kv_segment_ids)) return std::move(*err);
  set_segments(params.p, q_segment_ids, kv_segment_ids);
  if (auto err = check_tensor_buffers(q, params.p.seqlen_k, bias, mask, attrs.alibi != 0)) return std::move(*err);
  set_tensors(params.p, bias, mask, attrs.alibi != 0);
  const bool tensors = params.p.q_segment_ids != nullptr || params.p.bias != nullptr || params.p.mask != nullptr;
  if (tensors && attrs.deterministic) {
    return invalid("deterministic=True with segment ids or bias / mask tensors has no GPU kernel (jax_flash runs "
                   "such calls through XLA)");
  }
  // Hopper runs the sm90 family's kernel where it has one for the head dim; everything else the sm80 family's.
  const bool hopper = limits.major == 9 && entry->run_sm90 != nullptr;
  const BackwardRunFn run = hopper ? entry->run_sm90 : entry->run_sm80;
  const int smem_bytes = hopper ? entry->smem_bytes_sm90() : entry->smem_bytes_sm80();
  if (smem_bytes > limits.max_smem_optin) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: the backward kernel for head_dim=" + std::to_string(head_dim) + " needs " +
                          std::to_string(smem_bytes) + " bytes of shared memory per block; this device allows " +
                          std::to_string(limits.max_smem_optin));
  }
  params.t = {out.untyped_data(),
              d_out.untyped_data(),
              static_cast<const float*>(lse.untyped_data()),
              static_cast<const float*>(d_lse.untyped_data()),
              dq->untyped_data(),
              dk->untyped_data(),
              dv->untyped_data()};
  const size_t rows = static_cast<size_t>(q.element_count()) / head_dim;
  // (at least 16 bytes each: Sq = 0 still runs the kernel that writes dK = dV = 0)
  std::optional<void*> dq_accum = scratch.Allocate(std::max<size_t>(rows * head_dim * sizeof(float), 16),
                                                   kScratchAlignment);
  std::optional<void*> delta = scratch.Allocate(std::max<size_t>(rows * sizeof(float), 16), kScratchAlignment);
  if (!dq_accum.has_value() || !delta.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jax_flash: could not allocate " + std::to_string(rows * (head_dim + 1) * 4) +
                          " bytes of scratch memory for the backward (dQ's float32 accumulator and a float per row)");
  }
  if (hopper) {  // lse2 and delta per row, rows padded for the kernel's bulk copies (BackwardParams::row_stats)
    const int64_t rows_q = q.dimensions()[1];
    params.stats_rows = padded_stats_rows(rows_q);
    const size_t stats_bytes = 2 * static_cast<size_t>(q.dimensions()[0] * q.dimensions()[2] * params.stats_rows) * 4;
    std::optional<void*> stats = scratch.Allocate(std::max<size_t>(stats_bytes, 16), kScratchAlignment);
    if (!stats.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_flash: could not allocate " + std::to_string(stats_bytes) +
                            " bytes of scratch memory for the backward's row statistics");
    }
    params.row_stats = static_cast<float*>(*stats);
  }
  if (ffi::Error err = allocate_backward_blocks(scratch, params.p); err.failure()) return err;
  params.dq_accum = static_cast<float*>(*dq_accum);
  params.delta = static_cast<float*>(*delta);
  if (attrs.deterministic) {  // one turn counter per 64 query rows of each (batch, head)
    const int64_t rows_q = q.dimensions()[1];
    params.dq_turn_count = q.dimensions()[0] * q.dimensions()[2] * ((rows_q + kDQTurnRows - 1) / kDQTurnRows);
    std::optional<void*> turns = scratch.Allocate(
        std::max<size_t>(static_cast<size_t>(params.dq_turn_count) * sizeof(int), 16), kScratchAlignment);
    if (!turns.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_flash: could not allocate the deterministic backward's turn counters (" +
                            std::to_string(params.dq_turn_count * 4) + " bytes of scratch memory)");
    }
    params.dq_turns = static_cast<int*>(*turns);
  }
  if (std::string failure = run(params, stream); !failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jax_flash: " + failure);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBackwardCuda, attention_bwd_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Arg<ffi::AnyBuffer>()  // d_lse
                                  .Arg<ffi::AnyBuffer>()  // q_lengths
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths
                                  .Arg<ffi::AnyBuffer>()  // q_segment_ids (batch, seq_q); (batch, 0): none
                                  .Arg<ffi::AnyBuffer>()  // kv_segment_ids (batch, seq_k); (batch, 0): none
                                  .Arg<ffi::AnyBuffer>()  // bias float32 (B|1, Hq|1, Sq|1, Sk|1); (0, 0, 0, 0): none
                                  .Arg<ffi::AnyBuffer>()  // mask bool, the same shapes
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attrs<AttentionAttrs>());

}  // namespace jax_flash
