// CPU attention forward: the same blocked online-softmax algorithm as the GPU kernels, in fp32.
// Memory per work item is O(block_q * (block_kv + D)), never O(Sq * Sk).
#pragma once

#include "common/params.h"

namespace jax_flash {

enum class CpuElement { kFloat16, kBFloat16, kFloat32 };

// Computes params.o from params.q/k/v. Work items (batch, head, query block) run on up to `num_threads` threads.
void attention_cpu(const AttentionParams& params, CpuElement element, int block_q, int block_kv, int num_threads);

}  // namespace jax_flash
