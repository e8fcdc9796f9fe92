// Errors: one exception type that says what was wrong, in words a user can act on.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tq {

// Thrown for bad input (arguments, files, requests). The message names the problem.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}
}  // namespace detail

// Builds a message from pieces: tq::fail("group size ", g, " does not divide ", d).
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  detail::append_all(os, parts...);
  throw Error(os.str());
}

}  // namespace tq

// Checks a condition on input and throws tq::Error with the given message pieces when it fails.
#define TQ_CHECK(cond, ...)            \
  do {                                 \
    if (!(cond)) ::tq::fail(__VA_ARGS__); \
  } while (0)
