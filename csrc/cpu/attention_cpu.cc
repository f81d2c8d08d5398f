// CPU attention forward (see attention_cpu.h). One work item = one (batch, query head, query block); per visible key
// block:  S = scale * Q K^T (softcap: c tanh(S / c)), masked to each row's visible keys ;
//   m_new = max(m, rowmax(S)) ; P = exp(S - m_new) ; l = exp(m - m_new) l + rowsum(P) ; O = diag(exp(m - m_new)) O + P V
// and at the end O = O / l, lse = m + log(l) (rows that see no key: zeros, lse = -inf).
#include "cpu/attention_cpu.h"

#include "common/visibility.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace jax_flash {
namespace {

// ---- element conversions (fp16 and bf16 stored as uint16_t) ----------------------------------------------------
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;       // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;      // rounds to >= 65520: infinity
  if (abs_bits < 0x38800000u) {                            // below 2^-14: subnormal half (or zero)
    float a;
    std::memcpy(&a, &abs_bits, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));  // units of 2^-24, ties to even
  }
  // Normal: re-bias exponent, round mantissa from 23 to 10 bits, ties to even (a carry may bump the exponent).
  uint32_t h = ((abs_bits >> 13) - (112u << 10));
  const uint32_t rest = abs_bits & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

template <CpuElement E>
struct Element;
template <>
struct Element<CpuElement::kFloat32> {
  using Storage = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <>
struct Element<CpuElement::kFloat16> {
  using Storage = uint16_t;
  static float load(uint16_t x) { return fp16_to_float(x); }
  static uint16_t store(float x) { return float_to_fp16(x); }
};
template <>
struct Element<CpuElement::kBFloat16> {
  using Storage = uint16_t;
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
};

// Scratch of one worker: the fp32 tiles of one work item.
struct Tiles {
  std::vector<float> q;          // (block_q, D), pre-scaled by `scale`
  std::vector<float> k, v;       // (block_kv, D)
  std::vector<float> s;          // (block_q, block_kv) scores, then probabilities
  std::vector<float> acc_o;      // (block_q, D)
  std::vector<float> row_max;    // (block_q)
  std::vector<float> row_sum;    // (block_q)
  std::vector<KeyRange> keys;    // (block_q) visible keys of each row
};

template <CpuElement E>
void attention_block(const AttentionParams& p, int block_q, int block_kv, int64_t item, Tiles& t) {
  using Traits = Element<E>;
  using T = typename Traits::Storage;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int D = p.head_dim;
  const int64_t q_block = item % p.num_q_blocks;
  const int64_t bh = item / p.num_q_blocks;
  const int64_t head = bh % p.heads_q;
  const int64_t batch = bh / p.heads_q;
  const int64_t kv_head = head / p.q_heads_per_kv_head;
  const int row0 = static_cast<int>(q_block) * block_q;
  const int rows = std::min(block_q, p.seqlen_q - row0);
  const BatchLengths len = batch_lengths(p, batch);
  const KeySpan block_keys = visible_keys_of_rows(p, len, row0, row0 + rows);
  const bool softcap = p.softcap > 0.0f;

  const T* gQ = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
  const T* gK = static_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  const T* gV = static_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
  T* gO = static_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;

  for (int r = 0; r < rows; ++r) {
    const T* src = gQ + (row0 + r) * p.q_seq_stride;
    const float qscale = softcap ? p.softcap_scale : p.scale;  // softcap: s = c tanh(q.k * scale / c)
    for (int d = 0; d < D; ++d) t.q.data()[r * D + d] = Traits::load(src[d]) * qscale;
    t.keys[r] = visible_keys(p, len, row0 + r);
  }
  std::fill(t.acc_o.begin(), t.acc_o.begin() + static_cast<size_t>(rows) * D, 0.0f);
  std::fill(t.row_max.begin(), t.row_max.begin() + rows, kNegInf);
  std::fill(t.row_sum.begin(), t.row_sum.begin() + rows, 0.0f);

  // Only key blocks that some row of this block can see (causal and windows skip the rest).
  const int first_block_col = (block_keys.begin / block_kv) * block_kv;
  for (int col0 = first_block_col; col0 < block_keys.end; col0 += block_kv) {
    const int cols = std::min(block_kv, p.seqlen_k - col0);
    for (int c = 0; c < cols; ++c) {
      const T* k_src = gK + (col0 + c) * p.k_seq_stride;
      const T* v_src = gV + (col0 + c) * p.v_seq_stride;
      for (int d = 0; d < D; ++d) {
        t.k.data()[c * D + d] = Traits::load(k_src[d]);
        t.v.data()[c * D + d] = Traits::load(v_src[d]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const KeyRange keys = t.keys[r];
      // Columns of this block the row sees: [c_begin, c_end).
      const int c_begin = std::max(keys.first - col0, 0);
      const int c_end = std::min(keys.last + 1 - col0, cols);
      if (c_begin >= c_end) continue;
      const float* q_row = t.q.data() + r * D;  // (data(): the tiles are empty at head dim 0)
      float* s_row = &t.s[r * block_kv];
      float block_max = kNegInf;
      for (int c = c_begin; c < c_end; ++c) {  // S = scale Q K^T (softcap: c tanh(S / c))
        const float* k_row = t.k.data() + c * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q_row[d] * k_row[d];
        if (softcap) dot = p.softcap * std::tanh(dot);
        s_row[c] = dot;
        block_max = std::max(block_max, dot);
      }
      const float m_new = std::max(t.row_max[r], block_max);
      const float alpha = std::exp(t.row_max[r] - m_new);  // exp(-inf) = 0 on the first visible block
      float block_sum = 0.0f;
      for (int c = c_begin; c < c_end; ++c) {  // P = exp(S - m_new)
        s_row[c] = std::exp(s_row[c] - m_new);
        block_sum += s_row[c];
      }
      t.row_sum[r] = alpha * t.row_sum[r] + block_sum;
      t.row_max[r] = m_new;
      float* o_row = t.acc_o.data() + r * D;
      for (int d = 0; d < D; ++d) o_row[d] *= alpha;  // O = diag(alpha) O + P V
      for (int c = c_begin; c < c_end; ++c) {
        const float pc = s_row[c];
        const float* v_row = t.v.data() + c * D;
        for (int d = 0; d < D; ++d) o_row[d] += pc * v_row[d];
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    // A row that saw no key (l = 0): zeros and lse = -inf. A NaN l (a NaN or +inf score) stays NaN in O and lse.
    const bool seen = t.row_sum[r] != 0.0f;
    const float inv = seen ? 1.0f / t.row_sum[r] : 0.0f;
    T* dst = gO + (row0 + r) * p.o_seq_stride;
    for (int d = 0; d < D; ++d) dst[d] = Traits::store(t.acc_o.data()[r * D + d] * inv);
    if (p.lse != nullptr) {
      p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + row0 + r] =
          seen ? t.row_max[r] + std::log(t.row_sum[r]) : kNegInf;
    }
  }
}

template <CpuElement E>
void run(const AttentionParams& p, int block_q, int block_kv, int num_threads) {
  const int64_t num_items = static_cast<int64_t>(p.batch) * p.heads_q * p.num_q_blocks;
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Tiles t;
    const size_t D = static_cast<size_t>(p.head_dim);
    t.q.resize(block_q * D);
    t.k.resize(block_kv * D);
    t.v.resize(block_kv * D);
    t.s.resize(static_cast<size_t>(block_q) * block_kv);
    t.acc_o.resize(block_q * D);
    t.row_max.resize(block_q);
    t.row_sum.resize(block_q);
    t.keys.resize(block_q);
    for (int64_t item = next++; item < num_items; item = next++) attention_block<E>(p, block_q, block_kv, item, t);
  };
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_items)));
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace

void attention_cpu(const AttentionParams& params, CpuElement element, int block_q, int block_kv, int num_threads) {
  AttentionParams p = params;
  // Tiles no larger than the sequences: each worker's scratch is (2 block_q + 2 block_kv) x D floats, so it stays
  // proportional to the work (one query row against one key at a huge head dim needs no 64-row tiles).
  block_q = std::max(1, std::min(block_q, p.seqlen_q));
  block_kv = std::max(1, std::min(block_kv, p.seqlen_k));
  p.num_q_blocks = (p.seqlen_q + block_q - 1) / block_q;
  switch (element) {
    case CpuElement::kFloat16: return run<CpuElement::kFloat16>(p, block_q, block_kv, num_threads);
    case CpuElement::kBFloat16: return run<CpuElement::kBFloat16>(p, block_q, block_kv, num_threads);
    case CpuElement::kFloat32: return run<CpuElement::kFloat32>(p, block_q, block_kv, num_threads);
  }
}

}  // namespace jax_flash
