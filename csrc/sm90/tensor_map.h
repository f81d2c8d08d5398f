// Host side of the TMA loads: a 4-D tiled tensor map over a (B, S, H, D) tensor, boxes of (64 columns, rows, 1, 1)
// with the 128-byte swizzle the wgmma descriptors expect. cuTensorMapEncodeTiled is a driver function; it is looked
// up through the runtime once, so the module needs no link against libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

namespace jax_flash::sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(std::string& failure) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) failure = "cuTensorMapEncodeTiled is not available from the CUDA driver";
  return encode;
}

// `map` over `base`, a tensor of `type` and `rank` dimensions (innermost first, the first contiguous) with the byte
// strides of the others, in boxes of `box` elements, 128-byte swizzled; what() names the tensor in the error (built
// only then: every sm90 call encodes four maps). Elements past the dimensions read as zeros and are not written.
// Returns "" on success.
template <int kRank, class Describe>
std::string encode_swizzled_map(CUtensorMap* map, const void* base, CUtensorMapDataType type,
                                const cuuint64_t (&dims)[kRank],
                                const cuuint64_t (&strides_bytes)[kRank - 1], const cuuint32_t (&box)[kRank],
                                Describe what) {
  std::string failure;
  auto encode = tensor_map_encoder(failure);
  if (encode == nullptr) return failure;
  cuuint32_t element_strides[kRank];
  for (int i = 0; i < kRank; ++i) element_strides[i] = 1;
  const CUresult result = encode(
      map, type, kRank, const_cast<void*>(base),
      dims, strides_bytes, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return "cuTensorMapEncodeTiled failed (error " + std::to_string(static_cast<int>(result)) + ") for " + what();
  }
  return {};
}

inline CUtensorMapDataType half_type(bool bf16) {
  return bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// `map` over base (B, S, H, D) of `type` (element_bytes each) with element strides (batch, seq, head; D
// contiguous), box (128 bytes of columns, box_rows, 1, 1). Rows past S read as zeros.
inline std::string encode_bshd_map(CUtensorMap* map, const void* base, CUtensorMapDataType type, int element_bytes,
                                   int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t batch_stride,
                                   int64_t seq_stride, int64_t head_stride, int box_rows) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seq),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t bytes = static_cast<cuuint64_t>(element_bytes);
  const cuuint64_t strides_bytes[3] = {static_cast<cuuint64_t>(seq_stride) * bytes,
                                       static_cast<cuuint64_t>(head_stride) * bytes,
                                       static_cast<cuuint64_t>(batch_stride) * bytes};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / element_bytes), static_cast<cuuint32_t>(box_rows), 1, 1};
  return encode_swizzled_map(map, base, type, dims, strides_bytes, box, [&] {
    return "a (" + std::to_string(batch) + ", " + std::to_string(seq) + ", " + std::to_string(heads) + ", " +
           std::to_string(head_dim) + ") tensor";
  });
}
// ... of float16 or bfloat16 (box (64, box_rows, 1, 1)).
inline std::string encode_bshd_map(CUtensorMap* map, const void* base, bool bf16, int64_t batch, int64_t seq,
                                   int64_t heads, int64_t head_dim, int64_t batch_stride, int64_t seq_stride,
                                   int64_t head_stride, int box_rows) {
  return encode_bshd_map(map, base, half_type(bf16), 2, batch, seq, heads, head_dim, batch_stride, seq_stride,
                         head_stride, box_rows);
}

// Packed GQA (common/params.h, pack_gqa): `map` over the same (B, S, H, D) tensor seen as (B, S, Hk, G, D), heads
// h = kv_head * G + g, dims innermost first (D, G, S, Hk, B), box (64, G, box_positions, 1, 1). A box is G x
// box_positions rows of 64 columns in shared memory, row r = position r / G of head g = r % G: the rows of a packed
// tile, laid out (and swizzled) as a 2-D box of as many rows would be. Positions past S read as zeros and are not
// written.
inline std::string encode_packed_map(CUtensorMap* map, const void* base, bool bf16, int64_t batch, int64_t seq,
                                     int64_t heads_k, int64_t group, int64_t head_dim, int64_t batch_stride,
                                     int64_t seq_stride, int64_t head_stride, int box_positions) {
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(group),
                              static_cast<cuuint64_t>(seq), static_cast<cuuint64_t>(heads_k),
                              static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides_bytes[4] = {static_cast<cuuint64_t>(head_stride) * 2,
                                       static_cast<cuuint64_t>(seq_stride) * 2,
                                       static_cast<cuuint64_t>(head_stride * group) * 2,
                                       static_cast<cuuint64_t>(batch_stride) * 2};
  const cuuint32_t box[5] = {64, static_cast<cuuint32_t>(group), static_cast<cuuint32_t>(box_positions), 1, 1};
  return encode_swizzled_map(map, base, half_type(bf16), dims, strides_bytes, box, [&] {
    return "a packed (" + std::to_string(batch) + ", " + std::to_string(seq) + ", " + std::to_string(heads_k) +
           " x " + std::to_string(group) + ", " + std::to_string(head_dim) + ") tensor";
  });
}

// The backward's dQ accumulator: `map` over a contiguous float32 (B, S, H, D) tensor, box (32, box_rows, 1, 1) (the
// 128 bytes a swizzled row holds), for TMA reduce-adds. Rows past S are not written.
inline std::string encode_dq_accum_map(CUtensorMap* map, float* base, int64_t batch, int64_t seq, int64_t heads,
                                       int64_t head_dim, int box_rows) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seq),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides_bytes[3] = {static_cast<cuuint64_t>(heads * head_dim) * 4,
                                       static_cast<cuuint64_t>(head_dim) * 4,
                                       static_cast<cuuint64_t>(seq * heads * head_dim) * 4};
  const cuuint32_t box[4] = {32, static_cast<cuuint32_t>(box_rows), 1, 1};
  return encode_swizzled_map(map, base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, dims, strides_bytes, box, [&] {
    return "the float32 dq accumulator (" + std::to_string(batch) + ", " + std::to_string(seq) + ", " +
           std::to_string(heads) + ", " + std::to_string(head_dim) + ")";
  });
}

}  // namespace jax_flash::sm90
