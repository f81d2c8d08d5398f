// XLA FFI handler of the backward pass on the CPU platform: validates, then runs csrc/cpu/attention_bwd_cpu on XLA's
// intra-op threads with the OpenBLAS that jax_flash.native loaded.
#include "cpu/attention_bwd_cpu.h"
#include "ffi/attention_attrs.h"
#include "ffi/cpu_runtime.h"
#include "ffi/handlers.h"
#include "ffi/validate.h"

namespace jax_flash {

static ffi::Error attention_bwd_cpu_impl(ffi::ThreadPool thread_pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                         ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                                         ffi::AnyBuffer d_out, ffi::AnyBuffer d_lse, ffi::AnyBuffer q_lengths,
                                         ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                                         ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                         ffi::Result<ffi::AnyBuffer> dv,
                                         AttentionAttrs attrs) {
  if (auto err = check_buffers(q, k, v, q_lengths, kv_lengths, nullptr, out, lse, attrs)) return std::move(*err);
  if (auto err = check_backward_buffers(q, k, d_out, d_lse, lse, *dq, *dk, *dv)) return std::move(*err);
  if (auto err = check_segment_buffers(q, k.dimensions()[1], q_segment_ids, kv_segment_ids)) return std::move(*err);
  CpuElement element;
  if (auto err = cpu_element(q, attrs, element)) return std::move(*err);
  if (q.element_count() == 0 && k.element_count() == 0) return ffi::Error::Success();  // nothing to write
  CpuRuntime runtime;
  if (auto err = cpu_runtime(thread_pool, runtime)) return std::move(*err);
  AttentionParams params = params_from_buffers(q, k, v, q_lengths, kv_lengths, nullptr, out, lse, attrs);
  set_segments(params, q_segment_ids, kv_segment_ids);
  if (auto err = check_tensor_buffers(q, k.dimensions()[1], bias, mask, attrs.alibi != 0)) return std::move(*err);
  set_tensors(params, bias, mask, attrs.alibi != 0);
  const BackwardTensors tensors{out.untyped_data(),
                                d_out.untyped_data(),
                                static_cast<const float*>(lse.untyped_data()),
                                static_cast<const float*>(d_lse.untyped_data()),
                                dq->untyped_data(),
                                dk->untyped_data(),
                                dv->untyped_data()};
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
                                  .Arg<ffi::AnyBuffer>()  // q_segment_ids (batch, seq_q); (batch, 0): none
                                  .Arg<ffi::AnyBuffer>()  // kv_segment_ids (batch, seq_k); (batch, 0): none
                                  .Arg<ffi::AnyBuffer>()  // bias float32 (B|1, Hq|1, Sq|1, Sk|1); (0, 0, 0, 0): none
                                  .Arg<ffi::AnyBuffer>()  // mask bool, the same shapes
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Attrs<AttentionAttrs>());

}  // namespace jax_flash
