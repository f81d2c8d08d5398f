// A/B timing of the sm90 family's backward without a package build: run_attention_bwd_sm90 (preprocess, kernel, dQ
// conversion) for each row of the backward benchmark's grid (bf16 and fp16; head dims 64, 128 and 256; causal and
// not; 1024-16384 keys; batch x seq = 16384 tokens, heads x head_dim = 2048), launched back to back on one stream. An
// alternative is a patch applied to a copy of the tree (HARNESS=sm90_bwd_ab tools/ab/build.sh), never a switch in the
// shipped headers.
//   sm90_bwd_ab [--check] [--dtype bf16|fp16] [--softcap CAP] [D [S [causal]]]
//     --check: first compare dq, dk, dv of small problems (partial key and query blocks, GQA, causal, softcap, the
//              deterministic variant) with the CPU backward;
//     D: only that head dim's shapes; D S [causal]: only that shape (for Nsight Compute).
// One line per shape: median of 7 repetitions of back-to-back calls lasting >= 25 ms each; TFLOP/s count 2.5 times
// the forward's FLOPs (the benchmark's convention).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/backward_params.h"
#include "common/params.h"
#include "cpu/attention_bwd_cpu.h"
#include "cpu_reference.h"
#include "ab_common.h"
#include "harness_util.h"
#include "sm90/bwd_launch.cuh"

using namespace jax_flash;

namespace {

using ab::kBf16;
using ab::kFp16;
using ab::dtype_short;

struct Problem {
  int dtype, batch, seq, heads_q, heads_k, head_dim;
  bool causal;
  float softcap;
  bool deterministic = false;
  std::vector<uint16_t> q, k, v, out, d_out;  // host copies (B, S, H, D)
  std::vector<float> lse;                      // (B, Hq, S)
  void *gq = nullptr, *gk = nullptr, *gv = nullptr, *gout = nullptr, *gdout = nullptr;
  void *gdq = nullptr, *gdk = nullptr, *gdv = nullptr;
  float *glse = nullptr, *gdq_accum = nullptr, *gdelta = nullptr, *gstats = nullptr;
  int64_t stats_rows = 0;
  int* gturns = nullptr;
  int64_t turn_count = 0;

  // reference: the forward's out and lse from the CPU implementation (checks); else random out and a constant lse
  // (timing: the products cost the same, and the CPU forward of a 16384-key problem takes minutes).
  Problem(int dt, int b, int s, int hq, int hk, int d, bool is_causal, bool reference, float cap = 0.0f)
      : dtype(dt), batch(b), seq(s), heads_q(hq), heads_k(hk), head_dim(d), causal(is_causal), softcap(cap) {
    const size_t nq = size_t(b) * s * hq * d, nk = size_t(b) * s * hk * d;
    uint32_t state = 12345u + s + d;
    auto uniform = [&] {  // in [-2, 2)
      state = state * 1664525u + 1013904223u;
      return (state >> 8) * (4.0f / 16777216.0f) - 2.0f;
    };
    for (auto [t, n] : {std::pair{&q, nq}, {&k, nk}, {&v, nk}, {&d_out, nq}, {&out, nq}}) {
      t->resize(n);
      for (auto& x : *t) x = harness::to_bits(uniform(), dtype);
    }
    lse.assign(size_t(b) * hq * s, 20.0f);
    if (reference) {
      AttentionParams p = params(q.data(), k.data(), v.data(), out.data(), lse.data());
      attention_cpu(p, element(), 64, 64, harness::reference_runtime());
    }
    for (auto [dst, src] : {std::pair{&gq, &q}, {&gk, &k}, {&gv, &v}, {&gout, &out}, {&gdout, &d_out}}) {
      CHECK_CUDA(cudaMalloc(dst, src->size() * 2));
      CHECK_CUDA(cudaMemcpy(*dst, src->data(), src->size() * 2, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&gdq, nq * 2));
    CHECK_CUDA(cudaMalloc(&gdk, nk * 2));
    CHECK_CUDA(cudaMalloc(&gdv, nk * 2));
    CHECK_CUDA(cudaMalloc(&glse, lse.size() * 4));
    CHECK_CUDA(cudaMemcpy(glse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&gdq_accum, nq * 4));
    CHECK_CUDA(cudaMalloc(&gdelta, lse.size() * 4));
    stats_rows = (s + 639) / 640 * 640;  // whole query blocks of 64, 80 and 128 rows (builds before 80-row items too)
    CHECK_CUDA(cudaMalloc(&gstats, 2 * size_t(b) * hq * stats_rows * 4));
    turn_count = int64_t{b} * hq * ((s + kDQTurnRows - 1) / kDQTurnRows);  // (the preprocess zeroes them)
    CHECK_CUDA(cudaMalloc(&gturns, turn_count * sizeof(int)));
  }
  ~Problem() {
    for (void* ptr : {gq, gk, gv, gout, gdout, gdq, gdk, gdv, static_cast<void*>(glse),
                      static_cast<void*>(gdq_accum), static_cast<void*>(gdelta), static_cast<void*>(gturns),
                      static_cast<void*>(gstats)}) {
      cudaFree(ptr);
    }
  }
  CpuElement element() const { return dtype == kBf16 ? CpuElement::kBFloat16 : CpuElement::kFloat16; }
  AttentionParams params(const void* pq, const void* pk, const void* pv, void* po, float* plse) const {
    AttentionParams p = make_contiguous_params(pq, pk, pv, po, batch, seq, seq, heads_q, heads_k, head_dim,
                                               1.0f / std::sqrt(static_cast<float>(head_dim)));
    set_features(p, causal, -1, causal ? 0 : -1, softcap, nullptr, nullptr, plse);
    return p;
  }
  BackwardParams backward_params() const {
    BackwardParams bp{};
    bp.p = params(gq, gk, gv, gout, glse);
    bp.t = {gout, gdout, glse, nullptr, gdq, gdk, gdv};
    bp.dq_accum = gdq_accum;
    bp.delta = gdelta;
    bp.row_stats = gstats;
    bp.stats_rows = stats_rows;
    if (deterministic) {
      bp.dq_turns = gturns;
      bp.dq_turn_count = turn_count;
    }
    return bp;
  }
};

std::string run(const Problem& pr, cudaStream_t stream) {
  const BackwardParams bp = pr.backward_params();
  if (pr.head_dim == 256) {
    return pr.dtype == kBf16 ? sm90::run_attention_bwd_sm90<kBf16, 256>(bp, stream)
                             : sm90::run_attention_bwd_sm90<kFp16, 256>(bp, stream);
  }
  if (pr.head_dim == 64) {
    return pr.dtype == kBf16 ? sm90::run_attention_bwd_sm90<kBf16, 64>(bp, stream)
                             : sm90::run_attention_bwd_sm90<kFp16, 64>(bp, stream);
  }
  return pr.dtype == kBf16 ? sm90::run_attention_bwd_sm90<kBf16, 128>(bp, stream)
                           : sm90::run_attention_bwd_sm90<kFp16, 128>(bp, stream);
}


// Largest |GPU - CPU| of dq, dk and dv over the largest |CPU| (both from 16-bit outputs; the CPU backward computes
// in fp32).
float check(int dtype, int head_dim, bool causal, int seq, int group, float softcap, bool deterministic,
            int batch) {
  Problem pr(dtype, batch, seq, 2 * group, 2, head_dim, causal, true, softcap);
  pr.deterministic = deterministic;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  if (std::string failure = run(pr, stream); !failure.empty()) {
    std::fprintf(stderr, "launch failed: %s\n", failure.c_str());
    std::exit(3);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::vector<uint16_t> dq(pr.q.size()), dk(pr.k.size()), dv(pr.v.size());
  std::vector<uint16_t> cq(pr.q.size()), ck(pr.k.size()), cv(pr.v.size());
  CHECK_CUDA(cudaMemcpy(dq.data(), pr.gdq, dq.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(dk.data(), pr.gdk, dk.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(dv.data(), pr.gdv, dv.size() * 2, cudaMemcpyDeviceToHost));
  AttentionParams p = pr.params(pr.q.data(), pr.k.data(), pr.v.data(), const_cast<uint16_t*>(pr.out.data()),
                                const_cast<float*>(pr.lse.data()));
  const BackwardTensors t{pr.out.data(), pr.d_out.data(), pr.lse.data(), nullptr, cq.data(), ck.data(), cv.data()};
  attention_bwd_cpu(p, t, pr.element(), 64, 64, harness::reference_runtime());
  float worst = 0.0f;
  for (auto [gpu, cpu] : {std::pair{&dq, &cq}, {&dk, &ck}, {&dv, &cv}}) {
    float diff = 0.0f, scale = 1e-3f;
    for (size_t i = 0; i < gpu->size(); ++i) {
      const float c = harness::from_bits((*cpu)[i], dtype);
      const float d = std::fabs(harness::from_bits((*gpu)[i], dtype) - c);
      if (std::isnan(d)) return INFINITY;
      diff = std::max(diff, d);
      scale = std::max(scale, std::fabs(c));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  const ab::Args args = ab::parse_args(argc, argv);
  const std::vector<int>& dtypes = args.dtypes;
  const bool only_causal = args.only_causal;
  const int only_d = args.only_d, only_s = args.only_s;
  if (dtypes == std::vector<int>{ab::kFp8}) {
    std::fprintf(stderr, "the backward harness takes bf16 or fp16 (there is no FP8 backward)\n");
    return 2;
  }
  if (args.check) {
    for (int dtype : dtypes) {
      for (int head_dim : {64, 128, 256}) {
        for (bool causal : {false, true}) {
          // 300: partial key and query blocks; 520 with groups of 4 and softcap 30; 700 deterministic; 20 x 2100:
          // 680 thread blocks, 17 key blocks of 40 (batch, kv head) pairs (causal: longest first over full L2
          // sections of 16 or 32 pairs and a partial one of 8, common/backward_order.cuh)
          for (auto [seq, group, cap, det, batch] :
               {std::tuple{300, 1, 0.0f, false, 2}, {520, 4, 30.0f, false, 2}, {256, 2, 0.0f, false, 2},
                {700, 4, 0.0f, true, 2}, {2100, 1, 0.0f, false, 20}}) {
            const float err = check(dtype, head_dim, causal, seq, group, cap, det, batch);
            std::printf("check %s D=%d%s B=%d S=%d group %d softcap %g%s: max |gpu - cpu| / max |cpu| = %.4f %s\n",
                        dtype_short(dtype), head_dim, causal ? " causal" : "", batch, seq, group, cap,
                        det ? " deterministic" : "", err, err <= 2e-2f ? "ok" : "FAIL");
            if (!(err <= 2e-2f)) return 1;
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
        for (int seq : {1024, 2048, 4096, 8192, 16384}) {
          if (only_d != 0 && head_dim != only_d) continue;
          if (only_s != 0 && (seq != only_s || causal != only_causal)) continue;
          const Problem pr(dtype, 16384 / seq, seq, 2048 / head_dim, 2048 / head_dim, head_dim, causal, false,
                           args.softcap);
          const double ms = ab::median_ms([&] { return run(pr, stream); }, stream, start, stop);
          const double flops = 2.5 * 4.0 * pr.batch * pr.heads_q * double(seq) * seq * head_dim / (causal ? 2 : 1);
          std::printf("%s D=%d S=%d%s bwd: %.1f us %.1f TFLOP/s\n", dtype_short(dtype), head_dim, seq,
                      causal ? "c" : "", ms * 1e3, flops / ms / 1e9);
        }
      }
    }
  }
  return 0;
}
