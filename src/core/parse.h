// Strict parsing of numbers in flags and compact specs: the whole text must be the number, so that
// "8x", "3,1" or "" are errors that name the flag instead of a silently truncated value (std::stoi)
// or an uncaught std::invalid_argument that aborts the program.
#pragma once

#include <charconv>
#include <string_view>
#include <system_error>

#include "core/error.h"

namespace tq {

// The decimal integer spelled by all of `text` (an optional '-', then digits), else tq::Error:
// "<what> must be an integer, got '<text>'" or "<what> is out of range: '<text>'".
template <class Int = int>
Int parse_integer(std::string_view text, std::string_view what) {
  Int value{};
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::result_out_of_range) fail(what, " is out of range: '", text, "'");
  TQ_CHECK(ec == std::errc() && stop == end, what, " must be an integer, got '", text, "'");
  return value;
}

}  // namespace tq
