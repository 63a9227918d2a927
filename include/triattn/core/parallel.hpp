/// \file triattn/core/parallel.hpp
/// \brief How a round spreads its independent work over threads: a `parallel_for` hook the
/// engine maps onto its own threads, and `threads(n)`, a default on `std::thread`.
///
/// The library owns no thread and no pool. A round's work items are independent by
/// construction (one item scores one (layer, kv_head) row into its own buffer, selects one
/// decision, or compacts one row), and whatever they combine is folded afterwards on the
/// calling thread in a fixed order, so the keep sets are the same at every thread count.
/// When items throw, the error of the lowest item is rethrown: the same error a serial run
/// reports, and nothing has moved (compaction validates before any item runs).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Runs `task(item, worker)` once for every item in [0, count) and returns when all have
/// returned. `worker` is in [0, workers): items that run at the same time get different
/// workers (a task keeps per-worker scratch). Empty `run`: the items run in order on the
/// calling thread, worker 0.
struct parallel_for {
  using task_fn = std::function<void(std::int64_t item, int worker)>;
  int workers = 1;
  std::function<void(std::int64_t count, const task_fn& task)> run;

  /// Runs the items; rethrows the exception of the lowest item that threw.
  void operator()(std::int64_t count, const task_fn& task) const {
    if (!run || workers <= 1 || count <= 1) {
      for (std::int64_t i = 0; i < count; ++i) task(i, 0);
      return;
    }
#if defined(__cpp_exceptions)
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(count));
    run(count, [&](std::int64_t item, int worker) {
      try {
        task(item, worker);
      } catch (...) {
        errors[static_cast<std::size_t>(item)] = std::current_exception();
      }
    });
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
#else
    run(count, task);  // without exceptions a failing check aborts (TRIATTN_NO_EXCEPTIONS)
#endif
  }
};

/// A `parallel_for` on `n` threads: the calling thread and n - 1 `std::thread`s started for
/// each call and joined before it returns (no pool, nothing left running). Items are handed
/// out one at a time from a shared counter, so uneven rows balance. `n` = 1: serial.
inline parallel_for threads(int n) {
  TRIATTN_CHECK(n >= 1, "triattn::threads", "thread count ", n, " must be >= 1");
  parallel_for p;
  p.workers = n;
  p.run = [n](std::int64_t count, const parallel_for::task_fn& task) {
    std::atomic<std::int64_t> next{0};
    const auto work = [&](int worker) {
      for (std::int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) task(i, worker);
    };
    const int spawned = static_cast<int>(std::min<std::int64_t>(n, count)) - 1;
    std::vector<std::thread> pool;
    pool.reserve(static_cast<std::size_t>(spawned));
    for (int w = 1; w <= spawned; ++w) pool.emplace_back(work, w);
    work(0);
    for (std::thread& t : pool) t.join();
  };
  return p;
}

TRIATTN_NAMESPACE_END
