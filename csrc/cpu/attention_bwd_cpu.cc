// CPU attention backward (see attention_bwd_cpu.h). With s the scaled (soft-capped) scores of the forward,
// P = exp(s - lse) on visible keys (0 elsewhere), and the cotangents dO, dlse:
//   dV = P^T dO ;  dP = dO V^T ;  dS = P o (dP - D),  D_i = rowsum(dO_i o O_i) - dlse_i ;
//   dX = dS o g (the derivative of s in q.k: g = scale, or scale (1 - (s / c)^2) with softcap c) ;
//   dQ = dX K ;  dK = dX^T Q.
// An item is (batch, kv head, key range): it owns dK and dV of its keys and walks the group's query heads and rows
// against chunks of its keys (FlashAttention-2's order: keys outside, queries inside). dQ accumulates in float32 for
// the item's rows; with several key ranges per (batch, kv head) (fewer items than 4 x workers) each range keeps its
// own dQ and the last to finish sums them in range order, so the result never depends on timing.
#include "cpu/attention_bwd_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "common/visibility.h"
#include "cpu/elements.h"
#include "cpu/segments.h"
#include "cpu/vector_ops.h"

namespace jax_flash {
namespace {

using cpu::Element;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kKeyChunk = 2048;  // keys per chunk: the item's K, V, dK, dV scratch (4 x 2048 x D floats)

struct Plan {
  int block_q, block_kv, splits, group;
  int64_t items() const { return slots * splits; }
  int64_t slots;      // (batch, kv head) pairs
  int64_t split_len;  // keys per range
};

Plan make_plan(const AttentionParams& p, int block_q, int block_kv, int workers) {
  Plan plan;
  plan.block_q = std::max(1, std::min(block_q, std::max(1, p.seqlen_q)));
  plan.block_kv = std::max(1, std::min(block_kv, std::max(1, p.seqlen_k)));
  plan.group = p.q_heads_per_kv_head;
  plan.slots = int64_t{p.batch} * p.heads_k;
  plan.splits = 1;
  const int64_t wanted = 4 * static_cast<int64_t>(std::max(1, workers));
  if (plan.slots > 0 && plan.slots < wanted) {
    const int64_t by_keys = std::max<int64_t>(1, (p.seqlen_k + plan.block_kv - 1) / plan.block_kv);
    // each range's dQ: group x Sq x D floats; at most 256 MB of them over all ranges
    const int64_t dq_floats = std::max<int64_t>(1, int64_t{plan.group} * p.seqlen_q * p.head_dim);
    const int64_t by_memory = std::max<int64_t>(1, (int64_t{1} << 26) / (dq_floats * plan.slots));
    plan.splits = static_cast<int>(std::min({(wanted + plan.slots - 1) / plan.slots, by_keys, by_memory}));
  }
  plan.split_len = (int64_t{p.seqlen_k} + plan.splits - 1) / plan.splits;
  return plan;
}

// dQ of every range of every (batch, kv head) when ranges are split: slot, then range, then group x Sq x D.
struct SplitDq {
  SplitDq(const Plan& plan, const AttentionParams& p)
      : per_range(static_cast<size_t>(plan.group) * p.seqlen_q * p.head_dim),
        dq(per_range * plan.items()),
        remaining(plan.slots) {
    for (auto& r : remaining) r.store(plan.splits, std::memory_order_relaxed);
  }
  size_t per_range;
  std::vector<float> dq;
  std::vector<std::atomic<int>> remaining;
};

template <CpuElement E>
class BackwardWorker {
  using T = typename Element<E>::Storage;

 public:
  BackwardWorker(const AttentionParams& p, const BackwardTensors& t, const Plan& plan, const CpuRuntime& rt,
                 SplitDq* split_dq)
      : p_(p), t_(t), plan_(plan), rt_(rt), split_dq_(split_dq), D_(p.head_dim) {
    const size_t bq = plan.block_q, bkv = plan.block_kv, D = D_;
    const size_t chunk = std::min<int64_t>(kKeyChunk, std::max<int64_t>(plan.split_len, 1));
    k_.resize(chunk * D), v_.resize(chunk * D), dk_.resize(chunk * D), dv_.resize(chunk * D);
    q_.resize(bq * D), do_.resize(bq * D), s_.resize(bq * bkv), dp_.resize(bq * bkv), g_.resize(bq * bkv);
    row_d_.resize(static_cast<size_t>(plan.group) * p.seqlen_q);
    row_keys_.resize(bq);
    row_tensors_.resize(bq);
    if (plan.splits == 1) own_dq_.resize(static_cast<size_t>(plan.group) * p.seqlen_q * D);
  }

  void operator()(int64_t item) {
    const int64_t slot = item / plan_.splits;
    const int split = static_cast<int>(item % plan_.splits);
    batch_ = slot / p_.heads_k;
    kv_head_ = slot % p_.heads_k;
    len_ = batch_lengths(p_, batch_);
    segments_ = cpu::RowSegments(p_, batch_);
    float* dq = plan_.splits == 1 ? own_dq_.data() : split_dq_->dq.data() + item * split_dq_->per_range;
    std::fill(dq, dq + static_cast<size_t>(plan_.group) * p_.seqlen_q * D_, 0.0f);
    row_terms();
    const int64_t k0 = std::min<int64_t>(split * plan_.split_len, p_.seqlen_k);
    const int64_t k1 = std::min<int64_t>(k0 + plan_.split_len, p_.seqlen_k);
    for (int64_t c0 = k0; c0 < k1; c0 += kKeyChunk) attend_chunk(c0, std::min<int64_t>(k1, c0 + kKeyChunk), dq);
    if (plan_.splits == 1) return write_dq(dq);
    // The last range of the slot to finish sums them in range order; acq_rel publishes the others' dQ to it.
    if (split_dq_->remaining[slot].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      float* first = split_dq_->dq.data() + slot * plan_.splits * split_dq_->per_range;
      for (int s = 1; s < plan_.splits; ++s) {
        const float* other = first + s * split_dq_->per_range;
        for (size_t i = 0; i < split_dq_->per_range; ++i) first[i] += other[i];
      }
      write_dq(first);
    }
  }

 private:
  int64_t head(int g) const { return kv_head_ * plan_.group + g; }
  const T* row_of(const void* base, int64_t g, int64_t row) const {  // q-shaped tensors: q, out, d_out
    return static_cast<const T*>(base) + batch_ * p_.q_batch_stride + head(g) * p_.q_head_stride +
           row * p_.q_seq_stride;
  }
  int64_t lse_index(int g, int64_t row) const {
    return batch_ * p_.lse_batch_stride + head(g) * p_.lse_head_stride + row;
  }

  // D_i = rowsum(dO_i o O_i) - dlse_i for every row of the group's heads (rows past q_len never contribute).
  void row_terms() {
    float* o = q_.data();  // (the Q and dO tiles' first rows hold O_i and dO_i here)
    float* d_o = do_.data();
    for (int g = 0; g < plan_.group; ++g) {
      for (int64_t r = 0; r < p_.seqlen_q; ++r) {
        float sum = 0.0f;
        if (D_ > 0) {
          Element<E>::widen(row_of(t_.out, g, r), o, D_);
          Element<E>::widen(row_of(t_.d_out, g, r), d_o, D_);
          for (int d = 0; d < D_; ++d) sum += o[d] * d_o[d];
        }
        row_d_[g * p_.seqlen_q + r] = sum - (t_.d_lse != nullptr ? t_.d_lse[lse_index(g, r)] : 0.0f);
      }
    }
  }

  // Keys [c0, c1) of this item: their K and V converted (zeros at or past kv_len: invisible to every row), dK and
  // dV accumulated over the group's rows, then written.
  void attend_chunk(int64_t c0, int64_t c1, float* dq) {
    const int n = static_cast<int>(c1 - c0);
    const T* k = static_cast<const T*>(p_.k) + batch_ * p_.k_batch_stride + kv_head_ * p_.k_head_stride;
    const T* v = static_cast<const T*>(p_.v) + batch_ * p_.v_batch_stride + kv_head_ * p_.v_head_stride;
    for (int j = 0; j < n; ++j) {
      float* kj = k_.data() + static_cast<size_t>(j) * D_;
      float* vj = v_.data() + static_cast<size_t>(j) * D_;
      if (c0 + j < len_.kv_len) {
        Element<E>::widen(k + (c0 + j) * p_.k_seq_stride, kj, D_);
        Element<E>::widen(v + (c0 + j) * p_.v_seq_stride, vj, D_);
      } else {
        std::fill(kj, kj + D_, 0.0f), std::fill(vj, vj + D_, 0.0f);
      }
    }
    std::fill(dk_.begin(), dk_.begin() + static_cast<size_t>(n) * D_, 0.0f);
    std::fill(dv_.begin(), dv_.begin() + static_cast<size_t>(n) * D_, 0.0f);
    for (int g = 0; g < plan_.group; ++g) {
      for (int64_t r0 = 0; r0 < len_.q_len; r0 += plan_.block_q) {
        const int rows = static_cast<int>(std::min<int64_t>(plan_.block_q, len_.q_len - r0));
        const KeySpan span = visible_keys_of_rows(p_, len_, r0, r0 + rows);
        const int64_t begin = std::max<int64_t>(span.begin, c0), end = std::min<int64_t>(span.end, c1);
        if (begin < end) attend_rows(g, r0, rows, c0, begin, end, dq + (g * p_.seqlen_q + r0) * D_);
      }
    }
    T* dk = static_cast<T*>(t_.dk) + batch_ * p_.k_batch_stride + kv_head_ * p_.k_head_stride;
    T* dv = static_cast<T*>(t_.dv) + batch_ * p_.v_batch_stride + kv_head_ * p_.v_head_stride;
    for (int j = 0; j < n; ++j) {
      Element<E>::narrow(dk_.data() + static_cast<size_t>(j) * D_, dk + (c0 + j) * p_.k_seq_stride, D_, 1.0f);
      Element<E>::narrow(dv_.data() + static_cast<size_t>(j) * D_, dv + (c0 + j) * p_.v_seq_stride, D_, 1.0f);
    }
  }

  // Rows [r0, r0 + rows) of head g against keys [begin, end) of the chunk starting at c0; dq: the rows' dQ.
  void attend_rows(int g, int64_t r0, int rows, int64_t c0, int64_t begin, int64_t end, float* dq) {
    const int bkv = plan_.block_kv;
    for (int r = 0; r < rows; ++r) {
      Element<E>::widen(row_of(p_.q, g, r0 + r), q_.data() + static_cast<size_t>(r) * D_, D_);
      Element<E>::widen(row_of(t_.d_out, g, r0 + r), do_.data() + static_cast<size_t>(r) * D_, D_);
      row_keys_[r] = visible_keys(p_, len_, r0 + r);
    }
    const bool softcap = p_.softcap > 0.0f;
    const float alpha = softcap ? p_.softcap_scale : p_.scale;
    const float scale = softcap ? p_.softcap_scale * p_.softcap : p_.scale;  // the user's softmax scale
    cpu::SegmentRange row_ids;
    if (segments_.active()) {
      for (int r = 0; r < rows; ++r) row_ids.add(segments_.q[r0 + r]);
    }
    const bool tensors = p_.bias != nullptr || p_.mask != nullptr;
    for (int r = 0; tensors && r < rows; ++r) row_tensors_[r] = cpu::TensorRow(p_, batch_, head(g), r0 + r);
    for (int64_t col0 = begin; col0 < end; col0 += bkv) {
      const int cols = static_cast<int>(std::min<int64_t>(bkv, end - col0));
      if (segments_.active() && !row_ids.meets(segments_.keys(col0, col0 + cols))) continue;  // P = 0 on the tile
      if (p_.mask != nullptr && !any_unmasked(rows, col0, cols)) continue;
      const float* kt = k_.data() + (col0 - c0) * D_;
      const float* vt = v_.data() + (col0 - c0) * D_;
      // S = alpha Q K^T, then P = exp(s - lse) and g, row by row
      rt_.sgemm(cpu::kRowMajor, cpu::kNoTrans, cpu::kTrans, rows, cols, D_, alpha, q_.data(), D_, kt, D_, 0.0f,
                s_.data(), bkv);
      for (int r = 0; r < rows; ++r) probabilities(r, g, r0 + r, col0, cols, softcap, scale);
      // dV += P^T dO ; dP = dO V^T
      rt_.sgemm(cpu::kRowMajor, cpu::kTrans, cpu::kNoTrans, cols, D_, rows, 1.0f, s_.data(), bkv, do_.data(), D_,
                1.0f, dv_.data() + (col0 - c0) * D_, D_);
      rt_.sgemm(cpu::kRowMajor, cpu::kNoTrans, cpu::kTrans, rows, cols, D_, 1.0f, do_.data(), D_, vt, D_, 0.0f,
                dp_.data(), bkv);
      // dX = P o (dP - D) o g, into dp_
      for (int r = 0; r < rows; ++r) {
        const float row_d = row_d_[g * p_.seqlen_q + r0 + r];
        float* dx = dp_.data() + static_cast<size_t>(r) * bkv;
        const float* pr = s_.data() + static_cast<size_t>(r) * bkv;
        const float* gr = g_.data() + static_cast<size_t>(r) * bkv;
        for (int j = 0; j < cols; ++j) dx[j] = pr[j] == 0.0f ? 0.0f : pr[j] * (dx[j] - row_d) * gr[j];
      }
      // dQ += dX K ; dK += dX^T Q
      rt_.sgemm(cpu::kRowMajor, cpu::kNoTrans, cpu::kNoTrans, rows, D_, cols, 1.0f, dp_.data(), bkv, kt, D_, 1.0f,
                dq, D_);
      rt_.sgemm(cpu::kRowMajor, cpu::kTrans, cpu::kNoTrans, cols, D_, rows, 1.0f, dp_.data(), bkv, q_.data(), D_,
                1.0f, dk_.data() + (col0 - c0) * D_, D_);
    }
  }

  // Row r of the score tile (keys [col0, col0 + cols)) becomes P = exp(s - lse) on its visible keys and 0 elsewhere,
  // and its g row the derivative of s in q.k (a row whose lse is -inf saw no key: all 0).
  void probabilities(int r, int g, int64_t row, int64_t col0, int cols, bool softcap, float scale) {
    float* s = s_.data() + static_cast<size_t>(r) * plan_.block_kv;
    float* gr = g_.data() + static_cast<size_t>(r) * plan_.block_kv;
    const float lse = t_.lse[lse_index(g, row)];
    const int begin = static_cast<int>(std::clamp<int64_t>(row_keys_[r].first - col0, 0, cols));
    const int end = static_cast<int>(std::clamp<int64_t>(int64_t{row_keys_[r].last} + 1 - col0, begin, cols));
    std::fill(s, s + begin, 0.0f), std::fill(s + end, s + cols, 0.0f);
    std::fill(gr, gr + cols, scale);
    if (begin >= end || lse == kNegInf) {
      std::fill(s, s + cols, 0.0f);
      return;
    }
    if (softcap) {
      cpu::softcap(s + begin, end - begin, p_.softcap);
      const float inv_cap = 1.0f / p_.softcap;
      for (int j = begin; j < end; ++j) gr[j] = scale * (1.0f - (s[j] * inv_cap) * (s[j] * inv_cap));
    }
    if (p_.bias != nullptr || p_.mask != nullptr) row_tensors_[r].apply(s, col0, begin, end, kNegInf);
    cpu::exp_shifted_sum(s + begin, end - begin, lse);
    if (segments_.active()) {  // keys of other segments: P = 0
      const int id = segments_.q[row];
      const int* kv = segments_.kv + col0;
      for (int j = begin; j < end; ++j) s[j] = kv[j] == id ? s[j] : 0.0f;
    }
  }

  // Whether the mask tensor leaves some row a key of [col0, col0 + cols) (else the tile is skipped: P = 0).
  bool any_unmasked(int rows, int64_t col0, int cols) const {
    for (int r = 0; r < rows; ++r) {
      if (row_tensors_[r].any_visible(col0, col0 + cols)) return true;
    }
    return false;
  }

  void write_dq(const float* dq) {
    for (int g = 0; g < plan_.group; ++g) {
      for (int64_t r = 0; r < p_.seqlen_q; ++r) {
        T* out = static_cast<T*>(t_.dq) + batch_ * p_.q_batch_stride + head(g) * p_.q_head_stride +
                 r * p_.q_seq_stride;
        Element<E>::narrow(dq + (g * p_.seqlen_q + r) * D_, out, D_, 1.0f);
      }
    }
  }

  const AttentionParams& p_;
  const BackwardTensors& t_;
  const Plan& plan_;
  const CpuRuntime& rt_;
  SplitDq* split_dq_;
  const int D_;
  int64_t batch_ = 0, kv_head_ = 0;
  BatchLengths len_{};
  std::vector<float> k_, v_, dk_, dv_;  // (chunk, D): the item's keys, values and their gradients
  std::vector<float> q_, do_;           // (block_q, D)
  std::vector<float> s_, dp_, g_;       // (block_q, block_kv): S then P; dP then dX; ds / d(q.k)
  std::vector<float> row_d_;            // (group, Sq): rowsum(dO o O) - dlse
  std::vector<KeyRange> row_keys_;
  cpu::RowSegments segments_;           // the item's batch row
  std::vector<cpu::TensorRow> row_tensors_;  // (block_q) the rows' bias and mask entries (with those tensors)
  std::vector<float> own_dq_;           // (group, Sq, D) when the keys are not split
};

template <CpuElement E>
void run(const AttentionParams& p, const BackwardTensors& t, int block_q, int block_kv, const CpuRuntime& rt) {
  const int workers = std::max(1, rt.num_threads);
  const Plan plan = make_plan(p, block_q, block_kv, workers);
  std::unique_ptr<SplitDq> split_dq;
  if (plan.splits > 1) split_dq = std::make_unique<SplitDq>(plan, p);
  cpu::parallel_for(plan.items(), workers, rt.schedule, [&]() -> cpu::ItemFn {
    auto worker = std::make_shared<BackwardWorker<E>>(p, t, plan, rt, split_dq.get());
    return [worker](int64_t item) { (*worker)(item); };
  });
}

}  // namespace

void attention_bwd_cpu(const AttentionParams& params, const BackwardTensors& tensors, CpuElement element, int block_q,
                       int block_kv, const CpuRuntime& runtime) {
  switch (element) {
    case CpuElement::kFloat16: return run<CpuElement::kFloat16>(params, tensors, block_q, block_kv, runtime);
    case CpuElement::kBFloat16: return run<CpuElement::kBFloat16>(params, tensors, block_q, block_kv, runtime);
    case CpuElement::kFloat32: return run<CpuElement::kFloat32>(params, tensors, block_q, block_kv, runtime);
  }
}

}  // namespace jax_flash
