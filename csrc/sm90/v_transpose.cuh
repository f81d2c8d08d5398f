// FP8's V^T, written in shared memory. FP8 wgmma reads its B operand K-major only, so O += P V needs V as (D, keys).
// The producer (producer.cuh) copies each key block of V (B, Sk, Hk, D) into one of two raw buffers in turn as TMA
// loads it (SmemView::vraw: (kBlockKV, D) in 128-byte swizzled rows, like a K stage); warps 1-3 of the producer
// warpgroup (96 threads) wait for it and for the block's V stage to be free, write the stage's V^T, and release
// both.
//
// V^T stage: kVtPanels panels of [D rows][128 key positions], 128-byte swizzled like every tile (16-byte chunk c of
// row d at chunk c ^ (d % 8)). Within each 32 positions, position 16h + 4c + 2u + w holds key 16h + 8u + 2c + w:
// the order of P's k32 A fragments (fragments.cuh, pack_k32_e4m3), so the consumers pack P with no exchange between
// lanes: positions 4c .. 4c + 3 (+ 16) hold keys 2c + {0, 1, 8, 9} (+ 16).
#pragma once

#include <cstdint>

#include "sm90/pipeline.cuh"
#include "sm90/ptx.cuh"
#include "sm90/shared_storage.cuh"

namespace jax_flash::sm90 {

// The transposing threads: warps 1-3 of warpgroup 0 (warp 0 issues the copies).
inline constexpr int kVTransposeThreads = 96;

template <class T, class V>
struct VTransposer {
  using P = Pipeline<T, V>;
  static_assert(T::kFp8 && T::kHeadDim % 128 == 0 && T::kBlockKV % 32 == 0, "V^T of FP8 blocks of 32-key groups");
  static constexpr int kGroups = T::kBlockKV / 32;  // 32-key groups of a block
  static constexpr int kChunks = T::kHeadDim / 16;  // 16-byte column chunks of D
  static constexpr int kWarps = kVTransposeThreads / 32;
  static constexpr int kUnitChunks = 4;                          // chunks of a work unit
  static constexpr int kUnitsPerGroup = kChunks / kUnitChunks;
  static constexpr int kUnits = kGroups * kUnitsPerGroup;
  static_assert(kChunks % kUnitChunks == 0, "whole work units per 32-key group");

  SmemView<T> s;

  // The raw block at `raw` as V^T into the stage at `vt`, one (32-key group n, 16-column chunk c) per warp step.
  // Work unit: a group's run of 4 chunks; warp w takes units w, w + kWarps, ... (128 keys at D = 128: 8 units, so
  // 12 / 12 / 8 steps per warp where whole groups gave 16 / 8 / 8).
  //
  // Step: one transposed ldmatrix.x4 of the group's keys 8i .. 8i + 7 (matrix i, row r = lane l % 8 at lane l = 8i +
  // r) at chunk c gives lane l (c4 = l % 4, j = l / 4) register i = keys 8i + 2 c4 and + 1, each at columns 2j and
  // 2j + 1 of the chunk. Byte permutes of registers 0 / 1 (2 / 3) gather column 2j or 2j + 1 of keys 2 c4 + {0, 1,
  // 8, 9} (+ 16): V^T positions 4 c4 .. 4 c4 + 3 of the group's first (second) 16. One stmatrix.x4 writes them:
  // matrix i row r is V^T row 16c + 2r + u, u = (i % 2) xor (r >= 4), at half i / 2. Lanes j >= 4 take the other
  // column of their pair (the permute's selector is the lane's, so no select), so the 8 rows of each matrix hold
  // rows of both parities and fall in 8 distinct 16-byte chunks; with one parity per matrix, rows 2r % 8 took 4
  // chunks (2-way conflicts). Each ldmatrix and stmatrix phase (a matrix: 8 rows of 16 bytes) is one conflict-free
  // wavefront. 7 instructions a step besides the addresses, 16 steps a warp per 192-key block: the transposing
  // warps share the consumers' schedulers. 4-byte loads with 4 x 4 byte transposes (about 300 instructions a
  // block) ran at 0.87x, the form with selects (11 a step, whole groups per warp) at 0.94x the rate of the
  // XLA-transposed V^T build timed beside it (H200, 16384 keys, non-causal); this form +2 to +7% over that one at
  // 512 / 1024 keys, within the spread from 2048.
  __device__ __forceinline__ void transpose_block(const char* raw, char* vt, int warp, int lane) const {
    const int i = lane >> 3, r = lane & 7;  // the matrix and row this lane addresses
    // the column of its pair this lane's registers 0 / 2 take (1 / 3 the other): 2j for j < 4, 2j + 1 for j >= 4
    const bool odd = (lane >> 2) >= 4;
    const uint32_t first = odd ? 0x7531u : 0x6420u, second = odd ? 0x6420u : 0x7531u;
    // raw: key 8i + r of group 0 at chunk 0 (xor c << 4 for chunk c: rows are 128-byte aligned)
    const uint32_t raw_lane = smem_address(raw) + lane * T::kRowBytes + (r << 4);
    // V^T: row 2r + ((i % 2) xor (r >= 4)) of chunk 0, at position half i / 2 of group 0
    const int row = 2 * r + ((i & 1) ^ (r >> 2));
    const uint32_t vt_lane = smem_address(vt) + row * T::kRowBytes + (((i >> 1) ^ (row & 7)) << 4);
#pragma unroll 1
    for (int unit = warp; unit < kUnits; unit += kWarps) {
      const int n = unit / kUnitsPerGroup, c0 = (unit % kUnitsPerGroup) * kUnitChunks;
      const uint32_t raw_unit = (raw_lane + n * 32 * T::kRowBytes + (c0 / 8) * T::kKVPanelBytes) ^ ((c0 % 8) << 4);
      // group n: panel n / 4, positions 32 (n % 4): the 16-byte half h is chunk 2 (n % 4) + h before the swizzle
      const uint32_t vt_unit = ((vt_lane + (n / 4) * T::kVtPanelBytes) ^ ((2 * (n % 4)) << 4)) + c0 * 16 * T::kRowBytes;
#pragma unroll
      for (int c = 0; c < kUnitChunks; ++c) {
        uint32_t key_pairs[4];
        ldmatrix_x4_trans(raw_unit ^ (c << 4), key_pairs);
        const uint32_t out[4] = {__byte_perm(key_pairs[0], key_pairs[1], first),
                                 __byte_perm(key_pairs[0], key_pairs[1], second),
                                 __byte_perm(key_pairs[2], key_pairs[3], first),
                                 __byte_perm(key_pairs[2], key_pairs[3], second)};
        stmatrix_x4(vt_unit + c * 16 * T::kRowBytes, out);
      }
    }
  }

  // Blocks in the producer's order until it marks the end (VRawState::done).
  __device__ __forceinline__ void run() const {
    const int t = static_cast<int>(threadIdx.x) - 32;
    const int warp = t / 32, lane = t % 32;
    VRawState* const raw = s.vraw_state();
    for (int step = 0;; ++step) {
      const int b = P::vraw_buffer_of(step);
      mbarrier_wait(&raw->full[b], P::vraw_parity_of(step));
      if (*reinterpret_cast<volatile int*>(&raw->done) != 0) return;
      const int stage = P::stage_of(step);
      mbarrier_wait(s.v_empty(stage), P::parity_of(step) ^ 1);  // the consumers are done with the stage's last V^T
      transpose_block(s.vraw(b), s.v(stage), warp, lane);
      fence_proxy_async_smem();  // (the wgmma reads V^T through the async proxy)
      mbarrier_arrive(s.v_full(stage));
      mbarrier_arrive(&raw->empty[b]);
    }
  }
};

}  // namespace jax_flash::sm90
