// Window / causal / key-length masking of one warp's score accumulators, shared by both GPU families: the sm80
// mma.sync m16n8 fragments and the per-warp slice of an sm90 wgmma m64nN accumulator have the same layout
// (element e of tile (m, n) is row 16m + lane/4 + 8*(e/2), column 8n + 2*(lane%4) + e%2 of the warp's rows).
#pragma once

#include <cmath>

namespace jax_flash {

// Sets to -inf each score of this warp's fragment for which hide(d, c) holds, with d = col - row and c = col of the
// element relative to the fragment's first (lane's) element: d = 8n + e%2 - 16m - 8*(e/2), c = 8n + e%2, both
// compile-time constants after unrolling.
template <int kMTiles, int kSTiles, class Hide>
__device__ __forceinline__ void hide_scores(float (&acc_s)[kMTiles][kSTiles][4], Hide hide) {
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < kSTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (hide(n * 8 + (e % 2) - m * 16 - 8 * (e / 2), n * 8 + (e % 2))) acc_s[m][n][e] = -INFINITY;
      }
}

// Sets to -inf every score of key block [kv0, kv0 + kBlockKV) that its row may not see (common/visibility.h:
// lo_off <= col - row <= hi_off and col < kv_len). Blocks that every valid row sees whole are left untouched without
// a per-element test: the block is fully visible when its first key is within the last valid row's lower bound and
// its last key within the first row's upper bound (both bounds grow with the row) and below kv_len.
//   acc_s: [kMTiles][kSTiles][4] scores of this warp's rows; row0: the tile's first row; q_rows_valid: rows of the
//   tile below q_lengths[b]; warp_row0: this warp's first row within the tile.
// kOwnRows (sm90): that test takes this warp's own 16 * kMTiles rows instead of the tile's (a warp-uniform branch),
// so a block the warp sees whole is not tested score by score because the tile's first rows do not: with 192-row
// tiles over 128-key blocks (head dim 64, three consumers) or 80-key blocks (head dim 256) the tile's diagonal band
// covers two or three key blocks where each warp's covers one or two. kRightOnly: a block cut only by the right
// bound (the causal diagonal, below kv_len, no left bound in reach) takes one compare per score, against a limit
// formed once, instead of three.
template <int kBlockKV, bool kOwnRows = false, bool kRightOnly = false, int kMTiles, int kSTiles>
__device__ __forceinline__ void mask_key_block(float (&acc_s)[kMTiles][kSTiles][4], int kv0, int row0,
                                               int q_rows_valid, int warp_row0, int lane, int lo_off, int hi_off,
                                               int kv_len) {
  const int first_row = kOwnRows ? row0 + warp_row0 : row0;
  const int last_row = kOwnRows ? row0 + min(warp_row0 + 16 * kMTiles, q_rows_valid) - 1 : row0 + q_rows_valid - 1;
  if (kv0 >= last_row + lo_off && kv0 + kBlockKV - 1 <= first_row + hi_off && kv0 + kBlockKV <= kv_len) return;
  // col - row for element (m, n, e) = diag0 + 8n + e%2 - 16m - 8*(e/2)
  const int diag0 = kv0 + 2 * (lane % 4) - (row0 + warp_row0 + lane / 4);
  const int col0 = kv0 + 2 * (lane % 4);
  if constexpr (kRightOnly) {
    if (kv0 >= last_row + lo_off && kv0 + kBlockKV <= kv_len) {  // only the right bound cuts this block
      const int limit = hi_off - diag0;  // element (m, n, e) is visible iff its d <= limit
      hide_scores(acc_s, [limit](int d, int) { return d > limit; });
      return;
    }
  }
  hide_scores(acc_s, [=](int d, int c) {
    const int diag = diag0 + d;
    const int col = col0 + c;
    return diag < lo_off || diag > hi_off || col >= kv_len;
  });
}

// mask_key_block for packed GQA tiles (common/params.h, pack_gqa): a tile row is a query position of one of the
// group's heads, so the bounds apply to the positions, no longer linear in the row. pos[m][h]: the position of this
// lane's row 16m + lane/4 + 8h of the warp; first_pos / last_pos: those of the tile's first and last valid rows.
template <int kBlockKV, int kMTiles, int kSTiles>
__device__ __forceinline__ void mask_key_block_packed(float (&acc_s)[kMTiles][kSTiles][4], int kv0, int first_pos,
                                                      int last_pos, const int (&pos)[kMTiles][2], int lane,
                                                      int lo_off, int hi_off, int kv_len) {
  if (kv0 >= last_pos + lo_off && kv0 + kBlockKV - 1 <= first_pos + hi_off && kv0 + kBlockKV <= kv_len) return;
  const int col0 = kv0 + 2 * (lane % 4);
#pragma unroll
  for (int m = 0; m < kMTiles; ++m)
#pragma unroll
    for (int n = 0; n < kSTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = col0 + n * 8 + (e % 2);
        const int diag = col - pos[m][e / 2];
        if (diag < lo_off || diag > hi_off || col >= kv_len) acc_s[m][n][e] = -INFINITY;
      }
}

}  // namespace jax_flash
