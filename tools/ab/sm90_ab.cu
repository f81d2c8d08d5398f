// A/B timing of the sm90 family's kernels without a package build: the config cfg=None runs for each row of the
// benchmark's standard grid (bf16 and fp16; head dims 64, 128, 256; causal and not; 512-16384 keys; batch x seq =
// 16384 tokens, heads x head_dim = 2048), launched back to back on one stream. An alternative is a patch applied to
// a copy of the tree (tools/ab/build.sh), never a switch in the shipped headers.
//   sm90_ab [--check] [--dtype bf16|fp16|fp8] [--softcap CAP] [--lse] [D [S [causal]]]
//     --check: first compare 256-tile problems of every shipped head dim / config, causal and not, with the CPU
//              implementation (the problems exercise what carries across tiles, partial and half-width key blocks,
//              the end-aligned query blocks and the split tail);
//     --dtype fp8: the FP8 kernels cfg=None runs (head dims 128 and 256, descale factors 1, bfloat16 output),
//              checked against the CPU implementation of the dequantised inputs;
//     --softcap: the checked and timed calls soft-capped;
//     --lse: the timed calls also write the float32 lse (the forward of a training step);
//     D: only that head dim's shapes; D S [causal]: only that shape (for Nsight Compute).
// One line per shape: median of 7 repetitions of back-to-back launches lasting >= 25 ms each. Built with
// -DJAX_FLASH_TRACE, TRACE_FILE=prefix also writes each shape's timeline (csrc/sm90/trace.cuh) to
// prefix_D<d>_S<s>[c].bin for tools/ab/trace_report.py.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
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
#include "sm90/launch_fp8.cuh"

using namespace jax_flash;

namespace {

using ab::kBf16;
using ab::kFp16;
using ab::kFp8;
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

// cfg=None's FP8 choice (jax_flash/config.py, FP8_CONFIGS): pingpong, head dim 128 on 128-key blocks, head dim 256
// on 128-key blocks without the intra-warpgroup overlap. A candidate builds with -DAB_FP8_D128_LONG_KV=... (from 2048
// keys), -DAB_FP8_D128_SHORT_KV=..., -DAB_FP8_D256_KV=..., -DAB_FP8_D128_OVERLAP=0 / 1, -DAB_FP8_D256_OVERLAP=0 / 1.
#ifndef AB_FP8_D128_LONG_KV
#define AB_FP8_D128_LONG_KV 128
#endif
#ifndef AB_FP8_D128_SHORT_KV
#define AB_FP8_D128_SHORT_KV 128
#endif
#ifndef AB_FP8_D256_KV
#define AB_FP8_D256_KV 128
#endif
#ifndef AB_FP8_D128_OVERLAP
#define AB_FP8_D128_OVERLAP 1
#endif
#ifndef AB_FP8_D256_OVERLAP
#define AB_FP8_D256_OVERLAP 0
#endif
constexpr KernelKey fp8_key(int head_dim, int block_kv, bool overlap) {
  KernelKey key = sm90_key(kFp8, head_dim, block_kv, true, 2);
  key.overlap = overlap;
  return key;
}
std::string run_fp8_config(const AttentionParams& p, int head_dim, cudaStream_t stream) {
  if (head_dim == 256) {
    return sm90::run_attention_sm90_fp8<fp8_key(256, AB_FP8_D256_KV, AB_FP8_D256_OVERLAP)>(p, stream);
  }
  return p.seqlen_k >= 2048
             ? sm90::run_attention_sm90_fp8<fp8_key(128, AB_FP8_D128_LONG_KV, AB_FP8_D128_OVERLAP)>(p, stream)
             : sm90::run_attention_sm90_fp8<fp8_key(128, AB_FP8_D128_SHORT_KV, AB_FP8_D128_OVERLAP)>(p, stream);
}

const char* config_name(int dtype, int head_dim, int seq, bool causal) {
  if (dtype == kFp8) return head_dim == 256 ? "fp8 d256" : seq >= 2048 ? "fp8 d128 long" : "fp8 d128 short";
  if (head_dim == 64) return "kv128 wg3";
  if (head_dim == 128) return causal ? "kv128 wg2 pp0" : "kv128 wg2 pp1";
  return causal ? "kv80 wg2 pp0" : "kv80 wg2 pp1";
}

// An element of `dtype` as bits (e4m3 in the low byte), and back.
uint16_t element_bits(float x, int dtype) {
  return dtype == kFp8 ? __nv_fp8_e4m3(x).__x : harness::to_bits(x, dtype);
}
float element_value(uint16_t bits, int dtype) {
  if (dtype != kFp8) return harness::from_bits(bits, dtype);
  __nv_fp8_e4m3 e;
  e.__x = static_cast<__nv_fp8_storage_t>(bits);
  return static_cast<float>(e);
}
int output_dtype(int dtype) { return dtype == kFp8 ? kBf16 : dtype; }

// n elements of `dtype` uniform in [-2, 2), from a hash of (seed, index)
__global__ void fill_uniform(uint8_t* out, int64_t n, int dtype, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) ^ (seed * 0x9E3779B1u) ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    const float u = (x >> 8) * (4.0f / 16777216.0f) - 2.0f;
    if (dtype == kFp8) {
      out[i] = __nv_fp8_e4m3(u).__x;
    } else {
      const uint16_t bits = dtype == kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(u))
                                           : __half_as_ushort(__float2half_rn(u));
      reinterpret_cast<uint16_t*>(out)[i] = bits;
    }
  }
}

struct Problem {
  int dtype, batch, seq, heads, head_dim;
  bool causal = false;
  float softcap = 0.0f;
  std::vector<float> q, k, v;  // host values (B, S, H, D), each exact in dtype
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  uint16_t* dout = nullptr;  // dtype, bfloat16 for FP8
  float *dqk_descale = nullptr, *dv_descale = nullptr;  // FP8: (B, H) ones
  unsigned long long* dcounter = nullptr;
  void* dworkspace = nullptr;  // the split tail's scratch, as the FFI handler gives it (per SM)
  int64_t workspace_bytes = 0;
  float* dlse = nullptr;  // (B, H, S), with --lse
  // host_values: q, k, v drawn on the host and kept there (check()); otherwise drawn on the device (the timed
  // shapes, 100M elements and more).
  Problem(int dt, int b, int s, int h, int d, bool is_causal, float cap, bool host_values, bool with_lse = false)
      : dtype(dt), batch(b), seq(s), heads(h), head_dim(d), causal(is_causal), softcap(cap) {
    if (with_lse) CHECK_CUDA(cudaMalloc(&dlse, sizeof(float) * b * h * s));
    const size_t n = static_cast<size_t>(b) * s * h * d;
    const size_t bytes = dtype == kFp8 ? 1 : 2;
    uint32_t state = 12345u + s + d;
    auto uniform = [&] {  // in [-2, 2)
      state = state * 1664525u + 1013904223u;
      return (state >> 8) * (4.0f / 16777216.0f) - 2.0f;
    };
    std::vector<uint8_t> staged(host_values ? n * bytes : 0);
    for (auto [dst, host] : {std::pair{&dq, &q}, {&dk, &k}, {&dv, &v}}) {
      CHECK_CUDA(cudaMalloc(dst, n * bytes));
      if (!host_values) {
        fill_uniform<<<1024, 256>>>(static_cast<uint8_t*>(*dst), static_cast<int64_t>(n), dtype, state++);
        CHECK_CUDA(cudaGetLastError());
        continue;
      }
      host->resize(n);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t bits = element_bits(uniform(), dtype);
        (*host)[i] = element_value(bits, dtype);
        std::memcpy(&staged[i * bytes], &bits, bytes);  // (little-endian: e4m3's byte first)
      }
      CHECK_CUDA(cudaMemcpy(*dst, staged.data(), n * bytes, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&dout, n * 2));
    if (dtype == kFp8) {
      const std::vector<float> ones(size_t(b) * h, 1.0f);
      for (float** f : {&dqk_descale, &dv_descale}) {
        CHECK_CUDA(cudaMalloc(f, ones.size() * sizeof(float)));
        CHECK_CUDA(cudaMemcpy(*f, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
      }
    }
    CHECK_CUDA(cudaMalloc(&dcounter, sizeof(unsigned long long)));  // the tile counter (the launcher zeroes it)
    int device = 0, sms = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    workspace_bytes = int64_t{sms} * sm90::Traits<sm90_key(kBf16, 128, 128, true, 2)>::kSplitBytesPerSm;
    CHECK_CUDA(cudaMalloc(&dworkspace, workspace_bytes));
  }
  ~Problem() {
    for (void* ptr : {dq, dk, dv, static_cast<void*>(dout), static_cast<void*>(dqk_descale),
                      static_cast<void*>(dv_descale), static_cast<void*>(dcounter), dworkspace,
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
    set_features(p, causal, -1, causal ? 0 : -1, softcap, nullptr, nullptr, nullptr);
    p.lse = dlse;
    p.qk_descale = dqk_descale;
    p.v_descale = dv_descale;
    return p;
  }
};

std::string run(const Problem& pr, cudaStream_t stream) {
  if (pr.dtype == kFp8) return run_fp8_config(pr.params(), pr.head_dim, stream);
  return pr.dtype == kBf16 ? run_config<kBf16>(pr.params(), pr.head_dim, pr.causal, stream)
                           : run_config<kFp16>(pr.params(), pr.head_dim, pr.causal, stream);
}


// Max |GPU - CPU| (16-bit output; the CPU implementation computes in fp32 from the same values) over a problem of
// 256 tiles with `seq` keys: 1000 (a partial last key block of more than half its keys; 128 rows of shift with
// 192-row causal tiles), 960 (half a key block: the half-width block of masked three-consumer kernels), 976 (16 keys
// of an 80-key block: head dim 256's narrow block), 1030 (64 rows of shift) and 1024 (256 tiles of 8 key blocks over
// the grid: split in the unmasked head-dim-128 kernel).
float check(int dtype, int head_dim, bool causal, float softcap, int seq) {
  Problem pr(dtype, 4, seq, 8, head_dim, causal, softcap, /*host_values=*/true);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  if (std::string failure = run(pr, stream); !failure.empty()) {
    std::fprintf(stderr, "launch failed: %s\n", failure.c_str());
    std::exit(3);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  const size_t n = pr.q.size();
  std::vector<uint16_t> gpu(n);
  std::vector<float> cpu(n);
  CHECK_CUDA(cudaMemcpy(gpu.data(), pr.dout, n * 2, cudaMemcpyDeviceToHost));
  AttentionParams p = make_contiguous_params(pr.q.data(), pr.k.data(), pr.v.data(), cpu.data(), pr.batch, pr.seq,
                                             pr.seq, pr.heads, pr.heads, head_dim,
                                             1.0f / std::sqrt(static_cast<float>(head_dim)));
  set_features(p, causal, -1, causal ? 0 : -1, softcap, nullptr, nullptr, nullptr);
  attention_cpu(p, CpuElement::kFloat32, 64, 64, harness::reference_runtime());
  float worst = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float diff = std::fabs(harness::from_bits(gpu[i], output_dtype(dtype)) - cpu[i]);
    if (std::isnan(diff)) return INFINITY;  // (std::max would drop a NaN)
    worst = std::max(worst, diff);
  }
  return worst;
}

// check()'s key lengths; FP8 adds 2100 and 2304 (head dim 128's 192-key blocks from 2048 keys: a partial last
// block and none).
std::vector<int> check_lengths_of(int dtype) {
  std::vector<int> lengths = {1000, 960, 976, 1030, 1024};
  if (dtype == kFp8) lengths.insert(lengths.end(), {2100, 2304});
  return lengths;
}

// check()'s bound on |gpu - cpu|, values of V in [-2, 2): 4e-2 for 16-bit elements; FP8 rounds P to e4m3 (relative
// error up to 2^-4, not taken out of l), so a row's output may be off by 2^-4 max |v| (a causal row over few keys
// comes near it), plus the bfloat16 output's rounding.
float check_tolerance(int dtype) { return dtype == kFp8 ? 0.125f + 0.0078125f : 4e-2f; }

// The head dims a dtype's kernels cover (FP8: 128 and 256, launch_fp8.cuh).
std::vector<int> head_dims_of(int dtype) {
  return dtype == kFp8 ? std::vector<int>{128, 256} : std::vector<int>{64, 128, 256};
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
      for (int head_dim : head_dims_of(dtype)) {
        for (bool causal : {false, true}) {
          for (int seq : check_lengths_of(dtype)) {
            const float err = check(dtype, head_dim, causal, args.softcap, seq);
            const float tolerance = check_tolerance(dtype);
            std::printf("check %s D=%d %s%s S=%d: max |gpu - cpu| = %.4f %s\n", dtype_short(dtype), head_dim,
                        config_name(dtype, head_dim, seq, causal), causal ? " causal" : "", seq, err,
                        err <= tolerance ? "ok" : "FAIL");
            if (!(err <= tolerance)) return 1;
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
    for (int head_dim : head_dims_of(dtype)) {
      for (bool causal : {false, true}) {
        for (int seq : {512, 1024, 2048, 4096, 8192, 16384}) {
          if (only_d != 0 && head_dim != only_d) continue;
          if (only_s != 0 && (seq != only_s || causal != only_causal)) continue;
          const Problem pr(dtype, 16384 / seq, seq, 2048 / head_dim, head_dim, causal, args.softcap,
                           /*host_values=*/false, args.lse);
          const double ms = ab::median_ms([&] { return run(pr, stream); }, stream, start, stop);
          const double flops = 4.0 * pr.batch * pr.heads * double(seq) * seq * head_dim / (causal ? 2 : 1);
          std::printf("%s D=%d S=%d%s %s: %.1f us %.1f TFLOP/s\n", dtype_short(dtype), head_dim, seq, causal ? "c" : "",
                      config_name(dtype, head_dim, seq, causal), ms * 1e3, flops / ms / 1e9);
#ifdef JAX_FLASH_TRACE
          if (const char* prefix = std::getenv("TRACE_FILE")) write_trace(pr, stream, prefix);
#endif
        }
      }
    }
  }
  return 0;
}
