// The sm90 forward's tile entries for segment ids (sm90/segment_tiles.cuh): what the FFI handler sizes its scratch
// by and the kernels read.
#pragma once

#include <cstdint>

#include "common/visibility.h"  // JAX_FLASH_HOST_DEVICE

namespace jax_flash::sm90 {

// One tile of a batch row (32 bytes). rows == 0: no tile (a row that uses fewer slots than the longest).
struct SegmentTile {
  int first, end;      // query-block tiles: the key blocks whose id range meets the rows' (first, end)
  int q_min, q_max;    // ... and the rows' (min, max) id
  int row0, rows;      // the tile's first row and its rows (document tiles: those of the document only)
  int doc_start;       // document tiles: the document's first row (and key); -1: a query-block tile
  int doc_end;         // document tiles: one past the document's last row (and key)
};
static_assert(sizeof(SegmentTile) == 32, "two 16-byte loads per tile");

// The pre-pass works in chunks of kSegmentChunk positions, a block each (sm90/segment_tiles.cuh); each row's chunk
// summaries follow the tiles of all rows in p.segment_tiles.
inline constexpr int kSegmentChunk = 1024;

// One chunk of a row's positions for document tiles: whether its ids are sorted (also against the id before it) and
// the same for queries and keys, its first document start (the chunk's end where none), its last (-1 where none),
// and the tiles that start in it from its first document start on.
struct ChunkSummary {
  int fits, first_start, last_start, tiles;
};
static_assert(sizeof(ChunkSummary) == 16, "one 16-byte load per chunk");

JAX_FLASH_HOST_DEVICE int segment_chunks(int seqlen) { return (seqlen + kSegmentChunk - 1) / kSegmentChunk; }

// Tile slots per batch row: twice the query blocks, so document tiles fit where documents average block_q rows or
// more (each document adds at most one tile beyond its rows / block_q); rows of shorter ones run query blocks.
JAX_FLASH_HOST_DEVICE int segment_tile_slots(int seqlen_q, int block_q) {
  return 2 * ((seqlen_q + block_q - 1) / block_q);
}

// Bytes of p.segment_tiles for a call: (batch, slots) tiles, then (batch, chunks of seqlen_q) summaries.
inline int64_t segment_tile_bytes(int64_t batch, int seqlen_q, int block_q) {
  return batch * (int64_t{segment_tile_slots(seqlen_q, block_q)} * int64_t{sizeof(SegmentTile)} +
                  int64_t{segment_chunks(seqlen_q)} * int64_t{sizeof(ChunkSummary)});
}

}  // namespace jax_flash::sm90
