// Log: where the torch layer's messages go (a daemon that cannot take a
// group, a reconnect, a chunk CUDA would not register).
//
// By default each message is one line on stderr ("memoffload: ..."), which is
// what a C++ trainer sees. The Python extension calls EnableLogQueue() once
// at import: from then on messages are queued instead, and Python drains them
// (DrainLog) into its "memoffload" logger from the training thread, so no
// thread of ours ever takes the GIL.
//
// Thread-safety: every function may be called from any thread; the queue is
// guarded by its own mutex.
#ifndef MEMOFFLOAD_TORCH_LOG_H_
#define MEMOFFLOAD_TORCH_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/shared_mem/status.h"

namespace memoffload::torch {

enum class LogLevel : int { kInfo = 20, kWarning = 30, kError = 40 };  // Python's numbers

struct LogRecord {
  LogLevel level = LogLevel::kWarning;
  StatusCode code = StatusCode::kOk;  // the status the message is about, kOk if none
  std::string message;
};

// Queues messages from now on, keeping at most `max_records` (older ones are
// dropped and counted).
void EnableLogQueue(size_t max_records);

// Takes every queued record, oldest first.
std::vector<LogRecord> DrainLog();

// Records dropped because the queue was full.
uint64_t DroppedLogRecords();

// Writes one message to the queue or, without one, to stderr.
void Log(LogLevel level, StatusCode code, std::string message);

}  // namespace memoffload::torch

#endif  // MEMOFFLOAD_TORCH_LOG_H_
