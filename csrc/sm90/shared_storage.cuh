// The shared-memory layout of one sm90-family thread block: SharedStorage declares it (the kernel's dynamic shared
// memory is its sizeof plus the slack that lets the kernel round its base up to the 1024-byte swizzle atom), and
// SmemView forms the addresses of its regions from the block's base pointer and the members' byte offsets.
// Host-compilable (the registry and the launcher read the size).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "sm90/tile_scheduler.cuh"  // TileSlot

namespace jax_flash::sm90 {

// What a layout depends on, as one literal value (a template argument): the traits fill it in.
struct SmemShape {
  int q_bytes;       // one Q tile (kBlockQ, D): head_dim / 64 swizzled panels of [rows][64]
  int q_buffers;     // 2: the next tile's Q lands while this one's is read; 1 where 227 KB do not allow two
  bool o_in_kv;      // O is staged in the tile's final K / V stage instead of a buffer of its own
  int k_bytes;       // one K stage (kBlockKV, D)
  int v_bytes;       // one V stage (kBlockKV, D); FP8: V^T, (D, kBlockKV) in whole 128-key panels
  int stages;        // depth of the K/V ring
  int p_bytes;       // P of one consumer (64, kBlockKV) where P goes through shared memory, else 0
  int consumers;     // consumer warpgroups
  bool split_state;  // the split tail's shared state (split_tail.cuh)
  int o_bytes;       // O's staging buffer (kBlockQ, D) of the output dtype (q_bytes but for FP8 inputs)
  int vraw_bytes;    // FP8: one V block (kBlockKV, D) as loaded, before v_transpose.cuh writes its V^T stage; else 0
  int vraw_buffers;  // FP8: how many (2); else 0
};

// `s` with its Q buffering replaced (the traits size the candidates to choose between them).
constexpr SmemShape with_q_buffers(SmemShape s, int q_buffers, bool o_in_kv) {
  s.q_buffers = q_buffers;
  s.o_in_kv = o_in_kv;
  return s;
}

// A region of N bytes that takes no space when N = 0 ([[no_unique_address]] members of distinct Tag types).
template <int N, class Tag>
struct Bytes {
  char data[N];
};
template <class Tag>
struct Bytes<0, Tag> {};
struct OTag;
struct PTag;
struct SplitTag;
struct VRawTag;
struct VRawStateTag;

// The split tail's shared state: the producer's position in its share (the tile among the split ones, its first key
// block, the share's key blocks left) and what tile n of the block is, at kind[n % 4] (split_tail.cuh).
struct SplitState {
  int tile, first_block, blocks_left;
  int unused;  // (padding: the layout the split tail was measured with)
  int kind[4];
};

// FP8's raw V buffers (one block each, used in turn; v_transpose.cuh): buffer b's TMA copy completes on full[b],
// the transposing threads release it on empty[b]; `done` is set before the producer's last arrival on the next
// buffer's `full`, which carries no block.
struct VRawState {
  uint64_t full[2], empty[2];
  int done;
};

// Every tile region starts on a 1024-byte boundary (each is a whole number of 8-row swizzle atoms: 64 rows of Q,
// kBlockKV rows of K / V, a multiple of 8); the barriers and slots follow them.
template <SmemShape kS>
struct SharedStorage {
  char q[kS.q_buffers][kS.q_bytes];                                   // [q_buffers] (kBlockQ, D)
  [[no_unique_address]] Bytes<kS.o_in_kv ? 0 : kS.o_bytes, OTag> o;   // (kBlockQ, D): O's own staging buffer
  char k[kS.stages][kS.k_bytes];                                      // [stages] (kBlockKV, D)
  char v[kS.stages][kS.v_bytes];                                      // [stages] (kBlockKV, D) or V^T
  [[no_unique_address]] Bytes<kS.consumers * kS.p_bytes, PTag> p;     // [consumers] (64, kBlockKV)
  [[no_unique_address]] Bytes<kS.vraw_bytes * kS.vraw_buffers, VRawTag> vraw;  // FP8: [vraw_buffers] (kBlockKV, D)
  // mbarriers
  uint64_t q_full[kS.q_buffers];   // the buffer's Q has landed
  uint64_t q_empty[kS.q_buffers];  // the consumers no longer read it
  uint64_t k_full[kS.stages], v_full[kS.stages];
  uint64_t k_empty[kS.stages], v_empty[kS.stages];
  uint64_t sched_full[2];   // the tile slot holds the block's next tile
  uint64_t sched_empty[2];  // the consumers have read it
  TileSlot sched[2];        // the tiles the producer publishes (tile_scheduler.cuh)
  // the key range of the block's tile n at [n % 4] (split-KV), read by its epilogue rather than held through the
  // key loop: written before the tile is published, and the producer reaches tile n + 4 only after the consumers
  // have taken tile n + 2, so after tile n's epilogue
  int tile_split[4];
  [[no_unique_address]] std::conditional_t<kS.split_state, SplitState, Bytes<0, SplitTag>> split;
  [[no_unique_address]] std::conditional_t<(kS.vraw_bytes > 0), VRawState, Bytes<0, VRawStateTag>> vraw_state;
};

// The 128-byte swizzle is a function of address bits 4-9: the kernel rounds its dynamic shared-memory base up to a
// 1024-byte boundary, which costs at most this much.
inline constexpr int kSmemAlignSlack = 1024;

template <SmemShape kS>
inline constexpr int kSmemBytesOf = static_cast<int>(sizeof(SharedStorage<kS>)) + kSmemAlignSlack;

// Byte offsets of the regions of SharedStorage<kS>.
template <SmemShape kS>
struct SmemOffsets {
  using S = SharedStorage<kS>;
  static constexpr int kQ = offsetof(S, q);
  // (o_in_kv: no buffer of its own; the epilogue stages O in the tile's final K / V stage)
  static constexpr int kO = kS.o_in_kv ? -1 : static_cast<int>(offsetof(S, o));
  static constexpr int kK = offsetof(S, k);
  static constexpr int kV = offsetof(S, v);
  static constexpr int kP = kV + kS.stages * kS.v_bytes;
  static constexpr int kVRaw = kP + kS.consumers * kS.p_bytes;
  static constexpr int kVRawState = offsetof(S, vraw_state);
  static constexpr int kQFull = offsetof(S, q_full);
  static constexpr int kQEmpty = offsetof(S, q_empty);
  static constexpr int kKFull = offsetof(S, k_full);
  static constexpr int kVFull = offsetof(S, v_full);
  static constexpr int kKEmpty = offsetof(S, k_empty);
  static constexpr int kVEmpty = offsetof(S, v_empty);
  static constexpr int kSchedFull = offsetof(S, sched_full);
  static constexpr int kSchedEmpty = offsetof(S, sched_empty);
  static constexpr int kSched = offsetof(S, sched);
  static constexpr int kTileSplit = offsetof(S, tile_split);
  static constexpr int kSplit = offsetof(S, tile_split) + sizeof(S::tile_split);
  static_assert(kQ % 1024 == 0 && kK % 1024 == 0 && kV % 1024 == 0 && kP % 1024 == 0 && kVRaw % 1024 == 0,
                "tile regions must start on the 1024-byte swizzle atom");
};

// Typed pointers into one block's shared memory (base: the 1024-byte aligned start). The addresses are formed as
// base + offset + index * size, the form the kernels were tuned with: the same layout reached through member
// accesses of SharedStorage compiled to different address arithmetic, which spilled the 32-register producer.
template <class T>
struct SmemView {
  using Off = SmemOffsets<T::kShape>;
  char* base;

  __device__ __forceinline__ char* q(int buffer) const { return base + Off::kQ + buffer * T::kQBytes; }
  __device__ __forceinline__ char* o() const { return base + Off::kO; }
  __device__ __forceinline__ char* k(int stage) const { return base + Off::kK + stage * T::kKBytes; }
  __device__ __forceinline__ char* v(int stage) const { return base + Off::kV + stage * T::kVBytes; }
  __device__ __forceinline__ char* p(int consumer) const { return base + Off::kP + consumer * T::kPBytes; }
  __device__ __forceinline__ char* vraw(int buffer) const { return base + Off::kVRaw + buffer * T::kVRawBytes; }
  // mbarriers
  __device__ __forceinline__ uint64_t* q_full(int b) const { return bar(Off::kQFull) + b; }
  __device__ __forceinline__ uint64_t* q_empty(int b) const { return bar(Off::kQEmpty) + b; }
  __device__ __forceinline__ uint64_t* k_full(int stage) const { return bar(Off::kKFull) + stage; }
  __device__ __forceinline__ uint64_t* v_full(int stage) const { return bar(Off::kVFull) + stage; }
  __device__ __forceinline__ uint64_t* k_empty(int stage) const { return bar(Off::kKEmpty) + stage; }
  __device__ __forceinline__ uint64_t* v_empty(int stage) const { return bar(Off::kVEmpty) + stage; }
  __device__ __forceinline__ uint64_t* sched_full(int slot) const { return bar(Off::kSchedFull) + slot; }
  __device__ __forceinline__ uint64_t* sched_empty(int slot) const { return bar(Off::kSchedEmpty) + slot; }
  __device__ __forceinline__ TileSlot* sched() const { return reinterpret_cast<TileSlot*>(base + Off::kSched); }
  __device__ __forceinline__ int* tile_split() const { return reinterpret_cast<int*>(base + Off::kTileSplit); }
  __device__ __forceinline__ SplitState* split() const { return reinterpret_cast<SplitState*>(base + Off::kSplit); }
  __device__ __forceinline__ VRawState* vraw_state() const {
    return reinterpret_cast<VRawState*>(base + Off::kVRawState);
  }

 private:
  __device__ __forceinline__ uint64_t* bar(int offset) const { return reinterpret_cast<uint64_t*>(base + offset); }
};

}  // namespace jax_flash::sm90
