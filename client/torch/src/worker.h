// Worker: one thread running posted tasks in order (FIFO). The order is what
// makes the offloader simple: a group's Reserve runs before its copies, its
// copies before its Commit, its Commit before its Prefetch.
#ifndef MEMOFFLOAD_TORCH_SRC_WORKER_H_
#define MEMOFFLOAD_TORCH_SRC_WORKER_H_

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "memoffload/client/log.h"
#include "memoffload/common/status.h"

namespace memoffload::torch {

class Worker {
 public:
  // Reports what the first task that throws threw (on the worker thread);
  // without one, a line in the client's log (memoffload/client/log.h).
  using Report = std::function<void(const char* what)>;
  explicit Worker(Report report = nullptr)
      : report_(std::move(report)), thread_([this] { Run(); }) {}
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

  // Called with what a task threw. A task that owes someone a result (a
  // promise) posts with an on_throw that delivers it, so a throwing task
  // never leaves a waiter hanging.
  using OnThrow = std::function<void(const char* what)>;

  // Tasks should not throw. One that does is a bug: it is counted
  // (thrown()), the first one is reported (see Report), and its on_throw runs
  // on the worker thread.
  void Post(std::function<void()> task, OnThrow on_throw = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(Task{std::move(task), std::move(on_throw)});
    }
    cv_.notify_one();
  }

  // Tasks that threw so far.
  uint64_t thrown() const { return thrown_.load(std::memory_order_relaxed); }

  // Returns once every task posted before the call has run.
  void Flush() {
    std::promise<void> done;
    std::future<void> f = done.get_future();
    Post([&done] { done.set_value(); });
    f.wait();
  }

 private:
  struct Task {
    std::function<void()> run;
    OnThrow on_throw;
  };

  void Run() {
    // The tasks (RPCs, copies) overlap with the training thread's compute:
    // SCHED_BATCH (same share of the CPU, no wake-up preemption) keeps a
    // posted task from preempting the thread that posted it on a busy
    // machine. Best effort: a refusal leaves the default policy.
    sched_param param{};
    param.sched_priority = 0;
    (void)sched_setscheduler(0, SCHED_BATCH, &param);
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      try {
        task.run();
      } catch (const std::exception& e) {
        Thrown(task, e.what());
      } catch (...) {
        Thrown(task, "unknown exception");
      }
    }
  }

  void Thrown(const Task& task, const char* what) {
    if (thrown_.fetch_add(1, std::memory_order_relaxed) == 0) {
      if (report_) {
        report_(what);
      } else {
        client::Log(client::LogLevel::kError, StatusCode::kInternal,
                    std::string("a worker task threw (") + what + "); this is a bug (logged once)");
      }
    }
    if (task.on_throw) task.on_throw(what);
  }

  const Report report_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> thrown_{0};
  std::deque<Task> tasks_;  // GUARDED_BY(mu_)
  bool stopping_ = false;   // GUARDED_BY(mu_)
  std::thread thread_;      // last: starts after the members above
};

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_SRC_WORKER_H_
