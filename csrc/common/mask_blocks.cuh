// Block skipping for mask tensors: a pre-pass records whether each (block_q x block_kv) tile of the mask holds a
// nonzero entry, and a tile of one query head walks only the key blocks whose mask tile does (VisibleBlocks,
// common/segment_blocks.cuh). A dense causal mask then costs about what causal=True costs, plus the per-score test.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/launch_util.h"
#include "common/mask_blocks.h"
#include "common/params.h"

namespace jax_flash {

// One thread per (mask batch, mask head, query row, key block), key blocks fastest: sets the tile's flag when the
// row's block_kv entries hold a nonzero one (the flags start at zero; every writer writes 1).
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
  bool any = false;
  for (int j = kb * block_kv; j < end && !any; ++j) any = __ldg(entries + j * p.mask_strides[3]) != 0;
  if (any) p.mask_blocks[shape.row(b, h, p.mask_strides[2] != 0 ? i / block_q : 0) + kb] = 1;
}

// Clears the flags and launches the pre-pass on `stream` when the call has them (else nothing).
inline std::string launch_mask_blocks(const AttentionParams& p, int block_q, int block_kv, cudaStream_t stream) {
  if (p.mask == nullptr || p.mask_blocks == nullptr || p.seqlen_q == 0 || p.seqlen_k == 0) return {};
  const MaskBlockShape shape = MaskBlockShape::of(p, block_q, block_kv);
  if (cudaError_t err = cudaMemsetAsync(p.mask_blocks, 0, shape.bytes(), stream); err != cudaSuccess) {
    return cuda_failure("mask pre-pass clear", err);
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
