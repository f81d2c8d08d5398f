// The consumers' turns (pingpong) and their named barriers. Named barrier 0 is __syncthreads; ids 1 .. kConsumers
// are each consumer warpgroup's own (128 threads: P staged in shared memory, the epilogue, the split tail); the turn
// rings follow, then the two that hand the tile's final K / V stage to the epilogue (T::kOInKV).
//
// The consumers take turns issuing their products in a ring: consumer c waits on barrier kTurnBarrier + c, then
// hands the turn to consumer (c + 1) % kConsumers, so one warpgroup's softmax runs while another's products occupy
// the tensor cores. The last consumer hands on once before anyone issues, so it hands on once more than consumer 0
// waits inside the loop: consumer 0 takes that last turn after the loop (finish), and no arrival is left pending
// when the block exits. Every consumer takes the same turns (one per product group of each tile, idle ones
// included), so the ring never waits on a consumer that has left.
#pragma once

#include "sm90/ptx.cuh"

namespace jax_flash::sm90 {

// Barrier id of consumer warpgroup c's own 128 threads.
__device__ __forceinline__ void sync_consumer(int consumer) { named_barrier_sync(1 + consumer, 128); }

// T::kOInKV (two consumers): consumer 1 has read the tile's final K, where consumer 0 stages its O; consumer 0 has
// passed that barrier and its last P V is done, so consumer 1 may stage its O in the final V. (Consumer 0 arrives on
// the second only after the first has completed, so neither consumer can arrive twice on one of them.)
template <class T>
inline constexpr int kLastKReadBarrier = 1 + 3 * T::kConsumers;
template <class T>
inline constexpr int kLastVReadBarrier = 2 + 3 * T::kConsumers;

template <class T, class V>
struct Turns {
  static constexpr int kTurnBarrier = 1 + T::kConsumers;
  // V::kExpTurns: a second ring around the exponentials, beside the first one on the product issue. ptxas moves
  // register-only instructions across bar.sync / bar.arrive, so what the turn covers is its choice (in the measured
  // build the scaling FFMAs and the first exponentials).
  static constexpr int kExpBarrier = kTurnBarrier + T::kConsumers;
  int consumer;

  __device__ __forceinline__ void start() const {
    if constexpr (V::kExpTurns) {
      if (consumer == T::kConsumers - 1) named_barrier_arrive(kExpBarrier, 256);
    }
    if constexpr (T::kPingpong) {
      if (consumer == T::kConsumers - 1) named_barrier_arrive(kTurnBarrier, 256);  // consumer 0 goes first
    }
  }
  __device__ __forceinline__ void wait() const {
    if constexpr (T::kPingpong) named_barrier_sync(kTurnBarrier + consumer, 256);
  }
  __device__ __forceinline__ void pass() const {
    if constexpr (T::kPingpong) named_barrier_arrive(kTurnBarrier + (consumer + 1) % T::kConsumers, 256);
  }
  __device__ __forceinline__ void wait_exp() const {
    if constexpr (V::kExpTurns) named_barrier_sync(kExpBarrier + consumer, 256);
  }
  __device__ __forceinline__ void pass_exp() const {
    if constexpr (V::kExpTurns) named_barrier_arrive(kExpBarrier + (consumer + 1) % T::kConsumers, 256);
  }
  __device__ __forceinline__ void finish() const {  // the last consumer's last hand-overs
    if constexpr (T::kPingpong) {
      if (consumer == 0) named_barrier_sync(kTurnBarrier, 256);
    }
    if constexpr (V::kExpTurns) {
      if (consumer == 0) named_barrier_sync(kExpBarrier, 256);
    }
  }
};

}  // namespace jax_flash::sm90
