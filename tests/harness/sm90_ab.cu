// Standalone timing of the sm90 family's unmasked kernels, for A/B experiments on the kernel body without a package
// build (docs/NOTES.md, session 7). Compile one binary per variant (-DJAX_FLASH_SM90_VARIANT=N overrides the
// switches of csrc/sm90/kernel.cuh; without it, the shipped ones, printed as variant -1) and run them alternately on
// the GPU machine (docs/ab_session7/run.sh); each prints one line per shape:
//   sm90_ab [--check] [D S]  (--check: first compare one small case per head dim with the CPU implementation;
//                             D S: only that shape, e.g. for Nsight Compute)
// Shapes are the benchmark's (batch x seq = 16384 tokens, heads x head_dim = 2048), bf16, non-causal, keys a
// multiple of 128 (the unmasked variant). Time: median over 7 repetitions of back-to-back launches lasting >= 25 ms.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/params.h"
#include "cpu/attention_cpu.h"
#include "sm90/launch.cuh"

#ifdef JAX_FLASH_SM90_VARIANT
constexpr int kVariant = JAX_FLASH_SM90_VARIANT;
#else
constexpr int kVariant = -1;  // the shipped switches (csrc/sm90/traits.cuh)
#endif

using namespace jax_flash;

#define CHECK_CUDA(call)                                                                            \
  do {                                                                                              \
    cudaError_t err_ = (call);                                                                      \
    if (err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                 \
    }                                                                                               \
  } while (0)

namespace {

constexpr KernelKey key_for(int head_dim) {
  // The shipped non-causal configs: q128, kv128, 2 stages, 2 consumers, pingpong, overlap.
  return KernelKey{.dtype = static_cast<int>(DType::kBFloat16), .head_dim = head_dim, .block_q = 128, .block_kv = 128,
                   .num_warps = 12, .async_copy = true, .eager_load_blocks = true, .swizzled = true,
                   .q_mma_load_k_fragments = 2, .k_mma_load_k_fragments = 1, .v_mma_load_k_fragments = 1,
                   .mma_double_buffer_loads = true, .optimized_softmax = true, .family = 90, .stages = 2,
                   .consumer_warpgroups = 2, .pingpong = true, .overlap = true};
}

// run_attention_sm90 restricted to the unmasked, uncapped kernel (one instantiation per key compiles faster).
template <KernelKey kKey>
std::string launch_unmasked(AttentionParams p, cudaStream_t stream) {
  using T = sm90::Traits<kKey>;
  p.num_q_blocks = (p.seqlen_q + T::kBlockQ - 1) / T::kBlockQ;
  CUtensorMap mq{}, mk{}, mv{};
  std::string f = sm90::encode_bshd_map(&mq, p.q, true, p.batch, p.seqlen_q, p.heads_q, p.head_dim, p.q_batch_stride,
                                        p.q_seq_stride, p.q_head_stride, T::kBlockQ);
  if (f.empty()) f = sm90::encode_bshd_map(&mk, p.k, true, p.batch, p.seqlen_k, p.heads_k, p.head_dim,
                                           p.k_batch_stride, p.k_seq_stride, p.k_head_stride, T::kBlockKV);
  if (f.empty()) f = sm90::encode_bshd_map(&mv, p.v, true, p.batch, p.seqlen_k, p.heads_k, p.head_dim,
                                           p.v_batch_stride, p.v_seq_stride, p.v_head_stride, T::kBlockKV);
  if (!f.empty()) return f;
  if (p.seqlen_k % T::kBlockKV != 0) return "keys must be a multiple of block_kv";
  return sm90::launch_sm90<T, false, false>(p, mq, mk, mv, stream);
}

uint16_t bf16_bits(float x) {
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float bf16_value(uint16_t b) {
  __nv_bfloat16 h;
  std::memcpy(&h, &b, 2);
  return __bfloat162float(h);
}

struct Problem {
  int batch, seq, heads, head_dim;
  std::vector<uint16_t> q, k, v;  // host copies (B, S, H, D)
  uint16_t *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  unsigned long long* dcounter = nullptr;
  Problem(int b, int s, int h, int d) : batch(b), seq(s), heads(h), head_dim(d) {
    const size_t n = static_cast<size_t>(b) * s * h * d;
    uint32_t state = 12345u + s + d;
    auto uniform = [&] {  // in [-2, 2)
      state = state * 1664525u + 1013904223u;
      return (state >> 8) * (4.0f / 16777216.0f) - 2.0f;
    };
    for (auto* t : {&q, &k, &v}) {
      t->resize(n);
      for (auto& x : *t) x = bf16_bits(uniform());
    }
    for (auto [dst, src] : {std::pair{&dq, &q}, {&dk, &k}, {&dv, &v}}) {
      CHECK_CUDA(cudaMalloc(dst, n * 2));
      CHECK_CUDA(cudaMemcpy(*dst, src->data(), n * 2, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&dout, n * 2));
    CHECK_CUDA(cudaMalloc(&dcounter, sizeof(unsigned long long)));
  }
  ~Problem() {
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dout);
    cudaFree(dcounter);
  }
  AttentionParams params() const {
    AttentionParams p = make_contiguous_params(dq, dk, dv, dout, batch, seq, seq, heads, heads, head_dim,
                                               1.0f / std::sqrt(static_cast<float>(head_dim)));
    p.tile_counter = dcounter;
    return p;
  }
};

template <int kHeadDim>
std::string run(const Problem& pr, cudaStream_t stream) {
  return launch_unmasked<key_for(kHeadDim)>(pr.params(), stream);
}

std::string run_any(const Problem& pr, cudaStream_t stream) {
  return pr.head_dim == 64 ? run<64>(pr, stream) : run<128>(pr, stream);
}

// Max |GPU - CPU| over a small problem (bf16 output; the CPU implementation computes in fp32).
float check(int head_dim) {
  Problem pr(2, 384, 2, head_dim);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::string f = run_any(pr, stream);
  if (!f.empty()) {
    std::fprintf(stderr, "launch failed: %s\n", f.c_str());
    std::exit(3);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const size_t n = pr.q.size();
  std::vector<uint16_t> gpu(n), cpu(n);
  CHECK_CUDA(cudaMemcpy(gpu.data(), pr.dout, n * 2, cudaMemcpyDeviceToHost));
  AttentionParams p = make_contiguous_params(pr.q.data(), pr.k.data(), pr.v.data(), cpu.data(), pr.batch, pr.seq,
                                             pr.seq, pr.heads, pr.heads, head_dim,
                                             1.0f / std::sqrt(static_cast<float>(head_dim)));
  attention_cpu(p, CpuElement::kBFloat16, 64, 64, 8);
  float worst = 0.0f;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(bf16_value(gpu[i]) - bf16_value(cpu[i])));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  const bool do_check = argc > 1 && std::string(argv[1]) == "--check";
  const int first = do_check ? 2 : 1;
  const int only_d = argc > first + 1 ? std::atoi(argv[first]) : 0;
  const int only_s = argc > first + 1 ? std::atoi(argv[first + 1]) : 0;
  if (do_check) {
    for (int d : {64, 128}) {
      const float err = check(d);
      std::printf("variant %d check D=%d: max |gpu - cpu| = %.4f %s\n", kVariant, d, err,
                  err <= 4e-2f ? "ok" : "FAIL");
      if (!(err <= 4e-2f)) return 1;
    }
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int d : {64, 128}) {
    for (int s : {512, 1024, 4096, 16384}) {
      if (only_d != 0 && (d != only_d || s != only_s)) continue;
      Problem pr(16384 / s, s, 2048 / d, d);
      for (int i = 0; i < 3; ++i) run_any(pr, stream);  // warm up, opt in to the shared memory
      // launches per repetition so that one lasts >= 25 ms
      CHECK_CUDA(cudaEventRecord(start, stream));
      run_any(pr, stream);
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float one_ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&one_ms, start, stop));
      const int calls = std::max(3, static_cast<int>(25.0f / std::max(one_ms, 1e-3f)));
      std::vector<float> per_call;
      for (int rep = 0; rep < 7; ++rep) {
        CHECK_CUDA(cudaEventRecord(start, stream));
        for (int i = 0; i < calls; ++i) run_any(pr, stream);
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0.0f;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        per_call.push_back(ms / calls);
      }
      CHECK_CUDA(cudaGetLastError());
      std::sort(per_call.begin(), per_call.end());
      const double ms = per_call[per_call.size() / 2];
      const double flops = 4.0 * pr.batch * pr.heads * double(s) * s * d;
      std::printf("variant %d D=%d S=%d: %.1f us %.1f TFLOP/s (min %.1f us)\n", kVariant, d, s,
                  ms * 1e3, flops / ms / 1e9, per_call.front() * 1e3);
    }
  }
  return 0;
}
