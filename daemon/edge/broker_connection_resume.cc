// Broker::Connection's resume of a session a take-over or a restart handed
// on (attach_wire.h, "Resume"): the session is bound to this connection when
// its peer is the session's own process; and the notice that asks for it.
#include <chrono>
#include <string>

#include "edge/broker_connection.h"

namespace memoffload::daemon {

void Broker::Connection::NoticeResume(const std::string& why) {
  if (closed_ || session_id_ == 0) return;
  std::vector<OutFrame> frames;
  frames.push_back(Frame(EncodeNotice({NoticeKind::kResume, why})));
  // As for AskToLeave: a request may come while the notice is unread.
  Send(std::move(frames), [this] { leave_unread_ = UnreadBytes(socket_.native_handle()); });
}

void Broker::Connection::OnResume() {
  Result<Resume> resume = DecodeResume(payload_);
  if (!resume.ok()) return Refuse("bad_hello", resume.status());
  std::chrono::milliseconds waited{0};
  Hello hello;
  Result<SessionGrant> grant =
      broker_->table_->Resume(resume->session_id, resume->session_token, peer_, &hello, &waited);
  // Not found: the daemon restarted (the client attaches again); refused:
  // another process's session.
  if (!grant.ok()) return Refuse("session_error", grant.status());
  hello_ = hello;
  broker_->table_->SetSeries(grant->session_id,
                             broker_->metrics_->SeriesFor(hello_.job_id, hello_.rank));
  Granted(*grant, "resumed after " + std::to_string(waited.count()) + " ms");
  const ArenaSnapshot now = broker_->table_->Snapshot();
  if (now.handed_waiting == 0) {
    MO_LOG_INFO(
        "no handed session waits any more: %u resumed, %u closed unresumed; the "
        "longest waited %.0f ms",
        now.handed_resumed, now.handed_not_resumed, now.longest_resume_wait_seconds * 1000);
  }
}

}  // namespace memoffload::daemon
