// Helpers shared by the model tests: scratch files and error-message checks.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>
#include <string>
#include <unistd.h>

#include "core/error.h"

namespace tq::testing_util {

// A fresh directory under the test temp dir, removed at the end of the scope.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    static int counter = 0;
    path_ = std::filesystem::path(::testing::TempDir()) /
            ("tq_model_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Runs f, which must throw tq::Error, and returns the message ("" and a test failure otherwise).
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected tq::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected tq::Error, nothing was thrown";
  return "";
}

// Every needle must appear in the tq::Error thrown by f.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  const std::string msg = error_message(f);
  for (const std::string& n : needles) {
    EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
}

}  // namespace tq::testing_util
