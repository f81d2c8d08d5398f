// XLA FFI handler of the sm90 FP8 forward ("jax_flash_attention_fp8", CUDA): float8_e4m3fn q (B, Sq, Hq, D), k and
// v (B, Sk, Hk, D), float32 (B, Hk) factors q_descale x k_descale and v_descale; bfloat16 o like q and float32 lse
// (B, Hq, Sq). Hopper only; jax_flash/fp8.py sends every other FP8 call to the 16-bit kernels.
#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "common/registry.h"
#include "ffi/attention_attrs.h"
#include "ffi/cuda_device.h"
#include "ffi/handlers.h"
#include "ffi/validate.h"

namespace jax_flash {
namespace {

bool has_dims(const ffi::AnyBuffer& b, ffi::DataType type, std::initializer_list<int64_t> dims) {
  const auto d = b.dimensions();
  if (b.element_type() != type || d.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t n : dims) {
    if (d[i++] != n) return false;
  }
  return true;
}

// What the FP8 kernel needs beyond check_buffers (run with q as the output): e4m3 q, k and v, the descales, a
// bfloat16 output, and none of the features it leaves to the 16-bit kernels.
std::optional<ffi::Error> check_fp8_buffers(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                            const ffi::AnyBuffer& v, const ffi::AnyBuffer& qk_descale,
                                            const ffi::AnyBuffer& v_descale, const ffi::AnyBuffer& o,
                                            const AttentionAttrs& attrs) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  for (const auto* b : {&q, &k, &v}) {
    if (b->element_type() != ffi::DataType::F8E4M3FN) return invalid("the FP8 call takes float8_e4m3fn q, k and v");
  }
  for (const auto* d : {&qk_descale, &v_descale}) {
    if (!has_dims(*d, ffi::DataType::F32, {qd[0], kd[2]})) {
      return invalid("the FP8 call's descale factors must be float32 (batch, heads_k) = (" + std::to_string(qd[0]) +
                     ", " + std::to_string(kd[2]) + "); got " + dims_string(d->dimensions()));
    }
  }
  if (!has_dims(o, ffi::DataType::BF16, {qd[0], qd[1], qd[2], qd[3]})) {
    return invalid("the FP8 call's output must be bfloat16 " + dims_string(qd) + "; got " +
                   dims_string(o.dimensions()));
  }
  if (attrs.paged || attrs.softcap > 0.0f || attrs.pack_gqa != 0 || attrs.num_splits > 1) {
    return invalid("the FP8 kernel takes no paged K/V, softcap, pack_gqa or num_splits (jax_flash runs such FP8 "
                   "calls on the 16-bit kernels)");
  }
  return std::nullopt;
}

ffi::Error attention_fp8_cuda_impl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer qk_descale,
                                   ffi::AnyBuffer v_descale, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                                   AttentionAttrs attrs) {
  // q, k, v, the lengths, the lse and the attributes as the 16-bit call checks them (q standing in for o)
  if (auto err = check_buffers(q, k, v, q_lengths, kv_lengths, nullptr, q, *lse, attrs)) return std::move(*err);
  if (auto err = check_fp8_buffers(q, k, v, qk_descale, v_descale, *o, attrs)) return std::move(*err);
  KernelKey key{};
  key.dtype = static_cast<int>(DType::kFloat8E4M3);
  key.head_dim = static_cast<int>(q.dimensions()[3]);
#define JAX_FLASH_COPY_FIELD(type, name) key.name = static_cast<type>(attrs.name);
  JAX_FLASH_CONFIG_FIELDS(JAX_FLASH_COPY_FIELD)
#undef JAX_FLASH_COPY_FIELD
  const RegistryEntry* entry = find_fp8_kernel(key);
  if (entry == nullptr) {
    std::string compiled;
    for (int i = 0; i < kFp8RegistrySize; ++i) compiled += "\n  " + describe(kFp8Registry[i].key);
    return ffi::Error(ffi::ErrorCode::kNotFound, "jax_flash: no compiled FP8 GPU kernel for " + describe(key) +
                                                     "; compiled:" + (compiled.empty() ? " none" : compiled));
  }
  AttentionParams params = params_from_buffers(q, k, v, q_lengths, kv_lengths, nullptr, *o, *lse, attrs);
  params.qk_descale = static_cast<const float*>(qk_descale.untyped_data());
  params.v_descale = static_cast<const float*>(v_descale.untyped_data());
  params.num_splits = 1;
  if (q.element_count() == 0) return ffi::Error::Success();

  DeviceLimits limits;
  if (ffi::Error err = current_device_limits(limits); err.failure()) return err;
  if (limits.major != 9) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: the FP8 kernel uses Hopper-only instructions (FP8 wgmma, TMA) and needs compute "
                      "capability 9.0 (H100/H200); this device is " + std::to_string(limits.major) + "." +
                          std::to_string(limits.minor));
  }
  if (entry->smem_bytes > limits.max_smem_optin) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash: the FP8 kernel needs " + std::to_string(entry->smem_bytes) +
                          " bytes of shared memory per block; this device allows " +
                          std::to_string(limits.max_smem_optin));
  }
  if (ffi::Error err = allocate_tile_counter(scratch, params); err.failure()) return err;
  allocate_split_tail(scratch, entry->split_bytes_per_sm, limits, params);
  if (std::string failure = entry->run(params, stream); !failure.empty()) {
    return ffi::Error(ffi::ErrorCode::kInternal, "jax_flash: " + failure);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFp8Cuda, attention_fp8_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // q float8_e4m3fn (B, Sq, Hq, D)
                                  .Arg<ffi::AnyBuffer>()  // k float8_e4m3fn (B, Sk, Hk, D)
                                  .Arg<ffi::AnyBuffer>()  // v float8_e4m3fn (B, Sk, Hk, D)
                                  .Arg<ffi::AnyBuffer>()  // q_descale x k_descale float32 (B, Hk)
                                  .Arg<ffi::AnyBuffer>()  // v_descale float32 (B, Hk)
                                  .Arg<ffi::AnyBuffer>()  // q_lengths int32 (B,) or (0,)
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths int32 (B,) or (0,)
                                  .Ret<ffi::AnyBuffer>()  // o bfloat16 (B, Sq, Hq, D)
                                  .Ret<ffi::AnyBuffer>()  // lse float32 (B, Hq, Sq)
                                  .Attrs<AttentionAttrs>());

}  // namespace jax_flash
