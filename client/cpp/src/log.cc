#include "memoffload/client/log.h"

#include <unistd.h>

#include <atomic>
#include <deque>
#include <iterator>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace memoffload::client {
namespace {

std::atomic<LogSink> g_sink{nullptr};  // nullptr: StderrSink

void StderrSink(LogRecord record) {
  std::string line = FormatLogLine(record);
  line += '\n';
  // One write(2) per line, so that lines of several threads do not mix.
  const ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;  // a log line that cannot be written has nowhere else to go
}

struct LogQueue {
  absl::Mutex mu;
  size_t max_records ABSL_GUARDED_BY(mu) = 1;
  std::deque<LogRecord> queue ABSL_GUARDED_BY(mu);
  uint64_t dropped ABSL_GUARDED_BY(mu) = 0;
};

LogQueue& Queue() {
  static LogQueue* q = new LogQueue;  // never destroyed: worker threads may log at exit
  return *q;
}

void QueueSink(LogRecord record) {
  LogQueue& q = Queue();
  absl::MutexLock lock(&q.mu);
  if (q.queue.size() >= q.max_records) {
    q.queue.pop_front();
    ++q.dropped;
  }
  q.queue.push_back(std::move(record));
}

}  // namespace

LogSink SetLogSink(LogSink sink) { return g_sink.exchange(sink); }

void Log(LogLevel level, StatusCode code, std::string message, int rank) {
  LogSink sink = g_sink.load();
  (sink != nullptr ? sink : StderrSink)(LogRecord{level, code, rank, std::move(message)});
}

std::string FormatLogLine(const LogRecord& record) {
  std::string line = "memoffload: ";
  if (record.rank >= 0) line += "rank " + std::to_string(record.rank) + ": ";
  return line + record.message;
}

void EnableLogQueue(size_t max_records) {
  {
    LogQueue& q = Queue();
    absl::MutexLock lock(&q.mu);
    q.max_records = max_records > 0 ? max_records : 1;
  }
  SetLogSink(QueueSink);
}

std::vector<LogRecord> TakeLogRecords() {
  LogQueue& q = Queue();
  absl::MutexLock lock(&q.mu);
  std::vector<LogRecord> out(std::make_move_iterator(q.queue.begin()),
                             std::make_move_iterator(q.queue.end()));
  q.queue.clear();
  return out;
}

uint64_t DroppedLogRecords() {
  LogQueue& q = Queue();
  absl::MutexLock lock(&q.mu);
  return q.dropped;
}

}  // namespace memoffload::client
