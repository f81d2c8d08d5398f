// Work sharing for the CPU attention on threads it is given (XLA's intra-op pool), never threads of its own.
#pragma once

#include <cstdint>
#include <functional>

namespace jax_flash::cpu {

// Hands a task to another thread; it may also run it at once in the caller (XLA does so when its pool is absent).
using ScheduleFn = std::function<void(std::function<void()>)>;

// A worker: the function it runs per item, made once per worker (it owns that worker's scratch).
using ItemFn = std::function<void(int64_t item)>;
using MakeWorkerFn = std::function<ItemFn()>;

// Runs every item of [0, num_items) exactly once, in ascending order of claiming, on up to `workers` workers: the
// caller and workers - 1 tasks given to `schedule` (none when it is empty), each claiming items from one shared
// counter. Returns when every item has finished. Deadlock-free whatever the pool does with the tasks: the caller
// claims items too, so it can finish them all alone; a task that starts late finds no item and touches nothing
// but the shared counter it co-owns. make_worker is called only by a worker that claimed an item.
void parallel_for(int64_t num_items, int workers, const ScheduleFn& schedule, const MakeWorkerFn& make_worker);

}  // namespace jax_flash::cpu
