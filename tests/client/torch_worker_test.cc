// memoffload::torch::Worker (client/torch/src/worker.h, torch-free): one
// thread running posted tasks in FIFO order. Plain data written by tasks is
// read after Flush without further locking, so ThreadSanitizer
// (scripts/sanitize.sh) checks that Flush and the destructor really order
// those accesses.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "worker.h"

namespace memoffload::torch {
namespace {

TEST(TorchWorker, RunsTasksInPostOrderAndFlushSeesTheirWrites) {
  std::vector<int> order;  // touched only by the worker until Flush returns
  Worker w;
  for (int i = 0; i < 1000; ++i) w.Post([&order, i] { order.push_back(i); });
  w.Flush();
  ASSERT_EQ(order.size(), 1000u);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(order[i], i);
}

TEST(TorchWorker, KeepsEachPostersOrderWhenManyThreadsPost) {
  constexpr int kThreads = 4, kTasks = 2000;
  std::vector<std::vector<int>> seen(kThreads);  // written by the worker only
  Worker w;
  std::vector<std::thread> posters;
  for (int t = 0; t < kThreads; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < kTasks; ++i) w.Post([&seen, t, i] { seen[t].push_back(i); });
    });
  }
  for (auto& p : posters) p.join();
  w.Flush();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), static_cast<size_t>(kTasks)) << "poster " << t;
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[t][i], i) << "poster " << t;
  }
}

TEST(TorchWorker, FlushFromSeveralThreadsAtOnce) {
  Worker w;
  std::atomic<int> ran{0};
  std::vector<std::thread> flushers;
  for (int t = 0; t < 4; ++t) {
    flushers.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        const int before = ran.fetch_add(1) + 1;
        w.Post([&ran] { ran.fetch_add(1); });
        w.Flush();
        EXPECT_GE(ran.load(), before + 1);
      }
    });
  }
  for (auto& f : flushers) f.join();
  EXPECT_EQ(ran.load(), 4 * 200 * 2);
}

TEST(TorchWorker, DestructorRunsEveryPostedTask) {
  int count = 0;  // read after the worker's thread is joined
  {
    Worker w;
    for (int i = 0; i < 500; ++i) w.Post([&count] { ++count; });
  }
  EXPECT_EQ(count, 500);
}

TEST(TorchWorker, AThrowingTaskIsDroppedAndLaterTasksStillRun) {
  Worker w;
  bool after = false;
  w.Post([] { throw std::runtime_error("task failed"); });
  w.Post([&after] { after = true; });
  w.Flush();
  EXPECT_TRUE(after);
  EXPECT_EQ(w.thrown(), 1u);
}

// A task that owes a promise and throws must not leave its waiter hanging:
// its on_throw delivers an answer (what the offloader's Prefetch does).
TEST(TorchWorker, AThrowingTaskThatOwesAPromiseDeliversItThroughOnThrow) {
  Worker w;
  std::promise<std::string> owed;
  std::future<std::string> answer = owed.get_future();
  w.Post([] { throw std::runtime_error("prefetch exploded"); },
         [&owed](const char* what) { owed.set_value(what); });
  ASSERT_EQ(answer.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(answer.get(), "prefetch exploded");
  w.Post([] { throw 42; }, [](const char* what) { EXPECT_STREQ(what, "unknown exception"); });
  w.Flush();
  EXPECT_EQ(w.thrown(), 2u);
}

// The offloader reports the first throw through its log and exports thrown()
// as stats()["internal_errors"].
TEST(TorchWorker, TheFirstThrowIsReportedAndEveryThrowCounted) {
  std::vector<std::string> reported;  // written by the worker only
  Worker w([&reported](const char* what) { reported.push_back(what); });
  w.Post([] { throw std::runtime_error("first"); });
  w.Post([] { throw std::runtime_error("second"); });
  w.Flush();
  ASSERT_EQ(reported.size(), 1u);
  EXPECT_EQ(reported[0], "first");
  EXPECT_EQ(w.thrown(), 2u);
}

}  // namespace
}  // namespace memoffload::torch
