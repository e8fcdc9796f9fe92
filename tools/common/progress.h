// A one-line progress bar on stderr, drawn only when stderr is a terminal.
#pragma once

#include <cstdio>
#include <string>
#include <unistd.h>

namespace tq::cli {

class Progress {
 public:
  explicit Progress(int steps) : steps_(steps), tty_(isatty(fileno(stderr)) != 0) {}
  void step(const std::string& what) {
    ++done_;
    if (!tty_) return;
    const int width = 30, filled = width * done_ / steps_;
    std::fprintf(stderr, "\r[%s%s] %-40s", std::string(filled, '#').c_str(), std::string(width - filled, ' ').c_str(),
                 what.c_str());
    std::fflush(stderr);
  }
  void done() {
    if (tty_) std::fprintf(stderr, "\r%80s\r", "");
  }

 private:
  int steps_, done_ = 0;
  bool tty_;
};

}  // namespace tq::cli
