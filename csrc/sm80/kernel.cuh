// The sm80-family attention forward kernel (FlashAttention-2 structure on mma.sync, ldmatrix and cp.async).
// One thread block = one (batch, query head, block of kBlockQ query rows); it streams K/V blocks of kBlockKV keys
// through shared memory and keeps O, the row max and the row sum in registers.
#pragma once

#include <cstdint>

#include "common/mask_fragment.cuh"
#include "common/params.h"
#include "common/visibility.h"
#include "sm80/ptx.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/softmax.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace jax_flash::sm80 {

// kMaskBlocks: some key block may be partly invisible (causal, window, kv_lengths, or seqlen_k not a multiple of
// kBlockKV); false compiles the mask out. kHasSoftcap: s = softcap * tanh(s * scale / softcap).
template <class T, bool kMaskBlocks, bool kHasSoftcap>
__global__ void __launch_bounds__(T::kNumThreads) attention_kernel(const __grid_constant__ AttentionParams p) {
  using Element = typename T::Element;
  extern __shared__ __align__(128) char smem[];
  Element* sQ = reinterpret_cast<Element*>(smem);  // (kBlockQ, D)
  Element* sK = sQ + T::kSmemQElems;                // (kBlockKV, D)
  Element* sV = sK + T::kSmemKVElems;               // (kBlockKV, D)

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  // Block index -> (batch, head, query block), query blocks innermost so neighbouring blocks share K/V in L2. With a
  // right bound (causal) later query blocks see more keys: they go first so the last wave is the light blocks.
  const int64_t block = blockIdx.x;
  const int q_block_in_order = static_cast<int>(block % p.num_q_blocks);
  const int q_block = p.window_right < kUnbounded ? p.num_q_blocks - 1 - q_block_in_order : q_block_in_order;
  const int64_t batch_head = block / p.num_q_blocks;
  const int64_t head = batch_head % p.heads_q;
  const int64_t batch = batch_head / p.heads_q;
  const int64_t kv_head = head / p.q_heads_per_kv_head;
  const int row0 = q_block * T::kBlockQ;

  const Element* gQ = static_cast<const Element*>(p.q) + batch * p.q_batch_stride + row0 * p.q_seq_stride +
                      head * p.q_head_stride;  // (kBlockQ, D) rows of this block
  const Element* gK = static_cast<const Element*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  const Element* gV = static_cast<const Element*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
  Element* gO = static_cast<Element*>(p.o) + batch * p.o_batch_stride + row0 * p.o_seq_stride + head * p.o_head_stride;
  const int q_rows = min(T::kBlockQ, p.seqlen_q - row0);  // rows this block writes
  const BatchLengths len = batch_lengths(p, batch);
  const int q_rows_valid = max(0, min(T::kBlockQ, len.q_len - row0));  // rows that compute; the rest write zeros
  // Only key blocks some row of this block can see are visited (causal and windows skip the rest).
  const KeySpan keys = visible_keys_of_rows(p, len, row0, row0 + q_rows_valid);
  const int block_begin = keys.begin / T::kBlockKV;
  const int block_end = (keys.end + T::kBlockKV - 1) / T::kBlockKV;
  if (block_begin >= block_end) {  // no row sees a key: zeros and lse = -inf, no loads
    float* gLse = p.lse ? p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + row0 : nullptr;
    for (int i = tid; i < q_rows * T::kRowChunks; i += T::kNumThreads) {
      *reinterpret_cast<uint4*>(gO + (i / T::kRowChunks) * p.o_seq_stride + (i % T::kRowChunks) * kChunkElems) =
          make_uint4(0, 0, 0, 0);
    }
    if (gLse) {
      for (int r = tid; r < q_rows; r += T::kNumThreads) gLse[r] = -INFINITY;
    }
    return;
  }

  auto load_k_block = [&](int j) {
    const int kv0 = j * T::kBlockKV;
    copy_tile_to_smem<T, T::kBlockKV>(sK, gK + kv0 * p.k_seq_stride, p.k_seq_stride, p.seqlen_k - kv0, tid);
  };
  auto load_v_block = [&](int j) {
    const int kv0 = j * T::kBlockKV;
    copy_tile_to_smem<T, T::kBlockKV>(sV, gV + kv0 * p.v_seq_stride, p.v_seq_stride, p.seqlen_k - kv0, tid);
  };

  // ---- fragment loaders (shared -> registers), lane addressing of ldmatrix.x4 -------------------------------
  const int warp_row0 = warp * T::kRowsPerWarp;
  uint32_t rQ[T::kMTiles][T::kDSteps][4];                   // A of S = Q K^T
  uint32_t rK[T::kDSteps][T::kSTiles][2];                   // B of S = Q K^T
  uint32_t rP[T::kMTiles][T::kKVSteps][4];                  // A of O = P V (from the S accumulators)
  uint32_t rV[T::kKVSteps][T::kOTiles][2];                  // B of O = P V
  const int mat = lane / 8;  // which of the four 8x8 matrices of an ldmatrix.x4 this lane addresses
  // Q: matrices (rows 0-7, k lo), (rows 8-15, k lo), (rows 0-7, k hi), (rows 8-15, k hi) of each m16 tile.
  const LdmatrixAddresses<T> q_addr(sQ, warp_row0 + lane % 16, lane / 16);
  // K: two n8 tiles per x4: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi).
  const LdmatrixAddresses<T> k_addr(sK, (mat / 2) * 8 + lane % 8, mat % 2);
  // V, transposed: (kv lo, d 0-7), (kv hi, d 0-7), (kv lo, d 8-15), (kv hi, d 8-15).
  const LdmatrixAddresses<T> v_addr(sV, (mat % 2) * 8 + lane % 8, mat / 2);
  auto load_q = [&](int step) {
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) ldmatrix_x4(rQ[m][step], q_addr(m * kMmaM, 2 * step));
  };
  auto load_k = [&](int step) {
#pragma unroll
    for (int np = 0; np < T::kSTiles / 2; ++np) {
      uint32_t r[4];
      ldmatrix_x4(r, k_addr(np * 16, 2 * step));
      rK[step][2 * np][0] = r[0];
      rK[step][2 * np][1] = r[1];
      rK[step][2 * np + 1][0] = r[2];
      rK[step][2 * np + 1][1] = r[3];
    }
  };
  auto load_v = [&](int step) {
#pragma unroll
    for (int np = 0; np < T::kOTiles / 2; ++np) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, v_addr(step * kMmaK, 2 * np));
      rV[step][2 * np][0] = r[0];
      rV[step][2 * np][1] = r[1];
      rV[step][2 * np + 1][0] = r[2];
      rV[step][2 * np + 1][1] = r[3];
    }
  };
  auto no_load = [](int) {};

  float acc_o[T::kMTiles][T::kOTiles][4];  // O (kRowsPerWarp, D) of this warp
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < T::kOTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[m][n][e] = 0.0f;
  OnlineSoftmax<T> softmax;
  const float max_growth = lazy_rescale_threshold(p.scale_log2);

  // Key j is visible to row i when  i + lo_off <= j <= i + hi_off  and  j < kv_len  (common/visibility.h, with the
  // unbounded sides mapped to +-kUnbounded). Two offsets per block keep the mask cheap in registers.
  const int diag_offset = len.kv_len - len.q_len;
  // Masking (common/mask_fragment.cuh) tests the tile's rows with three compares per score: the sm90 family's
  // per-warp test and one-compare diagonal measured no gain here (median -1.2% causal, H200), since mma.sync and
  // ldmatrix bound this family, not the mask.
  constexpr bool kMaskOwnRows = false, kMaskRightOnly = false;
  const int lo_off = p.window_left >= kUnbounded ? -kUnbounded : diag_offset - p.window_left;
  const int hi_off = p.window_right >= kUnbounded ? kUnbounded : diag_offset + p.window_right;

  // ---- prologue: Q (and with eager loading K_0, V_0 as two cp.async groups) ---------------------------------
  copy_tile_to_smem<T, T::kBlockQ>(sQ, gQ, p.q_seq_stride, q_rows, tid);
  if constexpr (T::kEagerLoad) {
    load_k_block(block_begin);
    cp_async_commit();  // group: Q, K_first
    load_v_block(block_begin);
    cp_async_commit();  // group: V_first
  } else if constexpr (T::kAsyncCopy) {
    cp_async_commit();
  }

  for (int j = block_begin; j < block_end; ++j) {
    if constexpr (T::kEagerLoad) {
      cp_async_wait<1>();  // Q and K_j have landed (V_j may still be in flight)
    } else {
      load_k_block(j);
      load_v_block(j);
      if constexpr (T::kAsyncCopy) {
        cp_async_commit();
        cp_async_wait<0>();
      }
    }
    __syncthreads();  // K_j (and Q) visible to every warp

    if constexpr (T::kQInRegisters) {
      if (j == block_begin) {
#pragma unroll
        for (int s = 0; s < T::kDSteps; ++s) load_q(s);
      }
    }
    float acc_s[T::kMTiles][T::kSTiles][4];  // S (kRowsPerWarp, kBlockKV)
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[m][n][e] = 0.0f;
    // S = Q K_j^T
    if constexpr (T::kQInRegisters) {
      warp_gemm<Element, T::kDSteps, 0, T::kKChunk, T::kDoubleBuffer>(acc_s, rQ, rK, no_load, load_k);
    } else {
      warp_gemm<Element, T::kDSteps, T::kQChunk, T::kKChunk, T::kDoubleBuffer>(acc_s, rQ, rK, load_q, load_k);
    }

    if constexpr (T::kEagerLoad) {
      __syncthreads();  // every warp is done reading sK: K_{j+1} may overwrite it while softmax and P V run
      if (j + 1 < block_end) load_k_block(j + 1);
      cp_async_commit();  // (possibly empty) group keeps the wait counts uniform
    }

    if constexpr (kHasSoftcap) {  // S = softcap * tanh(S * scale / softcap); the softmax then runs with scale 1
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
        for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[m][n][e] = p.softcap * tanhf(acc_s[m][n][e] * p.softcap_scale);
    }
    if constexpr (kMaskBlocks) {
      mask_key_block<T::kBlockKV, kMaskOwnRows, kMaskRightOnly>(acc_s, j * T::kBlockKV, row0, q_rows_valid, warp_row0,
                                                              lane, lo_off, hi_off, len.kv_len);
    }
    softmax.update(acc_s, acc_o, p.scale, p.scale_log2, max_growth);

    // P (fp32 accumulators) -> A fragments: k16 step t covers S tiles 2t and 2t+1.
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int t = 0; t < T::kKVSteps; ++t) {
        rP[m][t][0] = pack2<Element>(acc_s[m][2 * t][0], acc_s[m][2 * t][1]);
        rP[m][t][1] = pack2<Element>(acc_s[m][2 * t][2], acc_s[m][2 * t][3]);
        rP[m][t][2] = pack2<Element>(acc_s[m][2 * t + 1][0], acc_s[m][2 * t + 1][1]);
        rP[m][t][3] = pack2<Element>(acc_s[m][2 * t + 1][2], acc_s[m][2 * t + 1][3]);
      }

    if constexpr (T::kEagerLoad) {
      cp_async_wait<1>();  // V_j has landed (K_{j+1} may still be in flight)
      __syncthreads();
    }
    // O += P V_j
    warp_gemm<Element, T::kKVSteps, 0, T::kVChunk, T::kDoubleBuffer>(acc_o, rP, rV, no_load, load_v);
    __syncthreads();  // every warp is done reading sV (and sK) before they are refilled
    if constexpr (T::kEagerLoad) {
      if (j + 1 < block_end) load_v_block(j + 1);
      cp_async_commit();
    }
  }
  if constexpr (T::kAsyncCopy) cp_async_wait<0>();  // no copy may land in smem after the epilogue reuses it

  softmax.finalize(acc_o);
  if (p.lse != nullptr && lane % 4 == 0) {  // one lane of each quad owns the row
    float* gLse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + row0;  // (q_rows)
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + m * kMmaM + lane / 4 + 8 * h;
        if (row < q_rows) gLse[row] = row < q_rows_valid ? softmax.lse(m, h, p.scale) : -INFINITY;
      }
  }

  // ---- epilogue: O -> this warp's rows of sQ (only this warp read them) -> 16-byte coalesced global stores ----
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + m * kMmaM + lane / 4 + 8 * h;
#pragma unroll
      for (int n = 0; n < T::kOTiles; ++n) {
        *reinterpret_cast<uint32_t*>(sQ + tile_offset<T>(row, n) + 2 * (lane % 4)) =
            pack2<Element>(acc_o[m][n][2 * h], acc_o[m][n][2 * h + 1]);
      }
    }
  __syncwarp();
  constexpr int kWarpChunks = T::kRowsPerWarp * T::kRowChunks;
#pragma unroll
  for (int i = lane; i < kWarpChunks; i += kWarpSize) {
    const int row = warp_row0 + i / T::kRowChunks, chunk = i % T::kRowChunks;
    if (row < q_rows) {  // rows past q_lengths[b] are zeros
      *reinterpret_cast<uint4*>(gO + row * p.o_seq_stride + chunk * kChunkElems) =
          row < q_rows_valid ? *reinterpret_cast<const uint4*>(sQ + tile_offset<T>(row, chunk)) : make_uint4(0, 0, 0, 0);
    }
  }
}

}  // namespace jax_flash::sm80
