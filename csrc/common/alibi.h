// ALiBi from slopes (AttentionParams::alibi): the bias of query row i and key j of batch row b and query head h is
// -slope[b, h] * |i + kv_len - q_len - j|, FlashAttention's alibi_slopes: zero on the bottom-right diagonal that
// causal masking uses (with the row's q_lengths / kv_lengths), falling linearly with the distance on both sides.
// Host and device code (the CPU path and both GPU families compute it per score instead of loading a bias tensor).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "common/visibility.h"

namespace jax_flash {

// The slope of (batch, query head): bias[b * s0 + h * s1] (s0 = 0 for slopes shared by the batch); read-only
// cached on the GPU.
JAX_FLASH_HOST_DEVICE float alibi_slope(const AttentionParams& p, int64_t batch, int64_t head) {
  const float* slope = p.bias + batch * p.bias_strides[0] + head * p.bias_strides[1];
#ifdef __CUDA_ARCH__
  return __ldg(slope);
#else
  return *slope;
#endif
}

// Query row `row`'s diagonal key, row + kv_len - q_len, as a float: the kernels take |diagonal - key| per score as
// one FADD from a float key index (exact below 2^24 keys; beyond, the distance keeps float32's relative precision)
// where an integer difference would need a conversion per score (MUFU-rate on the GPU, beside the exponentials).
JAX_FLASH_HOST_DEVICE float alibi_diagonal(int row, BatchLengths len) {
  return static_cast<float>(int64_t{row} + len.kv_len - len.q_len);
}

}  // namespace jax_flash
