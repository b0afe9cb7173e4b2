// Worker: one thread running posted tasks in order (FIFO). The order is what
// makes the offloader simple: a group's Reserve runs before its copies, its
// copies before its Commit, its Commit before its Prefetch.
#ifndef MEMOFFLOAD_TORCH_SRC_WORKER_H_
#define MEMOFFLOAD_TORCH_SRC_WORKER_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace memoffload::torch {

class Worker {
 public:
  Worker() : thread_([this] { Run(); }) {}
  // Runs every task already posted, then joins.
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Tasks must not throw; the worker catches and drops anything that does.
  void Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  // Returns once every task posted before the call has run.
  void Flush() {
    std::promise<void> done;
    std::future<void> f = done.get_future();
    Post([&done] { done.set_value(); });
    f.wait();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      try {
        task();
      } catch (...) {
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                    // GUARDED_BY(mu_)
  std::thread thread_;                       // last: starts after the members above
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_WORKER_H_
