// CPU attention forward: the blocked online-softmax algorithm of the GPU kernels, with each score tile and each P V
// update an OpenBLAS product in fp32. Memory is O(workers * tile), never O(Sq * Sk).
#pragma once

#include "common/params.h"
#include "cpu/blas.h"
#include "cpu/parallel.h"

namespace jax_flash {

enum class CpuElement { kFloat16, kBFloat16, kFloat32 };

struct CpuRuntime {
  cpu::SgemmFn sgemm;        // row-major cblas_sgemm (cpu::openblas_sgemm() in the package)
  cpu::ScheduleFn schedule;  // hands a task to another thread (XLA's intra-op pool); empty: the caller does all
  int num_threads;           // workers, the caller included
};

// Computes params.o (and params.lse when set) from params.q/k/v with query tiles of block_q rows and key tiles of
// block_kv keys (both clamped to the sequence lengths, and smaller at very large head dims).
void attention_cpu(const AttentionParams& params, CpuElement element, int block_q, int block_kv,
                   const CpuRuntime& runtime);

}  // namespace jax_flash
