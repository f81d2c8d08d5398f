// Standalone timing of the sm90 family's unmasked kernels, for A/B experiments on the kernel body without a package
// build (docs/NOTES.md, session 7). Compile one binary per variant (-DJAX_FLASH_SM90_VARIANT=N overrides the
// switches of csrc/sm90/kernel.cuh; without it, the shipped ones, printed as variant -1) and run them alternately on
// the GPU machine (docs/ab_session7/run.sh); each prints one line per shape:
//   sm90_ab [--check] [D [S [causal]]]  (--check: first compare 256-tile problems per head dim with the CPU
//                                        implementation; D: only that head dim's shapes; D S: only that shape,
//                                        e.g. for Nsight Compute)
// Shapes are the benchmark's (batch x seq = 16384 tokens, heads x head_dim = 2048), bf16, with the config
// cfg=None picks for each (run_shape). Time: median over 7 repetitions of back-to-back launches lasting >= 25 ms.
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
#include "harness_util.h"
#include "sm90/launch.cuh"

#ifdef JAX_FLASH_SM90_VARIANT
constexpr int kVariant = JAX_FLASH_SM90_VARIANT;
#else
constexpr int kVariant = -1;  // the shipped switches (csrc/sm90/traits.cuh)
#endif

using namespace jax_flash;


namespace {

// A/B builds: the K/V pipeline depth of the head-dim-64 configs, their key block for every shape (0: per shape, as
// shipped), and pingpong in the causal head-dim-128 config (shipped without)
#ifndef JAX_FLASH_AB_STAGES_D64
#define JAX_FLASH_AB_STAGES_D64 2
#endif
#ifndef JAX_FLASH_AB_D64_BLOCK_KV
#define JAX_FLASH_AB_D64_BLOCK_KV 0
#endif
// ... and their consumer warpgroups for every shape (3: 192-row tiles, 128-key blocks only; 2)
#ifndef JAX_FLASH_AB_D64_CONSUMERS  // 0: per shape, as shipped (Shape::consumers)
#define JAX_FLASH_AB_D64_CONSUMERS 0
#endif
// ... and pingpong between their consumers (shipped with)
#ifndef JAX_FLASH_AB_D64_PINGPONG
#define JAX_FLASH_AB_D64_PINGPONG true
#endif
// ... and three consumer warpgroups at head dim 128 (every shape; 192 x JAX_FLASH_AB_D128_3C_BLOCK_KV tiles; 0: as
// shipped, two)
#ifndef JAX_FLASH_AB_D128_3C_BLOCK_KV
#define JAX_FLASH_AB_D128_3C_BLOCK_KV 0
#endif
#ifndef JAX_FLASH_AB_D128_CAUSAL_PINGPONG
#define JAX_FLASH_AB_D128_CAUSAL_PINGPONG false
#endif
// ... and its key block and K/V stages (session 14: 64-key blocks for short causal)
#ifndef JAX_FLASH_AB_D128_CAUSAL_BLOCK_KV
#define JAX_FLASH_AB_D128_CAUSAL_BLOCK_KV 128
#endif
#ifndef JAX_FLASH_AB_D128_CAUSAL_STAGES
#define JAX_FLASH_AB_D128_CAUSAL_STAGES 2
#endif
// ... and head dim 256's key block and pingpong (non-causal; causal runs without, like head dim 128)
#ifndef JAX_FLASH_AB_D256_BLOCK_KV
#define JAX_FLASH_AB_D256_BLOCK_KV 80
#endif
#ifndef JAX_FLASH_AB_D256_PINGPONG
#define JAX_FLASH_AB_D256_PINGPONG true
#endif
constexpr KernelKey key_for(int head_dim, int block_kv = 128, bool pingpong = true, int consumers = 2, int stages = 0) {
  // The shipped configs (jax_flash/defaults.py, SM90_BY_SHAPE): 2 stages, 2 consumers (q128), overlap; D = 128
  // causal without pingpong; D = 64 with 3 consumers (q192), causal from 2048 keys (below, 2 consumers).
  return KernelKey{.dtype = static_cast<int>(DType::kBFloat16), .head_dim = head_dim, .block_q = 64 * consumers,
                   .block_kv = block_kv, .num_warps = 4 * (consumers + 1), .async_copy = true, .eager_load_blocks = true,
                   .swizzled = true, .q_mma_load_k_fragments = 2, .k_mma_load_k_fragments = 1,
                   .v_mma_load_k_fragments = 1, .mma_double_buffer_loads = true, .optimized_softmax = true,
                   .family = 90, .stages = stages != 0 ? stages : head_dim == 64 ? JAX_FLASH_AB_STAGES_D64 : 2,
                   .consumer_warpgroups = consumers, .pingpong = pingpong, .overlap = true};
}

constexpr int kBf16 = static_cast<int>(DType::kBFloat16);

struct Problem {
  int batch, seq, heads, head_dim;
  bool causal = false;
  std::vector<uint16_t> q, k, v;  // host copies (B, S, H, D)
  uint16_t *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  unsigned long long* dcounter = nullptr;
  void* dworkspace = nullptr;  // the split tail's scratch (launch.cuh), per SM the largest config's (head dim 256)
  int64_t workspace_bytes = 0;
  Problem(int b, int s, int h, int d) : batch(b), seq(s), heads(h), head_dim(d) {
    const size_t n = static_cast<size_t>(b) * s * h * d;
    uint32_t state = 12345u + s + d;
    auto uniform = [&] {  // in [-2, 2)
      state = state * 1664525u + 1013904223u;
      return (state >> 8) * (4.0f / 16777216.0f) - 2.0f;
    };
    for (auto* t : {&q, &k, &v}) {
      t->resize(n);
      for (auto& x : *t) x = harness::to_bits(uniform(), kBf16);
    }
    for (auto [dst, src] : {std::pair{&dq, &q}, {&dk, &k}, {&dv, &v}}) {
      CHECK_CUDA(cudaMalloc(dst, n * 2));
      CHECK_CUDA(cudaMemcpy(*dst, src->data(), n * 2, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&dout, n * 2));
    // the tile scheduler's counter (the launcher zeroes it before each launch; two words and zeroed here too so the
    // self-resetting counter of branch sm90-self-reset-counter runs in the same harness)
    CHECK_CUDA(cudaMalloc(&dcounter, 2 * sizeof(unsigned long long)));
    CHECK_CUDA(cudaMemset(dcounter, 0, 2 * sizeof(unsigned long long)));
    int device = 0, sms = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    workspace_bytes = int64_t{sms} * (sm90::Traits<key_for(256, JAX_FLASH_AB_D256_BLOCK_KV)>::kSplitSlotBytes + 64);
    CHECK_CUDA(cudaMalloc(&dworkspace, workspace_bytes));
  }
  ~Problem() {
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dout);
    cudaFree(dcounter);
    cudaFree(dworkspace);
  }
  AttentionParams params() const {
    AttentionParams p = make_contiguous_params(dq, dk, dv, dout, batch, seq, seq, heads, heads, head_dim,
                                               1.0f / std::sqrt(static_cast<float>(head_dim)));
    p.tile_counter = dcounter;
    p.split_workspace = dworkspace;
    p.split_workspace_bytes = workspace_bytes;
    if (causal) set_features(p, true, -1, 0, 0.0f, nullptr, nullptr, nullptr);
    return p;
  }
};

struct Shape {
  int head_dim, block_kv, seq;
  bool causal;
  int consumers = 2;  // the shipped config's consumer warpgroups
};

int consumers_of(const Shape& sh) {
  if (sh.head_dim == 128 && JAX_FLASH_AB_D128_3C_BLOCK_KV != 0) return 3;
  if (sh.head_dim != 64) return 2;
  return JAX_FLASH_AB_D64_CONSUMERS != 0 ? JAX_FLASH_AB_D64_CONSUMERS : sh.consumers;
}

int block_kv_of(const Shape& sh) {
  if (sh.head_dim == 256) return JAX_FLASH_AB_D256_BLOCK_KV;
  if (sh.head_dim == 128 && JAX_FLASH_AB_D128_3C_BLOCK_KV != 0) return JAX_FLASH_AB_D128_3C_BLOCK_KV;
  if (sh.head_dim == 128 && sh.causal) return JAX_FLASH_AB_D128_CAUSAL_BLOCK_KV;
  if (sh.head_dim == 64 && consumers_of(sh) == 3) return 128;
  return sh.head_dim == 64 && JAX_FLASH_AB_D64_BLOCK_KV != 0 ? JAX_FLASH_AB_D64_BLOCK_KV : sh.block_kv;
}

// The kernel of the shipped config for this shape (all mask / softcap variants compiled; masked when causal or the
// keys are not a multiple of the block).
std::string run_shape(const Shape& sh, const Problem& pr, cudaStream_t stream) {
  if (sh.head_dim == 64) {
    constexpr bool kPingpong = JAX_FLASH_AB_D64_PINGPONG;
    if (consumers_of(sh) == 3) {  // (three consumers have no registers for 192-key blocks)
      return sm90::run_attention_sm90<key_for(64, 128, kPingpong, 3)>(pr.params(), stream);
    }
    if (block_kv_of(sh) == 192) return sm90::run_attention_sm90<key_for(64, 192, kPingpong)>(pr.params(), stream);
    constexpr int kSmallBlock = JAX_FLASH_AB_D64_BLOCK_KV == 64 ? 64 : 128;  // (64: every shape, when asked)
    return sm90::run_attention_sm90<key_for(64, kSmallBlock, kPingpong)>(pr.params(), stream);
  }
  if (sh.head_dim == 256) {
    constexpr int kv = JAX_FLASH_AB_D256_BLOCK_KV;
    return sh.causal ? sm90::run_attention_sm90<key_for(256, kv, false)>(pr.params(), stream)
                     : sm90::run_attention_sm90<key_for(256, kv, JAX_FLASH_AB_D256_PINGPONG)>(pr.params(), stream);
  }
  if constexpr (JAX_FLASH_AB_D128_3C_BLOCK_KV != 0) {
    constexpr int kv = JAX_FLASH_AB_D128_3C_BLOCK_KV;
    return sh.causal
               ? sm90::run_attention_sm90<key_for(128, kv, JAX_FLASH_AB_D128_CAUSAL_PINGPONG, 3)>(pr.params(), stream)
               : sm90::run_attention_sm90<key_for(128, kv, true, 3)>(pr.params(), stream);
  }
  constexpr KernelKey kCausal128 = key_for(128, JAX_FLASH_AB_D128_CAUSAL_BLOCK_KV, JAX_FLASH_AB_D128_CAUSAL_PINGPONG, 2,
                                           JAX_FLASH_AB_D128_CAUSAL_STAGES);
  return sh.causal ? sm90::run_attention_sm90<kCausal128>(pr.params(), stream)
                   : sm90::run_attention_sm90<key_for(128)>(pr.params(), stream);
}

// Max |GPU - CPU| (bf16 output; the CPU implementation computes in fp32) over a problem of 256 tiles, so each
// persistent block runs several (what carries across tiles, the pipeline counters, the Q buffers, the epilogue's
// staging buffer, is exercised), with `seq` keys (1000: a partial last key block of more than half its keys; 960:
// of half, computed at half width in masked kernels, kernel.cuh kHalfLast) and, when causal, masking.
float check(int head_dim, int block_kv, bool causal, int consumers, int seq) {
  Problem pr(4, seq, 8, head_dim);
  pr.causal = causal;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::string f = run_shape({head_dim, block_kv, pr.seq, causal, consumers}, pr, stream);
  if (!f.empty()) {
    std::fprintf(stderr, "launch failed: %s\n", f.c_str());
    std::exit(3);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const size_t n = pr.q.size();
  std::vector<uint16_t> gpu(n), cpu(n);
  CHECK_CUDA(cudaMemcpy(gpu.data(), pr.dout, n * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaStreamDestroy(stream));
  AttentionParams p = make_contiguous_params(pr.q.data(), pr.k.data(), pr.v.data(), cpu.data(), pr.batch, pr.seq,
                                             pr.seq, pr.heads, pr.heads, head_dim,
                                             1.0f / std::sqrt(static_cast<float>(head_dim)));
  if (causal) set_features(p, true, -1, 0, 0.0f, nullptr, nullptr, nullptr);
  attention_cpu(p, CpuElement::kBFloat16, 64, 64, 8);
  float worst = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(harness::from_bits(gpu[i], kBf16) - harness::from_bits(cpu[i], kBf16));
    if (std::isnan(diff)) return INFINITY;  // (std::max would drop a NaN)
    worst = std::max(worst, diff);
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  const bool do_check = argc > 1 && std::string(argv[1]) == "--check";
  const int first = do_check ? 2 : 1;
  const int only_d = argc > first ? std::atoi(argv[first]) : 0;
  const int only_s = argc > first + 1 ? std::atoi(argv[first + 1]) : 0;
  const bool only_causal = argc > first + 2 && std::string(argv[first + 2]) == "causal";
  if (do_check) {
    // (head dim, key block, consumers) of the shipped configs; D = 256 runs its one key block
    const Shape configs[] = {{64, 128, 0, false, 2}, {64, 192, 0, false, 2}, {64, 128, 0, false, 3},
                             {128, 128, 0, false, 2}, {256, 0, 0, false, 2}};
    for (const Shape& c : configs) {
      for (bool causal : {false, true}) {
        // (1000 / 1030: 128 / 64 rows of shift with 192-row causal tiles; 1024: 256 tiles of 8 key blocks over the
        // grid, split in the unmasked head-dim-128 kernel, launch.cuh)
        for (int seq : {1000, 960, 1030, 1024}) {
          const float err = check(c.head_dim, c.block_kv, causal, c.consumers, seq);
          const Shape run{c.head_dim, c.block_kv, 0, causal, c.consumers};
          std::printf("variant %d check D=%d kv%d wg%d%s S=%d: max |gpu - cpu| = %.4f %s\n", kVariant, c.head_dim,
                      block_kv_of(run), consumers_of(run), causal ? " causal" : "", seq, err,
                      err <= 4e-2f ? "ok" : "FAIL");
          if (!(err <= 4e-2f)) return 1;
        }
      }
    }
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  // (head dim 64 causal runs three consumers at every length since session 13; until session 15 this list ran
  // its 512 / 1024-key causal shapes on two)
  const Shape shapes[] = {{64, 128, 512, false, 3},   {64, 128, 1024, false, 3}, {64, 128, 512, true, 3},
                          {64, 128, 1024, true, 3},
                          {64, 128, 2048, false, 3},  {64, 128, 2048, true, 3},  {64, 128, 4096, false, 3},
                          {64, 128, 16384, false, 3}, {64, 128, 4096, true, 3},  {128, 128, 512, false},
                          {128, 128, 1024, false}, {128, 128, 2048, false}, {128, 128, 4096, false},
                          {128, 128, 16384, false},
                          {128, 128, 512, true},   {128, 128, 1024, true},   {128, 128, 2048, true},
                          {128, 128, 4096, true},    {256, 0, 512, false},     {256, 0, 1024, false},
                          {256, 0, 4096, false},     {256, 0, 16384, false},   {256, 0, 512, true},
                          {256, 0, 1024, true},      {256, 0, 2048, true},     {256, 0, 4096, true}};
  for (const Shape& sh : shapes) {
    {
      const int d = sh.head_dim, s = sh.seq;
      if (only_d != 0 && d != only_d) continue;
      if (only_s != 0 && (s != only_s || sh.causal != only_causal)) continue;
      if (std::getenv("AB_CAUSAL_ONLY") != nullptr && !sh.causal) continue;  // (A/B runs of the causal tile order)
      Problem pr(16384 / s, s, 2048 / d, d);
      pr.causal = sh.causal;
      auto run_any = [&](const Problem& problem, cudaStream_t st) { return run_shape(sh, problem, st); };
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
      const double flops = 4.0 * pr.batch * pr.heads * double(s) * s * d / (sh.causal ? 2 : 1);
      std::printf("variant %d D=%d S=%d%s kv%d wg%d: %.1f us %.1f TFLOP/s (min %.1f us)\n", kVariant, d, s,
                  sh.causal ? "c" : "", block_kv_of(sh), consumers_of(sh), ms * 1e3, flops / ms / 1e9,
                  per_call.front() * 1e3);
#ifdef JAX_FLASH_TRACE
      // One more launch with the timeline on (csrc/sm90/trace.cuh), written raw to $TRACE_FILE_D<d>_S<s>[c].bin
      if (const char* trace_file = std::getenv("TRACE_FILE")) {
        int device = 0, sms = 0;
        CHECK_CUDA(cudaGetDevice(&device));
        CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        const size_t words = size_t(sms) * sm90::kTraceRoles * sm90::kTraceRecords * 2;
        uint64_t* dtrace = nullptr;
        CHECK_CUDA(cudaMalloc(&dtrace, words * 8));
        CHECK_CUDA(cudaMemset(dtrace, 0, words * 8));
        CHECK_CUDA(cudaMemcpyToSymbol(sm90::g_trace_buffer, &dtrace, sizeof(dtrace)));
        run_any(pr, stream);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        uint64_t* none = nullptr;
        CHECK_CUDA(cudaMemcpyToSymbol(sm90::g_trace_buffer, &none, sizeof(none)));
        std::vector<uint64_t> host(words);
        CHECK_CUDA(cudaMemcpy(host.data(), dtrace, words * 8, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaFree(dtrace));
        const std::string name = std::string(trace_file) + "_D" + std::to_string(d) + "_S" + std::to_string(s) +
                                 (sh.causal ? "c" : "") + ".bin";
        if (FILE* f = std::fopen(name.c_str(), "wb")) {
          std::fwrite(host.data(), 8, words, f);
          std::fclose(f);
        }
      }
#endif
    }
  }
  return 0;
}
