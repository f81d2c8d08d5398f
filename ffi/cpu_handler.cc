// XLA FFI handler for the CPU platform: validates, then runs csrc/cpu/attention_cpu on XLA's intra-op threads with
// the OpenBLAS that jax_flash.native loaded.
#include <algorithm>
#include <functional>
#include <optional>
#include <string>

#include "common/visibility.h"
#include "cpu/attention_cpu.h"
#include "ffi/attention_attrs.h"
#include "ffi/cpu_runtime.h"
#include "ffi/handlers.h"
#include "ffi/validate.h"

namespace jax_flash {

// Every page id a query row may read (keys [0, kv_len) that some row sees) must name a page: the CPU path checks
// them all before computing, and names the first that does not.
static std::optional<ffi::Error> check_page_table(const AttentionParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    const BatchLengths len = batch_lengths(p, b);
    const KeySpan keys = visible_keys_of_rows(p, len, 0, len.q_len);
    if (keys.begin >= keys.end) continue;
    for (int64_t i = keys.begin / p.page_size; i <= (keys.end - 1) / p.page_size; ++i) {
      const int page = p.page_table[b * p.page_table_stride + i];
      if (page < 0 || page >= p.num_pages) {
        return invalid("page_table[" + std::to_string(b) + ", " + std::to_string(i) + "] = " + std::to_string(page) +
                       " names no page (k and v hold " + std::to_string(p.num_pages) + "), and batch row " +
                       std::to_string(b) + " sees keys " + std::to_string(i * p.page_size) + ".." +
                       std::to_string((i + 1) * p.page_size - 1) + " of that entry (kv length " +
                       std::to_string(len.kv_len) + ")");
      }
    }
  }
  return std::nullopt;
}

static ffi::Error attention_cpu_impl(ffi::ThreadPool thread_pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                     ffi::AnyBuffer v, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                                     ffi::AnyBuffer page_table, ffi::AnyBuffer q_segment_ids,
                                     ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                                     ffi::Result<ffi::AnyBuffer> o,
                                     ffi::Result<ffi::AnyBuffer> lse, AttentionAttrs attrs) {
  if (auto err = check_buffers(q, k, v, q_lengths, kv_lengths, &page_table, *o, *lse, attrs)) {
    return std::move(*err);
  }
  CpuElement element;
  if (auto err = cpu_element(q, attrs, element)) return std::move(*err);
  // No query row: nothing to write. (Head dim 0 still has rows: their lse is log of the visible keys' count.)
  const auto qd = q.dimensions();
  if (qd[0] == 0 || qd[1] == 0 || qd[2] == 0) return ffi::Error::Success();
  CpuRuntime runtime;
  if (auto err = cpu_runtime(thread_pool, runtime)) return std::move(*err);
  AttentionParams params = params_from_buffers(q, k, v, q_lengths, kv_lengths, &page_table, *o, *lse, attrs);
  if (auto err = check_segment_buffers(q, params.seqlen_k, q_segment_ids, kv_segment_ids)) return std::move(*err);
  set_segments(params, q_segment_ids, kv_segment_ids);
  if (auto err = check_tensor_buffers(q, params.seqlen_k, bias, mask, attrs.alibi != 0)) return std::move(*err);
  set_tensors(params, bias, mask, attrs.alibi != 0);
  if (params.page_table != nullptr) {
    if (auto err = check_page_table(params)) return std::move(*err);
  }
  attention_cpu(params, element, static_cast<int>(attrs.block_q), static_cast<int>(attrs.block_kv), runtime);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCpu, attention_cpu_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
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
