// Log: where the messages of libmemoffload and of the torch layer go (an
// attach to a daemon instance, a daemon that restarted, a group kept in
// memory, ...). Every line of the client side goes through Log(); nothing
// of ours writes to stderr directly.
//
// Log() hands each record to the installed sink. The default sink writes one
// line to stderr ("memoffload: rank 3: message", the rank left out when
// unknown), which is what a C++ program sees. A program with a logging
// system of its own installs a sink: the Python extension installs the
// queue (EnableLogQueue) at import and takes it into Python's "memoffload"
// logger from Python threads, so no thread of ours ever takes the GIL.
//
// Thread-safety: every function may be called from any thread. A sink is
// called on the thread that logs, possibly several threads at once, and
// must not call Log() itself.
#ifndef MEMOFFLOAD_CLIENT_LOG_H_
#define MEMOFFLOAD_CLIENT_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "memoffload/common/status.h"

namespace memoffload::client {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };  // Python's

struct LogRecord {
  LogLevel level = LogLevel::kWarning;
  StatusCode code = StatusCode::kOk;  // the status the message is about, kOk if none
  int rank = -1;                      // the session's rank when the logger knows it, else -1
  std::string message;                // one line, without "memoffload: " or the rank
};

// Receives every record from the next Log() on.
using LogSink = void (*)(LogRecord record);

// Installs `sink` (nullptr: the default stderr sink) and returns the one it
// replaces (nullptr when that was the default).
LogSink SetLogSink(LogSink sink);

// Hands one record to the sink.
void Log(LogLevel level, StatusCode code, std::string message, int rank = -1);

// The default sink's line for `record`, without the newline:
// "memoffload: [rank N: ]message".
std::string FormatLogLine(const LogRecord& record);

// Installs a sink that queues records, keeping at most `max_records` (older
// ones are dropped and counted): for a program that moves them into its own
// logger from a thread of its choice (TakeLogRecords).
void EnableLogQueue(size_t max_records);

// Takes every queued record, oldest first.
std::vector<LogRecord> TakeLogRecords();

// Records the queue dropped because it was full.
uint64_t DroppedLogRecords();

}  // namespace memoffload::client

#endif  // MEMOFFLOAD_CLIENT_LOG_H_
