#include "app/systemd_job.h"

#include <systemd/sd-bus.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "base/log.h"

namespace memoffload::daemon {
namespace {

constexpr char kSystemd[] = "org.freedesktop.systemd1";

// Frees what sd-bus handed out, whatever the return.
struct BusCall {
  ~BusCall() {
    sd_bus_error_free(&error);
    sd_bus_message_unref(reply);
    sd_bus_flush_close_unref(bus);
  }
  Status Failed(const char* what, int r) const {
    return Unavailable(std::string("cannot ask systemd ") + what + ": " +
                       (error.message != nullptr ? error.message : std::strerror(-r)));
  }
  sd_bus* bus = nullptr;
  sd_bus_error error = SD_BUS_ERROR_NULL;
  sd_bus_message* reply = nullptr;
};

}  // namespace

Result<std::string> SystemdUnitJob() {
  BusCall c;
  if (int r = sd_bus_open_system(&c.bus); r < 0) return c.Failed("(system bus)", r);
  // Asked from the event loop at SIGTERM: a wedged bus must not hold the
  // exit up for sd-bus's default 25 s.
  sd_bus_set_method_call_timeout(c.bus, 2'000'000);
  if (int r = sd_bus_call_method(c.bus, kSystemd, "/org/freedesktop/systemd1",
                                 "org.freedesktop.systemd1.Manager", "GetUnitByPID", &c.error,
                                 &c.reply, "u", static_cast<uint32_t>(getpid()));
      r < 0) {
    return c.Failed("for this process's unit", r);
  }
  const char* unit_path = nullptr;
  if (int r = sd_bus_message_read(c.reply, "o", &unit_path); r < 0) {
    return c.Failed("for this process's unit", r);
  }
  const std::string unit = unit_path;
  c.reply = sd_bus_message_unref(c.reply);
  if (int r = sd_bus_get_property(c.bus, kSystemd, unit.c_str(), "org.freedesktop.systemd1.Unit",
                                  "Job", &c.error, &c.reply, "(uo)");
      r < 0) {
    return c.Failed("for the unit's job", r);
  }
  uint32_t job_id = 0;
  const char* job_path = nullptr;
  if (int r = sd_bus_message_read(c.reply, "(uo)", &job_id, &job_path); r < 0) {
    return c.Failed("for the unit's job", r);
  }
  if (job_id == 0) return std::string();
  const std::string job = job_path;
  char* type = nullptr;
  if (int r = sd_bus_get_property_string(
          c.bus, kSystemd, job.c_str(), "org.freedesktop.systemd1.Job", "JobType", &c.error, &type);
      r < 0) {
    return c.Failed("for the job's type", r);
  }
  std::string out = type;
  free(type);
  return out;
}

bool IsRestartJob(const std::string& type) {
  return type == "restart" || type == "try-restart" || type == "reload-or-restart" ||
         type == "reload-or-try-restart";
}

bool SigtermKeepsSessions(const std::string& mode, bool has_store, bool under_systemd,
                          const SessionTable& table) {
  if (!has_store || mode == "never" || table.draining() || table.Snapshot().sessions == 0) {
    return false;
  }
  // Under systemd: a restart keeps them, a stop for good drains them (the
  // unit's fd store goes with the stop).
  if (mode == "restart" && under_systemd) {
    Result<std::string> job = SystemdUnitJob();
    if (!job.ok()) {
      MO_LOG_WARN("received SIGTERM: %s, so a restart is not told from a stop: draining",
                  job.status().message().c_str());
      return false;
    }
    if (!IsRestartJob(*job)) {
      MO_LOG_INFO("received SIGTERM: systemd %s the unit, not a restart: draining",
                  job->empty() ? "runs no job on" : ("runs a '" + *job + "' job on").c_str());
      return false;
    }
  }
  for (const SessionRecord& s : table.SessionRecords()) {
    if (s.pid <= 0) {
      MO_LOG_INFO(
          "received SIGTERM: session %lu has no known pid (its process is outside this "
          "daemon's pid namespace), so no session can be resumed after a restart: draining",
          static_cast<unsigned long>(s.id));
      return false;
    }
  }
  return true;
}

}  // namespace memoffload::daemon
