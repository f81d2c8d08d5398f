// CPU attention backward: dq, dk, dv from the forward's q, k, v, out, lse and the cotangents of out and lse, by the
// blocked algorithm of FlashAttention-2's backward in fp32 with OpenBLAS products. Memory is O(S * D) per worker,
// never O(Sq * Sk); the result is the same bit for bit on every run (a fixed plan, sums in a fixed order).
#pragma once

#include "common/params.h"
#include "cpu/attention_cpu.h"

namespace jax_flash {

// The backward's tensors beside AttentionParams' q, k, v: out and d_out, dq like q (B, Sq, Hq, D); dk, dv like k
// (B, Sk, Hk, D); lse and d_lse float32 (B, Hq, Sq) (d_lse nullptr: zero).
struct BackwardTensors {
  const void* out;
  const void* d_out;
  const float* lse;
  const float* d_lse;
  void* dq;
  void* dk;
  void* dv;
};

// Writes every element of dq, dk and dv. Tiles of block_q query rows and block_kv keys (clamped to the lengths).
void attention_bwd_cpu(const AttentionParams& params, const BackwardTensors& tensors, CpuElement element, int block_q,
                       int block_kv, const CpuRuntime& runtime);

}  // namespace jax_flash
