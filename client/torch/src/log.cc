#include "memoffload/torch/log.h"

#include <cstdio>
#include <deque>
#include <mutex>
#include <utility>

namespace memoffload::torch {
namespace {

struct LogQueue {
  std::mutex mu;
  bool enabled = false;         // GUARDED_BY(mu)
  size_t max_records = 0;       // GUARDED_BY(mu)
  std::deque<LogRecord> queue;  // GUARDED_BY(mu)
  uint64_t dropped = 0;         // GUARDED_BY(mu)
};

LogQueue& Queue() {
  static LogQueue* q = new LogQueue;  // never destroyed: worker threads may log at exit
  return *q;
}

}  // namespace

void EnableLogQueue(size_t max_records) {
  LogQueue& q = Queue();
  std::lock_guard<std::mutex> lock(q.mu);
  q.enabled = true;
  q.max_records = max_records > 0 ? max_records : 1;
}

std::vector<LogRecord> DrainLog() {
  LogQueue& q = Queue();
  std::lock_guard<std::mutex> lock(q.mu);
  std::vector<LogRecord> out(std::make_move_iterator(q.queue.begin()),
                             std::make_move_iterator(q.queue.end()));
  q.queue.clear();
  return out;
}

uint64_t DroppedLogRecords() {
  LogQueue& q = Queue();
  std::lock_guard<std::mutex> lock(q.mu);
  return q.dropped;
}

void Log(LogLevel level, StatusCode code, std::string message) {
  LogQueue& q = Queue();
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.enabled) {
      if (q.queue.size() >= q.max_records) {
        q.queue.pop_front();
        ++q.dropped;
      }
      q.queue.push_back(LogRecord{level, code, std::move(message)});
      return;
    }
  }
  std::fprintf(stderr, "memoffload: %s\n", message.c_str());
}

}  // namespace memoffload::torch
