// Row operations of the CPU attention (see vector_ops.h). Every loop body is branch-free scalar code (selects, bit
// casts, polynomial evaluation) that the compiler vectorises; sums keep 16 independent lanes so that no
// reassociation flag is needed. JAX_FLASH_CLONES compiles each function for AVX-512, AVX2 + FMA and the baseline,
// and the dynamic loader binds the best one the processor supports (GCC's target_clones, an ifunc): one portable
// binary, no -march=native.
#include "cpu/vector_ops.h"

#include <bit>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define JAX_FLASH_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAX_FLASH_CLONES
#endif
#define JAX_FLASH_INLINE inline __attribute__((always_inline))

namespace jax_flash::cpu {
namespace {

constexpr int kLanes = 16;  // one AVX-512 register of fp32, two AVX2 ones, four SSE ones
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) by range reduction x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial for exp(r) (the Cephes expf
// coefficients, <= 2 ulp). x < -87.34 (exp < 2^-126) gives 0; NaN stays NaN.
JAX_FLASH_INLINE float exp_poly(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;      // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;       // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const bool is_nan = x != x;
  const bool underflow = x < -87.33654f;
  float xc = underflow || is_nan ? -87.33654f : x;  // the integer conversion below sees finite values only
  xc = xc > 88.3762626f ? 88.3762626f : xc;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n by its exponent bits; n in [-126, 127] after the clamp.
  const float two_n = std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  const float e = underflow ? 0.0f : p * two_n;
  return is_nan ? x : e;
}

// tanh(x): x + x^3 P(x^2) for |x| < 0.625 (Cephes tanhf), else 1 - 2 / (exp(2|x|) + 1); the sign copied back.
JAX_FLASH_INLINE float tanh_poly(float x) {
  const uint32_t sign = std::bit_cast<uint32_t>(x) & 0x80000000u;
  const float z = std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0x7fffffffu);
  const float z2 = z * z;
  float p = -5.70498872745e-3f;
  p = p * z2 + 2.06390887954e-2f;
  p = p * z2 - 5.37397155531e-2f;
  p = p * z2 + 1.33314422036e-1f;
  p = p * z2 - 3.33332819422e-1f;
  const float small = p * z2 * z + z;
  const float large = 1.0f - 2.0f / (exp_poly(z + z) + 1.0f);
  const float t = z >= 0.625f ? large : small;  // NaN: the comparison fails and `small` carries the NaN
  return std::bit_cast<float>(std::bit_cast<uint32_t>(t) | sign);
}

JAX_FLASH_INLINE float fp16_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;                                  // exponent and mantissa
  uint32_t normal = (em << 13) + (112u << 23);                      // re-bias 15 -> 127
  normal = em >= 0x7c00u ? normal + (112u << 23) : normal;          // infinity / NaN: exponent 255
  // Subnormal half: mantissa * 2^-24, an exact product of normal floats (flush-to-zero cannot touch it).
  const float subnormal = static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f;
  const float magnitude = em < 0x400u ? subnormal : std::bit_cast<float>(normal);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
}

JAX_FLASH_INLINE uint16_t float_to_fp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t a = bits & 0x7fffffffu;
  // Normal half: re-bias the exponent, round the mantissa from 23 to 10 bits, ties to even (a carry may bump the
  // exponent, which is right).
  uint32_t normal = (a >> 13) - (112u << 10);
  const uint32_t rest = a & 0x1fffu;
  normal += (rest > 0x1000u || (rest == 0x1000u && (normal & 1u))) ? 1u : 0u;
  // Subnormal half (|f| < 2^-14): |f| in units of 2^-24, rounded to nearest even by the 2^23 trick.
  const float units = a < 0x38800000u ? std::bit_cast<float>(a) * 16777216.0f : 0.0f;  // < 2^10
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>((units + 8388608.0f) - 8388608.0f));
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a >= 0x477ff000u ? 0x7c00u : h;  // rounds to >= 65520: infinity
  h = a > 0x7f800000u ? 0x7e00u : h;   // NaN
  return static_cast<uint16_t>(h | sign);
}

JAX_FLASH_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // round to nearest even
  const uint32_t nan = (bits >> 16) | 0x40u;                                // quiet NaN
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace

JAX_FLASH_CLONES void widen_fp16(const uint16_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]) * scale;
}

JAX_FLASH_CLONES void widen_bf16(const uint16_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16) * scale;
}

JAX_FLASH_CLONES void widen_fp32(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

JAX_FLASH_CLONES void narrow_fp16(const float* src, uint16_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp16(src[i] * scale);
}

JAX_FLASH_CLONES void narrow_bf16(const float* src, uint16_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i] * scale);
}

JAX_FLASH_CLONES void narrow_fp32(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

// The maximum over integer keys: the key of a float orders like the float (-0 just below +0; a negative NaN below
// -inf, a positive one above +inf). Integer max reductions vectorise without flags; float ones need
// -ffinite-math-only, which would break the NaN handling.
JAX_FLASH_CLONES float row_max(const float* x, int64_t n) {
  const auto key = [](int32_t bits) { return bits ^ ((bits >> 31) & 0x7fffffff); };  // its own inverse
  int32_t m = key(std::bit_cast<int32_t>(kNegInf));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t k = key(std::bit_cast<int32_t>(x[i]));
    m = k > m ? k : m;
  }
  return std::bit_cast<float>(key(m));
}

JAX_FLASH_CLONES float exp_shifted_sum(float* x, int64_t n, float shift) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float e = exp_poly(x[i + j] - shift);
      x[i + j] = e;
      lanes[j] += e;
    }
  }
  float sum = 0.0f;
  for (; i < n; ++i) {
    x[i] = exp_poly(x[i] - shift);
    sum += x[i];
  }
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

JAX_FLASH_CLONES void softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * tanh_poly(x[i]);
}

JAX_FLASH_CLONES void scale(float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

}  // namespace jax_flash::cpu
