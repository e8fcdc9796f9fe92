// The JSON headers of cache files (kv/cache.cc, kv/cache_file.cc): their integer fields, and the frame that
// starts both files (8 magic bytes, u32 version, u32 header length, the header text).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>
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

// The bytes a cache file starts with: magic[8], version (u32), the header's length (u32), then its text;
// the file's records follow.
inline std::vector<uint8_t> framed_header(const char* magic, uint32_t version, const std::string& header) {
  TQ_CHECK(header.size() <= UINT32_MAX, "a cache file's header of ", header.size(), " bytes does not fit its length field");
  std::vector<uint8_t> bytes(16 + header.size());
  const uint32_t len = static_cast<uint32_t>(header.size());
  std::memcpy(bytes.data(), magic, 8);
  std::memcpy(bytes.data() + 8, &version, 4);
  std::memcpy(bytes.data() + 12, &len, 4);
  std::memcpy(bytes.data() + 16, header.data(), header.size());
  return bytes;
}

// fnv1a64 of the bytes (kv/cache.cc).
uint64_t fnv1a(const uint8_t* p, size_t n);

// The header text of a whole cache file framed by framed_header and ending in the u64 fnv1a of what precedes
// it, after checking its size, magic ("is not a turboquant <kind> (bad magic)"), version, checksum and header
// length; `name` names the file in the messages. Versions oldest..version are read (oldest 0: version only);
// the file's goes to *stored_version_out.
inline std::string framed_header_text(std::span<const uint8_t> bytes, const char* magic, uint32_t version, const std::string& name,
                                      const char* kind, uint32_t oldest = 0, uint32_t* stored_version_out = nullptr) {
  TQ_CHECK(bytes.size() >= 24, name, " is truncated (", bytes.size(), " bytes)");
  TQ_CHECK(std::memcmp(bytes.data(), magic, 8) == 0, name, " is not a turboquant ", kind, " (bad magic)");
  uint32_t stored_version, len;
  std::memcpy(&stored_version, bytes.data() + 8, 4);
  std::memcpy(&len, bytes.data() + 12, 4);
  if (oldest == 0) oldest = version;
  TQ_CHECK(stored_version >= oldest && stored_version <= version, name, " has version ", stored_version, "; this build reads version ",
           oldest == version ? std::to_string(version) : std::to_string(oldest) + " to " + std::to_string(version));
  if (stored_version_out) *stored_version_out = stored_version;
  uint64_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 8, 8);
  TQ_CHECK(fnv1a(bytes.data(), bytes.size() - 8) == stored, name, " is corrupt or truncated (checksum mismatch)");
  TQ_CHECK(16 + static_cast<size_t>(len) + 8 <= bytes.size(), name, " is truncated inside its header");
  return std::string(reinterpret_cast<const char*>(bytes.data() + 16), len);
}

}  // namespace tq
