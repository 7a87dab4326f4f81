#include "cpu/thread_pool.h"

#include <sched.h>

#include <cstdlib>
#include <string>

#include "kvattn/error.h"

namespace kvattn::cpu {

int resolve_num_threads(int configured) {
  if (configured > 0) return configured;
  if (const char* env = std::getenv("KVATTN_NUM_THREADS")) {
    char* end = nullptr;
    const long value = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && value > 0 && value <= 4096) return int(value);
  }
  // The CPUs this process may run on: a container or `taskset` restricts them, and
  // hardware_concurrency() would still count every CPU of the host.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    const int count = CPU_COUNT(&allowed);
    if (count > 0) return count;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? int(hw) : 1;
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads) {
  check_arg(num_threads >= 1, "num_threads", "got ", num_threads, ", expected >= 1");
  workers_.reserve(size_t(num_threads - 1));
  for (int t = 1; t < num_threads; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::run_indices(int thread_id) {
  for (;;) {
    const int64_t index = next_.fetch_add(1, std::memory_order_relaxed);
    if (index >= count_) return;
    try {
      (*fn_)(index, thread_id);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop(int thread_id) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_indices(thread_id);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_workers_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t count, const std::function<void(int64_t, int)>& fn) {
  if (count <= 0) return;
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  error_ = nullptr;
  fn_ = &fn;
  count_ = count;
  next_.store(0, std::memory_order_relaxed);
  // A single index runs on the caller alone: waking the workers would only add latency.
  const bool use_workers = !workers_.empty() && count > 1;
  if (use_workers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_workers_ = int(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
  }
  run_indices(0);
  if (use_workers) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return busy_workers_ == 0; });
  }
  fn_ = nullptr;
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace kvattn::cpu
