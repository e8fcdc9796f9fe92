// Helpers shared by the libFuzzer targets (fuzz/*.cc, docs/RELIABILITY.md).
//
// What a target may do with an input: throw tq::Error (the parser refused it, naming the problem: the
// expected outcome for most inputs). Anything else is a finding: a crash or sanitizer report, any other
// exception escaping (std::bad_alloc, nlohmann's type_error, std::out_of_range: libFuzzer reports the
// abort of std::terminate), a leak, a run over the time limit, or an allocation over the memory limit.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace tq::fuzz {

// A folder of this process for the loaders that take paths (under $TMPDIR or /tmp), removed at exit.
inline const std::string& scratch_dir() {
  struct Dir {
    std::string path;
    Dir() {
      const char* base = std::getenv("TMPDIR");
      path = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/tq-fuzz-" + std::to_string(getpid());
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

// Writes `bytes` to scratch_dir()/name (replacing it) and returns the path.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

inline void remove_scratch(const std::string& name) {
  std::error_code ec;
  std::filesystem::remove(scratch_dir() + "/" + name, ec);
}

// Inputs that hold several files separate them with this line (the dictionaries list it, so mutations
// keep it whole).
inline constexpr std::string_view kSeparator = "\n%%%%tq-fuzz-file%%%%\n";

// The parts of `data` between separators; always `n` of them (missing ones empty, extra text stays in
// the last).
inline std::vector<std::string_view> split_parts(const uint8_t* data, size_t size, size_t n) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < n) {
    const size_t at = rest.find(kSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kSeparator.size());
  }
  parts.push_back(rest);
  while (parts.size() < n) parts.emplace_back();
  return parts;
}

// Runs `f`; a tq::Error (the input refused) returns false, anything else propagates.
template <class F>
bool refused(F&& f) {
  try {
    f();
    return false;
  } catch (const tq::Error&) {
    return true;
  }
}

}  // namespace tq::fuzz
