// The sm80-family attention backward (FlashAttention-2's, on mma.sync, ldmatrix and cp.async).
// One thread block = kBlockKV keys [kv0, kv0 + kBlockKV) of one (batch, kv head). It keeps K and V of those keys in
// shared memory and dK, dV in registers, and walks the work items (query head of the group, query block) whose rows
// see any of its keys, the next item's Q, dO, lse and delta loading while this one computes:
//   S^T = K Q^T,  P^T = exp(s - lse)  (s the scaled, soft-capped score; 0 where hidden),
//   dP^T = V dO^T,  dS^T = P^T o (dP^T - delta) o ds/d(q.k),
//   dV += P^T dO,  dK += dS^T Q,  dQ += dS K  (fp32 atomics into dq_accum, which sm80/bwd_prepost.cuh zeroes first
//   and converts last).
// Every product reads its operands from shared memory (P^T and dS^T go there as 16-bit elements), so each has its
// own warp grid (sm80/bwd_traits.cuh).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/backward_blocks.cuh"
#include "common/backward_params.h"
#include "common/backward_rows.cuh"
#include "common/backward_tensors.cuh"
#include "common/visibility.h"
#include "sm80/bwd_operands.cuh"
#include "sm80/bwd_traits.cuh"
#include "sm80/ptx.cuh"
#include "sm80/smem_tile.cuh"

namespace jax_flash::sm80 {

// P^T and dS^T of one item into shared memory (sP, sdS: (kBlockKV, kBlockQ) score tiles) from this warp's S^T and
// dP^T accumulators; element e of tile (m, n): key row s_row0 + 16m + lane/4 + 8(e/2), query column s_col0 + 8n +
// 2(lane%4) + e%2. kReads: the bias, mask and segment ids read per score; compiled with and without, chosen per item,
// so the items that need none run a straight-line loop (a uniform branch per score split it into blocks of one
// exponential each). ALiBi's term is added either way (zero without ALiBi).
template <class T, bool kMask, bool kSoftcap, bool kTensors, bool kReads>
__device__ __forceinline__ void item_scores(
    const AttentionParams& p, BatchLengths len, const ScoreItem& it, const AlibiTerm& alibi, int s_row0, int s_col0,
    int lane, float cap_slope, const float* lse2, const float* delta,
    const float (&acc_s)[T::ScoreGrid::kMTiles][T::ScoreGrid::kNTiles][4],
    const float (&acc_dp)[T::ScoreGrid::kMTiles][T::ScoreGrid::kNTiles][4], typename T::Element* sP,
    typename T::Element* sdS) {
  using Element = typename T::Element;
  using SG = typename T::ScoreGrid;
  using ScoreTile = typename T::ScoreTile;
#pragma unroll
  for (int m = 0; m < SG::kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < SG::kNTiles; ++n) {
      float pv[4], dsv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = s_row0 + m * kMmaM + lane / 4 + 8 * (e / 2);
        const int c = s_col0 + n * kMmaN + 2 * (lane % 4) + e % 2;
        float slope;
        const float prob = item_probability<kMask, kSoftcap, kTensors, kReads>(
            p, len, it, r, c, acc_s[m][n][e], lse2, alibi, n * kMmaN + e % 2 - m * kMmaM - 8 * (e / 2), cap_slope,
            slope);
        pv[e] = prob;
        dsv[e] = prob * (acc_dp[m][n][e] - delta[c]) * slope;
      }
      const int r = s_row0 + m * kMmaM + lane / 4;
      const int c = s_col0 + n * kMmaN + 2 * (lane % 4);
      const int off0 = tile_offset<ScoreTile>(r, c / kChunkElems) + c % kChunkElems;
      const int off1 = tile_offset<ScoreTile>(r + 8, c / kChunkElems) + c % kChunkElems;
      *reinterpret_cast<uint32_t*>(sP + off0) = pack2<Element>(pv[0], pv[1]);
      *reinterpret_cast<uint32_t*>(sP + off1) = pack2<Element>(pv[2], pv[3]);
      *reinterpret_cast<uint32_t*>(sdS + off0) = pack2<Element>(dsv[0], dsv[1]);
      *reinterpret_cast<uint32_t*>(sdS + off1) = pack2<Element>(dsv[2], dsv[3]);
    }
}

// kMask: some score may be hidden (window, lengths, or a partial last key block); kSoftcap: s = cap tanh(q.k scale
// / cap); kTensors (with kMask): segment ids, bias or mask tensors or ALiBi slopes (common/params.h), per score, on
// the tiles that can hold a visible score (common/backward_blocks.cuh).
template <class T, bool kMask, bool kSoftcap, bool kDeterministic, bool kTensors = false>
__global__ void __launch_bounds__(T::kNumThreads, 1) attention_bwd_kernel(const __grid_constant__ BackwardParams bp) {
  using Element = typename T::Element;
  using SG = typename T::ScoreGrid;
  using KG = typename T::KVGrid;
  using QG = typename T::QGrid;
  const AttentionParams& p = bp.p;
  extern __shared__ __align__(128) char smem[];
  Element* sK = reinterpret_cast<Element*>(smem);  // (kBlockKV, D)
  Element* sV = sK + T::kKVElems;                   // (kBlockKV, D)
  Element* sQ = sV + T::kKVElems;                   // 2 x (kBlockQ, D)
  Element* sdO = sQ + 2 * T::kQElems;               // 2 x (kBlockQ, D)
  Element* sP = sdO + 2 * T::kQElems;               // P^T (kBlockKV, kBlockQ)
  Element* sdS = sP + T::kScoreElems;               // dS^T (kBlockKV, kBlockQ)
  float* sLse2 = reinterpret_cast<float*>(sdS + T::kScoreElems);  // 2 x kBlockQ: lse * log2(e); +inf: P = 0
  float* sDelta = sLse2 + 2 * T::kBlockQ;                          // 2 x kBlockQ

  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  // Block index -> key block fastest (the blocks of one head share Q and dO in L2), then kv head, batch.
  const int num_kv_blocks = (p.seqlen_k + T::kBlockKV - 1) / T::kBlockKV;
  const int kv_block = static_cast<int>(blockIdx.x % num_kv_blocks);
  const int64_t head_batch = blockIdx.x / num_kv_blocks;
  const int64_t kv_head = head_batch % p.heads_k, batch = head_batch / p.heads_k;
  const BatchLengths len = batch_lengths(p, batch);
  const int kv0 = kv_block * T::kBlockKV;
  const int kv_rows = min(T::kBlockKV, p.seqlen_k - kv0);  // rows of dK / dV this block writes
  const QueryBlocks qb = query_blocks_seeing(p, len, kv0, min(kv0 + T::kBlockKV, len.kv_len), T::kBlockQ);
  const int group = p.q_heads_per_kv_head;
  const int q_blocks = qb.end - qb.begin;
  // item i: query head kv_head * group + i / q_blocks, query block qb.begin + i % q_blocks
  const int num_items = q_blocks * group;
  // Tensor calls visit the items whose tile can hold a visible score (common/backward_blocks.cuh); others, all.
  [[maybe_unused]] BackwardItems<T::kBlockQ, T::kBlockKV> items;
  if constexpr (kTensors) items = BackwardItems<T::kBlockQ, T::kBlockKV>(p, batch, kv_head, kv_block, qb);
  const int first_item = kTensors ? items.following(p, -1, lane) : 0;

  const Element* gK = static_cast<const Element*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  const Element* gV = static_cast<const Element*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
  if (first_item < num_items) {
    copy_tile_to_smem<typename T::RowTile, T::kBlockKV>(sK, gK + kv0 * p.k_seq_stride, p.k_seq_stride,
                                                        len.kv_len - kv0, tid);
    copy_tile_to_smem<typename T::RowTile, T::kBlockKV>(sV, gV + kv0 * p.v_seq_stride, p.v_seq_stride,
                                                        len.kv_len - kv0, tid);
  }
  // Q, dO, lse and delta of item i into buffer buf (Q and dO by cp.async; the row stats by plain loads, seen after
  // the __syncthreads that precedes their use).
  auto load_item = [&](int i, int buf) {
    const int64_t head = kv_head * group + i / q_blocks;
    const int q0 = (qb.begin + i % q_blocks) * T::kBlockQ;
    const int64_t q_offset = batch * p.q_batch_stride + head * p.q_head_stride + q0 * p.q_seq_stride;
    copy_tile_to_smem<typename T::RowTile, T::kBlockQ>(sQ + buf * T::kQElems,
                                                       static_cast<const Element*>(p.q) + q_offset,
                                                       p.q_seq_stride, p.seqlen_q - q0, tid);
    copy_tile_to_smem<typename T::RowTile, T::kBlockQ>(sdO + buf * T::kQElems,
                                                       static_cast<const Element*>(bp.t.d_out) + q_offset,
                                                       p.q_seq_stride, p.seqlen_q - q0, tid);
    load_row_stats<T::kBlockQ>(bp, batch, head, q0, len, sLse2 + buf * T::kBlockQ, sDelta + buf * T::kBlockQ, tid);
    if constexpr (kTensors) prefetch_bias_tile<T::kBlockQ, T::kBlockKV, T::kNumThreads>(p, batch, head, q0, kv0, tid);
  };
  if (first_item < num_items) load_item(first_item, 0);
  cp_async_commit();

  float acc_dk[KG::kMTiles][KG::kNTiles][4], acc_dv[KG::kMTiles][KG::kNTiles][4];
  zero_fill(acc_dk);
  zero_fill(acc_dv);
  using RowTile = typename T::RowTile;
  using ScoreTile = typename T::ScoreTile;
  const RowMajorA<RowTile> k_as_a(sK, lane), v_as_a(sV, lane);
  const TransposedB<RowTile> k_as_b(sK, lane);
  const RowMajorA<ScoreTile> p_as_a(sP, lane), ds_as_a(sdS, lane);
  const TransposedA<ScoreTile> ds_t_as_a(sdS, lane);

  const int diag = len.kv_len - len.q_len;
  const int lo_off = p.window_left >= kUnbounded ? -kUnbounded : diag - p.window_left;
  const int hi_off = p.window_right >= kUnbounded ? kUnbounded : diag + p.window_right;
  const float cap_slope = p.softcap * p.softcap_scale;  // ds/d(q.k) = cap_slope (1 - tanh^2) with a softcap

  // i: the item; n: its place in the walk, by which buffers alternate (i itself where every item is visited)
  for (int i = first_item, n = 0; i < num_items; ++n) {
    const int buf = (kTensors ? n : i) % 2;
    [[maybe_unused]] const bool test_hidden = !kTensors || items.per_score(i);
    const int next_item = kTensors ? items.following(p, i, lane) : i + 1;
    if (next_item < num_items) load_item(next_item, ((kTensors ? n : i) + 1) % 2);
    cp_async_commit();
    cp_async_wait<1>();  // item i (and K, V) have landed
    __syncthreads();
    const int q0 = (qb.begin + i % q_blocks) * T::kBlockQ;
    const Element* sQi = sQ + buf * T::kQElems;
    const Element* sdOi = sdO + buf * T::kQElems;
    const float* lse2 = sLse2 + buf * T::kBlockQ;
    const float* delta = sDelta + buf * T::kBlockQ;

    // ---- S^T = K Q^T and dP^T = V dO^T over this warp's (keys, queries) tile ----------------------------------
    const int s_row0 = SG::row0(warp), s_col0 = SG::col0(warp);
    {
      float acc_s[SG::kMTiles][SG::kNTiles][4], acc_dp[SG::kMTiles][SG::kNTiles][4];
      zero_fill(acc_s);
      zero_fill(acc_dp);
      smem_gemm<Element, T::kHeadDim / kMmaK>(acc_s, k_as_a, s_row0, RowMajorB<RowTile>(sQi, lane), s_col0);
      smem_gemm<Element, T::kHeadDim / kMmaK>(acc_dp, v_as_a, s_row0, RowMajorB<RowTile>(sdOi, lane), s_col0);
      const bool whole = !kMask || (kv0 + T::kBlockKV <= len.kv_len && q0 + T::kBlockQ <= len.q_len &&
                                    kv0 + T::kBlockKV - 1 - q0 <= hi_off && kv0 - (q0 + T::kBlockQ - 1) >= lo_off);
      [[maybe_unused]] const AlibiTerm alibi =
          kTensors ? AlibiTerm(p, batch, kv_head * group + i / q_blocks, q0 + s_col0 + 2 * (lane % 4),
                               kv0 + s_row0 + lane / 4, len)
                   : AlibiTerm{};
      const ScoreItem item{batch, kTensors ? kv_head * group + i / q_blocks : 0, kv0, q0, lo_off, hi_off, whole,
                           test_hidden};
      // (run_score_loop; the soft-capped and tensor variants keep one loop, as in sm90/bwd_kernel.cuh)
      constexpr bool kSplitMask = kMask && !kSoftcap && !kTensors;
      const bool reads = kTensors && item_reads_tensors(p, test_hidden);
      run_score_loop<kMask, kSplitMask>(item, reads, [&](const ScoreItem& it, auto test_mask, auto with_reads) {
        item_scores<T, decltype(test_mask)::value, kSoftcap, kTensors, decltype(with_reads)::value>(
            p, len, it, alibi, s_row0, s_col0, lane, cap_slope, lse2, delta, acc_s, acc_dp, sP, sdS);
      });
    }
    __syncthreads();  // P^T and dS^T complete

    // ---- dV += P^T dO, dK += dS^T Q over this warp's (keys, D) tile -----------------------------------------------
    const int kv_row0 = KG::row0(warp), kv_col0 = KG::col0(warp);
    smem_gemm<Element, T::kBlockQ / kMmaK>(acc_dv, p_as_a, kv_row0, TransposedB<RowTile>(sdOi, lane), kv_col0);
    smem_gemm<Element, T::kBlockQ / kMmaK>(acc_dk, ds_as_a, kv_row0, TransposedB<RowTile>(sQi, lane), kv_col0);

    // ---- dQ (this block's share) = dS K, added to dq_accum (B, Sq, Hq, D) -------------------------------------
    const int64_t head = kv_head * group + i / q_blocks;
    float* dq_rows = bp.dq_accum + ((batch * p.seqlen_q + q0) * p.heads_q + head) * p.head_dim;
    const int64_t dq_row_stride = int64_t{p.heads_q} * p.head_dim;
    const int q_rows = min(T::kBlockQ, len.q_len - q0);  // rows past q_len get no gradient
    const DQTurn turn = kDeterministic
                            ? dq_turn<T::kBlockQ, T::kBlockKV>(bp, len, batch, head, q0 / T::kBlockQ, kv_block)
                            : DQTurn{nullptr, 0};
#pragma unroll
    for (int chunk = 0; chunk < T::kDQChunks; ++chunk) {
      constexpr int kNT = QG::kNTiles / T::kDQChunks;
      float acc_dq[QG::kMTiles][kNT][4];
      zero_fill(acc_dq);
      const int q_row0 = QG::row0(warp), d_col0 = QG::col0(warp) + chunk * kNT * kMmaN;
      smem_gemm<Element, T::kBlockKV / kMmaK>(acc_dq, ds_t_as_a, q_row0, k_as_b, d_col0);
      if (kDeterministic && chunk == 0) dq_wait_turn(turn, tid);
#pragma unroll
      for (int m = 0; m < QG::kMTiles; ++m)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = q_row0 + m * kMmaM + lane / 4 + 8 * (e / 2);
            const int c = d_col0 + n * kMmaN + 2 * (lane % 4) + e % 2;
            if (r >= q_rows) continue;
            if constexpr (kDeterministic) {
              dq_add_ordered(dq_rows + r * dq_row_stride + c, acc_dq[m][n][e]);
            } else {
              atomicAdd(dq_rows + r * dq_row_stride + c, acc_dq[m][n][e]);
            }
          }
    }
    if constexpr (kDeterministic) dq_pass_turn(turn, tid);
    __syncthreads();  // every warp is done with this item's buffers, P^T and dS^T before they are refilled
    i = kTensors ? next_item : i + 1;  // (without tensors: recomputed, not kept across the item)
  }
  cp_async_wait<0>();

  // ---- dK, dV: this warp's (keys, D) tile, rows below seqlen_k (zeros where no row sees the key) ------------------
  const int kv_row0 = KG::row0(warp), kv_col0 = KG::col0(warp);
  Element* gdK = static_cast<Element*>(bp.t.dk) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  Element* gdV = static_cast<Element*>(bp.t.dv) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
#pragma unroll
  for (int m = 0; m < KG::kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < KG::kNTiles; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = kv_row0 + m * kMmaM + lane / 4 + 8 * h;
        const int c = kv_col0 + n * kMmaN + 2 * (lane % 4);
        if (r < kv_rows) {
          const int64_t key = kv0 + r;
          *reinterpret_cast<uint32_t*>(gdK + key * p.k_seq_stride + c) =
              pack2<Element>(acc_dk[m][n][2 * h], acc_dk[m][n][2 * h + 1]);
          *reinterpret_cast<uint32_t*>(gdV + key * p.v_seq_stride + c) =
              pack2<Element>(acc_dv[m][n][2 * h], acc_dv[m][n][2 * h + 1]);
        }
      }
}

}  // namespace jax_flash::sm80
