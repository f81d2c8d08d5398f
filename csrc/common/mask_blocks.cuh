// Block skipping for mask tensors: a pre-pass records whether each (block_q x block_kv) tile of the mask holds a
// nonzero entry, and a tile of one query head walks only the key blocks whose mask tile does (sm80: VisibleBlocks,
// common/segment_blocks.cuh; sm90: the range from the first to the last such block, and the per-score test only on
// blocks whose mask tile holds a zero entry). A dense causal mask then costs about what causal=True costs, plus the
// per-score test.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "common/mask_blocks.h"
#include "common/params.h"

namespace jax_flash {

// One thread per (mask batch, mask head, query row, key block), key blocks fastest. Flags start at zero and every
// writer writes 1: mask_blocks where the row's block_kv entries hold a nonzero one, mask_partial (sm90) where they
// hold a zero one. mask_ranges (sm90): the query block's first and last key block with a nonzero entry, as
// atomicMax of (key_blocks - kb, kb + 1) from zero, one atomic pair per run of a warp's lanes on one query block.
static __global__ void mask_blocks_kernel(const AttentionParams p, MaskBlockShape shape, int block_q, int block_kv,
                                          int rows) {
  const int64_t item = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t row_items = int64_t{rows} * shape.key_blocks;
  if (item >= shape.batch * shape.heads * row_items) return;
  const int64_t bh = item / row_items;
  const int i = static_cast<int>((item % row_items) / shape.key_blocks);
  const int kb = static_cast<int>(item % shape.key_blocks);
  const int64_t b = bh / shape.heads, h = bh % shape.heads;
  const uint8_t* entries = p.mask + b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2];
  const int end = p.mask_strides[3] != 0 ? min(p.seqlen_k, (kb + 1) * block_kv) : kb * block_kv + 1;
  const bool want_all = p.mask_partial != nullptr;  // (else the scan stops at the first nonzero entry)
  bool any = false, all = true;
  for (int j = kb * block_kv; j < end && (!any || (want_all && all)); ++j) {
    const bool visible = __ldg(entries + j * p.mask_strides[3]) != 0;
    any |= visible;
    all &= visible;
  }
  const int64_t flag = shape.row(b, h, p.mask_strides[2] != 0 ? i / block_q : 0) + kb;
  if (any && p.mask_blocks != nullptr) p.mask_blocks[flag] = 1;
  if (!all && p.mask_partial != nullptr) p.mask_partial[flag] = 1;
  if (p.mask_ranges == nullptr) return;
  const int64_t q_block = flag / shape.key_blocks;  // (b, h, query block) of the mask
  const unsigned same = __match_any_sync(__activemask(), q_block);
  const int first = __reduce_max_sync(same, any ? shape.key_blocks - kb : 0);
  const int last = __reduce_max_sync(same, any ? kb + 1 : 0);
  if (first != 0 && static_cast<int>(threadIdx.x % 32) == __ffs(same) - 1) {
    atomicMax(p.mask_ranges + 2 * q_block, first);
    atomicMax(p.mask_ranges + 2 * q_block + 1, last);
  }
}

// Clears the flags and ranges and launches the pre-pass on `stream` when the call has any of them (else nothing).
inline std::string launch_mask_blocks(const AttentionParams& p, int block_q, int block_kv, cudaStream_t stream) {
  const bool wanted = p.mask_blocks != nullptr || p.mask_partial != nullptr || p.mask_ranges != nullptr;
  if (p.mask == nullptr || !wanted || p.seqlen_q == 0 || p.seqlen_k == 0) return {};
  const MaskBlockShape shape = MaskBlockShape::of(p, block_q, block_kv);
  for (uint8_t* flags : {p.mask_blocks, p.mask_partial}) {
    if (flags == nullptr) continue;
    if (cudaError_t err = cudaMemsetAsync(flags, 0, shape.bytes(), stream); err != cudaSuccess) {
      return cuda_failure("mask pre-pass clear", err);
    }
  }
  if (p.mask_ranges != nullptr) {
    const size_t bytes = 2 * sizeof(int) * static_cast<size_t>(shape.bytes() / shape.key_blocks);
    if (cudaError_t err = cudaMemsetAsync(p.mask_ranges, 0, bytes, stream); err != cudaSuccess) {
      return cuda_failure("mask pre-pass clear", err);
    }
  }
  const int rows = p.mask_strides[2] != 0 ? p.seqlen_q : 1;  // a row broadcast over queries is read once
  const int64_t items = shape.batch * shape.heads * rows * shape.key_blocks;
  constexpr int kThreads = 256;
  const int64_t grid = (items + kThreads - 1) / kThreads;
  if (grid > 0x7fffffff) return "mask pre-pass grid of " + std::to_string(grid) + " blocks exceeds 2^31-1";
  mask_blocks_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p, shape, block_q, block_kv, rows);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_failure("mask pre-pass launch", err);
  return {};
}

}  // namespace jax_flash
