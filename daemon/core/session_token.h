// Session tokens: the secret a client presents with every request.
#ifndef MEMOFFLOAD_DAEMON_SESSION_TOKEN_H_
#define MEMOFFLOAD_DAEMON_SESSION_TOKEN_H_

#include <string>

#include "memoffload/common/status.h"

namespace memoffload::daemon {

// 128-bit random token as 32 lowercase hex digits (getrandom(2)).
Result<std::string> NewSessionToken();
// Compares in time independent of where the strings differ.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace memoffload::daemon

#endif  // MEMOFFLOAD_DAEMON_SESSION_TOKEN_H_
