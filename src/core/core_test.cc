#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/parse.h"
#include "core/rng.h"
#include "core/thread_pool.h"

namespace tq {
namespace {

TEST(Half, ExactValuesRoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = f16_bits_to_f32(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16_bits(f), h) << "f16 bits " << bits;
  }
}

TEST(Half, RoundsToNearestEven) {
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1.0).
  EXPECT_EQ(f16_bits_to_f32(f32_to_f16_bits(1.0f + 0x1.0p-11f)), 1.0f);
  EXPECT_EQ(f16_bits_to_f32(f32_to_f16_bits(1.0f + 3 * 0x1.0p-11f)), 1.0f + 0x1.0p-9f);
  EXPECT_EQ(f16_bits_to_f32(f32_to_f16_bits(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_bits_to_f32(f32_to_f16_bits(65520.0f))));
  EXPECT_EQ(f16_bits_to_f32(f32_to_f16_bits(0x1.0p-24f)), 0x1.0p-24f);   // smallest subnormal
  EXPECT_EQ(f16_bits_to_f32(f32_to_f16_bits(0x1.0p-26f)), 0.0f);         // below half of it
  EXPECT_TRUE(std::isnan(f16_bits_to_f32(f32_to_f16_bits(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Half, MatchesDoubleRoundingOnRandomFloats) {
  SplitMix64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const float f = static_cast<float>(rng.normal() * std::exp2(rng.uniform() * 40 - 25));
    const float r = f16_bits_to_f32(f32_to_f16_bits(f));
    // The result must be one of the two neighbours and at least as close as the other.
    const uint16_t h = f32_to_f16_bits(f);
    const float up = f16_bits_to_f32(static_cast<uint16_t>(h + 1));
    const float down = f16_bits_to_f32(static_cast<uint16_t>(h - 1));
    if (std::isinf(r) || std::isinf(up)) continue;
    EXPECT_LE(std::fabs(r - f), std::fabs(up - f));
    if ((h & 0x7fff) != 0) {
      EXPECT_LE(std::fabs(r - f), std::fabs(down - f));
    }
  }
}

TEST(BFloat16, RoundTripAndRounding) {
  EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(1.0f)), 1.0f);
  EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(1.0f + 0x1.0p-8f)), 1.0f);  // tie to even
  EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(1.0f + 3 * 0x1.0p-8f)), 1.0f + 0x1.0p-6f);
}

// The message of the tq::Error that f throws, or "" when it throws none.
template <class F>
std::string error_of(const F& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ParseInteger, TakesWholeIntegersOnly) {
  EXPECT_EQ(parse_integer("128", "group size"), 128);
  EXPECT_EQ(parse_integer("-7", "offset"), -7);
  EXPECT_EQ(parse_integer<long long>("9000000000", "bytes"), 9000000000LL);
  EXPECT_EQ(error_of([] { parse_integer("8x", "K bits"); }), "K bits must be an integer, got '8x'");
  EXPECT_EQ(error_of([] { parse_integer("3,1", "V bits"); }), "V bits must be an integer, got '3,1'");
  EXPECT_EQ(error_of([] { parse_integer("", "block size"); }), "block size must be an integer, got ''");
  EXPECT_EQ(error_of([] { parse_integer(" 5", "block size"); }), "block size must be an integer, got ' 5'");
  EXPECT_EQ(error_of([] { parse_integer("+5", "block size"); }), "block size must be an integer, got '+5'");
  EXPECT_EQ(error_of([] { parse_integer("99999999999", "block size"); }), "block size is out of range: '99999999999'");
}

TEST(Rng, SplitMix64IsFixed) {
  // First outputs for seed 0 are a published property of SplitMix64.
  SplitMix64 rng(0);
  EXPECT_EQ(rng.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(rng.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(splitmix64_at(0, 0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(splitmix64_at(0, 1), 0x6E789E6AA1B965F4ull);
}

TEST(ThreadPool, CoversRangeExactlyOnce) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (size_t n : {0u, 1u, 2u, 7u, 1000u}) {
      std::vector<std::atomic<int>> hits(n);
      for (int rep = 0; rep < 50; ++rep) {
        pool.parallel_for(n, [&](size_t b, size_t e, int) {
          for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
      }
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 50);
    }
  }
}

// More threads than cores: workers often wake after the caller has run their chunks (and find the
// call over), or take a chunk of a later call. Every element is still covered exactly once per call,
// each chunk is contiguous, and no call waits on a worker that never runs.
TEST(ThreadPool, OversubscribedPoolsCoverEveryCallExactlyOnce) {
  const int threads = 2 * static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  ThreadPool pool(threads);
  std::vector<std::atomic<int>> hits(64);
  for (int call = 0; call < 3000; ++call) {
    const size_t n = 1 + static_cast<size_t>(call) % hits.size();
    std::atomic<int> chunks{0};
    pool.parallel_for(n, [&](size_t b, size_t e, int t) {
      EXPECT_LT(b, e);
      EXPECT_GE(t, 0);
      EXPECT_LT(t, threads);
      for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
      chunks.fetch_add(1);
    });
    EXPECT_EQ(chunks.load(), static_cast<int>(std::min<size_t>(n, static_cast<size_t>(threads))));
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].exchange(0), 1) << "call " << call << " element " << i;
  }
}

// An error thrown in any chunk, on any thread, reaches the caller once the other chunks have run, and
// the pool keeps working.
TEST(ThreadPool, AChunkThatThrowsReachesTheCaller) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (size_t bad : {0u, 5u, 9u}) {
      std::vector<std::atomic<int>> hits(10);
      try {
        pool.parallel_for(hits.size(), [&](size_t b, size_t e, int) {
          for (size_t i = b; i < e; ++i) {
            if (i == bad) TQ_CHECK(false, "element ", i, " is bad");
            hits[i].fetch_add(1);
          }
        });
        ADD_FAILURE() << "expected the error of element " << bad;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("element " + std::to_string(bad) + " is bad"), std::string::npos) << e.what();
      }
      for (size_t i = 0; i < hits.size(); ++i) EXPECT_LE(hits[i].load(), 1);
      std::atomic<int> covered{0};
      pool.parallel_for(100, [&](size_t b, size_t e, int) { covered.fetch_add(static_cast<int>(e - b)); });
      EXPECT_EQ(covered.load(), 100);
    }
  }
}

// Calls of several chunks share the pool's fields: a second one while one runs is refused with an error
// (rather than overwriting the running call's fields), and the running call still covers every element.
TEST(ThreadPool, ACallWhileAnotherRunsIsRefused) {
  ThreadPool pool(2);
  // From inside a body, on the caller's chunk and on the worker's: the error reaches the outer caller.
  for (size_t nested_in : {0u, 1u}) {
    std::vector<std::atomic<int>> hits(2);
    try {
      pool.parallel_for(2, [&](size_t b, size_t, int) {
        hits[b].fetch_add(1);
        if (b == nested_in) pool.parallel_for(4, [](size_t, size_t, int) {});
      });
      ADD_FAILURE() << "expected the nested call to be refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("while another call runs"), std::string::npos) << e.what();
    }
    EXPECT_EQ(hits[0].load(), 1);
    EXPECT_EQ(hits[1].load(), 1);
  }
  // A call of one chunk runs inline and is allowed inside a body.
  std::atomic<int> inner{0};
  pool.parallel_for(2, [&](size_t, size_t, int) { pool.parallel_for(1, [&](size_t, size_t, int) { inner.fetch_add(1); }); });
  EXPECT_EQ(inner.load(), 2);
  // From a second thread while the first call waits inside its body.
  std::atomic<bool> started{false}, checked{false};
  std::string refused;
  std::thread other([&] {
    while (!started.load()) std::this_thread::yield();
    try {
      pool.parallel_for(2, [](size_t, size_t, int) {});
    } catch (const Error& e) {
      refused = e.what();
    }
    checked.store(true);
  });
  std::atomic<int> covered{0};
  pool.parallel_for(2, [&](size_t b, size_t e, int) {
    if (b == 0) {
      started.store(true);
      while (!checked.load()) std::this_thread::yield();
    }
    covered.fetch_add(static_cast<int>(e - b));
  });
  other.join();
  EXPECT_NE(refused.find("while another call runs"), std::string::npos) << refused;
  EXPECT_EQ(covered.load(), 2);
  // And the pool is usable afterwards.
  covered = 0;
  pool.parallel_for(100, [&](size_t b, size_t e, int) { covered.fetch_add(static_cast<int>(e - b)); });
  EXPECT_EQ(covered.load(), 100);
}

// Idle workers spin, then yield, then sleep on the condition variable; a call then has to wake them
// (the caller sees them counted as sleeping and notifies). Every call covers its range exactly once
// whichever state the workers are in, including calls right after they fell asleep.
TEST(ThreadPool, SleepingWorkersWakeForTheNextCall) {
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    const auto idle = ThreadPool::kSpinPause + ThreadPool::kSpinYield;
    for (int round = 0; round < 3; ++round) {
      // Wait until every worker sleeps (a few idle periods; a loaded machine may run them late).
      const auto give_up = std::chrono::steady_clock::now() + 200 * idle;
      while (pool.sleeping_workers() < threads - 1 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(idle);
      }
      EXPECT_EQ(pool.sleeping_workers(), threads - 1) << "round " << round;
      for (int call = 0; call < 20; ++call) {
        std::vector<std::atomic<int>> hits(50);
        pool.parallel_for(hits.size(), [&](size_t b, size_t e, int) {
          for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << "call " << call << " element " << i;
      }
    }
  }
}

// A worker's chunk that runs longer than the caller's pause phase: the caller goes on to yield
// between checks and still returns only once the chunk is done.
TEST(ThreadPool, TheCallerWaitsForLongChunks) {
  ThreadPool pool(2);
  for (int rep = 0; rep < 5; ++rep) {
    std::atomic<int> finished{0};
    pool.parallel_for(2, [&](size_t b, size_t, int) {
      if (b == 1) std::this_thread::sleep_for(2 * ThreadPool::kWaitPause);
      finished.fetch_add(1);
    });
    EXPECT_EQ(finished.load(), 2);
  }
}

// Destroying a pool whose workers spin, yield or sleep returns promptly (stop wakes every state).
TEST(ThreadPool, DestructionInAnyIdleState) {
  for (const auto wait : {std::chrono::microseconds(0), ThreadPool::kSpinPause / 2,
                          ThreadPool::kSpinPause + ThreadPool::kSpinYield / 2,
                          4 * (ThreadPool::kSpinPause + ThreadPool::kSpinYield)}) {
    for (int rep = 0; rep < 3; ++rep) {
      ThreadPool pool(3);
      std::atomic<int> covered{0};
      pool.parallel_for(30, [&](size_t b, size_t e, int) { covered.fetch_add(static_cast<int>(e - b)); });
      EXPECT_EQ(covered.load(), 30);
      std::this_thread::sleep_for(wait);
    }
  }
}

TEST(ThreadPool, RejectsZeroThreads) { EXPECT_THROW(ThreadPool(0), Error); }

}  // namespace
}  // namespace tq
