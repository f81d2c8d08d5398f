// Loading OpenBLAS at run time (see blas.h). The scipy-openblas32 wheel prefixes every symbol with "scipy_" so that
// it never clashes with another BLAS in the process (numpy's and SciPy's own copies included).
#include "cpu/blas.h"

#include <atomic>
#include <mutex>
#include <stdexcept>

#if defined(_WIN32)
#include <windows.h>
#else
#include <dlfcn.h>
#endif

namespace jax_flash::cpu {
namespace {

std::atomic<SgemmFn> g_sgemm{nullptr};
std::mutex g_load_mutex;
std::string g_corename;  // guarded by g_load_mutex; set once with g_sgemm

#if defined(_WIN32)
void* open_library(const std::string& path, std::string& error) {
  HMODULE handle = LoadLibraryA(path.c_str());
  if (!handle) error = "LoadLibrary failed with error " + std::to_string(GetLastError());
  return reinterpret_cast<void*>(handle);
}
void* find_symbol(void* library, const char* name) {
  return reinterpret_cast<void*>(GetProcAddress(reinterpret_cast<HMODULE>(library), name));
}
#else
void* open_library(const std::string& path, std::string& error) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) error = dlerror();
  return handle;
}
void* find_symbol(void* library, const char* name) { return dlsym(library, name); }
#endif

}  // namespace

std::string load_openblas(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_sgemm.load() != nullptr) return g_corename;
  std::string error;
  void* library = open_library(path, error);
  if (!library) throw std::runtime_error("could not load OpenBLAS from '" + path + "': " + error);
  // The library stays loaded for the life of the process: handlers may run until exit.
  auto sgemm = reinterpret_cast<SgemmFn>(find_symbol(library, "scipy_cblas_sgemm"));
  auto set_threads = reinterpret_cast<void (*)(int)>(find_symbol(library, "scipy_openblas_set_num_threads"));
  auto corename = reinterpret_cast<const char* (*)()>(find_symbol(library, "scipy_openblas_get_corename"));
  if (!sgemm || !set_threads || !corename) {
    throw std::runtime_error("'" + path +
                             "' is not the OpenBLAS of scipy-openblas32: it lacks scipy_cblas_sgemm, "
                             "scipy_openblas_set_num_threads or scipy_openblas_get_corename");
  }
  set_threads(1);
  g_corename = corename();
  g_sgemm.store(sgemm);
  return g_corename;
}

SgemmFn openblas_sgemm() { return g_sgemm.load(); }

}  // namespace jax_flash::cpu
