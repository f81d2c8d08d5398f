// The sm90-family attention backward: the algorithm of sm80/bwd_kernel.cuh (one thread block per kBlockKV = 128 keys
// of one (batch, kv head), dK and dV in registers, a walk over the (query head, query block) items that see the keys,
// dQ summed in a float32 accumulator) with every product on wgmma. Two warpgroups, 64 keys each:
//   S^T, dP^T (64 x kBlockQ) = K_wg Q^T, V_wg dO^T    wgmma, A and B K-major in shared memory
//   dV, dK (64 x D) += P^T dO, dS^T Q                  wgmma, A (P^T, dS^T) from registers, B MN-major
//   dQ (64 x 64) = dS K                                wgmma, A (dS^T in shared memory) and B MN-major;
//                                                      warpgroup w: query rows 64w.. (kBlockQ = 128) or D columns 64w..
// At head dim 128 without tensors or determinism an item is 80 query rows (kSwapDQ): S^T and dP^T are
// 64 x 80, and dQ is computed transposed, dQ^T (64 x 80) = K^T dS^T with dS (not dS^T) in shared memory, since
// wgmma has no M = 80 (H200: +5.5 to +8.4% non-causal, +1.4 to +9.1% causal against 64 rows, 1024-16384 keys).
// At head dim 256 (BwdTraits::kSplitD) a block takes 64 keys: warpgroup 0 computes the item's S^T and P^T over them,
// warpgroup 1 its dP^T and, from P^T passed through shared memory, dS^T (the soft-capped variants: both warpgroups
// both products); each then dV, dK and dQ for D columns 128w.. (dQ in two 64-column shares, staged in the item's
// dO and Q panels of those columns once its last products have read them).
// Tiles are 128-byte-swizzled panels of 64 columns (what the descriptors expect): K and V filled by cp.async from
// all threads, each item's Q and dO by TMA boxes and its rows' lse2 and delta (the preprocess's padded copies) by
// bulk copies that thread 0 issues onto the buffer's mbarrier. One barrier opens an item (every thread is done with
// the item before; then its mbarrier) and one lets dQ read both halves of dS^T (head dim 256 without a softcap: one
// before it passes P^T). The next item's loads go out behind this item's first products; S^T's exponentials run
// beside dP^T's wgmma and dS^T's arithmetic beside dV's (head dim 128 without a softcap; elsewhere dS^T is computed
// in the exponentials' loop, after dP^T), and dQ's reduce-add beside dK's products. dQ reaches dq_accum through
// shared memory and TMA reduce-adds (float2 read-modify-writes in the deterministic variant, which takes turns). At
// the block's end dK and dV are staged in the K and V tiles and leave by TMA stores.
// Against atomics after every product with a closing barrier (H100, bf16, 16 heads x 128 / 32 x 64, 1024-16384
// keys): head dim 128 +15-23% (causal +7-11%), head dim 64 +3-7% (causal -1 to +1%).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/backward_blocks.cuh"
#include "common/backward_order.cuh"
#include "common/backward_params.h"
#include "common/backward_rows.cuh"
#include "common/backward_tensors.cuh"
#include "common/cp_async.cuh"
#include "common/visibility.h"
#include "sm90/fragments.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"

namespace jax_flash::sm90 {

// Query rows per item by default: 128 at D = 64 (dQ splits by rows over the two warpgroups), 64 at D = 128 (by
// columns), so each warpgroup's dQ is 64 x 64. 64 rows at D = 64 measured 35% slower (H200): twice the items and
// their fixed costs, for no spills instead of ~150 bytes in the masked variants.
constexpr int default_bwd_block_q(int head_dim) { return head_dim == 64 ? 128 : 64; }

// kBlockQ_ = 80 (head dim 128, kSwapDQ; the launch takes it for calls without tensors or determinism,
// sm90/bwd_launch.cuh wide_items): S^T and dP^T are m64n80 products, whose operands cost 9% less shared-memory
// bandwidth per MAC than m64n64's (4.5 KB per 64 x 80 x 16 step against 4 KB per 64 x 64 x 16), and each item's
// fixed costs cover 1.25x the rows (FlashAttention-3's non-causal head dim 128 backward takes 80 rows). wgmma has no
// M = 80, so dQ is computed transposed, dQ^T (64 columns x 80 rows per warpgroup) = K^T dS^T, with dS (not dS^T)
// in shared memory.
template <class Element_, int kHeadDim_, int kBlockQ_ = default_bwd_block_q(kHeadDim_)>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // Head dim 256 (kSplitD): both warpgroups take the same 64 keys and half of D's gradient columns each (dK, dV and
  // dQ columns 128 wg..), so each warpgroup's registers hold what they hold at head dim 128 (dK and dV 64 x 128).
  // The item's S^T and dP^T (64 x 64 over all 256 columns) are computed once, one per warpgroup (kExchangeBytes);
  // splitting them by query columns instead would take m64n32 products (3 KB of operands read from shared memory
  // per 64 x 32 x 16 step: about two thirds of the tensor rate by that bandwidth).
  // K, V (32 KB each) and Q, dO twice (128 KB) leave no room for the stages of the other head dims: a warpgroup
  // stages the item's first dQ share in its dO panels (2 wg, 2 wg + 1) once dV's product is done and the second in
  // its Q panels once dK's is (after the dS^T barrier each warpgroup's products read only its own column panels),
  // and the reducing threads wait for those reads only before the item after next is loaded into the buffer.
  static constexpr bool kSplitD = kHeadDim == 256;
  static constexpr int kBlockKV = kSplitD ? 64 : 128;
  static constexpr int kBlockQ = kBlockQ_;
  static constexpr bool kSwapDQ = kBlockQ == 80;
  static_assert(kBlockQ == default_bwd_block_q(kHeadDim) || (kSwapDQ && kHeadDim == 128),
                "80-row items are built for head dim 128 only");
  static constexpr int kOutCols = kSplitD ? kHeadDim / 2 : kHeadDim;  // dK / dV columns per warpgroup
  static constexpr int kDQShares = kSplitD ? 2 : 1;                    // 64 x 64 dQ shares per warpgroup and item
  static constexpr int kNumThreads = 256;
  static constexpr int kAlignSlack = 1024;
  static constexpr int kRowBytes = 128;  // one panel row: 64 elements
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kKVPanelBytes = kBlockKV * kRowBytes;
  static constexpr int kQPanelBytes = kBlockQ * kRowBytes;
  static constexpr int kKVBytes = kKVPanelBytes * kPanels;
  static constexpr int kQBytes = kQPanelBytes * kPanels;
  // dS^T (kBlockKV, kBlockQ): kBlockQ / 64 panels of query columns; kSwapDQ: dS (kBlockQ, kBlockKV), a panel of 64
  // keys per warpgroup (dQ^T's B operand, K-major like Q in S^T's product).
  static constexpr int kScorePanelBytes = (kSwapDQ ? kBlockQ : kBlockKV) * kRowBytes;
  static constexpr int kScoreBytes = kScorePanelBytes * ((kSwapDQ ? kBlockKV : kBlockQ) / 64);
  // kSplitD without a softcap (kExchange): warpgroup 0 computes S^T and warpgroup 1 dP^T, once each, and P^T passes
  // from the one to the other through this tile (16-bit, as dV's product takes it), dS^T back through the dS^T
  // tile: half the score products' FLOPs and about 96 of an item's 576 KB of shared-memory traffic (H200: +5 to +11%
  // against both warpgroups computing both). The soft-capped variants need each score's slope beside dP^T: both
  // warpgroups compute both products there.
  static constexpr int kExchangeBytes = kSplitD ? kScoreBytes : 0;
  static constexpr bool kDQSplitRows = kBlockQ == 128;
  // Each warpgroup's dQ share of an item, 64 x 64 float32 (kSwapDQ: 80 rows x 64), is staged in shared memory (two
  // 32-column halves of 128-byte swizzled rows, one TMA box each) and added to dq_accum by TMA reduce-adds; two
  // buffers per warpgroup, so an item's stores wait only for the reduce of the item before last (kSwapDQ: one, 40
  // KB for both warpgroups beside 80-row tiles; its stores wait for the reduce of the item before, issued that
  // item's dK product and this item's first three products ago). Float2 atomics from the accumulator fragments
  // cost 20% of the kernel's time (H200, D = 128): each warp instruction touched 8 rows' 32-byte pieces.
  static constexpr int kDQRowsPerWarpgroup = kSwapDQ ? kBlockQ : 64;
  static constexpr int kDQHalfBytes = kDQRowsPerWarpgroup * 128;
  static constexpr int kDQStageBytes = 2 * kDQHalfBytes;
  static constexpr int kDQBuffers = kSwapDQ ? 1 : 2;
  static constexpr int kDQStagesBytes = kSplitD ? 0 : 2 * kDQBuffers * kDQStageBytes;  // x 2 warpgroups
  static constexpr int kDQAccRegs = kSwapDQ ? kBlockQ / 2 : 32;  // a warpgroup's dQ (or dQ^T) share, per thread
  // K, V; Q and dO twice; dS^T; P^T's exchange tile (kSplitD); the dQ stages; float32 lse2 and delta twice; int32
  // segment ids of the query rows twice and of the keys (the kSegments variant); each tile a whole number of
  // 1024-byte swizzle atoms from a base the kernel rounds up to 1024 bytes; the two Q / dO buffers' mbarriers.
  static constexpr int kSmemBytes = 2 * kKVBytes + 4 * kQBytes + kScoreBytes + kExchangeBytes + kDQStagesBytes +
                                    4 * kBlockQ * 4 + (2 * kBlockQ + kBlockKV) * 4 + 2 * 8 + kAlignSlack;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "the sm90 backward covers head dims 64, 128 and 256");
  static_assert(kSmemBytes <= 227 * 1024, "the sm90 backward's tiles exceed 227 KB of shared memory");
};

// Byte offset of (row, 16-byte chunk `chunk` of the row) in a panelled tile of kRows rows.
template <int kRows>
__device__ __forceinline__ uint32_t panel_offset(int row, int chunk) {
  return (chunk / 8) * (kRows * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

// cp.async of rows [0, kRows) of a (rows, kHeadDim) global tile into the panelled layout; rows >= rows_valid are zeros.
template <class Element, int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void copy_panels(uint32_t smem_tile, const Element* g, int64_t row_stride, int rows_valid,
                                            int tid) {
  constexpr int kRowChunks = kHeadDim / 8;
  constexpr int kChunks = kRows * kRowChunks;
  static_assert(kChunks % kThreads == 0, "chunks must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int id = tid + i * kThreads;
    const int row = id / kRowChunks, chunk = id % kRowChunks;
    const bool valid = row < rows_valid;
    const Element* src = valid ? g + row * row_stride + chunk * 8 : g;
    cp_async_16(smem_tile + panel_offset<kRows>(row, chunk), src, valid);
  }
}

// Warpgroup wg's share `share` of an item's dQ (64 x 64 of acc_dq, the wgmma accumulator layout): query rows
// 64 wg.. and all 64 columns (kDQSplitRows, head dim 64), all rows and D columns 64 wg.. (head dim 128), or all rows
// and D columns 128 wg + 64 share.. (kSplitD, head dim 256).
template <class T>
__device__ __forceinline__ void dq_share_origin(int wg, int share, int& row0, int& col0) {
  row0 = T::kDQSplitRows ? wg * 64 : 0;
  col0 = T::kDQSplitRows ? 0 : (wg * T::kDQShares + share) * 64;
}

// The deterministic variant: this thread's float2 pieces of warpgroup wg's share `share` (dq_share_origin) of the
// item whose rows start at q0 added into dq_accum by read-modify-writes in the key blocks' turn (the caller holds
// the turn: common/backward_rows.cuh), rows past q_rows left alone.
template <class T>
__device__ __forceinline__ void add_dq_ordered(const BackwardParams& bp, const float (&acc_dq)[32], int64_t batch,
                                               int64_t head, int q0, int q_rows, int wg, int share, int tid) {
  const AttentionParams& p = bp.p;
  const int warp = (tid / 32) % 4, lane = tid % 32;
  int row0, col0;
  dq_share_origin<T>(wg, share, row0, col0);
  float* dq_base = bp.dq_accum + ((batch * p.seqlen_q + q0) * p.heads_q + head) * p.head_dim;
  const int64_t dq_row_stride = int64_t{p.heads_q} * p.head_dim;
#pragma unroll
  for (int e = 0; e < 32; e += 2) {
    const int r = row0 + warp * 16 + lane / 4 + 8 * ((e / 2) % 2);
    const int c = col0 + 2 * (lane % 4) + 8 * (e / 4);
    if (r >= q_rows) continue;
    dq_add_ordered(reinterpret_cast<float2*>(dq_base + r * dq_row_stride + c), make_float2(acc_dq[e], acc_dq[e + 1]));
  }
}
template <class T>
__device__ __forceinline__ DQTurn dq_turn_of(const BackwardParams& bp, const BatchLengths& len, int64_t batch,
                                             int64_t head, int q0, int kv_block) {
  return dq_turn<T::kBlockQ, T::kBlockKV>(bp, len, batch, head, q0 / T::kBlockQ, kv_block);
}

// The default variant: share `share` (dq_share_origin), rows past q_len as zeros, into this warpgroup's `stage`
// (two 32-column halves of 64 rows x 128 bytes), then two TMA reduce-adds into dq_accum issued by the warpgroup's
// first thread (the caller waits for their reads before the stage is written again). Element (r, c) lies in half
// c / 32 at row r's 128 bytes, 16-byte chunk (c % 32) / 4 swizzled by r % 8 (a warp's float2 stores meet no bank
// twice). Row r = 16 warp + lane / 4 (+ 8), column c = 2 (lane % 4) + 8 (e / 4): r % 8 = lane / 4 and the chunk
// is (lane % 4) / 2 + 2 ((e / 4) % 4). The lane is read fresh so the 16 addresses are not kept across the caller's
// loop.
template <class T>
__device__ __forceinline__ void reduce_dq_through_stage(const CUtensorMap* tma_dq, const float (&acc_dq)[32],
                                                        char* stage, int64_t batch, int64_t head, int q0, int q_rows,
                                                        int wg, int share, int tid) {
  const int warp = (tid / 32) % 4;
  int wg_row0, wg_col0;
  dq_share_origin<T>(wg, share, wg_row0, wg_col0);
  const int ln = lane_id_fresh();
  const int swizzle = ((ln % 4) / 2) ^ (ln / 4);
  char* row_base = stage + (warp * 16 + ln / 4) * 128 + (ln % 2) * 8;
  const int row_live = q_rows - wg_row0 - (warp * 16 + ln / 4);  // > 0: row r live, > 8: row r + 8 too
  // (a share whose rows are all live, as every item's but a sequence's last query block, stores without the selects)
  auto store = [&](auto all_live) {
#pragma unroll
    for (int e = 0; e < 32; e += 2) {
      const int down = 8 * ((e / 2) % 2);
      const int offset = (e / 16) * T::kDQHalfBytes + down * 128 + ((swizzle ^ (2 * ((e / 4) % 4))) * 16);
      *reinterpret_cast<float2*>(row_base + offset) = decltype(all_live)::value || row_live > down
                                                          ? make_float2(acc_dq[e], acc_dq[e + 1])
                                                          : make_float2(0.0f, 0.0f);
    }
  };
  if (q_rows - wg_row0 >= 64) store(std::true_type{});
  else store(std::false_type{});
  fence_proxy_async_smem();  // the stores reach the async proxy the reduce reads through
  named_barrier_sync(1 + wg, 128);
  if (tid % 128 == 0) {
    const int row = q0 + wg_row0;
    tma_reduce_add_4d(tma_dq, stage, wg_col0, row, static_cast<int>(head), static_cast<int>(batch));
    tma_reduce_add_4d(tma_dq, stage + T::kDQHalfBytes, wg_col0 + 32, row, static_cast<int>(head),
                      static_cast<int>(batch));
    bulk_commit_group();
  }
}

// kSwapDQ: warpgroup wg's dQ^T share (acc_dq: 64 D columns 64 wg.. x kBlockQ query rows, the wgmma accumulator
// layout), rows past q_len as zeros, into its stage (two 32-column halves of kBlockQ rows x 128 bytes) and two TMA
// reduce-adds, as reduce_dq_through_stage. Element e is column 16 warp + lane / 4 + 8 ((e / 2) % 2) (half warp / 2,
// 16-byte chunk 4 (warp % 2) + 2 ((e / 2) % 2) + lane / 16, word (lane / 4) % 4) of query row r = 8 (e / 4) +
// 2 (lane % 4) + e % 2: four-byte stores, and a warp's 32 meet 32 banks (the chunk, swizzled by r % 8 = 2 (lane %
// 4) + e % 2, takes 8 values over lane % 4 and lane / 16).
template <class T>
__device__ __forceinline__ void reduce_dqt_through_stage(const CUtensorMap* tma_dq,
                                                         const float (&acc_dq)[T::kDQAccRegs], char* stage,
                                                         int64_t batch, int64_t head, int q0, int q_rows, int wg,
                                                         int tid) {
  const int warp = (tid / 32) % 4;
  const int ln = lane_id_fresh();
  const int chunk0 = 4 * (warp % 2) + ln / 16;
  char* half_base = stage + (warp / 2) * T::kDQHalfBytes + ((ln / 4) % 4) * 4;
  auto store = [&](auto all_live) {
#pragma unroll
    for (int e = 0; e < T::kDQAccRegs; ++e) {
      const int r = 8 * (e / 4) + 2 * (ln % 4) + e % 2;
      const int chunk = (chunk0 + 2 * ((e / 2) % 2)) ^ (2 * (ln % 4) + e % 2);
      *reinterpret_cast<float*>(half_base + r * 128 + chunk * 16) =
          decltype(all_live)::value || r < q_rows ? acc_dq[e] : 0.0f;
    }
  };
  if (q_rows >= T::kBlockQ) store(std::true_type{});
  else store(std::false_type{});
  fence_proxy_async_smem();  // the stores reach the async proxy the reduce reads through
  named_barrier_sync(1 + wg, 128);
  if (tid % 128 == 0) {
    tma_reduce_add_4d(tma_dq, stage, wg * 64, q0, static_cast<int>(head), static_cast<int>(batch));
    tma_reduce_add_4d(tma_dq, stage + T::kDQHalfBytes, wg * 64 + 32, q0, static_cast<int>(head),
                      static_cast<int>(batch));
    bulk_commit_group();
  }
}

// An item's query head within the group and query block among those that see the block's keys.
struct ItemCoords {
  int head;
  int block;
};

// Thread tid < kBlockQ's share of an item's rows (the kSegments variant), loaded into registers behind the item
// before's first products and stored to shared memory after that item: its query row's segment id.
struct ItemRows {
  int seg_q;
};

// P^T (and dS^T with kDSWithP: dP^T holds its products) from one item's scores acc_s (this thread's part of S^T in the
// wgmma accumulator layout). kMask: each score tested against the window and the lengths; kReads: the bias, mask and
// segment ids read per score; each compiled with and without, chosen per item, so the items that need neither run a
// straight-line loop (a uniform branch per score split it into blocks of one exponential each). kAny: ALiBi's term
// is added either way (zero without ALiBi). kSegments: the ids of the item's query rows (seg_q, by column) and of the
// block's keys (seg_k, by key row), in shared memory, compared on every item (see the kernel). delta: the rows'
// delta, times the softmax scale unless kSoftcap.
template <class T, bool kMask, bool kSoftcap, bool kDSWithP, BwdTensors kTensors, bool kReads>
__device__ __forceinline__ void item_scores(const AttentionParams& p, BatchLengths len, const ScoreItem& it,
                                            const AlibiTerm& alibi, int key_row0, int lane, float cap_slope,
                                            const float* lse2, const float* delta, const int* seg_q, const int* seg_k,
                                            float (&acc_s)[T::kBlockQ / 2], float (&acc_dp)[T::kBlockQ / 2]) {
  constexpr bool kAny = kTensors == BwdTensors::kAny, kSegments = kTensors == BwdTensors::kSegments;
#pragma unroll
  for (int e = 0; e < T::kBlockQ / 2; ++e) {
    const int r = key_row0 + 8 * ((e / 2) % 2);
    const int c = 8 * (e / 4) + 2 * (lane % 4) + e % 2;
    float slope;
    float prob = item_probability<kMask, kSoftcap, kAny, kReads && kAny>(
        p, len, it, r, c, acc_s[e], lse2, alibi, 8 * (e / 4) + e % 2 - 8 * ((e / 2) % 2), cap_slope, slope);
    if (kSegments && kReads && seg_q[c] != seg_k[r]) prob = 0.0f;
    acc_s[e] = prob;
    if constexpr (kDSWithP && kSoftcap) acc_dp[e] = prob * (acc_dp[e] - delta[c]) * slope;
    if constexpr (kDSWithP && !kSoftcap) acc_dp[e] = prob * fmaf(acc_dp[e], p.scale, -delta[c]);  // delta scaled
  }
}

// dS^T (acc_dp, this thread's part in the wgmma accumulator layout) packed into rdS, the A operand of dK's product,
// and stored at (key r, query c) of the panelled dS^T tile, which dQ's product reads from shared memory: rdS[t] is
// the four 8x8 matrices of k16 step t (columns 16t..), one stmatrix.x4 (fragments.cuh: lane l addresses row l % 8 of
// matrix l / 8; the warp's 16 rows start at a multiple of 8, so the swizzle is by l % 8) instead of four 4-byte stores.
// kSplitD with a softcap: both warpgroups hold the same dS^T; warpgroup wg stores query columns 32 wg.. of it.
// kAll (kExchange: one warpgroup computes all of dS^T) stores every column.
// kSwapDQ: dS itself (query row, key) into the warpgroup's 64-key panel, each matrix transposed: matrix m = lane / 8
// of step t holds keys warp_row0 + 8 (m % 2).. and query rows 16 t + 8 (m / 2).., so lane l addresses query row
// 16 t + 8 ((l / 8) / 2) + l % 8, whose 8 keys are one 16-byte chunk (2 warp + (l / 8) % 2, swizzled by the row).
template <class T, bool kAll = false>
__device__ __forceinline__ void pack_and_store_ds(const float (&acc_dp)[T::kBlockQ / 2],
                                                  uint32_t (&rdS)[T::kBlockQ / 16][4], uint32_t sdS, int key_row0,
                                                  int lane, int wg) {
  const int warp_row0 = key_row0 - lane / 4;  // (64 wg unless kSplitD) + 16 warp
  const uint32_t st_base = sdS + (warp_row0 + fragment_row_of(0, lane)) * 128;
  const int swap_chunk = ((warp_row0 % 64) / 8 + (lane / 8) % 2) ^ (lane % 8);
  const uint32_t swap_base = sdS + (warp_row0 / 64) * T::kScorePanelBytes + (8 * (lane / 16) + lane % 8) * 128 +
                             swap_chunk * 16;
#pragma unroll
  for (int t = 0; t < T::kBlockQ / 16; ++t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) rdS[t][j] = pack2<typename T::Element>(acc_dp[8 * t + 2 * j], acc_dp[8 * t + 2 * j + 1]);
    if constexpr (T::kSwapDQ) {
      stmatrix_x4_trans(swap_base + t * 16 * 128, rdS[t]);
    } else if (kAll || !T::kSplitD || t / 2 == wg) {
      stmatrix_x4(st_base + (t / 4) * T::kScorePanelBytes + fragment_chunk_of(t, lane) * 16, rdS[t]);
    }
  }
}

// kExchange: a 16-bit (kBlockKV, kBlockQ) score tile held as A fragments (r[t]: k16 step t, pack_and_store_ds's
// layout) stored to / loaded from its panelled shared-memory tile, by the same lane addressing.
template <class T>
__device__ __forceinline__ void store_score_fragments(const uint32_t (&r)[T::kBlockQ / 16][4], uint32_t tile,
                                                      int key_row0, int lane) {
  const uint32_t base = tile + (key_row0 - lane / 4 + fragment_row_of(0, lane)) * 128;
#pragma unroll
  for (int t = 0; t < T::kBlockQ / 16; ++t) {
    stmatrix_x4(base + (t / 4) * T::kScorePanelBytes + fragment_chunk_of(t, lane) * 16, r[t]);
  }
}
template <class T>
__device__ __forceinline__ void load_score_fragments(uint32_t (&r)[T::kBlockQ / 16][4], uint32_t tile, int key_row0,
                                                     int lane) {
  const uint32_t base = tile + (key_row0 - lane / 4 + fragment_row_of(0, lane)) * 128;
#pragma unroll
  for (int t = 0; t < T::kBlockQ / 16; ++t) {
    ldmatrix_x4(r[t], base + (t / 4) * T::kScorePanelBytes + fragment_chunk_of(t, lane) * 16);
  }
}

// dK and dV of the block's keys (zeros where no row sees the key) into the K and V tiles' panels, the layout their
// TMA stores read; each warp's 4-byte stores meet no bank twice (8 rows, one 16-byte chunk each, swizzled apart).
// (kSplitD: warpgroup wg's columns 128 wg..)
template <class T>
__device__ __forceinline__ void stage_dk_dv(const float (&acc_dk)[T::kOutCols / 2],
                                            const float (&acc_dv)[T::kOutCols / 2], char* sK_ptr, char* sV_ptr,
                                            int key_row0, int lane, int wg) {
  using Element = typename T::Element;
  const int col0 = T::kSplitD ? wg * T::kOutCols : 0;
#pragma unroll
  for (int e = 0; e < T::kOutCols / 2; e += 2) {
    const int r = key_row0 + 8 * ((e / 2) % 2), c = col0 + 8 * (e / 4) + 2 * (lane % 4);
    const uint32_t offset = panel_offset<T::kBlockKV>(r, c / 8) + (c % 8) * 2;
    *reinterpret_cast<uint32_t*>(sK_ptr + offset) = pack2<Element>(acc_dk[e], acc_dk[e + 1]);
    *reinterpret_cast<uint32_t*>(sV_ptr + offset) = pack2<Element>(acc_dv[e], acc_dv[e + 1]);
  }
}

// kExchange (head dim 256 without a softcap), after the item's first product: warpgroup 0 turns its S^T (acc_s) into
// P^T and passes it to warpgroup 1 through the exchange tile sP; both issue dV's product (P^T dO, do_mn0, committed
// here, waited for by the caller); warpgroup 1 turns its dP^T (acc_s) into dS^T = P^T (dP^T - delta) and stores all
// of it to sdS, which both read after the barrier, warpgroup 0 as dK's A operand (rdS).
template <class T, bool kMask, bool kSplitMask, BwdTensors kTensors>
__device__ __forceinline__ void exchange_scores(const AttentionParams& p, const BatchLengths& len,
                                                const ScoreItem& item, bool reads, const AlibiTerm& alibi,
                                                int key_row0, int lane, int wg, const float* lse2,
                                                const float* delta, const int* seg_q, const int* seg_k, uint32_t sP,
                                                uint32_t sdS, uint64_t do_mn0, float (&acc_s)[T::kBlockQ / 2],
                                                float (&acc_dv)[T::kOutCols / 2],
                                                uint32_t (&rP)[T::kBlockQ / 16][4],
                                                uint32_t (&rdS)[T::kBlockQ / 16][4]) {
  using Element = typename T::Element;
  if (wg == 0) {  // P^T, into the exchange tile for warpgroup 1
    run_score_loop<kMask, kSplitMask>(item, reads, [&](const ScoreItem& it, auto test_mask, auto with_reads) {
      item_scores<T, decltype(test_mask)::value, false, false, kTensors, decltype(with_reads)::value>(
          p, len, it, alibi, key_row0, lane, 0.0f, lse2, delta, seg_q, seg_k, acc_s, acc_s);
    });
#pragma unroll
    for (int t = 0; t < T::kBlockQ / 16; ++t)
#pragma unroll
      for (int j = 0; j < 4; ++j) rP[t][j] = pack2<Element>(acc_s[8 * t + 2 * j], acc_s[8 * t + 2 * j + 1]);
    store_score_fragments<T>(rP, sP, key_row0, lane);
  }
  __syncthreads();  // P^T in place
  if (wg == 1) load_score_fragments<T>(rP, sP, key_row0, lane);
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < T::kBlockQ / 16; ++t) {
    wgmma_rs<Element, T::kOutCols>(acc_dv, rP[t], smem_offset(do_mn0, t * 2048), 1);
  }
  wgmma_commit();
  if (wg == 1) {  // dS^T = P^T (dP^T - delta), from the 16-bit P^T, into the dS^T tile for both
#pragma unroll
    for (int e = 0; e < T::kBlockQ / 2; e += 2) {
      const float2 prob = unpack2<Element>(rP[e / 8][(e % 8) / 2]);
      const int c = 8 * (e / 4) + 2 * (lane % 4);
      acc_s[e] = prob.x * fmaf(acc_s[e], p.scale, -delta[c]);  // delta scaled
      acc_s[e + 1] = prob.y * fmaf(acc_s[e + 1], p.scale, -delta[c + 1]);
    }
    pack_and_store_ds<T, true>(acc_s, rdS, sdS, key_row0, lane, wg);
  }
  fence_proxy_async_smem();  // dS^T written, read next by wgmma
  __syncthreads();           // dS^T in place
  if (wg == 0) load_score_fragments<T>(rdS, sdS, key_row0, lane);
}

// The K-major operand offset of k16 step kk: 32 bytes per step inside a 64-column panel, a panel per 4 steps.
__device__ __forceinline__ uint32_t k_major_step(int kk, int panel_bytes) {
  return (kk / 4) * panel_bytes + (kk % 4) * 32;
}

// One score product of an item (A and B K-major in shared memory, over all of D) as one wgmma group; the caller
// fences first.
template <class T>
__device__ __forceinline__ void issue_score_group(float (&acc)[T::kBlockQ / 2], uint64_t a_desc0, uint64_t b_desc0) {
#pragma unroll
  for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
    wgmma_ss<typename T::Element, T::kBlockQ>(acc, smem_offset(a_desc0, k_major_step(kk, T::kKVPanelBytes)),
                                              smem_offset(b_desc0, k_major_step(kk, T::kQPanelBytes)), kk > 0);
  }
  wgmma_commit();
}
// An item's first products, S^T = K_wg Q^T and dP^T = V_wg dO^T, issued as two wgmma groups.
template <class T>
__device__ __forceinline__ void issue_score_products(float (&acc_s)[T::kBlockQ / 2], float (&acc_dp)[T::kBlockQ / 2],
                                                     uint64_t k_desc0, uint64_t v_desc0, uint32_t sQi,
                                                     uint32_t sdOi) {
  const uint64_t q_desc0 = smem_descriptor(sQi, 16, 1024), do_desc0 = smem_descriptor(sdOi, 16, 1024);
  wgmma_fence();
  issue_score_group<T>(acc_s, k_desc0, q_desc0);
  issue_score_group<T>(acc_dp, v_desc0, do_desc0);
}

// kExchange: one of them, S^T = K Q^T (warpgroup 0: a_desc0 K's, sBi the item's Q) or dP^T = V dO^T (warpgroup 1),
// as one wgmma group.
template <class T>
__device__ __forceinline__ void issue_score_product(float (&acc)[T::kBlockQ / 2], uint64_t a_desc0, uint32_t sBi) {
  const uint64_t b_desc0 = smem_descriptor(sBi, 16, 1024);
  wgmma_fence();
  issue_score_group<T>(acc, a_desc0, b_desc0);
}

// kSplitD: the item's dQ share 0 (in acc_dq, computed) added, then share 1 (K's next panel) computed into the same
// registers beside dK's products and added, share s staged in `stages[s]` (the deterministic variant: in the key
// blocks' turn, held around both). Returns with every wgmma of the item done.
template <class T, bool kDeterministic>
__device__ __forceinline__ void add_split_dq(const BackwardParams& bp, const BatchLengths& len, float (&acc_dq)[32],
                                             uint64_t ds_desc0, uint64_t kmn_desc0, const CUtensorMap* tma_dq,
                                             char* const (&stages)[2], int64_t batch, int64_t head, int q0,
                                             int q_rows, int kv_block, int wg, int tid) {
  auto add = [&](int share) {
    if constexpr (kDeterministic) {
      add_dq_ordered<T>(bp, acc_dq, batch, head, q0, q_rows, wg, share, tid);
    } else {
      reduce_dq_through_stage<T>(tma_dq, acc_dq, stages[share], batch, head, q0, q_rows, wg, share, tid);
    }
  };
  [[maybe_unused]] DQTurn turn{};
  if constexpr (kDeterministic) {
    turn = dq_turn_of<T>(bp, len, batch, head, q0, kv_block);
    dq_wait_turn(turn, tid);
  }
  add(0);
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < T::kBlockKV / 16; ++t) {
    wgmma_ss_tt<typename T::Element, 64>(acc_dq, smem_offset(ds_desc0, t * 2048),
                                         smem_offset(kmn_desc0, T::kKVPanelBytes + t * 2048), t > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(acc_dq);
  add(1);
  if constexpr (kDeterministic) dq_pass_turn(turn, tid);
}

// The block's K and V tiles (rows past kv_len as zeros) and, kSegments, its keys' segment ids, by cp.async.
template <class T, bool kSegments>
__device__ __forceinline__ void load_kv_block(const AttentionParams& p, const typename T::Element* gK,
                                              const typename T::Element* gV, int64_t batch, int kv0,
                                              const BatchLengths& len, uint32_t sK, uint32_t sV, int* sSegK,
                                              int tid) {
  using Element = typename T::Element;
  copy_panels<Element, T::kBlockKV, T::kHeadDim, T::kNumThreads>(sK, gK + kv0 * p.k_seq_stride, p.k_seq_stride,
                                                                 len.kv_len - kv0, tid);
  copy_panels<Element, T::kBlockKV, T::kHeadDim, T::kNumThreads>(sV, gV + kv0 * p.v_seq_stride, p.v_seq_stride,
                                                                 len.kv_len - kv0, tid);
  if constexpr (kSegments) {
    if (tid < T::kBlockKV) {
      const int key = kv0 + tid;  // (keys past seqlen_k: zeros, hidden by the lengths' mask)
      cp_async_4(smem_address(sSegK + tid),
                 p.kv_segment_ids + batch * p.kv_segment_stride + min(key, p.seqlen_k - 1), key < p.seqlen_k);
    }
  }
}

// The block's end: dK and dV through the K and V tiles (every product that read them was waited for in the loop;
// the barrier covers both warpgroups) and a TMA store per panel of each; rows past seqlen_k are not written. The
// stages and tiles stay until the reduces and stores have read them.
template <class T, bool kDeterministic>
__device__ __forceinline__ void store_dk_dv(const float (&acc_dk)[T::kOutCols / 2],
                                            const float (&acc_dv)[T::kOutCols / 2], char* smem,
                                            const CUtensorMap& tma_dk, const CUtensorMap& tma_dv, int kv0,
                                            int64_t kv_head, int64_t batch, int key_row0, int lane, int wg, int tid) {
  __syncthreads();
  stage_dk_dv<T>(acc_dk, acc_dv, smem, smem + T::kKVBytes, key_row0, lane, wg);
  fence_proxy_async_smem();
  __syncthreads();
  if (tid == 0) {
#pragma unroll
    for (int panel = 0; panel < T::kPanels; ++panel) {
      tma_store_4d(&tma_dk, smem + panel * T::kKVPanelBytes, panel * 64, kv0, static_cast<int>(kv_head),
                   static_cast<int>(batch));
      tma_store_4d(&tma_dv, smem + T::kKVBytes + panel * T::kKVPanelBytes, panel * 64, kv0,
                   static_cast<int>(kv_head), static_cast<int>(batch));
    }
    bulk_commit_group();
  }
  if ((!kDeterministic && tid % 128 == 0) || tid == 0) bulk_wait_group_read<0>();
}

// An item's dQ shares (this warpgroup's 64 x 64; kSwapDQ: dQ^T, 64 columns x kBlockQ rows = K^T dS^T) = dS K, then
// dK += dS^T Q behind them. Returns once dQ's products are done, and with them dV's (committed before) and its reads
// of P^T's registers; dK's run on while dQ is added into dq_accum.
template <class T>
__device__ __forceinline__ void issue_dq_and_dk_products(float (&acc_dq)[T::kDQAccRegs],
                                                         float (&acc_dk)[T::kOutCols / 2],
                                                         float (&acc_dv)[T::kOutCols / 2],
                                                         uint32_t (&rP)[T::kBlockQ / 16][4],
                                                         const uint32_t (&rdS)[T::kBlockQ / 16][4], uint64_t ds_desc0,
                                                         uint64_t kmn_desc0, uint64_t q_mn0) {
  using Element = typename T::Element;
  constexpr int kBlockQ = T::kBlockQ;
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < T::kBlockKV / 16; ++t) {
    if constexpr (T::kSwapDQ) {
      wgmma_ss_ta<Element, kBlockQ>(acc_dq, smem_offset(kmn_desc0, t * 2048),
                                    smem_offset(ds_desc0, k_major_step(t, T::kScorePanelBytes)), t > 0);
    } else {
      wgmma_ss_tt<Element, 64>(acc_dq, smem_offset(ds_desc0, t * 2048), smem_offset(kmn_desc0, t * 2048), t > 0);
    }
  }
  wgmma_commit();
#pragma unroll
  for (int t = 0; t < kBlockQ / 16; ++t) {
    wgmma_rs<Element, T::kOutCols>(acc_dk, rdS[t], smem_offset(q_mn0, t * 2048), 1);
  }
  wgmma_commit();
  wgmma_wait<1>();
  fence_registers(acc_dq);
  fence_registers(acc_dv);
  fence_registers(*reinterpret_cast<uint32_t(*)[kBlockQ / 4]>(&rP[0][0]));
}

// An item's dQ (this warpgroup's shares, acc_dq: the first share's product done) added into dq_accum: kSplitD through
// the warpgroup's column panels of the item's dO and Q in buffer buf (add_split_dq, which computes the second
// share), the deterministic variant in its turn by float2 read-modify-writes, else through the warpgroup's stage of
// buffer buf by TMA reduce-adds. Rows past q_len get no gradient.
template <class T, bool kDeterministic>
__device__ __forceinline__ void add_item_dq(const BackwardParams& bp, const BatchLengths& len,
                                            float (&acc_dq)[T::kDQAccRegs],
                                            uint64_t ds_desc0, uint64_t kmn_desc0, const CUtensorMap* tma_dq,
                                            char* sQ_ptr, char* sdO_ptr, char* sdQ_ptr, int buf, int64_t batch,
                                            int64_t head, int q0, int kv_block, int wg, int tid) {
  const int q_rows = min(T::kBlockQ, len.q_len - q0);
  if constexpr (T::kSplitD) {
    // this warpgroup's column panels of the item's dO (share 0) and Q (share 1)
    const uint32_t own_panels = buf * T::kQBytes + wg * 2 * T::kQPanelBytes;
    char* const stages[2] = {sdO_ptr + own_panels, sQ_ptr + own_panels};
    add_split_dq<T, kDeterministic>(bp, len, acc_dq, ds_desc0, kmn_desc0, tma_dq, stages, batch, head, q0, q_rows,
                                    kv_block, wg, tid);
  } else if constexpr (T::kSwapDQ) {
    static_assert(!kDeterministic, "80-row items have no deterministic variant");
    reduce_dqt_through_stage<T>(tma_dq, acc_dq, sdQ_ptr + wg * T::kDQStageBytes, batch, head, q0, q_rows, wg, tid);
  } else if constexpr (kDeterministic) {
    const DQTurn turn = dq_turn_of<T>(bp, len, batch, head, q0, kv_block);
    dq_wait_turn(turn, tid);
    add_dq_ordered<T>(bp, acc_dq, batch, head, q0, q_rows, wg, 0, tid);
    dq_pass_turn(turn, tid);
  } else {
    reduce_dq_through_stage<T>(tma_dq, acc_dq, sdQ_ptr + (buf * 2 + wg) * T::kDQStageBytes, batch, head, q0, q_rows,
                               wg, 0, tid);
  }
}

// kMask: some score may be hidden (window, lengths, or a partial last key block); kSoftcap: s = cap tanh(q.k scale
// / cap); kTensors (with kMask): segment ids alone, or any of segment ids, bias or mask tensors and ALiBi slopes, per
// score (common/backward_tensors.cuh). The segment-only variant keeps no bias or ALiBi state and compares the ids
// on every item in one code path (ids read from shared memory, a compare and select per score). With Q / dO by
// cp.async, the tensor variant (36 bytes of spill at head dim 128) ran packed rows at 0.76-0.82x the same documents
// unpacked (H200); this variant with its items split into tested and untested paths as the tensor variant's are,
// 0.87-1.07x; with one path, 1.01-1.15x (H100, mean document 512-4096).
template <class T, bool kMask, bool kSoftcap, bool kDeterministic, BwdTensors kTensors = BwdTensors::kNone>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    attention_bwd_kernel(const __grid_constant__ BackwardParams bp, const __grid_constant__ CUtensorMap tma_dq,
                         const __grid_constant__ CUtensorMap tma_q, const __grid_constant__ CUtensorMap tma_do,
                         const __grid_constant__ CUtensorMap tma_dk, const __grid_constant__ CUtensorMap tma_dv) {
  static_assert(!T::kSwapDQ || (!kDeterministic && kTensors == BwdTensors::kNone),
                "80-row items are built without tensors or determinism (sm90/bwd_launch.cuh wide_items)");
  constexpr bool kItems = kTensors != BwdTensors::kNone;  // walks the items the pre-passes leave (BackwardItems)
  constexpr bool kAny = kTensors == BwdTensors::kAny, kSegments = kTensors == BwdTensors::kSegments;
  using Element = typename T::Element;
  constexpr int kBlockQ = T::kBlockQ, kBlockKV = T::kBlockKV, kD = T::kHeadDim;
  const AttentionParams& p = bp.p;
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t sK = (smem_address(smem_raw) + 1023) & ~1023u;
  char* smem = smem_raw + (sK - smem_address(smem_raw));
  const uint32_t sV = sK + T::kKVBytes;
  const uint32_t sQ = sV + T::kKVBytes;       // 2 buffers
  const uint32_t sdO = sQ + 2 * T::kQBytes;   // 2 buffers
  const uint32_t sdS = sdO + 2 * T::kQBytes;  // dS^T
  char* sdS_ptr = smem + (sdS - sK);
  const uint32_t sP = sdS + T::kScoreBytes;  // kExchange: P^T
  char* sdQ_ptr = sdS_ptr + T::kScoreBytes + T::kExchangeBytes;  // (buffer, warpgroup) stages (kSplitD: none)
  float* sLse2 = reinterpret_cast<float*>(sdQ_ptr + T::kDQStagesBytes);  // 2 x kBlockQ
  float* sDelta = sLse2 + 2 * kBlockQ;                                         // 2 x kBlockQ
  int* sSegQ = reinterpret_cast<int*>(sDelta + 2 * kBlockQ);                   // 2 x kBlockQ (kSegments)
  int* sSegK = sSegQ + 2 * kBlockQ;                                            // kBlockKV (kSegments)
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sSegK + kBlockKV);            // 2: buffer b's Q and dO landed

  // The warpgroup through a lane-0 shuffle: warp-uniform for ptxas (CUTLASS's canonical_warp_group_idx), so the K, V
  // and dS^T descriptors derived from it live in uniform registers instead of moving there (R2UR) before each HGMMA.
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), warp = (tid / 32) % 4, lane = tid % 32;
  const int num_kv_blocks = (p.seqlen_k + kBlockKV - 1) / kBlockKV;
  const BackwardBlock order = backward_block(p, blockIdx.x, num_kv_blocks, kD, sizeof(Element));
  const int kv_block = order.kv_block;
  const int64_t kv_head = order.head_batch % p.heads_k, batch = order.head_batch / p.heads_k;
  const BatchLengths len = batch_lengths(p, batch);
  const int kv0 = kv_block * kBlockKV;
  const QueryBlocks qb = query_blocks_seeing(p, len, kv0, min(kv0 + kBlockKV, len.kv_len), kBlockQ);
  const int group = p.q_heads_per_kv_head;
  const int q_blocks = qb.end - qb.begin;
  const int num_items = q_blocks * group;
  // Tensor calls visit the items whose tile can hold a visible score (common/backward_blocks.cuh); others, all.
  [[maybe_unused]] BackwardItems<kBlockQ, kBlockKV> items;
  if constexpr (kItems) items = BackwardItems<kBlockQ, kBlockKV>(p, batch, kv_head, kv_block, qb);
  const int first_item = kItems ? items.following(p, -1, lane) : 0;

  const Element* gK = static_cast<const Element*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  const Element* gV = static_cast<const Element*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
  if (first_item < num_items) load_kv_block<T, kSegments>(p, gK, gV, batch, kv0, len, sK, sV, sSegK, tid);
  if (tid == 0) {
    mbarrier_init(&q_full[0], 1);
    mbarrier_init(&q_full[1], 1);
    fence_barrier_init();
  }
  // Item i is query head i / q_blocks of the group and query block i % q_blocks of those seeing the keys. Without
  // tensors the walk visits every item in order, so the next item's coordinates come from this one's by a step, not
  // by a division by the run-time q_blocks (about 20 instructions, several times per item).
  auto coords_of = [&](int i) { return ItemCoords{i / q_blocks, i % q_blocks}; };
  auto step = [&](ItemCoords c) {
    return c.block + 1 < q_blocks ? ItemCoords{c.head, c.block + 1} : ItemCoords{c.head + 1, 0};
  };
  // Item c's Q and dO tiles go out as TMA boxes into buffer place % 2 (place: its place in the walk; rows past
  // seqlen_q read as zeros) and its rows' lse2 and delta as two bulk copies (the preprocess padded them), all
  // completing on the buffer's mbarrier: no thread's registers wait for them, so no fence does. Its ItemRows are
  // returned, for store_item_rows into that buffer once the item before has been computed.
  auto load_item = [&](ItemCoords c, int place) {
    const int buf = place % 2;
    const int64_t head = kv_head * group + c.head;
    const int q0 = (qb.begin + c.block) * kBlockQ;
    if (tid == 0) {
      constexpr uint32_t kStatBytes = kBlockQ * sizeof(float);
      mbarrier_arrive_expect_tx(&q_full[buf], 2 * T::kQBytes + 2 * kStatBytes);
      const float* stats = bp.row_stats + (batch * p.heads_q + head) * bp.stats_rows + q0;
      bulk_load(sLse2 + buf * kBlockQ, stats, kStatBytes, &q_full[buf]);
      bulk_load(sDelta + buf * kBlockQ, stats + int64_t{p.batch} * p.heads_q * bp.stats_rows, kStatBytes,
                &q_full[buf]);
#pragma unroll
      for (int panel = 0; panel < T::kPanels; ++panel) {
        const uint32_t offset = buf * T::kQBytes + panel * T::kQPanelBytes;
        tma_load_4d(smem + (sQ - sK) + offset, &tma_q, &q_full[buf], panel * 64, q0, static_cast<int>(head),
                    static_cast<int>(batch));
        tma_load_4d(smem + (sdO - sK) + offset, &tma_do, &q_full[buf], panel * 64, q0, static_cast<int>(head),
                    static_cast<int>(batch));
      }
    }
    if constexpr (kAny) prefetch_bias_tile<kBlockQ, kBlockKV, T::kNumThreads>(p, batch, head, q0, kv0, tid);
    ItemRows rows{0};
    if constexpr (kSegments) {
      const int row = q0 + tid;
      if (tid < kBlockQ && row < p.seqlen_q) rows.seg_q = p.q_segment_ids[batch * p.q_segment_stride + row];
    }
    return rows;
  };
  // Thread tid < kBlockQ's segment id of an item into buffer buf.
  auto store_item_rows = [&](const ItemRows& rows, int buf) {
    if (kSegments && tid < kBlockQ) sSegQ[buf * kBlockQ + tid] = rows.seg_q;
  };
  ItemCoords at = coords_of(first_item);  // the item the loop is on
  if (first_item < num_items) store_item_rows(load_item(at, 0), 0);
  // K and V (and the keys' segment ids) are the block's only cp.async copies. The loop waits for none: a
  // cp.async.wait_group there also waits for the dQ reduce-adds the thread issued (one scoreboard counts both), and
  // the warps issuing them held every warp at the item's opening barrier until their last reduce was done.
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_smem();  // cp.async wrote through the generic proxy; wgmma reads through the async one

  // Descriptors (ptx.cuh smem_descriptor): K-major operands step 32 bytes per k16 inside a panel and a panel per 4
  // steps; MN-major ones step 16 rows (2048 bytes) per k16, their 64-column panels kPanelBytes apart (LBO).
  const uint32_t wg_rows = T::kSplitD ? 0 : wg * 64 * T::kRowBytes;  // this warpgroup's 64 keys of K and V
  const uint64_t k_desc0 = smem_descriptor(sK + wg_rows, 16, 1024);
  const uint64_t v_desc0 = smem_descriptor(sV + wg_rows, 16, 1024);
  // dQ: rows 64 wg.. of dS (panel wg of dS^T) with all of K's columns, or all rows with K's panel wg (kSplitD:
  // panels 2 wg and 2 wg + 1, one per share).
  // kSwapDQ: dQ^T = K^T dS^T, A K's panel wg (MN-major), B dS K-major (kBlockQ rows of the block's 128 keys).
  const uint64_t ds_desc0 =
      T::kSwapDQ ? smem_descriptor(sdS, 16, 1024)
                 : smem_descriptor(sdS + (T::kDQSplitRows ? wg * T::kScorePanelBytes : 0), T::kScorePanelBytes, 1024);
  const uint64_t kmn_desc0 = smem_descriptor(
      sK + (T::kDQSplitRows ? 0 : wg * T::kDQShares * T::kKVPanelBytes), T::kKVPanelBytes, 1024);

  constexpr int kOut = T::kOutCols;  // dK / dV columns of this warpgroup: D, or D / 2 from column 128 wg (kSplitD)
  float acc_dk[kOut / 2], acc_dv[kOut / 2];
#pragma unroll
  for (int i = 0; i < kOut / 2; ++i) acc_dk[i] = acc_dv[i] = 0.0f;

  const int diag = len.kv_len - len.q_len;
  const int lo_off = p.window_left >= kUnbounded ? -kUnbounded : diag - p.window_left;
  const int hi_off = p.window_right >= kUnbounded ? kUnbounded : diag + p.window_right;
  const float cap_slope = p.softcap * p.softcap_scale;
  // Accumulator element i of a 64 x N wgmma tile: row 16 warp + lane/4 + 8 ((i/2) % 2),
  // column 8 (i/4) + 2 (lane%4) + i%2.
  const int key_row0 = (T::kSplitD ? 0 : wg * 64) + warp * 16 + lane / 4;  // + 8 ((i/2) % 2)
  // dS^T computed in the exponentials' loop, after dP^T's wgmma, so P^T's and dP^T's float32 tiles die at once:
  // with a softcap (its slope needs the score), and at head dim 64, whose 128-row items otherwise spill ~175 bytes.
  constexpr bool kDSWithP = kSoftcap || kD == 64;
  constexpr bool kExchange = T::kSplitD && !kSoftcap;  // (BwdTraits::kExchangeBytes)

  // i: the item; n: its place in the walk, by which buffers alternate (i itself where every item is visited)
  for (int i = first_item, n = 0; i < num_items; ++n) {
    const int buf = (kItems ? n : i) % 2;
    [[maybe_unused]] const bool test_hidden = !kItems || items.per_score(i);
    // This item's dQ stage held the share of the item before last: its reduce has read it (the barrier below tells
    // the warpgroup).
    if (!kDeterministic && !T::kSplitD && !T::kSwapDQ && tid % 128 == 0) bulk_wait_group_read<1>();
    __syncthreads();
    mbarrier_wait(&q_full[buf], ((kItems ? n : i) / 2) % 2);  // the item's Q and dO
    const int q0 = (qb.begin + at.block) * kBlockQ;
    const uint32_t sQi = sQ + buf * T::kQBytes, sdOi = sdO + buf * T::kQBytes;
    const float* lse2 = sLse2 + buf * kBlockQ;
    const float* delta = sDelta + buf * kBlockQ;

    float acc_s[kBlockQ / 2];  // (kExchange: warpgroup 0's S^T, warpgroup 1's dP^T)
    [[maybe_unused]] float acc_dp[kBlockQ / 2];
    if constexpr (kExchange) {
      issue_score_product<T>(acc_s, wg == 0 ? k_desc0 : v_desc0, wg == 0 ? sQi : sdOi);
    } else {
      issue_score_products<T>(acc_s, acc_dp, k_desc0, v_desc0, sQi, sdOi);
    }
    // The next item's loads go out behind this one's first products. Its buffers held the item before's, which every
    // thread finished before it passed the barrier above (so did its reads of dS^T).
    if constexpr (T::kSplitD && !kDeterministic) {
      // The buffer the next item's loads fill held the item before's dQ shares: both reducing threads wait for
      // their reads (issued an opening barrier and this item's first products ago), and thread 0 for the other's.
      if (tid % 128 == 0) bulk_wait_group_read<0>();
      if (tid / 32 == 0) named_barrier_sync(3, 64);
      if (tid / 32 == 4) named_barrier_arrive(3, 64);
    }
    ItemRows next_rows{};
    const int next_item = kItems ? items.following(p, i, lane) : i + 1;
    const ItemCoords next_at = kItems ? coords_of(next_item) : step(at);
    if (next_item < num_items) next_rows = load_item(next_at, (kItems ? n : i) + 1);
    uint32_t rP[kBlockQ / 16][4], rdS[kBlockQ / 16][4];
    const uint32_t out_panels = T::kSplitD ? wg * 2 * T::kQPanelBytes : 0;  // dO's and Q's columns of dV and dK
    uint64_t q_mn0, do_mn0;
    if constexpr (kExchange) {
      do_mn0 = smem_descriptor(sdOi + out_panels, T::kQPanelBytes, 1024);
      q_mn0 = smem_descriptor(sQi + out_panels, T::kQPanelBytes, 1024);
      wgmma_wait<0>();
      fence_registers(acc_s);
    } else {
      wgmma_wait<1>();
      fence_registers(acc_s);
      if constexpr (kDSWithP) {
        wgmma_wait<0>();
        fence_registers(acc_dp);
      }
    }
    // The item's scores: whether every one is visible (no window / lengths test), ALiBi's term, the tensors' reads.
    const bool whole = !kMask || (kv0 + kBlockKV <= len.kv_len && q0 + kBlockQ <= len.q_len &&
                                  kv0 + kBlockKV - 1 - q0 <= hi_off && kv0 - (q0 + kBlockQ - 1) >= lo_off);
    [[maybe_unused]] const AlibiTerm alibi =
        kAny ? AlibiTerm(p, batch, kv_head * group + at.head, q0 + 2 * (lane % 4), kv0 + key_row0, len) : AlibiTerm{};
    const ScoreItem item{batch, kAny ? kv_head * group + at.head : 0, kv0, q0, lo_off, hi_off, whole, test_hidden};
    const int* seg_q = sSegQ + buf * kBlockQ;
    // The soft-capped and tensor variants keep the window / lengths test in one loop: two copies of theirs spilled
    // 20-780 bytes more (soft-capped: 24-48 bytes, and causal soft-capped calls ran within 1.5% either way, H100).
    constexpr bool kSplitMask = kMask && !kSoftcap && !kAny;
    const bool reads = kAny ? item_reads_tensors(p, test_hidden) : kSegments;
    if constexpr (kExchange) {
      exchange_scores<T, kMask, kSplitMask, kTensors>(p, len, item, reads, alibi, key_row0, lane, wg, lse2, delta,
                                                       seg_q, sSegK, sP, sdS, do_mn0, acc_s, acc_dv, rP, rdS);
    } else {
      run_score_loop<kMask, kSplitMask>(item, reads, [&](const ScoreItem& it, auto test_mask, auto with_reads) {
        item_scores<T, decltype(test_mask)::value, kSoftcap, kDSWithP, kTensors, decltype(with_reads)::value>(
            p, len, it, alibi, key_row0, lane, cap_slope, lse2, delta, seg_q, sSegK, acc_s, acc_dp);
      });
#pragma unroll
      for (int t = 0; t < kBlockQ / 16; ++t)
#pragma unroll
        for (int j = 0; j < 4; ++j) rP[t][j] = pack2<Element>(acc_s[8 * t + 2 * j], acc_s[8 * t + 2 * j + 1]);
      do_mn0 = smem_descriptor(sdOi + out_panels, T::kQPanelBytes, 1024);
      q_mn0 = smem_descriptor(sQi + out_panels, T::kQPanelBytes, 1024);
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kBlockQ / 16; ++t) wgmma_rs<Element, kOut>(acc_dv, rP[t], smem_offset(do_mn0, t * 2048), 1);
      wgmma_commit();
      if constexpr (!kDSWithP) {
        wgmma_wait<1>();
        fence_registers(acc_dp);
#pragma unroll
        for (int e = 0; e < kBlockQ / 2; ++e) {
          const int c = 8 * (e / 4) + 2 * (lane % 4) + e % 2;
          acc_dp[e] = acc_s[e] * fmaf(acc_dp[e], p.scale, -delta[c]);  // delta scaled
        }
      }
      pack_and_store_ds<T>(acc_dp, rdS, sdS, key_row0, lane, wg);
      fence_proxy_async_smem();  // dS^T written by this thread, read next by wgmma
      // kSwapDQ's one dQ stage per warpgroup held the item before's share: its reduce has read it (the barrier
      // below tells the warpgroup)
      if (T::kSwapDQ && tid % 128 == 0) bulk_wait_group_read<0>();
      __syncthreads();  // both warpgroups' halves of dS^T are in place
    }

    // ---- dQ (this warpgroup's 64 x 64 shares) = dS K, added into dq_accum while dK's products run ------------------
    float acc_dq[T::kDQAccRegs];
    issue_dq_and_dk_products<T>(acc_dq, acc_dk, acc_dv, rP, rdS, ds_desc0, kmn_desc0, q_mn0);

    add_item_dq<T, kDeterministic>(bp, len, acc_dq, ds_desc0, kmn_desc0, &tma_dq, smem + (sQ - sK), smem + (sdO - sK),
                                   sdQ_ptr, buf, batch, kv_head * group + at.head, q0, kv_block, wg, tid);
    wgmma_wait<0>();
    fence_registers(acc_dk);
    fence_registers(*reinterpret_cast<uint32_t(*)[kBlockQ / 4]>(&rdS[0][0]));
    // (buffer next_buf held the item before's, which every thread finished before this item's first barrier)
    const int next_buf = ((kItems ? n : i) + 1) % 2;
    const int after = kItems ? next_item : i + 1;  // (without tensors: recomputed, not kept across the item)
    if (after < num_items) store_item_rows(next_rows, next_buf);
    at = kItems ? coords_of(after) : step(at);
    i = after;
  }
  store_dk_dv<T, kDeterministic>(acc_dk, acc_dv, smem, tma_dk, tma_dv, kv0, kv_head, batch, key_row0, lane, wg, tid);
}

}  // namespace jax_flash::sm90
