// Row operations of the CPU attention on contiguous fp32 rows: conversions from and to fp16 / bf16, the exponentials
// and reductions of the online softmax, the softcap. Each is compiled for several x86 instruction sets (AVX-512,
// AVX2 + FMA, the SSE2 baseline) and the loader picks the best the processor has; other architectures get one
// version compiled for their baseline.
#pragma once

#include <cstdint>

namespace jax_flash::cpu {

// dst[i] = float(src[i]) * scale, for fp16 / bf16 stored as uint16_t, and for fp32.
void widen_fp16(const uint16_t* src, float* dst, int64_t n, float scale);
void widen_bf16(const uint16_t* src, float* dst, int64_t n, float scale);
void widen_fp32(const float* src, float* dst, int64_t n, float scale);

// dst[i] = round_to_nearest_even(src[i] * scale) in the storage type (NaN stays NaN, overflow gives infinity).
void narrow_fp16(const float* src, uint16_t* dst, int64_t n, float scale);
void narrow_bf16(const float* src, uint16_t* dst, int64_t n, float scale);
void narrow_fp32(const float* src, float* dst, int64_t n, float scale);

// max_i x[i] (-inf for n = 0; a NaN element may or may not be returned: it reaches the sum through exp anyway).
float row_max(const float* x, int64_t n);

// x[i] = exp(x[i] - shift) in place; returns the sum of the new x. Relative error of each exp <= 2 ulp; results
// below 2^-126 are 0 (as under XLA's flush-to-zero); NaN stays NaN.
float exp_shifted_sum(float* x, int64_t n, float shift);

// x[i] = cap * tanh(x[i]) in place (the softcap; absolute error of tanh <= 2^-23).
void softcap(float* x, int64_t n, float cap);

// x[i] *= a.
void scale(float* x, int64_t n, float a);

}  // namespace jax_flash::cpu
