/// \file runner/thread_team.hpp
/// \brief A fixed team of threads for one batch's forward pass: the one threading helper of the
/// programs (runner, tools, eval, bench).
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "triattn/core/error.hpp"

namespace triattn_runner {

/// A fixed team of threads for one batch's forward: `run(f)` calls f(member) on every member
/// and returns when all are done. The calling thread is member 0; the others wait between
/// calls by spinning (yielding the CPU every few iterations) for a few milliseconds, then on a
/// futex: a forward makes hundreds of calls, and a futex wake-up costs tens of microseconds
/// on a virtual machine (measured: 15-20 % of a batched step); the yields keep a team from
/// starving other programs when the cores are oversubscribed. No thread is started for a
/// team of one.
class thread_team {
 public:
  explicit thread_team(int threads = 1) {
    TRIATTN_CHECK(threads >= 1 && threads <= 1024, "triattn_runner::thread_team", "threads ", threads, " must be in [1, 1024]");
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this, t] { work(t); });
  }
  thread_team(const thread_team&) = delete;
  thread_team& operator=(const thread_team&) = delete;
  ~thread_team() {
    stop_ = true;
    generation_.fetch_add(1);
    generation_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// f(member) for every member in [0, size()); rethrows the first exception one threw.
  void run(const std::function<void(int)>& f) {
    if (workers_.empty()) return f(0);
    job_ = &f;
    error_ = nullptr;
    pending_.store(static_cast<int>(workers_.size()));
    generation_.fetch_add(1);
    generation_.notify_all();
    call(0);
    for (int spin = 0; pending_.load() != 0; ++spin) {
      if (spin < spin_limit) {
        pause(spin);
        continue;
      }
      const int left = pending_.load();
      if (left != 0) pending_.wait(left);
    }
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  /// f(i) for every i in [0, count), item i on member i % size().
  void for_each(std::size_t count, const std::function<void(std::size_t)>& f) {
    const auto members = static_cast<std::size_t>(size());
    run([&](int t) {
      for (std::size_t i = static_cast<std::size_t>(t); i < count; i += members) f(i);
    });
  }

  /// f(i) for every i in [0, count), each item taken by the next member that is free: for
  /// items of uneven cost (an evaluation's windows and prompts). The first exception stops
  /// the items not yet taken and is rethrown.
  void for_each_dynamic(std::size_t count, const std::function<void(std::size_t)>& f) {
    std::atomic<std::size_t> next{0};
    run([&](int) {
      for (std::size_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
        try {
          f(i);
        } catch (...) {
          next = count;
          throw;
        }
      }
    });
  }

 private:
  static constexpr int spin_limit = 1 << 18;
  static void pause(int spin) {
    if (spin % 64 == 63) std::this_thread::yield();
  }

  void call(int t) {
    try {
      (*job_)(t);
    } catch (...) {
      const std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
  void work(int t) {
    unsigned seen = 0;
    for (;;) {
      for (int spin = 0; generation_.load() == seen; ++spin) {
        if (spin >= spin_limit) generation_.wait(seen);
        pause(spin);
      }
      seen = generation_.load();
      if (stop_) return;
      call(t);
      if (pending_.fetch_sub(1) == 1) pending_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<unsigned> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace triattn_runner
