// The sm90-family attention forward kernel: warp-specialised, wgmma for both products, TMA loads and stores.
// Persistent thread blocks of kNumThreads threads (at most one per SM) walk tiles of kBlockQ = 64 * kConsumers query
// rows (tile_scheduler.cuh). Warpgroup 0 is the producer (producer.cuh: TMA copies of Q, K and V into shared
// memory; with FP8 inputs its warps 1-3 write V^T from each V block, v_transpose.cuh), warpgroups 1 .. kConsumers
// the consumers (consumer.cuh: the products, the softmax and the epilogue);
// setmaxnreg moves most of the producer's registers to them. Shared memory: SharedStorage (shared_storage.cuh).
#pragma once

#include <cstdint>

#include "common/params.h"
#include "sm90/consumer.cuh"
#include "sm90/producer.cuh"
#include "sm90/ptx.cuh"
#include "sm90/traits.cuh"
#include "sm90/v_transpose.cuh"

namespace jax_flash::sm90 {

// The mbarriers' arrival counts, set once by thread 0 before any role starts.
template <class T>
__device__ __forceinline__ void init_barriers(SmemView<T> s) {
  for (int b = 0; b < T::kQBuffers; ++b) {
    mbarrier_init(s.q_full(b), 1);
    mbarrier_init(s.q_empty(b), T::kConsumers * 128);  // every consumer thread releases Q after its last Q K^T
  }
  for (int st = 0; st < T::kStages; ++st) {
    mbarrier_init(s.k_full(st), 1);
    // (FP8: the V^T stage is written by the transposing threads, each arriving once it has fenced its stores)
    mbarrier_init(s.v_full(st), T::kFp8 ? kVTransposeThreads : 1);
    // every consumer thread releases the stage's K, and later its V (T::kOInKV: a consumer whose O the stage holds,
    // one thread for all 128 once the TMA store has read it)
    mbarrier_init(s.k_empty(st), T::kConsumers * 128);
    mbarrier_init(s.v_empty(st), T::kConsumers * 128);
  }
  for (int slot = 0; slot < 2; ++slot) {
    mbarrier_init(s.sched_full(slot), 1);
    mbarrier_init(s.sched_empty(slot), T::kConsumers * 128);
  }
  if constexpr (T::kFp8) {
    for (int b = 0; b < T::kVRawBuffers; ++b) {
      mbarrier_init(&s.vraw_state()->full[b], 1);
      mbarrier_init(&s.vraw_state()->empty[b], kVTransposeThreads);
    }
    s.vraw_state()->done = 0;
  }
  fence_barrier_init();
}

// kMaskBlocks: some key block may be partly invisible (causal, window, kv_lengths, or seqlen_k not a multiple of
// kBlockKV); false compiles the mask out. kHasSoftcap: s = softcap * tanh(s * scale / softcap). kSplitPaged: split
// key ranges (p.num_splits > 1), paged K/V (p.page_table), packed GQA (p.pack_gqa > 1) or segment ids; kTensors
// (with kSplitPaged): bias or mask tensors. num_tiles: batch x head units (query heads, or kv heads when packed) x
// query blocks x ranges.
template <class T, bool kMaskBlocks, bool kHasSoftcap, bool kSplitPaged = false, bool kTensors = false>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    attention_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ CUtensorMap tma_q,
                     const __grid_constant__ CUtensorMap tma_k, const __grid_constant__ CUtensorMap tma_v,
                     const __grid_constant__ CUtensorMap tma_o, int64_t num_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using V = Variant<T, kMaskBlocks, kHasSoftcap, kSplitPaged, kTensors>;
  extern __shared__ char smem_raw[];
  // The 128-byte swizzle is a function of address bits 4-9: tiles must start on 1024-byte boundaries.
  constexpr uint32_t kMask = kSmemAlignSlack - 1;
  char* smem = smem_raw + ((kSmemAlignSlack - (smem_address(smem_raw) & kMask)) & kMask);
  const SmemView<T> s{smem};
  const int tid = threadIdx.x;
  if (tid == 0) init_barriers<T>(s);
  __syncthreads();
  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    if constexpr (T::kFp8) {  // warps 1-3: FP8's V^T (v_transpose.cuh)
      if (tid >= 32) {
        VTransposer<T, V>{s}.run();
        return;
      }
    }
    if constexpr (Producer<T, V>::kWarp) {  // (paged calls of boxes under 64 rows: warp 0, Producer::lanes_for)
      if (Producer<T, V>::lanes_for(p)) {
        if (tid < 32) Producer<T, V, true>{p, s, tma_q, tma_k, tma_v}.run(num_tiles);
        return;
      }
    }
    if (tid == 0) Producer<T, V>{p, s, tma_q, tma_k, tma_v}.run(num_tiles);
    return;
  }
  run_consumer<T, V>(p, s, tma_o, warpgroup, tid);
#endif
}

}  // namespace jax_flash::sm90
