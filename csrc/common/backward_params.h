// Runtime arguments of one attention backward beside AttentionParams (q, k, v, the features, with o = the forward's
// output), shared by the CPU implementation and the GPU kernels.
#pragma once

#include "common/params.h"

namespace jax_flash {

// The backward's tensors: out and d_out, dq like q (B, Sq, Hq, D); dk, dv like k (B, Sk, Hk, D); lse and d_lse
// float32 (B, Hq, Sq) (d_lse nullptr: zero). All contiguous.
struct BackwardTensors {
  const void* out;
  const void* d_out;
  const float* lse;
  const float* d_lse;
  void* dq;
  void* dk;
  void* dv;
};

// The GPU backward's launch arguments: the forward's params, the tensors, and float32 scratch from the caller:
//   dq_accum (B, Sq, Hq, D): dQ summed over key blocks (atomics), converted to the input dtype at the end;
//   delta (B, Hq, Sq): rowsum(dO o O) - d_lse, the softmax-gradient term of every row;
//   dq_turns (B, Hq, ceil(Sq / 64)) int32, or nullptr: deterministic dQ (common/backward_rows.cuh, DQTurn): the key
//   blocks that see a query block add their dQ shares one after another in key-block order, with plain loads and
//   stores, instead of float atomics in whatever order they arrive.
struct BackwardParams {
  AttentionParams p;
  BackwardTensors t;
  float* dq_accum;
  float* delta;
  int* dq_turns;
  int64_t dq_turn_count;  // B * Hq * ceil(Sq / 64): zeroed by the preprocess
  // The sm90 family's row statistics, written by the preprocess (nullptr for the sm80 family): lse2 = lse log2(e)
  // (+inf past q_len) and delta times the softmax scale (delta itself with a softcap), each (B, Hq, stats_rows) with
  // the rows padded (+inf and 0, padded_stats_rows) so that a query block's are one aligned bulk copy; lse2 first.
  float* row_stats;
  int64_t stats_rows;
};

// BackwardParams::stats_rows for Sq query rows: whole query blocks of every sm90 backward tile (64, 80 or 128 rows),
// so a block's bulk copy reads no row of the next (batch, head); a multiple of 16 (the copies' 16-byte alignment).
inline constexpr int64_t padded_stats_rows(int64_t seqlen_q) {
  const int64_t by128 = (seqlen_q + 127) / 128 * 128, by80 = (seqlen_q + 79) / 80 * 80;
  return by128 > by80 ? by128 : by80;
}

inline constexpr int kDQTurnRows = 64;  // dq_turns holds one counter per 64 query rows (the smallest block_q)

// The block-skipping scratch of a backward with segment ids or a mask tensor (common/backward_blocks.cuh) is sized
// for tiles of kBackwardBlockMin query rows and keys, at least as many tiles as either family's backward makes (64 or
// 128 query rows, 64 or 128 keys).
inline constexpr int kBackwardBlockMin = 64;

// What a backward kernel variant tests per score beyond the lengths, window and causal mask: nothing; segment ids
// alone (a packed row: no bias, mask tensor or ALiBi state in the kernel); or any of segment ids, bias and mask
// tensors and ALiBi slopes.
enum class BwdTensors : int { kNone = 0, kSegments = 1, kAny = 2 };

}  // namespace jax_flash
