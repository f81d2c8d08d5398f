// The sm90 tile scheduler's counters, one pair per (device, stream), kept for the life of the process.
//
// The kernel draws tiles from word 0 and counts finished blocks in word 1; its last block zeroes both
// (csrc/common/params.h), so a pair that starts zero serves every later launch on its stream: launches on one
// stream run one after another, launches on different streams get different pairs. That saves the memset that
// otherwise precedes each launch (3-5 us per call on the H200, docs/NOTES.md session 11).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace jax_flash {

// Sets *counter to the zeroed two-word pair of (the current device, stream), allocating it (cudaMalloc, then a
// cudaMemsetAsync on `stream`) on the stream's first launch. Returns "" on success, else what failed (the caller
// can fall back to memory of its own, zeroed before the launch).
std::string stream_tile_counter(cudaStream_t stream, unsigned long long** counter);

}  // namespace jax_flash
