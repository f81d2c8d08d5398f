// What the A/B harnesses (sm90_ab.cu, sm90_bwd_ab.cu) share: their command line and their timing loop.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/kernel_key.h"  // DType
#include "harness_util.h"        // CHECK_CUDA

namespace jax_flash::ab {

inline constexpr int kBf16 = static_cast<int>(DType::kBFloat16);
inline constexpr int kFp16 = static_cast<int>(DType::kFloat16);
inline constexpr int kFp8 = static_cast<int>(DType::kFloat8E4M3);
inline const char* dtype_short(int dtype) { return dtype == kBf16 ? "bf16" : dtype == kFp8 ? "fp8" : "fp16"; }

// harness [--check] [--dtype bf16|fp16|fp8] [--softcap CAP] [D [S [causal]]]: check first; time one dtype, or one
// head dim, or one shape; --softcap: the checked and timed shapes soft-capped; fp8: the forward harness's e4m3
// kernels (launch_fp8.cuh), not part of the default dtypes.
struct Args {
  bool check = false, only_causal = false;
  std::vector<int> dtypes = {kBf16, kFp16};
  int only_d = 0, only_s = 0;  // 0: every head dim / length
  float softcap = 0.0f;
  bool lse = false;  // the forward harness: also write the lse (B, H, S), as the calls of a training step do
};

inline Args parse_args(int argc, char** argv) {
  Args out;
  std::vector<int> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--check") {
      out.check = true;
    } else if (arg == "--dtype" && i + 1 < argc) {
      const std::string name = argv[++i];
      out.dtypes = {name == "fp16" ? kFp16 : name == "fp8" ? kFp8 : kBf16};
    } else if (arg == "--softcap" && i + 1 < argc) {
      out.softcap = static_cast<float>(std::atof(argv[++i]));
    } else if (arg == "--lse") {
      out.lse = true;
    } else if (arg == "causal") {
      out.only_causal = true;
    } else {
      positional.push_back(std::atoi(arg.c_str()));
    }
  }
  out.only_d = positional.size() > 0 ? positional[0] : 0;
  out.only_s = positional.size() > 1 ? positional[1] : 0;
  return out;
}

// The median milliseconds per call of `call` on `stream`, over 7 repetitions of back-to-back calls lasting >= 25 ms
// each, after 3 warm-up calls (which also opt the kernels in to their shared memory). `call` returns "" or what
// failed; a failed warm-up call ends the program.
template <class Call>
double median_ms(Call call, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) {
  for (int i = 0; i < 3; ++i) {
    if (std::string failure = call(); !failure.empty()) {
      std::fprintf(stderr, "launch failed: %s\n", failure.c_str());
      std::exit(3);
    }
  }
  CHECK_CUDA(cudaEventRecord(start, stream));
  call();
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float one_ms = 0.0f;
  CHECK_CUDA(cudaEventElapsedTime(&one_ms, start, stop));
  const int calls = std::max(3, static_cast<int>(25.0f / std::max(one_ms, 1e-3f)));
  std::vector<float> per_call;
  for (int rep = 0; rep < 7; ++rep) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    for (int i = 0; i < calls; ++i) call();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    per_call.push_back(ms / calls);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

}  // namespace jax_flash::ab
