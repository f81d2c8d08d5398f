// The consumers' main loop of the sm90 kernel: per key block of a tile, S = Q K^T by wgmma (Q from shared memory, or
// from registers loaded once per tile: V::kQRegs), softcap and mask, the online softmax in registers (exp2 with the
// scale folded in), and O += P V by wgmma with P from registers (or shared memory: V::kPSmem) and V (MN-major) from
// shared memory. With intra-warpgroup overlap (T::kOverlap) the previous block's P V is issued together with this
// block's Q K^T and the softmax runs under it; with pingpong the consumers take turns issuing (pingpong.cuh).
// Masked kernels with a narrow block width (T::kNarrowKeys) walk a tile's key blocks last first (V::kReverse), so a
// consumer whose rows see only that many keys of its last block computes that block, its first, at that width
// (V::kNarrowLast).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/alibi.h"
#include "common/mask_blocks.h"
#include "common/mask_fragment.cuh"
#include "common/params.h"
#include "common/row_reduce.cuh"  // lazy_rescale_threshold
#include "common/visibility.h"
#include "sm90/fragments.cuh"
#include "sm90/pingpong.cuh"
#include "sm90/pipeline.cuh"
#include "sm90/ptx.cuh"
#include "sm90/shared_storage.cuh"
#include "sm90/softmax.cuh"
#include "sm90/trace.cuh"
#include "sm90/wgmma_ops.cuh"

namespace jax_flash::sm90 {

// A tile's facts as one consumer holds them (copied from its slot, tile_scheduler.cuh).
struct ConsumerTile {
  int batch, head, row0, q_rows, q_rows_valid;
  int block_begin, block_end;
  BatchLengths len;
};

// The soft-capped score softcap * tanh(s * scale / softcap) without its factor softcap, which the softmax takes in
// its scale instead (the launcher sets scale = softcap, scale_log2 = softcap log2(e): launch.cuh): one MUFU operation
// (tanh.approx.f32, relative error about 2^-11, below bf16's rounding of P) and one FMUL per score, beside the
// exponential's MUFU. As softcap - 2 softcap / (1 + 2^(2 log2(e) s scale / softcap)) (two MUFU operations and three
// FMA-pipe ones) head dim 128 ran at 0.64-0.74x the speed without softcap (H100), the MUFU pipe the bound.
__device__ __forceinline__ float softcap_tanh(float s, float scale_over_softcap) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s * scale_over_softcap));
  return t;
}

// One consumer's registers that live across tiles (a local of the consumer role, which the epilogue and the split
// tail read too).
template <class T, class V>
struct ConsumerRegisters {
  float acc_o[1][T::kOTiles][4];               // O (16 rows of this warp, D): the wgmma m64nD fragment
  // FP8: one key block's P V over D / kPvParts columns, added into acc_o in fp32 (Mainloop::fold_pv)
  float acc_pv[1][T::kFp8 ? T::kOTiles / T::kPvParts : 1][4];
  float acc_s[1][T::kSTiles][4];               // S of the current key block
  uint32_t rP[T::kKVSteps][4];                 // P of the previous key block as wgmma A fragments
  uint32_t rQ[V::kQRegs ? T::kDSteps : 1][4];  // V::kQRegs: this consumer's 64 rows of Q as wgmma A fragments
  float alpha[2];                              // the O rescale of the current key block
  SplitSoftmax<T::kSTiles, T::kOTiles, T::kPOffsetLog2> softmax;  // the current tile's row maxima and sums
};

// One consumer's main loop, one object for the whole block: begin_tile() sets up a tile, run() computes O and the
// softmax statistics of its 64 rows over the tile's key blocks, into the caller's registers.
template <class T, class V>
struct Mainloop {
  using Element = typename T::Element;
  using P = Pipeline<T, V>;
  using Softmax = SplitSoftmax<T::kSTiles, T::kOTiles, T::kPOffsetLog2>;

  // ---- the consumer, for the whole block
  const AttentionParams& p;
  const SmemView<T> s;
  const Turns<T, V> turns;
  Tracer& trace;
  const int consumer;    // rows [64 * consumer, 64 * consumer + 64) of each tile
  const int warp_in_wg;  // this warp's 16 of them
  const int lane;
  const int warp_row0;     // 64 * consumer + 16 * warp_in_wg
  float max_growth;        // the lazy rescale's threshold (common/row_reduce.cuh); FP8's is set per tile (begin_tile)
  int it = 0;              // the pipeline step of the next key block (pipeline.cuh)
  int tiles_done = 0;      // tiles whose Q this consumer has taken
  float (&acc_o)[1][T::kOTiles][4];
  float (&acc_pv)[1][T::kFp8 ? T::kOTiles / T::kPvParts : 1][4];
  float (&acc_s)[1][T::kSTiles][4];
  uint32_t (&rP)[T::kKVSteps][4];
  uint32_t (&rQ)[V::kQRegs ? T::kDSteps : 1][4];
  float (&alpha)[2];
  Softmax& softmax;

  // ---- the current tile
  ConsumerTile tile;        // (a copy: the consumer's own may be reloaded for the epilogue)
  int tile_number;          // (the trace's)
  int qb;                   // its Q buffer
  uint32_t sQ_addr;         // this consumer's 64 rows of it
  uint64_t q_desc0, k_desc0, v_desc0, p_desc0;
  int st_row;               // this lane's fragment row (fragments.cuh)
  uint32_t st_base;         // ... in this consumer's P (V::kPSmem)
  int lo_off, hi_off;       // key j is visible to row i when i + lo_off <= j <= i + hi_off, j < kv_len
  // Segment ids (V::kSplitPaged with p.segment_tiles): the tile's (min, max) q id and this lane's two rows' ids,
  // read once per tile, and the (min, max) kv id of the next key block, read before its S = Q K^T is waited for so
  // the load's latency hides under the product (read after it, per block, it sat on the softmax's path). A document
  // tile's keys are all its rows' document's: no test, marked q_min > q_max (a flag of its own took a register
  // through the key loop, and the tensor variants spilled in it).
  struct Segments {
    int q_min, q_max, row_id0, row_id1;
    int2 block_ids;
  };
  struct NoSegments {};
  [[no_unique_address]] std::conditional_t<V::kSplitPaged, Segments, NoSegments> seg;
  int my_end;               // this consumer's key blocks end here (V::kTrimTail), else the tile's
  bool narrow_last;         // V::kNarrowLast: its last key block is computed at T::kNarrowKeys
  // FP8: the tile's (batch, kv head) factors folded in: scale x q_descale x k_descale (and x log2(e)), v_descale
  float fp8_scale, fp8_scale_log2, fp8_v_descale;

  // The softmax's scale of this tile's scores: the call's, times q_descale x k_descale for FP8.
  __device__ __forceinline__ float scale_log2() const {
    if constexpr (T::kFp8) return fp8_scale_log2;
    return p.scale_log2;
  }
  __device__ __forceinline__ float scale() const {
    if constexpr (T::kFp8) return fp8_scale;
    return p.scale;
  }

  __device__ __forceinline__ Mainloop(const AttentionParams& p_, SmemView<T> s_, int consumer_, int warp_in_wg_,
                                      int lane_, Tracer& trace_, ConsumerRegisters<T, V>& r)
      : p(p_), s(s_), turns{consumer_}, trace(trace_), consumer(consumer_), warp_in_wg(warp_in_wg_), lane(lane_),
        warp_row0(64 * consumer_ + 16 * warp_in_wg_),
        max_growth(T::kFp8 ? 0.0f : lazy_rescale_threshold(p_.scale_log2)),
        acc_o(r.acc_o), acc_pv(r.acc_pv), acc_s(r.acc_s), rP(r.rP), rQ(r.rQ), alpha(r.alpha),
        softmax(r.softmax) {}

  // the accumulators and P as flat arrays (the wgmma operand lists)
  __device__ __forceinline__ auto& acc_o_flat() {
    return *reinterpret_cast<float(*)[T::kHeadDim / 2]>(&acc_o[0][0][0]);
  }
  // the accumulator P V's wgmma writes: FP8's one-block part, else O
  __device__ __forceinline__ auto& pv_flat() {
    if constexpr (T::kFp8) {
      return *reinterpret_cast<float(*)[T::kHeadDim / T::kPvParts / 2]>(&acc_pv[0][0][0]);
    } else {
      return acc_o_flat();
    }
  }
  __device__ __forceinline__ auto& acc_s_flat() {
    return *reinterpret_cast<float(*)[T::kBlockKV / 2]>(&acc_s[0][0][0]);
  }
  __device__ __forceinline__ auto& rP_flat() { return *reinterpret_cast<uint32_t(*)[T::kKVSteps * 4]>(&rP[0][0]); }

  // ---- descriptors: a base descriptor (stage 0, step 0) plus a byte offset added to its start-address field (the
  // per-step masks and shifts of a full descriptor were a fifth of the key loop's instructions). Q (A, K-major): this
  // consumer's 64 rows of each panel; k16 step kk is panel kk/4, byte 32*(kk%4) of the swizzled row. K (B, K-major):
  // the same stepping over kBlockKV rows. V (B, MN-major): k16 step t is rows 16t..16t+15 (2048 bytes in), the N = D
  // columns span the panels kKVPanelBytes apart (LBO); FP8's V^T (B, K-major): k32 step t is panel t / 4, byte
  // 32 * (t % 4) of its D rows. P (A, V::kPSmem): this consumer's (64, kBlockKV), like Q.
  __device__ __forceinline__ uint64_t q_desc(int kk) const {
    return smem_offset(q_desc0, (kk / 4) * T::kQPanelBytes + (kk % 4) * 32);
  }
  __device__ __forceinline__ uint64_t k_desc(int stage, int kk) const {
    return smem_offset(k_desc0, stage * T::kKBytes + (kk / 4) * T::kKVPanelBytes + (kk % 4) * 32);
  }
  __device__ __forceinline__ uint64_t v_desc(int stage, int t) const {
    if constexpr (T::kFp8) return smem_offset(v_desc0, stage * T::kVBytes + (t / 4) * T::kVtPanelBytes + (t % 4) * 32);
    return smem_offset(v_desc0, stage * T::kVBytes + t * 16 * T::kRowBytes);
  }
  __device__ __forceinline__ uint64_t p_desc(int t) const {
    return smem_offset(p_desc0, (t / 4) * T::kPPanelBytes + (t % 4) * 32);
  }

  // ---- the products (kKeys: the keys of the block that are computed, kBlockKV or T::kNarrowKeys; S's first
  // kKeys / 8 n-tiles are the m64n(kKeys) accumulator), one commit group each
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ void issue_s(int stage) {  // S = Q K^T
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < T::kDSteps; ++kk) {
      if constexpr (V::kQRegs) {
        wgmma_rs_k<Element, kKeys>(*reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]), rQ[kk], k_desc(stage, kk),
                                   kk > 0);
      } else {
        wgmma_ss<Element, kKeys>(*reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]), q_desc(kk),
                                 k_desc(stage, kk), kk > 0);
      }
    }
    wgmma_commit();
  }
  // O += P V; FP8: acc_pv = P V over columns [part, part + 1) * D / kPvParts (V^T's rows, kRowBytes each)
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ void issue_pv(int stage, int part = 0) {
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kKeys / T::kStepElems; ++t) {
      if constexpr (T::kFp8) {  // a fresh sum per key block and part (fold_pv)
        constexpr int kCols = T::kHeadDim / T::kPvParts;
        wgmma_rs_k<Element, kCols>(pv_flat(), rP[t], smem_offset(v_desc(stage, t), part * kCols * T::kRowBytes), t > 0);
      } else if constexpr (V::kPSmem) {
        wgmma_ss_tb<Element, T::kHeadDim>(acc_o_flat(), p_desc(t), v_desc(stage, t), 1);
      } else {
        wgmma_rs<Element, T::kHeadDim>(acc_o_flat(), rP[t], v_desc(stage, t), 1);
      }
    }
    wgmma_commit();
  }

  // ---- O's two-level sum (FP8)
  // The FP8 wgmma does not accumulate in full fp32: it aligns the products to the largest exponent among them and
  // the accumulator and keeps about 13-14 bits, truncating. Accumulated over a long row, O grows far above each
  // product and they are cut away: a flat row of 16384 keys over values near 1 lost 28% of its O (H200), so each
  // key block's P V goes into a fresh acc_pv, added here into O in fp32 (FlashAttention-3's FP8 fix in vLLM,
  // SageAttention 2). acc_pv covers D / kPvParts columns (traits.cuh): part 0 is issued with the key loop's
  // products, the others here, each while the part before it is added. 16-bit products accumulate in fp32 in O.
  // fold_pv: part 0 of P V (done) and the other parts into O, then O rescaled by alpha if the row maxima moved.
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ void fold_pv(int stage, bool rescale_o) {
    if constexpr (T::kFp8) {
      constexpr int kPartTiles = T::kOTiles / T::kPvParts;
#pragma unroll
      for (int part = 0; part < T::kPvParts; ++part) {
        if (part > 0) {
          issue_pv<kKeys>(stage, part);
          if (rescale_o) rescale_o_part(part - 1);  // while the part's product runs
          wgmma_wait<0>();
          fence_registers(pv_flat());
        }
#pragma unroll
        for (int n = 0; n < kPartTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_o[0][part * kPartTiles + n][e] += acc_pv[0][n][e];
      }
      if (rescale_o) rescale_o_part(T::kPvParts - 1);
    } else {
      if (rescale_o) Softmax::rescale(acc_o, alpha);
    }
  }
  __device__ __forceinline__ void rescale_o_part(int part) {
    constexpr int kPartTiles = T::kOTiles / T::kPvParts;
#pragma unroll
    for (int n = part * kPartTiles; n < (part + 1) * kPartTiles; ++n) {
      acc_o[0][n][0] *= alpha[0];
      acc_o[0][n][1] *= alpha[0];
      acc_o[0][n][2] *= alpha[1];
      acc_o[0][n][3] *= alpha[1];
    }
  }
  // FP8: the later parts read P's fragments and V's stage, so they are folded before either is let go. One part
  // (head dim 128 with the overlap) is folded after: V's stage and P go a fold sooner, +0.3 to +1.6% non-causal and
  // +1.0 to +5.2% causal (H200, A/B harness, three rounds, 512-16384 keys).
  static constexpr bool kFoldBeforeRelease = T::kFp8 && T::kPvParts > 1;

  // ---- the softmax steps
  // softcap, mask and the running max of S_j; sets alpha for the O rescale and returns whether it is needed
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ bool scores_to_max(int j) {
    if constexpr (V::kHasSoftcap) {  // S = tanh(S * scale / softcap); the softmax's scale holds the factor softcap
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][n][e] = softcap_tanh(acc_s[0][n][e], p.softcap_scale);
    }
    if constexpr (V::kMaskBlocks) {
      auto& scores = *reinterpret_cast<float(*)[1][kKeys / 8][4]>(&acc_s[0][0][0]);
      if (V::kSplitPaged && p.pack_gqa > 1) {  // packed GQA: the bounds apply to the rows' positions
        const int shift = __ffs(p.pack_gqa) - 1;
        const int r = tile.row0 + warp_row0 + lane / 4;
        const int pos[1][2] = {{r >> shift, (r + 8) >> shift}};
        const int first_pos = (tile.row0 + warp_row0) >> shift;
        const int last_pos = (tile.row0 + min(warp_row0 + 16, tile.q_rows_valid) - 1) >> shift;
        mask_key_block_packed<kKeys>(scores, j * T::kBlockKV, first_pos, last_pos, pos, lane, lo_off, hi_off,
                                     tile.len.kv_len);
      } else {
        mask_key_block<kKeys, V::kMaskOwnRows, V::kMaskRightOnly>(scores, j * T::kBlockKV, tile.row0,
                                                                  tile.q_rows_valid, warp_row0, lane, lo_off, hi_off,
                                                                  tile.len.kv_len);
      }
      if constexpr (V::kSplitPaged) {
        if (has_segments()) mask_segments<kKeys>(scores, j);
      }
      if constexpr (V::kTensors) apply_tensors<kKeys>(scores, j);
    }
    return softmax.template update_max<kKeys / 8>(acc_s, scale_log2(), max_growth, alpha);
  }
  __device__ __forceinline__ bool has_segments() const { return V::kSplitPaged && p.segment_tiles != nullptr; }
  __device__ __forceinline__ void begin_segments() {  // (begin_tile)
    if constexpr (V::kSplitPaged) {
      if (!has_segments()) return;
      // a row runs document tiles or query-block tiles only (segment_tiles.cuh): its first slot's doc_start says
      // which; a query-block tile is slot row0 / kBlockQ, whose first 16 bytes hold its ids' range
      const int4* row_tiles =
          reinterpret_cast<const int4*>(p.segment_tiles) + 2 * int64_t{tile.batch} * p.segment_tile_slots;
      const int4 first_tile = row_tiles[1];  // (row0, rows, doc_start, doc_end) of the row's first tile
      const int4 tile_ids = row_tiles[2 * (tile.row0 / T::kBlockQ)];
      const bool document = first_tile.z >= 0;
      seg.q_min = document ? 1 : tile_ids.z;
      seg.q_max = document ? 0 : tile_ids.w;
      const int* q_ids = p.q_segment_ids + tile.batch * p.q_segment_stride;
      const int row = tile.row0 + warp_row0 + lane / 4;
      seg.row_id0 = row < p.seqlen_q ? __ldg(q_ids + row) : 0;  // (rows past seqlen_q are never stored)
      seg.row_id1 = row + 8 < p.seqlen_q ? __ldg(q_ids + row + 8) : 0;
    }
  }
  __device__ __forceinline__ void prefetch_segments(int j) {  // before S_j is waited for
    if constexpr (V::kSplitPaged) {
      if (!has_segments() || seg.q_min > seg.q_max) return;  // (a document tile)
      const int key_blocks = (p.seqlen_k + T::kBlockKV - 1) / T::kBlockKV;
      seg.block_ids = reinterpret_cast<const int2*>(p.kv_block_segments)[int64_t{tile.batch} * key_blocks + j];
    }
  }
  // Segment ids: hides each score of key block j whose key's kv id differs from its row's q id, unless every query
  // row of the tile and every key of the block carry one id (the pre-passes' ranges, common/segment_blocks.cuh:
  // inside a document of sorted ids, most blocks). A lane's two rows' ids decide a block of one id whole (a tile
  // across a document boundary, over one document's keys); only a block across a boundary takes the lane's
  // 2 x kKeys / 8 columns, compared into one bit per score in a loop of 4 loads in flight (all of them at once, fully
  // unrolled, the variant spilled 270 more bytes; 8 at once, 60), the bits then applied.
  template <int kKeys>
  __device__ __forceinline__ void mask_segments(float (&scores)[1][kKeys / 8][4], int j) {
    if (seg.q_min > seg.q_max) return;  // a document tile
    const int2 block_ids = seg.block_ids;
    if (seg.q_min == seg.q_max && block_ids.x == seg.q_min && block_ids.y == seg.q_min) return;
    const int row_id0 = seg.row_id0, row_id1 = seg.row_id1;
    if (block_ids.x == block_ids.y) {  // every key of the block carries one id: a row sees all of it or none
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (row_id0 != block_ids.x) scores[0][n][c] = -INFINITY;
          if (row_id1 != block_ids.x) scores[0][n][2 + c] = -INFINITY;
        }
      return;
    }
    const int* kv_ids = p.kv_segment_ids + tile.batch * p.kv_segment_stride;
    using Bits = std::conditional_t<(kKeys / 4 > 32), uint64_t, uint32_t>;  // a bit per column of this lane
    Bits hide0 = 0, hide1 = 0;  // bit 2n + c: column col0 + 8n + c hidden from row lane / 4 (+ 8)
    const int col0 = j * T::kBlockKV + 2 * (lane % 4);
#pragma unroll 4
    for (int i = 0; i < kKeys / 4; ++i) {
      const int col = col0 + 8 * (i / 2) + i % 2;
      const int id = col < p.seqlen_k ? __ldg(kv_ids + col) : 0;  // (keys past seqlen_k: masked already)
      hide0 |= static_cast<Bits>(id != row_id0) << i;
      hide1 |= static_cast<Bits>(id != row_id1) << i;
    }
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // element 2h + c of tile n: row lane / 4 + 8h, column col0 + 8n + c
        if ((hide0 >> (2 * n + c)) & 1) scores[0][n][c] = -INFINITY;
        if ((hide1 >> (2 * n + c)) & 1) scores[0][n][2 + c] = -INFINITY;
      }
  }

  // Row `row`'s entries of a (B, H, Sq, Sk) tensor with these element strides, at this tile's batch and head.
  template <class Entry>
  __device__ __forceinline__ const Entry* row_entries(const Entry* tensor, const int64_t (&strides)[4], int row) const {
    return tensor + tile.batch * strides[0] + tile.head * strides[1] + row * strides[2];
  }
  // f(score, entry) for each of this lane's scores in row h (element 2h + c of tile n: column col0 + 8n + c) and its
  // entry of `entries` (the row's, row_entries): keys stepped by `step` (1, or 0 when broadcast), clamped to last_key.
  template <int kKeys, class Entry, class F>
  __device__ __forceinline__ void for_each_key(float (&scores)[1][kKeys / 8][4], const Entry* entries, int h,
                                               int64_t step, int col0, int last_key, F f) const {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) f(scores[0][n][2 * h + c], __ldg(entries + min(col0 + 8 * n + c, last_key) * step));
  }

  // Bias and mask tensors (common/params.h): s += bias / scale (the softmax multiplies S by scale, which holds the
  // factor softcap when soft-capped), then -inf where the mask entry is 0; each entry read from global memory
  // (broadcast dimensions have stride 0; rows past seqlen_q and keys past seqlen_k read the last one's entry and are
  // dropped or hidden already). The mask's per-score test runs only on blocks whose mask tile holds a zero entry
  // (p.mask_partial, the pre-pass's).
  template <int kKeys>
  __device__ __forceinline__ void apply_tensors(float (&scores)[1][kKeys / 8][4], int j) {
    const int row = tile.row0 + warp_row0 + lane / 4;
    const int rows[2] = {min(row, p.seqlen_q - 1), min(row + 8, p.seqlen_q - 1)};
    const int col0 = j * T::kBlockKV + 2 * (lane % 4), last_key = p.seqlen_k - 1;
    if (p.bias != nullptr && p.alibi) {
      apply_alibi<kKeys>(scores, row, col0);
    } else if (p.bias != nullptr) {
      const float inv_scale = 1.0f / p.scale;
      const int64_t step = p.bias_strides[3];
      // A lane's two keys of a tile as one 8-byte load where the rows are float2-aligned (keys contiguous, an even
      // key count: every stride a multiple of it), the pair clamped to the last one; else one load per key.
      const bool pairs = step == 1 && p.seqlen_k % 2 == 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* entries = row_entries(p.bias, p.bias_strides, rows[h]);
        if (pairs) {
#pragma unroll
          for (int n = 0; n < kKeys / 8; ++n) {
            const float2 b = __ldg(reinterpret_cast<const float2*>(entries + min(col0 + 8 * n, last_key - 1)));
            scores[0][n][2 * h] += b.x * inv_scale;
            scores[0][n][2 * h + 1] += b.y * inv_scale;
          }
        } else {
          for_each_key<kKeys>(scores, entries, h, step, col0, last_key,
                              [inv_scale](float& s, float bias) { s += bias * inv_scale; });
        }
      }
    }
    if (p.mask != nullptr) {
      if (p.mask_partial != nullptr) {
        const MaskBlockShape shape = MaskBlockShape::of(p, T::kBlockQ, T::kBlockKV);
        if (p.mask_partial[shape.block_of(p, tile.batch, tile.head, tile.row0 / T::kBlockQ) * shape.key_blocks + j] ==
            0) {
          return;  // every entry of the block's mask tile is nonzero
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        for_each_key<kKeys>(scores, row_entries(p.mask, p.mask_strides, rows[h]), h, p.mask_strides[3], col0,
                            last_key, [](float& s, uint8_t visible) {
                              if (visible == 0) s = -INFINITY;
                            });
      }
    }
  }

  // ALiBi (common/alibi.h): s += -slope |i + kv_len - q_len - j| / scale for this lane's rows `row` and row + 8 and
  // keys col0 + 8n + c: two FP32 operations per score (the distance an FADD from a float key index, then an FFMA).
  template <int kKeys>
  __device__ __forceinline__ void apply_alibi(float (&scores)[1][kKeys / 8][4], int row, int col0) const {
    const float neg_slope = -alibi_slope(p, tile.batch, tile.head) / p.scale;
    const float key0 = static_cast<float>(col0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float distance0 = alibi_diagonal(row + 8 * h, tile.len) - key0;  // to key col0
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          scores[0][n][2 * h + c] += neg_slope * fabsf(distance0 - static_cast<float>(8 * n + c));
        }
    }
  }

  // P = exp2(...) in place, inside the exponentials' turn (V::kExpTurns)
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ void exponentiate_in_turn() {
    [[maybe_unused]] auto& s_flat = *reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]);
    turns.wait_exp();
    if constexpr (V::kExpTurns) fence_registers(s_flat);
    softmax.template exponentiate<kKeys / 8>(acc_s, scale_log2());
    if constexpr (V::kExpTurns) fence_registers(s_flat);
    turns.pass_exp();
  }
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ bool scores_to_probabilities(int j) {  // scores_to_max, then P
    const bool rescale = scores_to_max<kKeys>(j);
    exponentiate_in_turn<kKeys>();
    return rescale;
  }
  // P (fp32) -> A fragments: k16 step t covers S tiles 2t and 2t+1, FP8's k32 step 4t .. 4t+3 (in registers, or
  // stmatrix into shared memory)
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ void pack_probabilities() {
#pragma unroll
    for (int t = 0; t < kKeys / T::kStepElems; ++t) {
      uint32_t a[4];
      pack_p_step<Element>(acc_s, t, a);
      if constexpr (V::kPSmem) {
        stmatrix_x4(st_base + (t / 4) * T::kPPanelBytes + fragment_chunk_of(t, lane) * 16, a);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) rP[t][e] = a[e];
      }
    }
    if constexpr (V::kPSmem) {  // the whole warpgroup's P is written and visible to wgmma (the async proxy)
      fence_proxy_async_smem();
      sync_consumer(consumer);
    }
  }
  // V::kPackInExp: P = exp2(...) with each k16 step packed into the A fragments as it is made
  template <int kKeys = T::kBlockKV>
  __device__ __forceinline__ void exponentiate_packed() {
    softmax.template exponentiate_packed<kKeys / 8, T::kStepElems / 8>(acc_s, scale_log2(), [&](int t) {
      uint32_t a[4];
      pack_p_step<Element>(acc_s, t, a);
#pragma unroll
      for (int e = 0; e < 4; ++e) rP[t][e] = a[e];
    });
  }
  __device__ __forceinline__ void fence_p() {  // P V has completed: the compiler may now reuse P's registers
    if constexpr (!V::kPSmem) fence_registers(rP_flat());
  }
  // After the tile's last Q K^T the producer may refill the Q buffer (unless Q was read into registers).
  __device__ __forceinline__ void release_q() {
    if constexpr (!V::kQRegs) mbarrier_arrive(s.q_empty(qb));
  }
  // The tile's last key block in the consumers' order (its pipeline stage is the last one both consumers read).
  __device__ __forceinline__ int final_block() const { return V::kReverse ? tile.block_begin : tile.block_end - 1; }
  // Key block j's K / V (pipeline stage `stage`) read by this consumer: the producer may refill them. T::kOInKV: the
  // tile's final block's stage holds O in the epilogue, consumer 0's in its K and consumer 1's in its V, which the
  // epilogue releases; consumer 1 tells consumer 0 once it has read that K.
  __device__ __forceinline__ void release_k(int j, int stage) {
    if constexpr (T::kOInKV) {
      if (j == final_block()) {
        if (consumer == 0) return;
        named_barrier_arrive(kLastKReadBarrier<T>, 256);
      }
    }
    mbarrier_arrive(s.k_empty(stage));
  }
  __device__ __forceinline__ void release_v(int j, int stage) {
    if constexpr (T::kOInKV) {
      if (j == final_block() && consumer == 1) return;
    }
    mbarrier_arrive(s.v_empty(stage));
  }
  // V::kTrimTail: the key blocks past this consumer's rows: no math, but the consumer waits for and releases their
  // stages and takes their turns (an arrival before a stage's fill would count toward its previous phase).
  __device__ __forceinline__ void skip_blocks() {
    for (int j = my_end; j < tile.block_end; ++j, ++it) {
      turns.wait();  // (one turn per key block, with or without overlap)
      turns.pass();
      mbarrier_wait(s.k_full(P::stage_of(it)), P::parity_of(it));
      release_k(j, P::stage_of(it));
      mbarrier_wait(s.v_full(P::stage_of(it)), P::parity_of(it));
      release_v(j, P::stage_of(it));
    }
  }

  // ---- a tile of an idle consumer: every row of this consumer is past the tile's valid rows (the last query block
  // of a length that is not a multiple of kBlockQ, or a padded batch entry). No math, but the consumer still takes
  // part in the pipeline: it releases each K/V stage and Q once the producer's fill of them has landed and takes its
  // pingpong turns. (Three consumers only: with two, the extra path made ptxas spill in the D = 128 kernels, and
  // 192-row tiles are the ones that waste a third.)
  __device__ __forceinline__ void run_idle(const ConsumerTile& t) {
    const int q_buffer = P::q_buffer_of(tiles_done);
    mbarrier_wait(s.q_full(q_buffer), P::q_parity_of(tiles_done));
    ++tiles_done;
    for (int j = t.block_begin; j <= t.block_end; ++j, ++it) {  // turn j: S_j (j < block_end) and P_{j-1} V_{j-1}
      if (T::kOverlap || j < t.block_end) {  // without overlap one turn per key block (its exponentials)
        turns.wait();
        turns.pass();
      }
      if (j < t.block_end) {
        mbarrier_wait(s.k_full(P::stage_of(it)), P::parity_of(it));
        mbarrier_arrive(s.k_empty(P::stage_of(it)));
        if (j == t.block_end - 1) mbarrier_arrive(s.q_empty(q_buffer));
      }
      if (j > t.block_begin) {
        mbarrier_wait(s.v_full(P::stage_of(it - 1)), P::parity_of(it - 1));
        mbarrier_arrive(s.v_empty(P::stage_of(it - 1)));
      }
    }
    --it;  // the loop ran block_end - block_begin + 1 times; the math path advances it once per key block
  }

  // ---- a tile: O and the softmax state of this consumer's 64 rows over the tile's key blocks
  __device__ __forceinline__ void run(const ConsumerTile& t, int n) {
    begin_tile(t, n);
    mbarrier_wait(s.q_full(qb), P::q_parity_of(tiles_done));
    ++tiles_done;
    if constexpr (V::kQRegs) {
      // this consumer's 64 rows of Q -> A fragments (k16 step kk: panel kk / 4, the fragment addresses, which are
      // ldmatrix's too), then the buffer is free: every read of it is in registers
#pragma unroll
      for (int kk = 0; kk < T::kDSteps; ++kk) {
        ldmatrix_x4(rQ[kk], sQ_addr + (kk / 4) * T::kQPanelBytes + st_row * T::kRowBytes +
                                fragment_chunk_of(kk, lane) * 16);
      }
      mbarrier_arrive(s.q_empty(qb));
    }
    trace(kTraceQReady, tile_number);
    if constexpr (!T::kOverlap) {
      run_without_overlap();
      if constexpr (V::kTrimTail) skip_blocks();
    } else {
      if constexpr (V::kTrimTail && V::kReverse) skip_blocks();
      // the key blocks in this consumer's order: first_j first, then each block toward last_j
      const int first_j = V::kReverse ? my_end - 1 : t.block_begin;
      const int last_j = V::kReverse ? t.block_begin : my_end - 1;
      if constexpr (V::kNarrowLast) {
        if (narrow_last) {
          key_loop<T::kNarrowKeys>(first_j, last_j);
        } else {
          key_loop<T::kBlockKV>(first_j, last_j);
        }
      } else {
        key_loop<T::kBlockKV>(first_j, last_j);
      }
      if constexpr (V::kTrimTail && !V::kReverse) skip_blocks();
    }
  }

  __device__ __forceinline__ void begin_tile(const ConsumerTile& t, int n) {
    tile = t;
    tile_number = n;
    begin_segments();
#pragma unroll
    for (int n = 0; n < T::kOTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][n][e] = 0.0f;
    softmax = Softmax{};
    const int diag_offset = t.len.kv_len - t.len.q_len;
    lo_off = p.window_left >= kUnbounded ? -kUnbounded : diag_offset - p.window_left;
    hi_off = p.window_right >= kUnbounded ? kUnbounded : diag_offset + p.window_right;
    // V::kTrimTail: this consumer's own last key block. Its 64 rows can see fewer keys than the tile's last row
    // (causal: consumer 0's rows end 64 rows above consumer 1's); at least one block is computed, so rows that see
    // no key come out as zeros and lse = -inf.
    my_end = t.block_end;
    // V::kNarrowLast: this consumer's rows see none of its last key block past its first T::kNarrowKeys keys (the
    // causal diagonal; a key length that ends there), so that block's two products run at that width and its
    // softmax over those scores. (Warp-uniform for ptxas through a lane-0 shuffle: wgmma under a branch it cannot
    // prove uniform is serialised.)
    narrow_last = false;
    if constexpr (V::kTrimTail || V::kNarrowLast) {
      int row_begin = t.row0 + 64 * consumer, row_end = t.row0 + min(64 * consumer + 64, t.q_rows_valid);
      if (V::kSplitPaged && p.pack_gqa > 1) {  // packed GQA: the rows' positions
        const int shift = __ffs(p.pack_gqa) - 1;
        row_begin >>= shift;
        row_end = (row_end + p.pack_gqa - 1) >> shift;
      }
      const KeySpan mine = visible_keys_of_rows(p, t.len, row_begin, row_end);
      if constexpr (V::kTrimTail) {
        my_end = max(t.block_begin + 1, min(t.block_end, (mine.end + T::kBlockKV - 1) / T::kBlockKV));
      }
      if constexpr (V::kNarrowLast) {
        narrow_last =
            __shfl_sync(0xffffffffu, mine.end <= (my_end - 1) * T::kBlockKV + T::kNarrowKeys ? 1 : 0, 0) != 0;
      }
    }
    if constexpr (T::kFp8) {  // (a factor that is not > 0 gives NaN: the softmax needs a positive scale)
      const int64_t pair = int64_t{t.batch} * p.heads_k + t.head / p.q_heads_per_kv_head;
      const float qk = __ldg(p.qk_descale + pair);
      fp8_scale = qk > 0.0f ? p.scale * qk : __int_as_float(0x7fffffff);
      fp8_scale_log2 = qk > 0.0f ? p.scale_log2 * qk : __int_as_float(0x7fffffff);
      fp8_v_descale = __ldg(p.v_descale + pair);
      // a factor 2^0.75 after exp2 (traits.cuh, kPOffsetLog2): O rescaled on 19% of the key blocks of a 16384-key
      // row instead of 40% (tools/fp8_p_rounding.py), P's e4m3 rounding no coarser
      max_growth = 0.75f / fp8_scale_log2;
    }
    qb = P::q_buffer_of(tiles_done);
    sQ_addr = smem_address(s.q(qb)) + consumer * 64 * T::kRowBytes;
    q_desc0 = smem_descriptor(sQ_addr, 16, 1024);
    k_desc0 = smem_descriptor(smem_address(s.k(0)), 16, 1024);
    v_desc0 = smem_descriptor(smem_address(s.v(0)), T::kFp8 ? 16 : T::kKVPanelBytes, 1024);
    st_row = fragment_row_of(warp_in_wg, lane);
    if constexpr (V::kPSmem) {
      const uint32_t sP_addr = smem_address(s.p(consumer));
      p_desc0 = smem_descriptor(sP_addr, 16, 1024);
      st_base = sP_addr + st_row * T::kRowBytes;
    }
  }

  // No intra-warpgroup overlap (cuDNN's schedule). Per key block: S_j = Q K_j^T waited for at once, its row max,
  // then the turn: exponentials, O rescale and P packing, pass the turn, O += P_j V_j waited for at once. With
  // pingpong the consumers' exponentials (MUFU) never run at the same time, and each one's products run under the
  // other's exponentials.
  __device__ __forceinline__ void run_without_overlap() {
    for (int j = tile.block_begin; j < my_end; ++j, ++it) {
      prefetch_segments(j);
      mbarrier_wait(s.k_full(P::stage_of(it)), P::parity_of(it));
      issue_s(P::stage_of(it));
      wgmma_wait<0>();
      fence_registers(acc_s_flat());
      release_k(j, P::stage_of(it));
      if (j == my_end - 1) release_q();  // the tile's last read of Q
      const bool rescale_o = scores_to_max(j);
      turns.wait();
      softmax.exponentiate(acc_s, scale_log2());
      if (rescale_o) Softmax::rescale(acc_o, alpha);
      pack_probabilities();
      turns.pass();
      mbarrier_wait(s.v_full(P::stage_of(it)), P::parity_of(it));
      issue_pv(P::stage_of(it));
      wgmma_wait<0>();
      fence_registers(pv_flat());
      fold_pv(P::stage_of(it), false);
      fence_p();
      release_v(j, P::stage_of(it));
    }
  }

  // ---- the overlapped key loop, whose first block computes kFirstKeys keys. (Each path issues and waits for all of
  // its products itself: wgmma issued in one branch and waited for after the paths join is serialised by ptxas. A
  // narrow S = Q K^T in the steady loop, issued beside a full P V, made ptxas serialise every wgmma of the kernel,
  // C7511; in the prologue it does not.)
  template <int kFirstKeys>
  __device__ __forceinline__ void key_loop(int first_j, int last_j) {
    constexpr bool kNarrowFirst = kFirstKeys < T::kBlockKV;
    constexpr int kDir = V::kReverse ? -1 : 1;
    bool kv_ready = false;  // V::kEarlyTest: K_j and V_prev were seen complete during the last block's softmax
    prologue<kFirstKeys>(first_j, last_j);
    if constexpr (kNarrowFirst) {  // the next step's P V is the narrow one (or the drain's, if none)
      if (first_j == last_j) {
        drain<kFirstKeys>(last_j);
        return;
      }
      step<kFirstKeys>(first_j + kDir, last_j, kv_ready);
    }
    for (int j = first_j + (kNarrowFirst ? 2 : 1) * kDir; V::kReverse ? j >= last_j : j <= last_j; j += kDir) {
      step<T::kBlockKV>(j, last_j, kv_ready);
    }
    drain<T::kBlockKV>(last_j);
  }

  // Prologue: S of the first block and its softmax (O is still zero: no rescale).
  template <int kKeys>
  __device__ __forceinline__ void prologue(int first_j, int last_j) {
    prefetch_segments(first_j);
    mbarrier_wait(s.k_full(P::stage_of(it)), P::parity_of(it));
    trace(kTraceKReady, first_j);
    turns.wait();
    trace(kTraceTurn, first_j);
    issue_s<kKeys>(P::stage_of(it));
    turns.pass();
    wgmma_wait<0>();
    fence_registers(*reinterpret_cast<float(*)[kKeys / 2]>(&acc_s[0][0][0]));
    trace(kTraceSDone, first_j);
    release_k(first_j, P::stage_of(it));
    if (first_j == last_j) release_q();  // the tile's last read of Q
    if constexpr (V::kPackInExp) {
      scores_to_max<kKeys>(first_j);
      exponentiate_packed<kKeys>();
    } else {
      scores_to_probabilities<kKeys>(first_j);
      pack_probabilities<kKeys>();
    }
    trace(kTraceSoftmaxDone, first_j);
    ++it;
  }

  // Steady state: issue S_j = Q K_j^T and O += P_prev V_prev back to back; the softmax of S_j runs while
  // P_prev V_prev is still on the tensor cores; O is rescaled once it is done. kPrevKeys: the keys of the previous
  // block computed.
  template <int kPrevKeys>
  __device__ __forceinline__ void step(int j, int last_j, bool& kv_ready) {
    prefetch_segments(j);
    if (!kv_ready) {
      mbarrier_wait(s.k_full(P::stage_of(it)), P::parity_of(it));
      mbarrier_wait(s.v_full(P::stage_of(it - 1)), P::parity_of(it - 1));
    }
    trace(kTraceKReady, j);
    turns.wait();
    trace(kTraceTurn, j);
    issue_s(P::stage_of(it));
    issue_pv<kPrevKeys>(P::stage_of(it - 1));
    turns.pass();
    wgmma_wait<1>();  // the older group, S_j, is done
    fence_registers(acc_s_flat());
    trace(kTraceSDone, j);
    release_k(j, P::stage_of(it));
    if (j == last_j) release_q();  // the tile's last read of Q: its buffer may refill
    // V::kEarlyTest: whether the next K and this V have landed, tested during the softmax (V::kTestsEarly: both
    // tests before the row maxima, so their latency hides under them, and no branch between them)
    [[maybe_unused]] bool k_next_landed = false, v_landed = false;
    if constexpr (V::kEarlyTest && V::kTestsEarly) {
      k_next_landed = mbarrier_test(s.k_full(P::stage_of(it + 1)), P::parity_of(it + 1));
      v_landed = mbarrier_test(s.v_full(P::stage_of(it)), P::parity_of(it));
    }
    const bool rescale_o = scores_to_max(j);
    if constexpr (V::kEarlyTest && V::kTestsEarly) {
      kv_ready = k_next_landed & v_landed;
    } else if constexpr (V::kEarlyTest) {
      kv_ready = mbarrier_test(s.k_full(P::stage_of(it + 1)), P::parity_of(it + 1)) &&
                 mbarrier_test(s.v_full(P::stage_of(it)), P::parity_of(it));
    }
    if constexpr (V::kPackInExp) {
      wgmma_wait<0>();  // P_prev V_prev is done: its P fragments may be rewritten as the exponentials go
      fence_registers(pv_flat());
      if constexpr (kFoldBeforeRelease) fold_pv<kPrevKeys>(P::stage_of(it - 1), rescale_o);
      fence_p();
      trace(kTracePVDone, j);
      mbarrier_arrive(s.v_empty(P::stage_of(it - 1)));
      exponentiate_packed();
      trace(kTraceSoftmaxDone, j);
      if constexpr (!kFoldBeforeRelease) fold_pv<kPrevKeys>(P::stage_of(it - 1), rescale_o);
    } else {
      exponentiate_in_turn();
      trace(kTraceSoftmaxDone, j);
      wgmma_wait<0>();  // P_prev V_prev is done: O and the P fragments may change
      fence_registers(pv_flat());
      if constexpr (kFoldBeforeRelease) fold_pv<kPrevKeys>(P::stage_of(it - 1), rescale_o);
      fence_p();
      trace(kTracePVDone, j);
      mbarrier_arrive(s.v_empty(P::stage_of(it - 1)));
      if constexpr (!kFoldBeforeRelease) fold_pv<kPrevKeys>(P::stage_of(it - 1), rescale_o);
      pack_probabilities();
    }
    ++it;
  }

  // Drain: O += P_last V_last of key block last_j (kKeys: the keys of the last block computed).
  template <int kKeys>
  __device__ __forceinline__ void drain(int last_j) {
    mbarrier_wait(s.v_full(P::stage_of(it - 1)), P::parity_of(it - 1));
    turns.wait();
    trace(kTraceDrainTurn, tile_number);
    issue_pv<kKeys>(P::stage_of(it - 1));
    turns.pass();
    wgmma_wait<0>();
    fence_registers(pv_flat());
    fold_pv<kKeys>(P::stage_of(it - 1), false);
    fence_p();
    trace(kTracePVDone, -1);
    release_v(last_j, P::stage_of(it - 1));
  }
};

}  // namespace jax_flash::sm90
