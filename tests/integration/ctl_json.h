// Parses memoffloadctl's --json output into the daemon's reply message (a
// test failure, with the text, when it does not parse).
#ifndef MEMOFFLOAD_TESTS_INTEGRATION_CTL_JSON_H_
#define MEMOFFLOAD_TESTS_INTEGRATION_CTL_JSON_H_

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <string>

namespace memoffload::testing {

template <typename Message>
Message ParseJson(const std::string& json) {
  Message m;
  auto st = google::protobuf::util::JsonStringToMessage(json, &m);
  EXPECT_TRUE(st.ok()) << st.ToString() << "\n" << json;
  return m;
}

}  // namespace memoffload::testing

#endif  // MEMOFFLOAD_TESTS_INTEGRATION_CTL_JSON_H_
