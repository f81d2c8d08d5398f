// How the producer and the consumers count through the shared-memory pipelines: key block j of a tile is pipeline
// step `it` (counted over all of a block's tiles); it lives in K/V stage it % kStages, filled for the
// (it / kStages)-th time, so that fill completes the stage barriers' phase of parity (it / kStages) & 1. Likewise the
// block's loaded tile number t (tiles with nothing to load are not counted) uses Q buffer t % kQBuffers.
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

template <class T, class V>
struct Pipeline {
  // (unsigned where the early K / V tests run: the step counter may be tested one step ahead)
  __device__ __forceinline__ static int stage_of(int it) {
    if constexpr (V::kEarlyTest) return static_cast<int>(static_cast<uint32_t>(it) % T::kStages);
    return it % T::kStages;
  }
  __device__ __forceinline__ static uint32_t parity_of(int it) {
    if constexpr (V::kEarlyTest) return (static_cast<uint32_t>(it) / T::kStages) & 1;
    return static_cast<uint32_t>((it / T::kStages) & 1);
  }
  __device__ __forceinline__ static int q_buffer_of(int t) { return t % T::kQBuffers; }
  __device__ __forceinline__ static uint32_t q_parity_of(int t) {
    return static_cast<uint32_t>((t / T::kQBuffers) & 1);
  }
  // FP8: the raw V buffer of key-block step `step` (v_transpose.cuh), used in turn, and the phase of its barriers
  __device__ __forceinline__ static int vraw_buffer_of(int step) { return step % T::kVRawBuffers; }
  __device__ __forceinline__ static uint32_t vraw_parity_of(int step) {
    return static_cast<uint32_t>((step / T::kVRawBuffers) & 1);
  }
};

}  // namespace jax_flash::sm90
