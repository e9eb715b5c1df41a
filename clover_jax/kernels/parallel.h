// Work split over XLA's own intra-op thread pool (the FFI ThreadPool context), not a pool of ours:
// two pools on a small machine fight for the same cores.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace clover {

// Calls task(0), ..., task(n - 1), each once, on the pool's threads and the calling thread. Tasks are
// claimed through an atomic counter and the caller claims too, so it only ever waits for tasks that
// another thread has started: no deadlock when the pool is busy or has no thread to spare.
template <typename Task>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, Task task) {
  struct State {
    Task task;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    State(Task t, int64_t count) : task(std::move(t)), n(count) {}
    bool run_one() {
      const int64_t i = next.fetch_add(1);
      if (i >= n) return false;  // late helpers touch nothing else: the caller may have returned
      task(i);
      done.fetch_add(1, std::memory_order_release);
      return true;
    }
  };
  auto state = std::make_shared<State>(std::move(task), n);
  const int64_t helpers = std::min<int64_t>(n - 1, pool.num_threads());
  for (int64_t h = 0; h < helpers; ++h)
    pool.Schedule([state] {
      while (state->run_one()) {
      }
    });
  while (state->run_one()) {
  }
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace clover
