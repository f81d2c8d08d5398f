// CPU attention forward (see attention_cpu.h). One item = one unit (batch, query head, query block), or one key
// range of it (work_plan.h). Per key tile of the item's keys:
//   S = scale Q K^T (sgemm; softcap: c tanh(S / c)), restricted to each row's visible keys ;
//   m_new = max(m, rowmax(S)) ; P = exp(S - m_new), 0 where masked ; l = exp(m - m_new) l + rowsum(P) ;
//   O = diag(exp(m - m_new)) O + P V (sgemm)
// and at the end O = O / l, lse = m + log(l); rows that see no key get zeros and lse = -inf. Split units leave
// (m, l, O) per split and the last split to finish merges them:
//   M = max_s m_s, L = sum_s exp(m_s - M) l_s, O = sum_s exp(m_s - M) O_s / L.
#include "cpu/attention_cpu.h"

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
#include "cpu/work_plan.h"

namespace jax_flash {
namespace {

using cpu::Unit;
using cpu::WorkPlan;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using cpu::Element;

// (m, l, O) of every split of every split unit: slot-major, then split, then rows of block_q.
struct SplitPartials {
  SplitPartials(const WorkPlan& plan, int head_dim) : remaining(plan.num_units()) {
    const size_t rows = static_cast<size_t>(plan.num_items()) * plan.block_q();
    m.resize(rows);
    l.resize(rows);
    o.resize(rows * head_dim);
    for (auto& r : remaining) r.store(plan.splits(), std::memory_order_relaxed);
  }
  std::vector<float> m, l, o;
  std::vector<std::atomic<int>> remaining;  // per slot: splits not yet finished
};

template <CpuElement E>
class TileWorker {
  using T = typename Element<E>::Storage;

 public:
  TileWorker(const AttentionParams& p, const WorkPlan& plan, const CpuRuntime& rt, SplitPartials* partials)
      : p_(p), plan_(plan), rt_(rt), partials_(partials), D_(p.head_dim) {
    const size_t bq = plan.block_q(), bkv = plan.block_kv(), D = D_;
    s_.resize(bq * bkv);
    o_.resize(bq * D);
    m_.resize(bq);
    l_.resize(bq);
    row_keys_.resize(bq);
    row_segment_.resize(bq);
    row_tensors_.resize(bq);
  }

  void operator()(int64_t item) {
    const int64_t slot = item / plan_.splits();
    const int split = static_cast<int>(item % plan_.splits());
    const Unit u = plan_.unit(slot);
    attend(u, plan_.split_keys(u, split));
    if (plan_.splits() == 1) return write_output(u);
    save_partial(item, u.rows);
    // The last split of the slot to finish merges; acq_rel makes the other splits' partials visible to it.
    if (partials_->remaining[slot].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      merge_partials(slot, u.rows);
      write_output(u);
    }
  }

 private:
  const T* q_row(const Unit& u, int r) const {
    return static_cast<const T*>(p_.q) + u.batch * p_.q_batch_stride + u.head_of(r) * p_.q_head_stride +
           u.position(r) * p_.q_seq_stride;
  }
  // Logical key `key` of u's kv head in k (or v): contiguous, or through the page table (the handler has checked
  // the ids of every page a unit may read: check_page_table).
  const T* kv_row(const void* base, int64_t batch_stride, int64_t seq_stride, int64_t head_stride, const Unit& u,
                  int64_t key) const {
    const T* kv = static_cast<const T*>(base) + u.kv_head * head_stride;
    if (p_.page_table == nullptr) return kv + u.batch * batch_stride + key * seq_stride;
    const int64_t page = p_.page_table[u.batch * p_.page_table_stride + key / p_.page_size];
    return kv + page * batch_stride + (key % p_.page_size) * seq_stride;
  }
  const T* k_row(const Unit& u, int64_t key) const {
    return kv_row(p_.k, p_.k_batch_stride, p_.k_seq_stride, p_.k_head_stride, u, key);
  }
  const T* v_row(const Unit& u, int64_t key) const {
    return kv_row(p_.v, p_.v_batch_stride, p_.v_seq_stride, p_.v_head_stride, u, key);
  }

  // rows x D fp32 operand of a GEMM whose row i is row_at(i): the input itself for fp32 rows at one stride (`stride`
  // > 0, at most BLAS's 32-bit leading dimension), else converted into `scratch`, (block_q | block_kv) x D,
  // allocated on first use.
  template <class RowAt>
  const float* operand(RowAt row_at, int64_t stride, int rows, std::vector<float>& scratch, int& ld) {
    if constexpr (Element<E>::kDirect) {
      if (stride > 0 && stride <= std::numeric_limits<int>::max()) {
        ld = static_cast<int>(stride);
        return row_at(0);
      }
    }
    if (scratch.empty()) scratch.resize(static_cast<size_t>(std::max(plan_.block_q(), plan_.block_kv())) * D_);
    for (int r = 0; r < rows; ++r) Element<E>::widen(row_at(r), scratch.data() + r * D_, D_);
    ld = D_;
    return scratch.data();
  }

  // Accumulates keys [keys.begin, keys.end) of unit u into (m_, l_, o_).
  void attend(const Unit& u, KeySpan keys) {
    const int rows = u.rows, bkv = plan_.block_kv();
    std::fill(m_.begin(), m_.begin() + rows, kNegInf);
    std::fill(l_.begin(), l_.begin() + rows, 0.0f);
    std::fill(o_.begin(), o_.begin() + static_cast<size_t>(rows) * D_, 0.0f);
    if (keys.begin >= keys.end) return;
    for (int r = 0; r < rows; ++r) row_keys_[r] = visible_keys(p_, u.len, u.position(r));
    segments_ = cpu::RowSegments(p_, u.batch);
    cpu::SegmentRange row_ids;  // of the rows that see a key
    if (segments_.active()) {
      for (int r = 0; r < rows; ++r) {
        row_segment_[r] = segments_.q[u.position(r)];
        if (row_keys_[r].first <= row_keys_[r].last) row_ids.add(row_segment_[r]);
      }
    }
    const bool tensors = p_.bias != nullptr || p_.mask != nullptr;
    for (int r = 0; tensors && r < rows; ++r) row_tensors_[r] = cpu::TensorRow(p_, u.batch, u.head_of(r), u.position(r));
    const bool softcap = p_.softcap > 0.0f;
    const float alpha = softcap ? p_.softcap_scale : p_.scale;  // softcap: s = c tanh(q.k * scale / c)
    // Packed rows step through the group's heads, then the positions: no single stride.
    const int64_t q_stride = u.pack == 1 ? p_.q_seq_stride : 0;
    const int64_t kv_stride = p_.page_table == nullptr ? 1 : 0;  // paged keys: no single stride either
    int ldq = 0;
    const float* q =
        D_ > 0 ? operand([&](int r) { return q_row(u, r); }, q_stride, rows, q_, ldq) : nullptr;

    for (int col0 = keys.begin; col0 < keys.end; col0 += bkv) {
      const int cols = std::min(bkv, keys.end - col0);
      if (segments_.active() && !row_ids.meets(segments_.keys(col0, col0 + cols))) continue;  // no row sees a key
      if (p_.mask != nullptr && !any_unmasked(rows, col0, cols)) continue;
      int ldk = 0, ldv = 0;
      if (D_ > 0) {
        const float* k = operand([&](int r) { return k_row(u, col0 + r); }, kv_stride * p_.k_seq_stride, cols, k_,
                                 ldk);
        rt_.sgemm(cpu::kRowMajor, cpu::kNoTrans, cpu::kTrans, rows, cols, D_, alpha, q, ldq, k, ldk, 0.0f,
                  s_.data(), bkv);
      } else {
        std::fill(s_.begin(), s_.end(), 0.0f);  // an empty dot product
      }
      bool any_visible = false;
      for (int r = 0; r < rows; ++r) any_visible |= softmax_row(r, col0, cols, softcap);
      if (any_visible && D_ > 0) {
        const float* v = operand([&](int r) { return v_row(u, col0 + r); }, kv_stride * p_.v_seq_stride, cols, v_,
                                 ldv);
        rt_.sgemm(cpu::kRowMajor, cpu::kNoTrans, cpu::kNoTrans, rows, D_, cols, 1.0f, s_.data(), bkv, v, ldv, 1.0f,
                  o_.data(), D_);
      }
    }
  }

  // Online-softmax update of row r for key tile [col0, col0 + cols): turns its scores into P (zeros where
  // masked), rescales its O row. False when the row sees no key of the tile (its P row is all zeros).
  bool softmax_row(int r, int col0, int cols, bool softcap) {
    float* s = s_.data() + static_cast<size_t>(r) * plan_.block_kv();
    const int begin = std::max(row_keys_[r].first - col0, 0);
    const int end = std::min(row_keys_[r].last + 1 - col0, cols);
    if (begin >= end) {
      std::fill(s, s + cols, 0.0f);
      return false;
    }
    if (softcap) cpu::softcap(s + begin, end - begin, p_.softcap);
    const bool tensors = p_.bias != nullptr || p_.mask != nullptr;
    if (tensors) row_tensors_[r].apply(s, col0, begin, end, kNegInf);
    if (segments_.active()) {  // keys of other segments: -inf
      const int* kv = segments_.kv + col0;
      for (int j = begin; j < end; ++j) s[j] = kv[j] == row_segment_[r] ? s[j] : kNegInf;
    }
    if ((tensors || segments_.active()) && cpu::row_max(s + begin, end - begin) == kNegInf) {
      std::fill(s, s + cols, 0.0f);  // no key left (or only -inf scores): as no key at all
      return false;
    }
    const float m_new = std::max(m_[r], cpu::row_max(s + begin, end - begin));
    const float rescale = std::exp(m_[r] - m_new);  // exp(-inf) = 0 on the row's first visible tile
    const float sum = cpu::exp_shifted_sum(s + begin, end - begin, m_new);
    std::fill(s, s + begin, 0.0f);
    std::fill(s + end, s + cols, 0.0f);
    l_[r] = rescale * l_[r] + sum;
    m_[r] = m_new;
    if (rescale != 1.0f) cpu::scale(o_.data() + static_cast<size_t>(r) * D_, D_, rescale);
    return true;
  }

  // Whether the mask tensor leaves some row a key of [col0, col0 + cols) (else the tile is skipped).
  bool any_unmasked(int rows, int col0, int cols) const {
    for (int r = 0; r < rows; ++r) {
      if (row_tensors_[r].any_visible(col0, col0 + cols)) return true;
    }
    return false;
  }

  void save_partial(int64_t item, int rows) {
    const size_t base = static_cast<size_t>(item) * plan_.block_q();
    std::copy(m_.begin(), m_.begin() + rows, partials_->m.begin() + base);
    std::copy(l_.begin(), l_.begin() + rows, partials_->l.begin() + base);
    std::copy(o_.begin(), o_.begin() + static_cast<size_t>(rows) * D_, partials_->o.begin() + base * D_);
  }

  // Merges the splits of `slot` into (m_, l_, o_).
  void merge_partials(int64_t slot, int rows) {
    const int splits = plan_.splits();
    const size_t bq = plan_.block_q();
    const size_t first = static_cast<size_t>(slot) * splits * bq;
    for (int r = 0; r < rows; ++r) {
      float m = kNegInf;
      for (int s = 0; s < splits; ++s) m = std::max(m, partials_->m[first + s * bq + r]);
      float l = 0.0f;
      float* o = o_.data() + static_cast<size_t>(r) * D_;
      std::fill(o, o + D_, 0.0f);
      for (int s = 0; s < splits; ++s) {
        const size_t row = first + s * bq + r;
        const float l_s = partials_->l[row];
        if (l_s == 0.0f) continue;  // the split saw none of this row's keys
        const float w = std::exp(partials_->m[row] - m);
        l += w * l_s;
        const float* o_s = partials_->o.data() + row * D_;
        for (int d = 0; d < D_; ++d) o[d] += w * o_s[d];
      }
      m_[r] = m;
      l_[r] = l;
    }
  }

  void write_output(const Unit& u) {
    T* out = static_cast<T*>(p_.o) + u.batch * p_.o_batch_stride;
    for (int r = 0; r < u.rows; ++r) {
      // A row that saw no key (l = 0): zeros and lse = -inf. A NaN l (a NaN or +inf score) stays NaN in O and lse.
      const bool seen = l_[r] != 0.0f;
      const float inv = seen ? 1.0f / l_[r] : 0.0f;
      const int64_t head = u.head_of(r), position = u.position(r);
      Element<E>::narrow(o_.data() + static_cast<size_t>(r) * D_,
                         out + head * p_.o_head_stride + position * p_.o_seq_stride, D_, inv);
      if (p_.lse != nullptr) {
        p_.lse[u.batch * p_.lse_batch_stride + head * p_.lse_head_stride + position] =
            seen ? m_[r] + std::log(l_[r]) : kNegInf;
      }
    }
  }

  const AttentionParams& p_;
  const WorkPlan& plan_;
  const CpuRuntime& rt_;
  SplitPartials* partials_;
  const int D_;
  std::vector<float> q_, k_, v_;  // converted tiles (fp16 / bf16 inputs, or fp32 with huge strides)
  std::vector<float> s_;          // (block_q, block_kv) scores, then probabilities
  std::vector<float> o_;          // (block_q, D) unnormalised output
  std::vector<float> m_, l_;      // (block_q) running maximum and sum
  std::vector<KeyRange> row_keys_;
  std::vector<int> row_segment_;  // (block_q) the rows' segment ids (with segments)
  std::vector<cpu::TensorRow> row_tensors_;  // (block_q) the rows' bias and mask entries (with those tensors)
  cpu::RowSegments segments_;     // the current unit's batch row
};

template <CpuElement E>
void run(const AttentionParams& p, int block_q, int block_kv, const CpuRuntime& rt) {
  const int workers = std::max(1, rt.num_threads);
  const WorkPlan plan(p, block_q, block_kv, workers);
  std::unique_ptr<SplitPartials> partials;
  if (plan.splits() > 1) partials = std::make_unique<SplitPartials>(plan, p.head_dim);
  cpu::parallel_for(plan.num_items(), workers, rt.schedule, [&]() -> cpu::ItemFn {
    auto worker = std::make_shared<TileWorker<E>>(p, plan, rt, partials.get());
    return [worker](int64_t item) { (*worker)(item); };
  });
}

}  // namespace

void attention_cpu(const AttentionParams& params, CpuElement element, int block_q, int block_kv,
                   const CpuRuntime& runtime) {
  switch (element) {
    case CpuElement::kFloat16: return run<CpuElement::kFloat16>(params, block_q, block_kv, runtime);
    case CpuElement::kBFloat16: return run<CpuElement::kBFloat16>(params, block_q, block_kv, runtime);
    case CpuElement::kFloat32: return run<CpuElement::kFloat32>(params, block_q, block_kv, runtime);
  }
}

}  // namespace jax_flash
