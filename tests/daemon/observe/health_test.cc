// HealthResponse: the probe endpoint's answers to well-formed and malformed
// request heads (the server itself runs in tests/integration/health_test.cc).
#include "observe/health.h"

#include <gtest/gtest.h>

#include <string>

namespace memoffload::daemon {
namespace {

std::string StatusLine(const std::string& response) {
  return response.substr(0, response.find("\r\n"));
}
std::string Body(const std::string& response) {
  return response.substr(response.find("\r\n\r\n") + 4);
}

TEST(HealthResponse, ReadyAndLiveWhileServing) {
  for (const char* path : {"/healthz", "/readyz", "/livez", "/readyz?verbose=1"}) {
    const std::string r =
        HealthResponse(std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n", false);
    EXPECT_EQ(StatusLine(r), "HTTP/1.1 200 OK") << path;
    EXPECT_EQ(Body(r), "ok\n") << path;
    EXPECT_NE(r.find("Content-Length: 3\r\n"), std::string::npos) << r;
    EXPECT_NE(r.find("Connection: close\r\n"), std::string::npos) << r;
  }
}

TEST(HealthResponse, DrainingIsNotReadyButStillLive) {
  for (const char* path : {"/healthz", "/readyz"}) {
    const std::string r = HealthResponse(std::string("GET ") + path + " HTTP/1.0\r\n\r\n", true);
    EXPECT_EQ(StatusLine(r), "HTTP/1.1 503 Service Unavailable") << path;
    EXPECT_EQ(Body(r), "draining\n");
  }
  const std::string live = HealthResponse("GET /livez HTTP/1.1\r\n\r\n", true);
  EXPECT_EQ(StatusLine(live), "HTTP/1.1 200 OK");
  EXPECT_EQ(Body(live), "draining\n");
}

TEST(HealthResponse, DeadDataPlaneIsNotReadyButStillLive) {
  const std::string why = "gRPC socket cannot accept: Too many open files";
  for (const char* path : {"/healthz", "/readyz"}) {
    const std::string r =
        HealthResponse(std::string("GET ") + path + " HTTP/1.0\r\n\r\n", false, why);
    EXPECT_EQ(StatusLine(r), "HTTP/1.1 503 Service Unavailable") << path;
    EXPECT_EQ(Body(r), "not ready: " + why + "\n");
  }
  EXPECT_EQ(StatusLine(HealthResponse("GET /livez HTTP/1.1\r\n\r\n", false, why)),
            "HTTP/1.1 200 OK");
  // Draining is what a probe needs to know first.
  EXPECT_EQ(Body(HealthResponse("GET /readyz HTTP/1.1\r\n\r\n", true, why)), "draining\n");
}

TEST(HealthResponse, HeadHasNoBodyBareLfIsAccepted) {
  const std::string r = HealthResponse("HEAD /readyz HTTP/1.1\r\n\r\n", false);
  EXPECT_EQ(StatusLine(r), "HTTP/1.1 200 OK");
  EXPECT_EQ(Body(r), "");
  EXPECT_EQ(StatusLine(HealthResponse("GET /livez HTTP/1.0\n\n", false)), "HTTP/1.1 200 OK");
}

TEST(HealthResponse, UnknownPathAndMethod) {
  EXPECT_EQ(StatusLine(HealthResponse("GET /metrics HTTP/1.1\r\n\r\n", false)),
            "HTTP/1.1 404 Not Found");
  EXPECT_EQ(StatusLine(HealthResponse("POST /readyz HTTP/1.1\r\n\r\n", false)),
            "HTTP/1.1 405 Method Not Allowed");
}

TEST(HealthResponse, MalformedRequestsAre400) {
  for (const std::string& head :
       {std::string("\r\n\r\n"), std::string("GET\r\n\r\n"), std::string("GET /readyz\r\n\r\n"),
        std::string("GET /readyz HTTP/2\r\n\r\n"), std::string("GET  /readyz HTTP/1.1\r\n\r\n"),
        std::string("GET /readyz HTTP/1.1 extra\r\n\r\n"),
        std::string("GET readyz HTTP/1.1\r\n\r\n"), std::string("GET /ready\x01z HTTP/1.1\r\n\r\n"),
        std::string("GET /\xff HTTP/1.1\r\n\r\n"), std::string("\0\0\0\0\r\n\r\n", 8),
        std::string("no line end")}) {
    EXPECT_EQ(StatusLine(HealthResponse(head, false)), "HTTP/1.1 400 Bad Request") << head;
  }
}

}  // namespace
}  // namespace memoffload::daemon
