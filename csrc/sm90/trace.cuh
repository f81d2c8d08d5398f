// A timeline of one launch of the sm90 kernel, for diagnosis only: a build with -DJAX_FLASH_TRACE (the A/B harness,
// tools/ab/) records it; without the flag every call here is empty and the kernel's code is unchanged.
//
// Each role of each block (the producer's thread 0, lane 0 of each consumer's first warp) appends 16-byte records
// {event, tile or key block, SM clock} to its own row of a global buffer: row (blockIdx.x * kTraceRoles + role),
// kTraceRecords records per row (later records are dropped). The clock is the SM's cycle counter (%clock64), which
// all warps of a block share, so the events of one block's roles can be put on one time axis.
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

// What happened (the record's first word). Consumer events carry the key block j (or the tile number for the
// tile events) in the second word.
enum TraceEvent : uint32_t {
  kTraceTileStart = 1,   // consumer: the tile's slot read (after sched_full)
  kTraceQReady = 2,      // consumer: Q landed (and, with Q in registers, loaded into them)
  kTraceTurn = 3,        // consumer: a turn taken (the products about to be issued)
  kTraceSDone = 4,       // consumer: S = Q K^T complete
  kTraceSoftmaxDone = 5, // consumer: P computed (before waiting for the previous P V)
  kTracePVDone = 6,      // consumer: a P V complete
  kTraceKReady = 7,      // consumer: K (and V of the previous block) seen landed
  kTraceEpilogueDone = 8,// consumer: O stored (the TMA store issued)
  kTraceDrainTurn = 9,   // consumer: the turn of the tile's last P V taken
  kTraceProducerTile = 20,  // producer: a tile published
  kTraceProducerQ = 21,     // producer: Q's copy issued
  kTraceProducerK = 22,     // producer: K_j's copy issued (its stage was free)
  kTraceProducerV = 23,     // producer: V_j's copy issued
};

constexpr int kTraceRoles = 4;       // producer, up to three consumers
constexpr int kTraceRecords = 8192;  // per role and block

#ifdef JAX_FLASH_TRACE
// The buffer (gridDim.x * kTraceRoles * kTraceRecords records of 2 x uint64_t), set by the harness; null: no trace.
__device__ uint64_t* g_trace_buffer = nullptr;

struct Tracer {
  uint64_t* row = nullptr;
  int count = 0;
  bool on = false;
  __device__ __forceinline__ void start(int role, bool recording_thread) {
    on = recording_thread && g_trace_buffer != nullptr;
    row = g_trace_buffer + (static_cast<int64_t>(blockIdx.x) * kTraceRoles + role) * kTraceRecords * 2;
  }
  __device__ __forceinline__ void operator()(uint32_t event, int aux) {
    uint64_t clock;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(clock));
    if (on && count < kTraceRecords) {
      row[2 * count] = (uint64_t{event} << 32) | static_cast<uint32_t>(aux);
      row[2 * count + 1] = clock;
    }
    ++count;
  }
};
#else
// Without the flag every call is empty: the shipped kernels' code is unchanged.
struct Tracer {
  __device__ __forceinline__ void start(int, bool) {}
  __device__ __forceinline__ void operator()(uint32_t, int) {}
};
#endif

}  // namespace jax_flash::sm90
