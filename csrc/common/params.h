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

  // Softmax scaling: s = scale * q.k ; scale_log2 = scale * log2(e) for the exp2 path.
  float scale;
  float scale_log2;

  // Derived by the launcher for the chosen tile sizes.
  int num_q_blocks;   // ceil(seqlen_q / block_q)
  int num_kv_blocks;  // ceil(seqlen_k / block_kv)
};

// Fills strides for contiguous [B, S, H, D] tensors and the derived scale.
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
  return p;
}

}  // namespace jax_flash
