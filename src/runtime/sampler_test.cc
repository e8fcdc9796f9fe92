// The sampler's OpenAI extensions (logit_bias, presence / frequency penalties, logprobs) against
// reference computations written out here, and the stop-string filter the server streams through.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "runtime/sampler.h"
#include "runtime/stop_filter.h"

namespace tq {
namespace {

std::vector<float> random_logits(int n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> l(static_cast<size_t>(n));
  for (float& x : l) x = static_cast<float>(rng.normal() * 3.0);
  return l;
}

TEST(SamplerExtensions, LogitBiasAndPenaltiesMatchTheReferenceRule) {
  const std::vector<float> base = random_logits(50, 1);
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.7f;
  p.frequency_penalty = -0.3f;
  p.logit_bias = {{3, 5.0f}, {10, -100.0f}};
  // The prompt (7, 7, 9) is not counted by presence / frequency; the generated part (7, 12, 12, 12) is.
  const std::vector<int32_t> history = {7, 7, 9, 7, 12, 12, 12};
  const size_t generated_from = 3;
  Sampler s(p);
  std::vector<float> got = base;
  s.adjust(got, history, generated_from);
  // Reference: bias, then l -= presence * [c > 0] + frequency * c over generated counts c.
  std::map<int32_t, int> count;
  for (size_t i = generated_from; i < history.size(); ++i) ++count[history[i]];
  for (int32_t id = 0; id < 50; ++id) {
    double want = base[static_cast<size_t>(id)];
    if (id == 3) want += 5.0;
    if (id == 10) want -= 100.0;
    const int c = count.count(id) ? count[id] : 0;
    if (c > 0) want -= 0.7 + 0.3 * -c;
    EXPECT_NEAR(got[static_cast<size_t>(id)], want, 1e-5) << "token " << id;
  }
  EXPECT_FLOAT_EQ(got[9], base[9]);  // only in the prompt: untouched
  // A large bias decides a greedy pick.
  SamplingParams b;
  b.temperature = 0;
  b.logit_bias = {{42, 100.0f}};
  Sampler biased(b);
  std::vector<float> l = base;
  EXPECT_EQ(biased.sample(l, {}), 42);
}

TEST(SamplerExtensions, NeedsLogitsOnlyBeyondAPlainArgmax) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_FALSE(Sampler(p).needs_logits());
  p.presence_penalty = 0.1f;
  EXPECT_TRUE(Sampler(p).needs_logits());
  p.presence_penalty = 0;
  p.logit_bias = {{1, 1.0f}};
  EXPECT_TRUE(Sampler(p).needs_logits());
  p.logit_bias.clear();
  p.temperature = 0.5f;
  EXPECT_TRUE(Sampler(p).needs_logits());
}

TEST(SamplerExtensions, PenaltiesOutOfRangeAreRefusedByName) {
  SamplingParams p;
  p.presence_penalty = 2.5f;
  try {
    p.validate();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("presence_penalty"), std::string::npos) << e.what();
  }
  p.presence_penalty = 0;
  p.logit_bias = {{-1, 1.0f}};
  EXPECT_THROW(p.validate(), Error);
}

TEST(Logprobs, SumToOneAndMatchALogSoftmaxInDouble) {
  const std::vector<float> l = random_logits(300, 2);
  const int V = static_cast<int>(l.size());
  const Logprobs all = compute_logprobs(l, 17, V);
  ASSERT_EQ(all.top.size(), l.size());
  double total = 0;
  for (const TokenLogprob& t : all.top) total += std::exp(static_cast<double>(t.logprob));
  EXPECT_NEAR(total, 1.0, 1e-5);
  // Reference log-softmax.
  double m = -1e30;
  for (float x : l) m = std::max(m, static_cast<double>(x));
  double z = 0;
  for (float x : l) z += std::exp(x - m);
  const double lse = m + std::log(z);
  EXPECT_NEAR(all.chosen, l[17] - lse, 1e-5);
  for (const TokenLogprob& t : all.top) EXPECT_NEAR(t.logprob, l[static_cast<size_t>(t.id)] - lse, 1e-5);
  EXPECT_LE(all.chosen, 0.0f);
}

TEST(Logprobs, TopAreSortedLargestFirstLowestIdOnTies) {
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  const Logprobs r = compute_logprobs(l, 2, 4);
  ASSERT_EQ(r.top.size(), 4u);
  EXPECT_EQ(r.top[0].id, 1);  // tie with 3: the lower id first
  EXPECT_EQ(r.top[1].id, 3);
  EXPECT_EQ(r.top[2].id, 4);
  EXPECT_EQ(r.top[3].id, 0);
  for (size_t i = 1; i < r.top.size(); ++i) EXPECT_GE(r.top[i - 1].logprob, r.top[i].logprob);
  EXPECT_TRUE(compute_logprobs(l, 0, 0).top.empty());
  EXPECT_EQ(compute_logprobs(l, 0, 99).top.size(), l.size());  // no more than the vocabulary
  EXPECT_THROW(compute_logprobs(l, 5, 1), Error);
}

TEST(StopFilter, HoldsBackPossibleStartsAndTheEarliestStopWins) {
  StopFilter f({"END", "b"});
  EXPECT_FALSE(f.add("hello E"));
  EXPECT_EQ(f.take(), "hello ");  // "E" could start "END"
  EXPECT_FALSE(f.add("Nx"));
  EXPECT_EQ(f.take(), "ENx");
  StopFilter g({"b", "a"});
  EXPECT_TRUE(g.add("xab"));  // "a" starts before "b"
  EXPECT_EQ(g.take(), "x");
  StopFilter h({"", "zz"});  // an empty stop string matches nothing
  EXPECT_FALSE(h.add("abc"));
  EXPECT_EQ(h.flush(), "abc");
}

}  // namespace
}  // namespace tq
