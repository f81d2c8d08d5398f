// The CPU path's element types: how fp32, fp16 and bf16 tensors are read into fp32 rows and written back.
#pragma once

#include <cstdint>

#include "cpu/attention_cpu.h"  // CpuElement
#include "cpu/vector_ops.h"

namespace jax_flash::cpu {

template <CpuElement E>
struct Element;
template <>
struct Element<CpuElement::kFloat32> {
  using Storage = float;
  static constexpr bool kDirect = true;  // the GEMMs read fp32 tensors in place (leading dimension = seq stride)
  static void widen(const float* src, float* dst, int64_t n) { widen_fp32(src, dst, n, 1.0f); }
  static void narrow(const float* src, float* dst, int64_t n, float s) { narrow_fp32(src, dst, n, s); }
};
template <>
struct Element<CpuElement::kFloat16> {
  using Storage = uint16_t;
  static constexpr bool kDirect = false;
  static void widen(const uint16_t* src, float* dst, int64_t n) { widen_fp16(src, dst, n, 1.0f); }
  static void narrow(const float* src, uint16_t* dst, int64_t n, float s) { narrow_fp16(src, dst, n, s); }
};
template <>
struct Element<CpuElement::kBFloat16> {
  using Storage = uint16_t;
  static constexpr bool kDirect = false;
  static void widen(const uint16_t* src, float* dst, int64_t n) { widen_bf16(src, dst, n, 1.0f); }
  static void narrow(const float* src, uint16_t* dst, int64_t n, float s) { narrow_bf16(src, dst, n, s); }
};

}  // namespace jax_flash::cpu
