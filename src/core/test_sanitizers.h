// Which sanitizer this test binary is built with (header only, for the tests; the libraries never ask).
// The slowest tests run fewer cases under a sanitizer, still real ones: the sanitizer stages of .ci/run must
// fit its time (docs/RELIABILITY.md). GCC defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang answers
// __has_feature.
#pragma once

namespace tq::testing_util {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace tq::testing_util
