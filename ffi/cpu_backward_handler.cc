// XLA FFI handler of the backward pass on the CPU platform: validates, then runs csrc/cpu/attention_bwd_cpu on XLA's
// intra-op threads with the OpenBLAS that jax_flash.native loaded.
#include <algorithm>
#include <functional>

#include "cpu/attention_bwd_cpu.h"
#include "ffi/attention_attrs.h"
#include "ffi/handlers.h"
#include "ffi/validate.h"

namespace jax_flash {

static ffi::Error attention_bwd_cpu_impl(ffi::ThreadPool thread_pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                         ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                         ffi::AnyBuffer d_out, ffi::AnyBuffer d_lse, ffi::AnyBuffer q_lengths,
                                         ffi::AnyBuffer kv_lengths, ffi::Result<ffi::AnyBuffer> dq,
                                         ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                                         AttentionAttrs attrs) {
  if (auto err = check_buffers(q, k, v, q_lengths, kv_lengths, nullptr, out, lse, attrs)) return std::move(*err);
  if (auto err = check_backward_buffers(q, k, d_out, d_lse, lse, *dq, *dk, *dv)) return std::move(*err);
  CpuElement element;
  switch (q.element_type()) {
    case ffi::DataType::F16: element = CpuElement::kFloat16; break;
    case ffi::DataType::BF16: element = CpuElement::kBFloat16; break;
    case ffi::DataType::F32: element = CpuElement::kFloat32; break;
    default: return invalid("the CPU handler supports float16, bfloat16 and float32 inputs");
  }
  if (attrs.block_q < 1 || attrs.block_kv < 1 || attrs.block_q > 4096 || attrs.block_kv > 4096) {
    return invalid("block_q and block_kv must be in [1, 4096]; got " + std::to_string(attrs.block_q) + " and " +
                   std::to_string(attrs.block_kv));
  }
  if (q.element_count() == 0 && k.element_count() == 0) return ffi::Error::Success();  // nothing to write
  const cpu::SgemmFn sgemm = cpu::openblas_sgemm();
  if (sgemm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_flash's CPU attention needs OpenBLAS from the scipy-openblas32 package, and it is not "
                      "loaded (importing jax_flash loads it; install it with `pip install scipy-openblas32`)");
  }
  const AttentionParams params = params_from_buffers(q, k, v, q_lengths, kv_lengths, nullptr, out, lse, attrs);
  const BackwardTensors tensors{out.untyped_data(),  d_out.untyped_data(), static_cast<const float*>(lse.untyped_data()),
                                static_cast<const float*>(d_lse.untyped_data()), dq->untyped_data(),
                                dk->untyped_data(), dv->untyped_data()};
  const int64_t pool_threads = thread_pool.num_threads();
  CpuRuntime runtime;
  runtime.sgemm = sgemm;
  runtime.num_threads = static_cast<int>(std::clamp<int64_t>(pool_threads, 1, 1024));
  if (pool_threads > 1) {
    runtime.schedule = [&thread_pool](std::function<void()> task) { thread_pool.Schedule(std::move(task)); };
  }
  attention_bwd_cpu(params, tensors, element, static_cast<int>(attrs.block_q), static_cast<int>(attrs.block_kv),
                    runtime);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBackwardCpu, attention_bwd_cpu_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Arg<ffi::AnyBuffer>()  // d_lse
                                  .Arg<ffi::AnyBuffer>()  // q_lengths
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attrs<AttentionAttrs>());

}  // namespace jax_flash
