// Thin wrappers over the Hopper (sm_90a) instructions the sm90 family uses: mbarrier, TMA bulk tensor copies,
// wgmma synchronisation and shared-memory matrix descriptors, setmaxnreg, named barriers and proxy fences.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte opaque struct; only its type is needed in device code)

#include <cstdint>

#include "common/fragment_ops.cuh"  // smem_address

namespace jax_flash::sm90 {

// The lane index read by a volatile asm, which ptxas neither hoists out of loops nor keeps live across them: for
// addresses that are needed once per tile (the epilogue's), so they are not held in registers through the key loop.
__device__ __forceinline__ int lane_id_fresh() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// ---- mbarrier (64-bit shared-memory barrier with an arrival count and a transaction-byte count) ----------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of transactions (the TMA copies that will complete on this barrier).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

// `count` arrivals at once (one thread arriving for its warpgroup).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}

// Blocks until the phase with parity `parity` has completed (a fresh barrier is in phase 0, so waiting for
// parity 1 returns at once: the producer's first pass over the empty barriers).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// Non-blocking: whether the phase with parity `parity` has completed (mbarrier.test_wait never suspends the thread,
// unlike try_wait), so a wait can be tested early and its latency hidden under other work.
__device__ __forceinline__ bool mbarrier_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// ---- TMA: 4-D tiled copy global -> shared, completing `bytes` on an mbarrier ----------------------------------
// Coordinates are (head_dim column, sequence row, head, batch), innermost first, as in the tensor map.
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_address(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// The same copy over a 5-D map (the packed GQA Q map, tensor_map.h).
__device__ __forceinline__ void tma_load_5d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
      "%7}], [%2];\n" ::"r"(smem_address(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// ---- TMA: 4-D tiled copy shared -> global (the epilogue's O store), tracked by bulk async-groups -------------------
// Rows of the box outside the tensor are not written. The source must be visible to the async proxy first
// (fence_proxy_async_smem by every thread that wrote it, then a barrier).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_address(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void tma_store_5d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                             int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_address(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}
// TMA: 4-D tiled reduce shared -> global, each element of the box added (float32 add) to global memory; box elements
// outside the tensor are skipped. The same source visibility rule and bulk async-groups as tma_store_4d.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* smem_src, int c0, int c1, int c2,
                                                  int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_address(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// A 1-D bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global into shared memory,
// completing on `bar`'s transaction count.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_address(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_address(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's committed bulk stores, all but the kPending most recent groups, have finished reading shared memory
// (the source may be overwritten) ...
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// ... or have completed entirely (before the block exits).
__device__ __forceinline__ void bulk_wait_group0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// ---- wgmma synchronisation --------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Ties accumulator registers to this point: the compiler may not move their reads or writes across it (wgmma
// writes them asynchronously, which the compiler cannot see).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// ---- shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"), 128-byte swizzle --------------------
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4, 62-63 layout
// (1 = 128-byte swizzle). K-major tiles: rows of 64 elements (128 bytes), 8-row groups 1024 bytes apart (SBO);
// LBO is unused. MN-major (the transposed V operand): LBO = bytes between 64-element panels along N, SBO = 1024.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t smem_addr, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
  return (static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4)) |
         (static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

// The descriptor of the shared-memory address `bytes` further on: the start address (bits 0-13, in 16-byte units)
// plus bytes / 16, added to the low word alone. Shared-memory addresses stay below 2^18 (228 KB), so the field never
// carries into the leading-byte offset; the halves are re-paired with mov.b64 (no 64-bit add, no masks).
__device__ __forceinline__ uint64_t smem_offset(uint64_t desc, uint32_t bytes) {
  uint64_t r;
  asm("mov.b64 %0, {%1, %2};"
      : "=l"(r)
      : "r"(static_cast<uint32_t>(desc) + (bytes >> 4)), "r"(static_cast<uint32_t>(desc >> 32)));
  return r;
}

// ---- register reallocation between warpgroup roles ---------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- ldmatrix / stmatrix: four 8x8 b16 matrices between shared memory and mma-fragment registers -------------------
// Transposed load: lane t gives the shared address of row t%8 of matrix t/8 (16 bytes); register k of lane t receives
// rows 2*(t%4) and +1 of matrix k at column t/4 (the first row's element in the low half).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t smem_addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr)
               : "memory");
}

// Register k of lane t holds row t/4, columns 2*(t%4) and +1 of matrix k (the ldmatrix / mma.sync fragment layout);
// lane t gives the shared address of row t%8 of matrix t/8.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// The same, each matrix transposed: lane t's address receives column t%8 of matrix t/8 (its 8 rows' elements).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// ---- named barriers (id 0 is __syncthreads) and proxy fences ----------------------------------------------------
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA, wgmma) accesses.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- flags between thread blocks (the split tail, split_tail.cuh) -------------------------------------------------------
// Release: this thread's earlier global writes (and, after a CTA barrier, its block's: the barrier orders them before
// it) are visible at GPU scope to whoever acquires the flag's new value.
__device__ __forceinline__ void flag_store_release(unsigned* flag, unsigned value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned flag_load_acquire(const unsigned* flag) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

}  // namespace jax_flash::sm90
