// The prefix cache's index: block boundaries, the longest verified match, redundant entries, LRU.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "serve/prefix_cache.h"

namespace tq::serve {
namespace {

std::vector<int32_t> iota(int n, int32_t from = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

TEST(PrefixCache, BoundariesFollowTheSinkAndTheBlocks) {
  PrefixCache c(/*first=*/4, /*block_tokens=*/16, 8);
  EXPECT_EQ(c.boundary(19), 0);
  EXPECT_EQ(c.boundary(20), 20);
  EXPECT_EQ(c.boundary(35), 20);
  EXPECT_EQ(c.boundary(36), 36);
}

TEST(PrefixCache, FindsTheLongestVerifiedPrefixBelowTheLimit) {
  PrefixCache c(0, 16, 8);
  const std::vector<int32_t> a = iota(48);  // three blocks
  c.insert(/*seq=*/5, a);
  std::vector<int32_t> p = iota(60);
  auto m = c.lookup(p, p.size() - 1);
  EXPECT_EQ(m.entry >= 0, true);
  EXPECT_EQ(m.length, 48);
  EXPECT_EQ(c.seq_of(m.entry), 5);
  // The limit (a request computes its last prompt token) keeps the match below it.
  m = c.lookup(a, a.size() - 1);
  EXPECT_EQ(m.length, 32);
  // A difference in the second block: only the first block matches.
  p[20] = 999;
  EXPECT_EQ(c.lookup(p, p.size() - 1).length, 16);
  p[3] = 999;
  EXPECT_EQ(c.lookup(p, p.size() - 1).entry, -1);
  EXPECT_EQ(c.lookup(iota(10), 9).entry, -1);  // shorter than a block
}

TEST(PrefixCache, LongerEntriesReplaceTheirPrefixesAndLruGoesFirst) {
  PrefixCache c(0, 16, 3);
  c.insert(1, iota(16));
  EXPECT_EQ(c.covering(iota(16)), c.entries()[0]);
  EXPECT_EQ(c.covering(iota(32)), -1);
  // An entry whose tokens extend entry 1's makes it redundant.
  EXPECT_EQ(c.insert(2, iota(32)), std::vector<int>{1});
  EXPECT_EQ(c.size(), 1);
  c.insert(3, iota(16, 100));
  c.insert(4, iota(16, 200));
  EXPECT_EQ(c.size(), 3);
  EXPECT_EQ(c.over_bound(), c.least_recent());
  // Using the oldest entry makes the next one the least recent.
  const auto m = c.lookup(iota(40), 39);
  ASSERT_GE(m.entry, 0);
  EXPECT_EQ(c.seq_of(m.entry), 2);
  c.touch(m.entry);
  EXPECT_EQ(c.seq_of(c.least_recent()), 3);
  EXPECT_EQ(c.erase(c.least_recent()), 3);
  EXPECT_EQ(c.size(), 2);
  EXPECT_EQ(c.over_bound(), -1);
  // Erased entries are out of the index.
  EXPECT_EQ(c.lookup(iota(20, 100), 19).entry, -1);
}

// For forks that cannot be truncated (sliding windows): a shorter entry kept beside a longer one, and a
// match served by the entry that ends there.
TEST(PrefixCache, KeepsShorterEntriesAndPrefersTheOneEndingAtTheMatch) {
  PrefixCache c(0, 16, 4);
  c.insert(1, iota(32));
  EXPECT_TRUE(c.insert(2, iota(64), /*drop_prefixes=*/false).empty());
  EXPECT_EQ(c.size(), 2);
  EXPECT_EQ(c.seq_of(c.holding(iota(32))), 1);
  EXPECT_EQ(c.holding(iota(48)), -1);  // covered by entry 2, held by none
  EXPECT_GE(c.covering(iota(48)), 0);
  // A prompt sharing 40 tokens: the match is 32, from the entry that ends at 32.
  std::vector<int32_t> p = iota(40);
  p.push_back(9999);
  const auto m = c.lookup(p, p.size() - 1);
  EXPECT_EQ(m.length, 32);
  EXPECT_EQ(c.seq_of(m.entry), 1);
  // A prompt sharing all 64: the longer entry.
  EXPECT_EQ(c.seq_of(c.lookup(iota(70), 69).entry), 2);
}

TEST(PrefixCache, EntriesMustHoldWholeBlocks) { EXPECT_ANY_THROW(PrefixCache(0, 16, 2).insert(1, iota(20))); }

}  // namespace
}  // namespace tq::serve
