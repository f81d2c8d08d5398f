// One zeroed pair of 64-bit tile-scheduler counters per (device, stream): ffi/tile_counters.h.
#include "ffi/tile_counters.h"

#include <map>
#include <mutex>
#include <utility>

namespace jax_flash {

std::string stream_tile_counter(cudaStream_t stream, unsigned long long** counter) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, unsigned long long*> pairs;  // never freed: kernels may still run
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    return std::string("cudaGetDevice failed: ") + cudaGetErrorName(err);
  }
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = pairs.try_emplace({device, stream}, nullptr);
  if (inserted) {
    void* memory = nullptr;
    cudaError_t err = cudaMalloc(&memory, 2 * sizeof(unsigned long long));
    // on the stream itself: ordered before the first kernel that uses the pair
    if (err == cudaSuccess) err = cudaMemsetAsync(memory, 0, 2 * sizeof(unsigned long long), stream);
    if (err != cudaSuccess) {
      if (memory != nullptr) cudaFree(memory);
      cudaGetLastError();  // (clear it: the launcher's check after the kernel launch would report it)
      pairs.erase(it);
      return std::string("allocating the tile counters failed: ") + cudaGetErrorName(err);
    }
    it->second = static_cast<unsigned long long*>(memory);
  }
  *counter = it->second;
  return {};
}

}  // namespace jax_flash
