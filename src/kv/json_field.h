// Integer fields of the JSON headers of cache files (kv/cache.cc, kv/cache_file.cc).
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "core/error.h"

namespace tq {

// A header's integer field, whole and in Int's range: nlohmann's get<int> takes 4294967296 as 0 and
// converts 1e300 with undefined behaviour, which would make a lying header look like another one.
template <class Int>
inline Int integer_field(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = j.at(key);
  bool fits = false;
  if (v.is_number_unsigned()) {
    fits = v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<Int>::max());
  } else if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if constexpr (std::is_signed_v<Int>)
      fits = x >= static_cast<int64_t>(std::numeric_limits<Int>::min()) && x <= static_cast<int64_t>(std::numeric_limits<Int>::max());
    else
      fits = x >= 0 && static_cast<uint64_t>(x) <= static_cast<uint64_t>(std::numeric_limits<Int>::max());
  }
  TQ_CHECK(fits, "'", key, "' must be an integer from ", +std::numeric_limits<Int>::min(), " to ", +std::numeric_limits<Int>::max(),
           ", got ", v.dump());
  return v.get<Int>();
}

}  // namespace tq
