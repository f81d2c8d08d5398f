// The mask tile flags' layout (AttentionParams::mask_blocks, mask_partial and mask_ranges): host code sizes the
// scratch, the pre-pass (common/mask_blocks.cuh) fills it and the kernels read it.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/visibility.h"

namespace jax_flash {

// The shape of p.mask_blocks: (batch, heads, query blocks, key blocks), a broadcast mask dimension of size 1.
struct MaskBlockShape {
  int64_t batch, heads;
  int q_blocks, key_blocks;

  JAX_FLASH_HOST_DEVICE static MaskBlockShape of(const AttentionParams& p, int block_q, int block_kv) {
    return {p.mask_strides[0] != 0 ? p.batch : 1, p.mask_strides[1] != 0 ? p.heads_q : 1,
            p.mask_strides[2] != 0 ? (p.seqlen_q + block_q - 1) / block_q : 1, (p.seqlen_k + block_kv - 1) / block_kv};
  }
  JAX_FLASH_HOST_DEVICE int64_t bytes() const { return batch * heads * q_blocks * key_blocks; }
  // The key-block flags of query block q_block of (batch b, query head h).
  JAX_FLASH_HOST_DEVICE int64_t row(int64_t b, int64_t h, int q_block) const {
    return ((b * heads + h) * q_blocks + q_block) * key_blocks;
  }
  // The mask's (batch, head, query block) of a tile of batch b, query head h, query block q_block (broadcast
  // dimensions: 0), as an index into the per-query-block ranges (p.mask_ranges).
  JAX_FLASH_HOST_DEVICE int64_t block_of(const AttentionParams& p, int64_t b, int64_t h, int q_block) const {
    return ((p.mask_strides[0] != 0 ? b : 0) * heads + (p.mask_strides[1] != 0 ? h : 0)) * q_blocks +
           (p.mask_strides[2] != 0 ? q_block : 0);
  }
};

}  // namespace jax_flash
