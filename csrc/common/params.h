// Runtime arguments of one attention call, shared by the CPU implementation and the GPU kernels.
// One plain struct: pointers, strides in elements as 64-bit integers, sizes, and the numbers the host derives
// (block counts, scale * log2(e)) so device code only indexes.
#pragma once

#include <cstdint>

namespace jax_flash {

struct AttentionParams {
  // Tensors: q (B, Sq, Hq, D), k and v (B, Sk, Hk, D), o (B, Sq, Hq, D); all of the input dtype.
  const void* q;
  const void* k;
  const void* v;
  void* o;

  // Strides in elements (64-bit so tensors above 2^31 elements index correctly).
  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;

  // Sizes.
  int batch;
  int seqlen_q, seqlen_k;
  int heads_q, heads_k;
  int head_dim;
  int q_heads_per_kv_head;  // heads_q / heads_k (GQA group size)

  // Softmax scaling: s = scale * q.k ; scale_log2 = scale * log2(e) for the exp2 path. scale > 0: jax_flash.attention
  // rewrites scale < 0 (negated k) and scale = 0 (q = 0, scale 1) exactly, so the kernels' running maximum of the
  // raw scores is also the maximum of the scaled ones.
  float scale;
  float scale_log2;

  // Visibility (the contract of DESIGN.md "Semantics"): with q_len, kv_len the actual lengths of this batch row and
  // offset = kv_len - q_len, query row i sees key j when  j < kv_len, i < q_len  and
  //   i + offset - window_left <= j <= i + offset + window_right.
  // kUnbounded on a side means no bound there; causal is window_right = 0 (bottom-right aligned).
  int window_left, window_right;
  const int* q_lengths;   // (B) int32 or nullptr (= seqlen_q); values are clamped to [0, seqlen_q]
  const int* kv_lengths;  // (B) int32 or nullptr (= seqlen_k); values are clamped to [0, seqlen_k]

  // Softcap: s = softcap * tanh(scale * q.k / softcap); then softmax over s with scale 1 (the host sets
  // scale = 1, scale_log2 = log2(e) and softcap_scale = scale / softcap). softcap = 0: off.
  float softcap;
  float softcap_scale;

  // Log-sum-exp output (B, Hq, Sq) float32, natural log, or nullptr when not requested.
  float* lse;
  int64_t lse_batch_stride, lse_head_stride;

  // Paged K/V (page_table != nullptr): k and v are (num_pages, page_size, Hk, D), their batch stride steps one page,
  // and logical key j of batch row b is row j % page_size of page page_table[b * page_table_stride + j / page_size];
  // seqlen_k = pages_per_seq * page_size. The entries of keys at or past kv_len are never read. A page id outside
  // [0, num_pages) reads as a page of zeros on the GPU; the CPU handler refuses it before computing.
  const int* page_table;
  int64_t page_table_stride;
  int page_size, num_pages;

  // Segment ids (packed sequences): query i of batch row b sees key j only when
  // q_segment_ids[b * q_segment_stride + i] == kv_segment_ids[b * kv_segment_stride + j], on top of the masks above
  // (which keep measuring positions in the row). nullptr: no segments.
  const int* q_segment_ids;
  const int* kv_segment_ids;
  int64_t q_segment_stride, kv_segment_stride;
  // GPU: the smallest and largest kv segment id of each key block of the kernel's block_kv keys, (B, key blocks, 2),
  // scratch the launcher's pre-pass fills (common/segment_blocks.cuh); a tile skips the blocks whose id range misses
  // its own. nullptr: no skipping.
  int* kv_block_segments;

  // Bias and mask tensors: logical shape (B, Hq, Sq, Sk), each dimension full or broadcast (stride
  // 0), strides in elements in that order. The bias is added to the (soft-capped) score, s += bias[b, h, i, j]; a
  // mask entry 0 hides the key, on top of every mask above. nullptr: none.
  const float* bias;
  const uint8_t* mask;
  int64_t bias_strides[4], mask_strides[4];

  // Packed GQA: rows per query position in a tile. 1: a tile holds one query head's rows. q_heads_per_kv_head (the
  // group): a tile belongs to a kv head, and its row r is query position r / group of query head
  // kv_head * group + r % group, so each K/V block is read once for the whole group.
  int pack_gqa;

  // Split-KV: each tile's visible key blocks are cut into num_splits ranges, one thread block each (1: not split).
  // With more than one, each range leaves its normalised O and its lse in partial_o (num_splits, B, Hq, Sq, D) and
  // partial_lse (num_splits, B, Hq, Sq), float32 scratch from the caller, and the combine step
  // (common/split_combine.cuh) merges them into o and lse. A range that sees no key writes lse = -inf only.
  int num_splits;
  float* partial_o;
  float* partial_lse;

  // Derived by the launcher for the chosen tile size (key blocks come from the visible span, common/visibility.h).
  int num_q_blocks;  // ceil(seqlen_q * pack_gqa / block_q)

  // sm90 family, dynamic tile scheduler: 8 bytes of device memory the launcher zeroes on the stream before the
  // launch (thread blocks draw their next tile from it with atomicAdd); nullptr = a static stride of the grid.
  unsigned long long* tile_counter;
  // sm90, right-bounded masks: tiles are ordered heaviest first inside sections of this many (batch, head) pairs
  // whose K and V fit in half the L2 cache together, at most 16 from head dim 128 (sm90/tile_scheduler.cuh).
  int section_heads;
  // sm90, right-bounded masks with three consumer warpgroups: query block q > 0 starts at row q * block_q -
  // q_block_shift and block 0 holds the first block_q - q_block_shift rows (a multiple of 64; sm90/tile_scheduler.cuh),
  // so the short query block of a length that is not a multiple of block_q is the first, whose rows see the fewest
  // keys, instead of the last, whose rows see the most. 0: block q starts at q * block_q.
  int q_block_shift;
  // sm90, the split tail (equal-cost tiles walked by a static stride, sm90/split_tail.cuh): scratch memory from the
  // caller (nullptr / 0: none, the kernels do not split), and what the launcher carves from it. The last split_tiles
  // tiles (0: none) are not handed out whole: their split_tiles x split_blocks key blocks are cut into gridDim.x equal
  // shares, one per block, and a tile cut between two blocks is finished by the one holding its first key blocks,
  // which merges the other's partial O, row maxima and row sums (split_partials) once its flag (split_flags, zeroed
  // on the stream before the launch) is set.
  void* split_workspace;
  int64_t split_workspace_bytes;
  float* split_partials;
  unsigned* split_flags;
  int split_tiles, split_blocks;
  int64_t split_whole_tiles;     // num_tiles - split_tiles: the tiles handed out whole
  int split_share, split_extra;  // block b's share: split_share key blocks, + 1 for b < split_extra

  // sm80 family, mask tensor, one query head per tile: whether each (block_q x block_kv) tile of the mask holds a
  // nonzero entry, (mask batch, mask head, query block, key block) bytes with the broadcast dimensions of size 1,
  // scratch the launcher's pre-pass fills (common/mask_blocks.cuh); a tile skips the key blocks whose mask tile is
  // all zeros. nullptr: no skipping. (Last, so the other kernels' parameter offsets stay as they were.)
  uint8_t* mask_blocks;
  // sm80 family with bias or mask tensors: nonzero orders the tiles batch before head (after the query block), so
  // the tiles that share a tensor broadcast over the batch run together and read it once through L2.
  int batch_inner;
  // GPU backward with segment ids: per (batch, query block of the backward's block_q rows), the key blocks
  // [first, end) whose (min, max) kv id range meets the block's query ids and that range (q_min, q_max), as
  // (first, end, q_min, q_max) in 4 ints (16-byte aligned), scratch the second pre-pass fills
  // (common/segment_blocks.cuh). nullptr: none. (The sm90 forward's tiles: segment_tiles below.)
  int* q_block_segments;
  // sm90 family, mask tensor: per (block_q x block_kv) tile of the mask (MaskBlockShape, common/mask_blocks.h), 1
  // where it holds a zero entry (the per-score test is needed), and per (mask batch, mask head, query block) the key
  // blocks [first, end) holding a nonzero entry as (key_blocks - first, end) in 2 ints (0, 0 where none), scratch
  // the launcher's pre-pass fills (common/mask_blocks.cuh). nullptr: none.
  uint8_t* mask_partial;
  int* mask_ranges;
  // sm90 FP8 kernels (float8_e4m3fn q, k, v; sm90/launch_fp8.cuh): float32 (B, Hk) factors, q_descale x k_descale
  // (the scores') and v_descale (the output's), read once per tile. nullptr in every other call.
  const float* qk_descale;
  const float* v_descale;
  // ALiBi: nonzero when `bias` holds one slope per (batch, query head), shape (B|1, Hq, 1, 1) in bias_strides, instead
  // of a bias tensor; the bias of query row i and key j is then -slope * |i + kv_len - q_len - j| (common/alibi.h),
  // computed per score instead of loaded.
  int alibi;
  // sm90 forward with segment ids: the tiles of each batch row, (B, segment_tile_slots) SegmentTile entries
  // (sm90/segment_tiles.cuh) followed by the pre-pass's chunk summaries (sm90/segment_tiles.h, segment_tile_bytes),
  // and the most tiles any row uses (one int, zeroed on the stream before the pre-pass that fills both). A row of sorted ids, equal for queries and keys, runs document tiles: each starts at a
  // document's first row or block_q rows after the previous one and ends with the document, and its key blocks start
  // at the document's first key, so no tile or key block spans two documents (FlashAttention's variable-length
  // batches). Other rows run the query blocks of block_q rows with the key blocks whose id range meets theirs.
  // nullptr: no segment ids (or not the sm90 forward).
  int* segment_tiles;
  int* segment_tile_count;
  int segment_tile_slots;
};

inline constexpr int kUnbounded = 1 << 30;  // a window side with no bound (|offsets| stay far from int overflow)

// Every row of every tile sees every key (no window, no lengths, no mask tensor or segment ids, whose key-block
// ranges differ from tile to tile): the tiles of one kernel all cost the same (the sm90 launcher's static stride
// and split tail).
inline bool has_equal_cost_tiles(const AttentionParams& p) {
  return p.window_left >= kUnbounded && p.window_right >= kUnbounded && p.q_lengths == nullptr &&
         p.kv_lengths == nullptr && p.page_table == nullptr && p.num_splits == 1 && p.mask == nullptr &&
         p.q_segment_ids == nullptr;
}

// A bias or mask tensor shared by the batch but not by the heads (ALiBi's (1, N, T, S) bias): the launchers set
// batch_inner, so the batch's tiles of one head and query block run together and read it once through L2. In head
// order they run heads x query blocks apart, and each batch entry read the tensor again from memory (4 GB a call for
// a (1, 16, 4096, 4096) float32 bias over a batch of 4). ALiBi slopes are one float per head: no such order.
inline bool tensors_shared_by_batch(const AttentionParams& p) {
  auto shared = [](const void* tensor, const int64_t* strides) {
    return tensor != nullptr && strides[0] == 0 && strides[1] != 0;
  };
  return (!p.alibi && shared(p.bias, p.bias_strides)) || shared(p.mask, p.mask_strides);
}

// Sets the paged-K/V fields: k and v of shape (num_pages, page_size, Hk, D), page_table (B, pages_per_seq) int32.
inline void set_pages(AttentionParams& p, const int* page_table, int pages_per_seq, int page_size, int num_pages) {
  p.page_table = page_table;
  p.page_table_stride = pages_per_seq;
  p.page_size = page_size;
  p.num_pages = num_pages;
  p.seqlen_k = pages_per_seq * page_size;
}

// Fills strides for contiguous [B, S, H, D] tensors and the derived scale; no masking, no softcap, no LSE.
inline AttentionParams make_contiguous_params(const void* q, const void* k, const void* v, void* o, int batch,
                                              int seqlen_q, int seqlen_k, int heads_q, int heads_k, int head_dim,
                                              float scale) {
  AttentionParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = head_dim;
  p.q_seq_stride = p.o_seq_stride = static_cast<int64_t>(heads_q) * head_dim;
  p.k_seq_stride = p.v_seq_stride = static_cast<int64_t>(heads_k) * head_dim;
  p.q_batch_stride = p.o_batch_stride = p.q_seq_stride * seqlen_q;
  p.k_batch_stride = p.v_batch_stride = p.k_seq_stride * seqlen_k;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_k = heads_k;
  p.head_dim = head_dim;
  p.q_heads_per_kv_head = heads_k > 0 ? heads_q / heads_k : 1;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;  // log2(e)
  p.window_left = p.window_right = kUnbounded;
  p.lse_head_stride = seqlen_q;
  p.lse_batch_stride = static_cast<int64_t>(heads_q) * seqlen_q;
  p.pack_gqa = 1;
  p.num_splits = 1;
  return p;
}

// Applies the optional features to params: causal and window (-1 = unbounded side), softcap (0 = off), lengths, LSE.
inline void set_features(AttentionParams& p, bool causal, int64_t window_left, int64_t window_right, float softcap,
                         const int* q_lengths, const int* kv_lengths, float* lse) {
  p.window_left = window_left < 0 || window_left >= kUnbounded ? kUnbounded : static_cast<int>(window_left);
  p.window_right = window_right < 0 || window_right >= kUnbounded ? kUnbounded : static_cast<int>(window_right);
  if (causal && p.window_right > 0) p.window_right = 0;
  p.softcap = softcap;
  if (softcap > 0.0f) {
    p.softcap_scale = p.scale / softcap;
    p.scale = 1.0f;
    p.scale_log2 = 1.4426950408889634f;
  }
  p.q_lengths = q_lengths;
  p.kv_lengths = kv_lengths;
  p.lse = lse;
}

}  // namespace jax_flash
