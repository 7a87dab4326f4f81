// A small persistent thread pool for the CPU kernels: a fixed set of workers that sleep between
// calls, and one blocking parallel_for that hands out indices one at a time (the work items of
// the attention kernels are coarse, so an atomic counter balances them well).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvattn::cpu {

/// Threads to use: `configured` when > 0, else the environment variable KVATTN_NUM_THREADS when it
/// holds a positive integer, else the number of CPUs the process may run on (its affinity mask,
/// which containers and `taskset` narrow; at least 1).
int resolve_num_threads(int configured);

class ThreadPool {
 public:
  /// `num_threads` threads in all, the caller of parallel_for included (so num_threads - 1
  /// workers are started). Throws kvattn::Error when num_threads < 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  /// Runs fn(index, thread_id) for every index in [0, count) and returns when all are done;
  /// thread_id is in [0, size()) and the same thread never runs two indices at once, so it can
  /// pick per-thread scratch. The first exception a call throws is rethrown here (the other
  /// indices still run). Calls from several threads are serialized.
  void parallel_for(int64_t count, const std::function<void(int64_t, int)>& fn);

 private:
  void worker_loop(int thread_id);
  void run_indices(int thread_id);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one parallel_for at a time

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;  // bumped once per parallel_for; workers wait for a new value
  int busy_workers_ = 0;
  bool stopping_ = false;

  // The current call (valid while busy_workers_ > 0 or the caller runs indices).
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

}  // namespace kvattn::cpu
