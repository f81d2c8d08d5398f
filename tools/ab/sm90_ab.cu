// A/B timing of the sm90 family's kernels without a package build: the config cfg=None runs for each row of the
// benchmark's standard grid (bf16 and fp16; head dims 64, 128, 256; causal and not; 512-16384 keys; batch x seq =
// 16384 tokens, heads x head_dim = 2048), launched back to back on one stream. An alternative is a patch applied to
// a copy of the tree (tools/ab/build.sh), never a switch in the shipped headers.
//   sm90_ab [--check] [--dtype bf16|fp16] [--lse] [D [S [causal]]]
//     --check: first compare 256-tile problems of every shipped head dim / config, causal and not, with the CPU
//              implementation (the problems exercise what carries across tiles, partial and half-width key blocks,
//              the end-aligned query blocks and the split tail);
//     --lse: the timed calls also write the float32 lse (the forward of a training step);
//     D: only that head dim's shapes; D S [causal]: only that shape (for Nsight Compute).
// One line per shape: median of 7 repetitions of back-to-back launches lasting >= 25 ms each. Built with
// -DJAX_FLASH_TRACE, TRACE_FILE=prefix also writes each shape's timeline (csrc/sm90/trace.cuh) to
// prefix_D<d>_S<s>[c].bin for tools/ab/trace_report.py.
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
#include "cpu_reference.h"
#include "ab_common.h"
#include "harness_util.h"
#include "sm90/launch.cuh"

using namespace jax_flash;

namespace {

using ab::kBf16;
using ab::kFp16;
using ab::dtype_short;

// An sm90 config as KernelConfig.sm90() builds it (jax_flash/config.py).
constexpr KernelKey sm90_key(int dtype, int head_dim, int block_kv, bool pingpong, int consumers) {
  return KernelKey{.dtype = dtype, .head_dim = head_dim, .block_q = 64 * consumers, .block_kv = block_kv,
                   .num_warps = 4 * (consumers + 1), .async_copy = true, .eager_load_blocks = true, .swizzled = true,
                   .q_mma_load_k_fragments = 2, .k_mma_load_k_fragments = 1, .v_mma_load_k_fragments = 1,
                   .mma_double_buffer_loads = true, .optimized_softmax = true, .family = 90, .stages = 2,
                   .consumer_warpgroups = consumers, .pingpong = pingpong, .overlap = true};
}

// cfg=None's choice on sm_90 (jax_flash/selection.py, SM90_BY_SHAPE): head dim 64 three consumers with 128-key
// blocks; head dims 128 and 256 pingpong without a right bound, none with one; head dim 256 80-key blocks.
template <int kDType>
std::string run_config(const AttentionParams& p, int head_dim, bool causal, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return sm90::run_attention_sm90<sm90_key(kDType, 64, 128, true, 3)>(p, stream);
    case 128:
      return causal ? sm90::run_attention_sm90<sm90_key(kDType, 128, 128, false, 2)>(p, stream)
                    : sm90::run_attention_sm90<sm90_key(kDType, 128, 128, true, 2)>(p, stream);
    default:
      return causal ? sm90::run_attention_sm90<sm90_key(kDType, 256, 80, false, 2)>(p, stream)
                    : sm90::run_attention_sm90<sm90_key(kDType, 256, 80, true, 2)>(p, stream);
  }
}

const char* config_name(int head_dim, bool causal) {
  if (head_dim == 64) return "kv128 wg3";
  if (head_dim == 128) return causal ? "kv128 wg2 pp0" : "kv128 wg2 pp1";
  return causal ? "kv80 wg2 pp0" : "kv80 wg2 pp1";
}

struct Problem {
  int dtype, batch, seq, heads, head_dim;
  bool causal = false;
  std::vector<uint16_t> q, k, v;  // host copies (B, S, H, D)
  uint16_t *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  unsigned long long* dcounter = nullptr;
  void* dworkspace = nullptr;  // the split tail's scratch, as the FFI handler gives it (per SM)
  int64_t workspace_bytes = 0;
  float* dlse = nullptr;  // (B, H, S), with --lse
  Problem(int dt, int b, int s, int h, int d, bool is_causal, bool with_lse = false)
      : dtype(dt), batch(b), seq(s), heads(h), head_dim(d), causal(is_causal) {
    if (with_lse) CHECK_CUDA(cudaMalloc(&dlse, sizeof(float) * b * h * s));
    const size_t n = static_cast<size_t>(b) * s * h * d;
    uint32_t state = 12345u + s + d;
    auto uniform = [&] {  // in [-2, 2)
      state = state * 1664525u + 1013904223u;
      return (state >> 8) * (4.0f / 16777216.0f) - 2.0f;
    };
    for (auto* t : {&q, &k, &v}) {
      t->resize(n);
      for (auto& x : *t) x = harness::to_bits(uniform(), dtype);
    }
    for (auto [dst, src] : {std::pair{&dq, &q}, {&dk, &k}, {&dv, &v}}) {
      CHECK_CUDA(cudaMalloc(dst, n * 2));
      CHECK_CUDA(cudaMemcpy(*dst, src->data(), n * 2, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&dout, n * 2));
    CHECK_CUDA(cudaMalloc(&dcounter, sizeof(unsigned long long)));  // the tile counter (the launcher zeroes it)
    int device = 0, sms = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    workspace_bytes = int64_t{sms} * sm90::Traits<sm90_key(kBf16, 128, 128, true, 2)>::kSplitBytesPerSm;
    CHECK_CUDA(cudaMalloc(&dworkspace, workspace_bytes));
  }
  ~Problem() {
    for (void* ptr : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv),
                      static_cast<void*>(dout), static_cast<void*>(dcounter), dworkspace,
                      static_cast<void*>(dlse)}) {
      cudaFree(ptr);
    }
  }
  AttentionParams params() const {
    AttentionParams p = make_contiguous_params(dq, dk, dv, dout, batch, seq, seq, heads, heads, head_dim,
                                               1.0f / std::sqrt(static_cast<float>(head_dim)));
    p.tile_counter = dcounter;
    p.split_workspace = dworkspace;
    p.split_workspace_bytes = workspace_bytes;
    if (causal) set_features(p, true, -1, 0, 0.0f, nullptr, nullptr, nullptr);
    p.lse = dlse;
    return p;
  }
};

std::string run(const Problem& pr, cudaStream_t stream) {
  return pr.dtype == kBf16 ? run_config<kBf16>(pr.params(), pr.head_dim, pr.causal, stream)
                           : run_config<kFp16>(pr.params(), pr.head_dim, pr.causal, stream);
}


// Max |GPU - CPU| (16-bit output; the CPU implementation computes in fp32) over a problem of 256 tiles with `seq`
// keys: 1000 (a partial last key block of more than half its keys; 128 rows of shift with 192-row causal tiles),
// 960 (half a key block: the half-width block of masked three-consumer kernels), 976 (16 keys of an 80-key block:
// head dim 256's narrow block), 1030 (64 rows of shift) and 1024 (256 tiles of 8 key blocks over the grid: split in
// the unmasked head-dim-128 kernel).
float check(int dtype, int head_dim, bool causal, int seq) {
  Problem pr(dtype, 4, seq, 8, head_dim, causal);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  if (std::string failure = run(pr, stream); !failure.empty()) {
    std::fprintf(stderr, "launch failed: %s\n", failure.c_str());
    std::exit(3);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  const size_t n = pr.q.size();
  std::vector<uint16_t> gpu(n), cpu(n);
  CHECK_CUDA(cudaMemcpy(gpu.data(), pr.dout, n * 2, cudaMemcpyDeviceToHost));
  AttentionParams p = make_contiguous_params(pr.q.data(), pr.k.data(), pr.v.data(), cpu.data(), pr.batch, pr.seq,
                                             pr.seq, pr.heads, pr.heads, head_dim,
                                             1.0f / std::sqrt(static_cast<float>(head_dim)));
  if (causal) set_features(p, true, -1, 0, 0.0f, nullptr, nullptr, nullptr);
  attention_cpu(p, dtype == kBf16 ? CpuElement::kBFloat16 : CpuElement::kFloat16, 64, 64,
                harness::reference_runtime());
  float worst = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(harness::from_bits(gpu[i], dtype) - harness::from_bits(cpu[i], dtype));
    if (std::isnan(diff)) return INFINITY;  // (std::max would drop a NaN)
    worst = std::max(worst, diff);
  }
  return worst;
}

#ifdef JAX_FLASH_TRACE
// One more launch with the timeline on, written raw to <prefix>_D<d>_S<s>[c].bin.
void write_trace(const Problem& pr, cudaStream_t stream, const char* prefix) {
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t words = size_t(sms) * sm90::kTraceRoles * sm90::kTraceRecords * 2;
  uint64_t* dtrace = nullptr;
  CHECK_CUDA(cudaMalloc(&dtrace, words * 8));
  CHECK_CUDA(cudaMemset(dtrace, 0, words * 8));
  CHECK_CUDA(cudaMemcpyToSymbol(sm90::g_trace_buffer, &dtrace, sizeof(dtrace)));
  run(pr, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  uint64_t* none = nullptr;
  CHECK_CUDA(cudaMemcpyToSymbol(sm90::g_trace_buffer, &none, sizeof(none)));
  std::vector<uint64_t> host(words);
  CHECK_CUDA(cudaMemcpy(host.data(), dtrace, words * 8, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(dtrace));
  const std::string name = std::string(prefix) + "_" + dtype_short(pr.dtype) + "_D" + std::to_string(pr.head_dim) + "_S" + std::to_string(pr.seq) +
                           (pr.causal ? "c" : "") + ".bin";
  if (FILE* f = std::fopen(name.c_str(), "wb")) {
    std::fwrite(host.data(), 8, words, f);
    std::fclose(f);
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const ab::Args args = ab::parse_args(argc, argv);
  const std::vector<int>& dtypes = args.dtypes;
  const bool only_causal = args.only_causal;
  const int only_d = args.only_d, only_s = args.only_s;
  if (args.check) {
    for (int dtype : dtypes) {
      for (int head_dim : {64, 128, 256}) {
        for (bool causal : {false, true}) {
          for (int seq : {1000, 960, 976, 1030, 1024}) {
            const float err = check(dtype, head_dim, causal, seq);
            std::printf("check %s D=%d %s%s S=%d: max |gpu - cpu| = %.4f %s\n", dtype_short(dtype), head_dim,
                        config_name(head_dim, causal), causal ? " causal" : "", seq, err, err <= 4e-2f ? "ok" : "FAIL");
            if (!(err <= 4e-2f)) return 1;
          }
        }
      }
    }
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int dtype : dtypes) {
    for (int head_dim : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        for (int seq : {512, 1024, 2048, 4096, 8192, 16384}) {
          if (only_d != 0 && head_dim != only_d) continue;
          if (only_s != 0 && (seq != only_s || causal != only_causal)) continue;
          const Problem pr(dtype, 16384 / seq, seq, 2048 / head_dim, head_dim, causal, args.lse);
          const double ms = ab::median_ms([&] { return run(pr, stream); }, stream, start, stop);
          const double flops = 4.0 * pr.batch * pr.heads * double(seq) * seq * head_dim / (causal ? 2 : 1);
          std::printf("%s D=%d S=%d%s %s: %.1f us %.1f TFLOP/s\n", dtype_short(dtype), head_dim, seq, causal ? "c" : "",
                      config_name(head_dim, causal), ms * 1e3, flops / ms / 1e9);
#ifdef JAX_FLASH_TRACE
          if (const char* prefix = std::getenv("TRACE_FILE")) write_trace(pr, stream, prefix);
#endif
        }
      }
    }
  }
  return 0;
}
