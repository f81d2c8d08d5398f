// The compile-time identity of one GPU kernel: data type, head dim and the KernelConfig fields (generated from
// jax_flash/config.py: common/config_fields.h). It is both the registry key and the template parameter of both
// families (a C++20 structural type), so the generated instantiations and the lookup share one definition.
#pragma once

#include <cstdint>
#include <string>

#include "common/config_fields.h"

namespace jax_flash {

// kFloat8E4M3: the sm90 FP8 forward only (csrc/sm90/launch_fp8.cuh; the registry holds float16 and bfloat16).
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat8E4M3 = 2 };

struct KernelKey {
  int dtype;  // DType value
  int head_dim;
#define JAX_FLASH_DECLARE_FIELD(type, name) type name;
  JAX_FLASH_CONFIG_FIELDS(JAX_FLASH_DECLARE_FIELD)
#undef JAX_FLASH_DECLARE_FIELD

  constexpr bool operator==(const KernelKey&) const = default;
};

inline const char* dtype_name(int dtype) {
  if (dtype == static_cast<int>(DType::kFloat8E4M3)) return "float8_e4m3fn";
  return dtype == static_cast<int>(DType::kBFloat16) ? "bfloat16" : "float16";
}

inline std::string field_text(bool value) { return value ? "True" : "False"; }
inline std::string field_text(int value) { return std::to_string(value); }

// "family=sm90 bfloat16 head_dim=128 block_q=128 ..." (the fields its family reads) for error messages.
inline std::string describe(const KernelKey& key) {
  std::string text = "family=sm" + std::to_string(key.family) + " " + dtype_name(key.dtype) +
                     " head_dim=" + std::to_string(key.head_dim);
#define JAX_FLASH_DESCRIBE_FIELD(type, name) text += std::string(" " #name "=") + field_text(key.name);
  if (key.family == 90) {
    JAX_FLASH_SM90_FIELDS(JAX_FLASH_DESCRIBE_FIELD)
  } else {
    JAX_FLASH_SM80_FIELDS(JAX_FLASH_DESCRIBE_FIELD)
  }
#undef JAX_FLASH_DESCRIBE_FIELD
  return text;
}

}  // namespace jax_flash
