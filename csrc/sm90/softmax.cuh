// Online softmax for one consumer warp's 16 rows of the wgmma accumulators, split so the O rescale can wait:
// with the intra-warpgroup overlap, O += P_{j-1} V_{j-1} is still running on the tensor cores while the softmax of
// S_j runs, so update_max() only returns each row's factor alpha = exp(m_old - m_new) (and whether it is needed) and
// rescale() applies it to O once that product has completed.
// Fragment layout (per warp, the mma.sync m16n8 layout repeated): element e of n-tile n is row lane/4 + 8*(e/2),
// column 8n + 2*(lane%4) + e%2; the four lanes of a quad share a row (reductions by shfl_xor 1 and 2).
#pragma once

#include <cmath>

#include "common/fragment_ops.cuh"  // exp2_approx
#include "common/row_reduce.cuh"    // quad_max, quad_sum, row_half_max, row_half_sum

namespace jax_flash::sm90 {

// kPOffsetLog2: P = exp2(S * scale_log2 - m * scale_log2 + kPOffsetLog2), so its largest entry is 2^kPOffsetLog2
// (FP8: 2^8 of e4m3's 448, which keeps entries down to 2^-9 / 2^8 of the maximum from flushing to zero); the row
// sums carry the factor and cancel it in O / l, and row_lse() takes it out.
template <int kSTiles, int kOTiles, int kPOffsetLog2 = 0>
struct SplitSoftmax {
  float row_max[2] = {-INFINITY, -INFINITY};  // raw score units (the scale is applied inside exp2)
  float row_sum[2] = {0.0f, 0.0f};            // this thread's partial sums until finalize()
  // Independent partial max / sum chains per row half (common/row_reduce.cuh): 4, but 2 for 192-key blocks, where the
  // extra partials made the soft-capped variant spill.
  static constexpr int kChains = kSTiles > 16 ? 2 : 4;

  // One key block's update in two halves (the kernel may take a pingpong turn between them): update_max() moves
  // the running maximum m and returns whether O must be rescaled by `alpha` (= exp2((m_old - m_new) * scale_log2)
  // per row half, the row sums already rescaled), the same answer on every lane of the warp; exponentiate() then
  // turns S into P = exp2(S * scale_log2 - m * scale_log2) in place and adds P's rows to the row sums.
  // Lazy rescale (FlashAttention-4): the running maximum m moves only when some row of the warp has grown by more
  // than max_growth (raw units, lazy_rescale_threshold: a factor 2^8 after exp2). Otherwise P is taken against the old
  // m, so its entries are <= 2^8 (exact enough in bf16 / fp16: the relative rounding is the same), the row sums and
  // O stay in fp32, and the O rescale (D / 2 FMUL per thread) and the alpha exponentials are skipped: after the
  // first key blocks the maximum of a row rarely grows that much. Needs scale_log2 > 0 (csrc/common/params.h).
  // kTiles: the n-tiles that hold this key block's scores (fewer than kSTiles when only the block's first keys were
  // computed: the kernel's narrow last key block); the others are ignored.
  template <int kTiles>
  __device__ __forceinline__ static const auto& first_tiles(const float (&acc_s)[1][kSTiles][4]) {
    static_assert(kTiles <= kSTiles);
    return *reinterpret_cast<const float(*)[kTiles][4]>(&acc_s[0][0][0]);
  }
  template <int kTiles = kSTiles>
  __device__ __forceinline__ bool update_max(const float (&acc_s)[1][kSTiles][4], float scale_log2, float max_growth,
                                             float (&alpha)[2]) {
    const auto& tiles = first_tiles<kTiles>(acc_s);
    float m_new[2];
    bool grows = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_new[h] = fmaxf(row_max[h], quad_max(row_half_max<kTiles, kChains>(tiles, h)));
      // true for a row's first finite maximum (-inf + max_growth is -inf); false while every score is masked
      grows |= !(m_new[h] <= row_max[h] + max_growth);
    }
    const bool rescale = __any_sync(0xffffffffu, grows);
    if (rescale) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // A row that has seen only masked (-inf) scores keeps m = -inf: exponentiate against 0 so nothing is NaN.
        alpha[h] = exp2_approx(row_max[h] * scale_log2 - (m_new[h] == -INFINITY ? 0.0f : m_new[h]) * scale_log2);
        row_max[h] = m_new[h];
        row_sum[h] *= alpha[h];
      }
    }
    return rescale;
  }

  template <int kTiles = kSTiles>  // (as in update_max)
  __device__ __forceinline__ void exponentiate(float (&acc_s)[1][kSTiles][4], float scale_log2) {
    static_assert(kTiles <= kSTiles);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_scaled = offset((row_max[h] == -INFINITY ? 0.0f : row_max[h]) * scale_log2);
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          acc_s[0][n][e] = exp2_approx(fmaf(acc_s[0][n][e], scale_log2, -m_scaled));
        }
      }
      row_sum[h] += row_half_sum<kTiles, kChains>(first_tiles<kTiles>(acc_s), h);
    }
  }

  // exponentiate(), with P handed on as it is made: after the exponentials of n-tiles 2t and 2t + 1 (both row
  // halves), pack_step(t) packs k16 step t (the caller's wgmma A fragments), so the conversions run among the
  // exponentials instead of after them (Variant::kPackInExp). The same values and row sums as exponentiate().
  // kStepTiles: the n-tiles of one k step (2 for k16, 4 for FP8's k32).
  template <int kTiles = kSTiles, int kStepTiles = 2, class PackStep>
  __device__ __forceinline__ void exponentiate_packed(float (&acc_s)[1][kSTiles][4], float scale_log2,
                                                      PackStep&& pack_step) {
    static_assert(kTiles <= kSTiles && kTiles % kStepTiles == 0);
    float m_scaled[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) m_scaled[h] = offset((row_max[h] == -INFINITY ? 0.0f : row_max[h]) * scale_log2);
#pragma unroll
    for (int t = 0; t < kTiles / kStepTiles; ++t) {
#pragma unroll
      for (int n = kStepTiles * t; n < kStepTiles * t + kStepTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][n][e] = exp2_approx(fmaf(acc_s[0][n][e], scale_log2, -m_scaled[e / 2]));
      pack_step(t);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] += row_half_sum<kTiles, kChains>(first_tiles<kTiles>(acc_s), h);
  }

  __device__ __forceinline__ static void rescale(float (&acc_o)[1][kOTiles][4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < kOTiles; ++n) {
      acc_o[0][n][0] *= alpha[0];
      acc_o[0][n][1] *= alpha[0];
      acc_o[0][n][2] *= alpha[1];
      acc_o[0][n][3] *= alpha[1];
    }
  }

  // finalize() with less work per tile (Variant::kFastEpilogue): 1 / l by one MUFU.RCP (l >= 1
  // for a row that saw a key: the entry that set its maximum counts 2^0, and l is rescaled with the maximum), the
  // row selects only when some row of the warp is past the valid rows (`warp_all_valid`, the same on every lane),
  // and no lse here: row_lse() gives it from the returned row sums l, for the calls that ask for it.
  __device__ __forceinline__ void finalize_fast(float (&acc_o)[1][kOTiles][4], const bool (&row_valid)[2],
                                                bool warp_all_valid, float (&l)[2]) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = quad_sum(row_sum[h]);
      float r;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(l[h]));
      inv[h] = l[h] > 0.0f ? r : 0.0f;
    }
    if (warp_all_valid) {
#pragma unroll
      for (int n = 0; n < kOTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][n][e] *= inv[e / 2];
    } else {
#pragma unroll
      for (int n = 0; n < kOTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[0][n][e] = row_valid[e / 2] ? acc_o[0][n][e] * inv[e / 2] : 0.0f;
    }
  }
  // Row half h's natural-log log-sum-exp of the scaled scores from its row sum l (finalize_fast); -inf for a row
  // that saw no key (l = 0), NaN for one whose sum is NaN (a NaN or +inf score).
  __device__ __forceinline__ float row_lse(int h, float l, float scale) const {
    if constexpr (kPOffsetLog2 != 0) {
      return l != 0.0f ? row_max[h] * scale + (logf(l) - kPOffsetLog2 * 0.6931471805599453f) : -INFINITY;
    }
    return l != 0.0f ? row_max[h] * scale + logf(l) : -INFINITY;
  }

 private:
  // m * scale_log2 less the offset (kPOffsetLog2 = 0: unchanged)
  __device__ __forceinline__ static float offset(float m_scaled) {
    if constexpr (kPOffsetLog2 != 0) return m_scaled - kPOffsetLog2;
    return m_scaled;
  }

 public:

  // The epilogue's O = O / l, with zeros for a row that saw no key (l = 0) and for row half h when !row_valid[h]
  // (rows past the batch entry's query length, whose scores may hold anything: a select, not a multiply by 0), and
  // each row half's natural-log log-sum-exp of the scaled scores (-inf for a row that saw no key).
  __device__ __forceinline__ void finalize(float (&acc_o)[1][kOTiles][4], const bool (&row_valid)[2], float scale,
                                           float (&lse)[2]) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(row_sum[h]);
      inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
      lse[h] = row_lse(h, l, scale);
    }
#pragma unroll
    for (int n = 0; n < kOTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][n][e] = row_valid[e / 2] ? acc_o[0][n][e] * inv[e / 2] : 0.0f;
  }
};

}  // namespace jax_flash::sm90
