// CPU attention backward: dq, dk, dv from the forward's q, k, v, out, lse and the cotangents of out and lse, by the
// blocked algorithm of FlashAttention-2's backward in fp32 with OpenBLAS products. Memory is O(S * D) per worker,
// never O(Sq * Sk); the result is the same bit for bit on every run (a fixed plan, sums in a fixed order).
#pragma once

#include "common/backward_params.h"
#include "common/params.h"
#include "cpu/attention_cpu.h"

namespace jax_flash {

// Writes every element of dq, dk and dv. Tiles of block_q query rows and block_kv keys (clamped to the lengths).
void attention_bwd_cpu(const AttentionParams& params, const BackwardTensors& tensors, CpuElement element, int block_q,
                       int block_kv, const CpuRuntime& runtime);

}  // namespace jax_flash
