// Work sharing (see parallel.h).
#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace jax_flash::cpu {
namespace {

struct SharedWork {
  explicit SharedWork(int64_t n, const MakeWorkerFn& make) : num_items(n), make_worker(&make) {}
  const int64_t num_items;
  std::atomic<int64_t> next{0};
  const MakeWorkerFn* make_worker;  // the caller's; used only while an unfinished item exists
  std::mutex mutex;
  std::condition_variable all_done;
  int64_t finished = 0;  // guarded by mutex
};

void work(SharedWork& shared) {
  int64_t item = shared.next.fetch_add(1);
  if (item >= shared.num_items) return;
  int64_t count = 0;
  {
    ItemFn run_item = (*shared.make_worker)();
    for (; item < shared.num_items; item = shared.next.fetch_add(1)) {
      run_item(item);
      ++count;
    }
  }  // the worker's scratch is freed before its items count as finished
  std::lock_guard<std::mutex> lock(shared.mutex);
  shared.finished += count;
  if (shared.finished == shared.num_items) shared.all_done.notify_all();
}

}  // namespace

void parallel_for(int64_t num_items, int workers, const ScheduleFn& schedule, const MakeWorkerFn& make_worker) {
  if (num_items <= 0) return;
  auto shared = std::make_shared<SharedWork>(num_items, make_worker);
  const int64_t helpers = schedule ? std::min<int64_t>(workers, num_items) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) schedule([shared] { work(*shared); });
  work(*shared);
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->finished == shared->num_items; });
}

}  // namespace jax_flash::cpu
