// Standalone kernel harness (a CMake test target, not shipped in the wheel): runs every kernel of the generated
// registry over an odd-shape matrix (causal, windows, GQA, lengths, every head dim, lengths 1..1025) and checks
//   - out-of-bounds reads: inputs padded with NaN past the tensor give output bitwise equal to a zero-padded run;
//   - full writes: output and lse pre-filled with a NaN sentinel are finite (lse may be -inf) everywhere;
//   - no writes past the end: the sentinel padding after output and lse is untouched;
//   - correctness: the output agrees with the C++ CPU implementation on the same inputs.
// Run it plainly or under compute-sanitizer (memcheck, racecheck, initcheck, synccheck); see README.
//   kernel_harness [--quick]     (--quick: the smaller matrix, for the slower sanitizer tools)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/params.h"
#include "cpu_reference.h"
#include "common/registry.h"
#include "harness_util.h"

using namespace jax_flash;
using harness::from_bits;
using harness::to_bits;

namespace {

constexpr size_t kPadElems = 1 << 16;  // padding after every tensor: NaN (inputs) or sentinel (outputs)
constexpr uint16_t kNaN16 = 0x7fff;    // a NaN in both fp16 and bf16


struct Case {
  int batch, seq_q, seq_k, heads_q, heads_k;
  bool causal;
  int window_left, window_right;
  bool lengths;
  float softcap;
};

// A device buffer of `n` 16-bit elements followed by kPadElems of `pad`.
struct Padded {
  uint16_t* ptr = nullptr;
  size_t n = 0;
  Padded(const std::vector<uint16_t>& host, uint16_t pad) : n(host.size()) {
    std::vector<uint16_t> full(host);
    full.resize(n + kPadElems, pad);
    CHECK_CUDA(cudaMalloc(&ptr, full.size() * 2));
    CHECK_CUDA(cudaMemcpy(ptr, full.data(), full.size() * 2, cudaMemcpyHostToDevice));
  }
  ~Padded() { cudaFree(ptr); }
  std::vector<uint16_t> read() const {
    std::vector<uint16_t> host(n + kPadElems);
    CHECK_CUDA(cudaMemcpy(host.data(), ptr, host.size() * 2, cudaMemcpyDeviceToHost));
    return host;
  }
};

struct RunResult {
  std::vector<uint16_t> out;  // with padding
  std::vector<float> lse;     // with padding
};

RunResult run_gpu(const RegistryEntry& e, const Case& c, const std::vector<uint16_t>& q,
                  const std::vector<uint16_t>& k, const std::vector<uint16_t>& v, const std::vector<int>& q_len,
                  const std::vector<int>& kv_len, uint16_t input_pad, std::string& failure) {
  const int D = e.key.head_dim;
  Padded dq(q, input_pad), dk(k, input_pad), dv(v, input_pad);
  Padded dout(std::vector<uint16_t>(q.size(), kNaN16), kNaN16);
  const size_t lse_n = static_cast<size_t>(c.batch) * c.heads_q * c.seq_q;
  float* dlse = nullptr;
  std::vector<float> lse_host(lse_n + kPadElems, std::nanf(""));
  CHECK_CUDA(cudaMalloc(&dlse, lse_host.size() * 4));
  CHECK_CUDA(cudaMemcpy(dlse, lse_host.data(), lse_host.size() * 4, cudaMemcpyHostToDevice));
  int *dql = nullptr, *dkl = nullptr;
  CHECK_CUDA(cudaMalloc(&dql, c.batch * 4));
  CHECK_CUDA(cudaMalloc(&dkl, c.batch * 4));
  CHECK_CUDA(cudaMemcpy(dql, q_len.data(), c.batch * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkl, kv_len.data(), c.batch * 4, cudaMemcpyHostToDevice));
  AttentionParams p = make_contiguous_params(dq.ptr, dk.ptr, dv.ptr, dout.ptr, c.batch, c.seq_q, c.seq_k, c.heads_q,
                                             c.heads_k, D, 1.0f / std::sqrt(static_cast<float>(D)));
  set_features(p, c.causal, c.window_left, c.window_right, c.softcap, c.lengths ? dql : nullptr,
               c.lengths ? dkl : nullptr, dlse);
  unsigned long long* dcounter = nullptr;  // the sm90 dynamic tile scheduler's counter (the launcher zeroes it)
  CHECK_CUDA(cudaMalloc(&dcounter, sizeof(unsigned long long)));
  p.tile_counter = dcounter;
  void* dworkspace = nullptr;  // the split tail's scratch (RegistryEntry::split_bytes_per_sm), as the FFI handler
  if (e.split_bytes_per_sm > 0) {
    int device = 0, sms = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    p.split_workspace_bytes = int64_t{sms} * e.split_bytes_per_sm;
    CHECK_CUDA(cudaMalloc(&dworkspace, p.split_workspace_bytes));
    p.split_workspace = dworkspace;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  failure = e.run(p, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaStreamDestroy(stream));
  RunResult r{dout.read(), lse_host};
  CHECK_CUDA(cudaMemcpy(r.lse.data(), dlse, r.lse.size() * 4, cudaMemcpyDeviceToHost));
  cudaFree(dlse);
  cudaFree(dcounter);
  cudaFree(dworkspace);
  cudaFree(dql);
  cudaFree(dkl);
  return r;
}

std::string check_case(const RegistryEntry& e, const Case& c, uint32_t seed) {
  const int D = e.key.head_dim, dtype = e.key.dtype;
  const size_t nq = static_cast<size_t>(c.batch) * c.seq_q * c.heads_q * D;
  const size_t nk = static_cast<size_t>(c.batch) * c.seq_k * c.heads_k * D;
  std::vector<uint16_t> q(nq), k(nk), v(nk);
  uint32_t state = seed * 2654435761u + 1;
  auto uniform = [&]() {  // in [-2, 2)
    state = state * 1664525u + 1013904223u;
    return (state >> 8) * (4.0f / 16777216.0f) - 2.0f;
  };
  for (auto& x : q) x = to_bits(uniform(), dtype);
  for (auto& x : k) x = to_bits(uniform(), dtype);
  for (auto& x : v) x = to_bits(uniform(), dtype);
  std::vector<int> q_len(c.batch, c.seq_q), kv_len(c.batch, c.seq_k);
  if (c.lengths) {
    for (int b = 0; b < c.batch; ++b) {
      q_len[b] = b % 2 ? c.seq_q / 2 : c.seq_q;
      kv_len[b] = b % 2 ? c.seq_k : (c.seq_k * 2) / 3;
    }
  }
  std::string failure;
  const RunResult nan_padded = run_gpu(e, c, q, k, v, q_len, kv_len, kNaN16, failure);
  if (!failure.empty()) return "launch failed: " + failure;
  const RunResult zero_padded = run_gpu(e, c, q, k, v, q_len, kv_len, 0, failure);
  if (nan_padded.out != zero_padded.out) return "output depends on memory past the inputs (out-of-bounds read)";
  for (size_t i = 0; i < nq; ++i) {
    if (!std::isfinite(from_bits(nan_padded.out[i], dtype))) return "output element " + std::to_string(i) +
                                                                    " not written (or NaN)";
  }
  for (size_t i = nq; i < nq + kPadElems; ++i) {
    if (nan_padded.out[i] != kNaN16) return "write past the end of the output at " + std::to_string(i);
  }
  const size_t nl = static_cast<size_t>(c.batch) * c.heads_q * c.seq_q;
  for (size_t i = 0; i < nl; ++i) {
    if (std::isnan(nan_padded.lse[i])) return "lse element " + std::to_string(i) + " not written";
  }
  for (size_t i = nl; i < nl + kPadElems; ++i) {
    if (!std::isnan(nan_padded.lse[i])) return "write past the end of lse at " + std::to_string(i);
  }
  // The CPU implementation on the same inputs (host copies; fp32 math).
  std::vector<uint16_t> cpu_out(nq);
  std::vector<float> cpu_lse(nl);
  AttentionParams p = make_contiguous_params(q.data(), k.data(), v.data(), cpu_out.data(), c.batch, c.seq_q, c.seq_k,
                                             c.heads_q, c.heads_k, D, 1.0f / std::sqrt(static_cast<float>(D)));
  set_features(p, c.causal, c.window_left, c.window_right, c.softcap, c.lengths ? q_len.data() : nullptr,
               c.lengths ? kv_len.data() : nullptr, cpu_lse.data());
  attention_cpu(p, dtype == static_cast<int>(DType::kBFloat16) ? CpuElement::kBFloat16 : CpuElement::kFloat16, 64, 64,
                harness::reference_runtime());
  const float tol = dtype == static_cast<int>(DType::kBFloat16) ? 4e-2f : 8e-3f;
  for (size_t i = 0; i < nq; ++i) {
    const float diff = std::fabs(from_bits(nan_padded.out[i], dtype) - from_bits(cpu_out[i], dtype));
    if (!(diff <= tol)) return "output " + std::to_string(i) + " differs from the CPU implementation by " +
                               std::to_string(diff);
  }
  for (size_t i = 0; i < nl; ++i) {
    const float a = nan_padded.lse[i], b = cpu_lse[i];
    if (std::isinf(a) || std::isinf(b) ? a != b : !(std::fabs(a - b) <= 1e-2f)) {
      return "lse " + std::to_string(i) + " differs: " + std::to_string(a) + " vs " + std::to_string(b);
    }
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::vector<Case> cases = {
      {1, 1, 1, 1, 1, false, -1, -1, false, 0.0f},        {2, 17, 129, 4, 2, true, -1, -1, false, 0.0f},
      {1, 129, 17, 2, 1, true, -1, -1, true, 0.0f},       {2, 113, 203, 4, 1, false, 7, 3, true, 5.0f},
      {1, 64, 64, 2, 2, false, 0, 0, false, 0.0f},        {3, 33, 1, 2, 2, false, -1, -1, true, 0.0f},
  };
  if (!quick) {
    cases.push_back({1, 1025, 1023, 2, 1, true, -1, -1, false, 0.0f});
    cases.push_back({2, 1, 1025, 4, 4, false, -1, -1, true, 30.0f});
    cases.push_back({1, 1023, 1025, 2, 2, false, 100, -1, false, 0.0f});
  }
  // Kernels with a split tail (csrc/sm90/launch.cuh: more tiles than SMs, not a multiple of them, >= 16 key blocks)
  // also run shapes that split on a 132-SM H200 / H100: 153 / 170 tiles of 16 key blocks, unmasked (one with
  // softcap) and masked ones (2000 keys: the soft-capped kernel splits, the other does not); Sq != Sk, GQA.
  const std::vector<Case> split_cases = {
      {1, 1152, 2048, 17, 17, false, -1, -1, false, 0.0f},
      {2, 640, 2048, 17, 1, false, -1, -1, false, 20.0f},
      {1, 1100, 2000, 17, 17, false, -1, -1, false, 0.0f},  {1, 1100, 2000, 17, 17, false, -1, -1, false, 10.0f},
  };
  int passed = 0, failed = 0;
  for (int i = 0; i < kRegistrySize; ++i) {
    const RegistryEntry& e = kRegistry[i];
    std::vector<Case> entry_cases = cases;
    if (e.split_bytes_per_sm > 0) entry_cases.insert(entry_cases.end(), split_cases.begin(), split_cases.end());
    for (size_t j = 0; j < entry_cases.size(); ++j) {
      const Case& c = entry_cases[j];
      const std::string failure = check_case(e, c, static_cast<uint32_t>(i * 131 + j));
      if (failure.empty()) {
        ++passed;
      } else {
        ++failed;
        std::printf("FAIL %s case %zu (B=%d Sq=%d Sk=%d Hq=%d Hk=%d causal=%d window=(%d,%d) lengths=%d "
                    "softcap=%g): %s\n",
                    describe(e.key).c_str(), j, c.batch, c.seq_q, c.seq_k, c.heads_q, c.heads_k, c.causal,
                    c.window_left, c.window_right, c.lengths, c.softcap, failure.c_str());
      }
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
