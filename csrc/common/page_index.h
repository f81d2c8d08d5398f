// Logical key -> (page, row within the page) of a paged K/V cache with a run-time page size (host and device code).
#pragma once

#include <cstdint>

#include "common/visibility.h"  // JAX_FLASH_HOST_DEVICE

namespace jax_flash {

// floor(key / size) as (key x multiplier) >> (31 + l), l = ceil(log2(size)), multiplier = ceil(2^(31 + l) / size):
// exact for 0 <= key < 2^31 (the multiplier's excess over 2^(31 + l) / size is below 1, so key times it adds less
// than 2^-l <= 1 / size to key / size), one wide multiply and a shift. A division by a run-time int is about 20
// dependent instructions: the sm80 decode tiles did three per key block, which at one thread block per SM cost
// about 0.3 us a block (MQA fp16 D = 64, 128 x 1024 keys in 64-key pages: 23.7 us against 18.5 contiguous, 28% more
// instructions executed; H100).
struct PageDivider {
  int size;
  uint32_t multiplier;
  int shift;  // 31 + l
  JAX_FLASH_HOST_DEVICE explicit PageDivider(int page_size) : size(page_size) {
    int l = 0;
    while ((int64_t{1} << l) < page_size) ++l;
    shift = 31 + l;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << shift) + page_size - 1) / page_size);
  }
  JAX_FLASH_HOST_DEVICE int page(int key) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(key)) * multiplier) >> shift);
  }
  JAX_FLASH_HOST_DEVICE int row(int key) const { return key - page(key) * size; }
};

}  // namespace jax_flash
