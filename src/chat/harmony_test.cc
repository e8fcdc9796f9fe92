#include "chat/harmony.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/rng.h"

namespace tq {
namespace {

// What a gpt-oss model writes after the template's generation prompt `<|start|>assistant`.
const std::string kAnswer =
    "<|channel|>analysis<|message|>The user asks 2+2. Compare: 1 <| 2 and a<b.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4** <|unknown|> \xe2\x9c\x93<|return|>";

struct Collected {
  std::string analysis, final, other;
};

void collect(const std::vector<HarmonyDelta>& ds, Collected& c) {
  for (const HarmonyDelta& d : ds) (d.channel == "analysis" ? c.analysis : d.channel == "final" ? c.final : c.other) += d.text;
}

TEST(Harmony, SplitsAnalysisFromFinal) {
  HarmonyParser p;
  Collected c;
  collect(p.push(kAnswer), c);
  collect(p.finish(), c);
  EXPECT_EQ(c.analysis, "The user asks 2+2. Compare: 1 <| 2 and a<b.");
  EXPECT_EQ(c.final, "2 + 2 = **4** <|unknown|> \xe2\x9c\x93");
  EXPECT_EQ(c.other, "");
  EXPECT_TRUE(p.done());
  ASSERT_EQ(p.messages().size(), 2u);
  EXPECT_EQ(p.messages()[0].role, "assistant");
  EXPECT_EQ(p.messages()[0].end, "<|end|>");
  EXPECT_EQ(p.messages()[1].role, "assistant");
  EXPECT_EQ(p.messages()[1].channel, "final");
  EXPECT_EQ(p.messages()[1].end, "<|return|>");
  EXPECT_EQ(p.text_of("final"), c.final);
  EXPECT_EQ(p.text_of("analysis"), c.analysis);
}

// Byte by byte, and in random pieces: the same text per channel, and nothing shown early that later turns
// out to be part of a marker.
TEST(Harmony, StreamingNeverShowsPartOfAMarker) {
  HarmonyParser whole;
  Collected want;
  collect(whole.push(kAnswer), want);
  collect(whole.finish(), want);

  SplitMix64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    HarmonyParser p;
    Collected got;
    for (size_t i = 0; i < kAnswer.size();) {
      const size_t n = trial == 0 ? 1 : 1 + rng.next() % 9;
      std::vector<HarmonyDelta> ds = p.push(std::string_view(kAnswer).substr(i, n));
      i += n;
      collect(ds, got);
      // What was shown so far is a prefix of the final text of each channel.
      ASSERT_EQ(want.analysis.compare(0, got.analysis.size(), got.analysis), 0) << got.analysis;
      ASSERT_EQ(want.final.compare(0, got.final.size(), got.final), 0) << got.final;
      for (const HarmonyDelta& d : ds) {
        EXPECT_EQ(d.text.find("<|end"), std::string::npos) << d.text;
        EXPECT_EQ(d.text.find("<|ret"), std::string::npos) << d.text;
      }
    }
    collect(p.finish(), got);
    EXPECT_EQ(got.analysis, want.analysis);
    EXPECT_EQ(got.final, want.final);
    EXPECT_EQ(got.other, "");
  }
}

TEST(Harmony, HoldsBackOnlyWhatCouldBeAMarker) {
  HarmonyParser p;
  p.push("<|channel|>final<|message|>");
  auto ds = p.push("x <");
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0].text, "x ");  // "<" may start <|end|>
  ds = p.push("|");
  EXPECT_TRUE(ds.empty());
  ds = p.push("y");
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0].text, "<|y");
  ds = p.push("<|en");
  EXPECT_TRUE(ds.empty());
  // The generation stopped there: the held-back text is content after all.
  ds = p.finish();
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(ds[0].text, "<|en");
  EXPECT_EQ(p.text_of("final"), "x <|y<|en");
  EXPECT_FALSE(p.done());
  EXPECT_EQ(p.messages()[0].end, "");
}

TEST(Harmony, ToolCallHeaders) {
  // The template's own form (recipient before the channel, content type as a last word) ...
  HarmonyParser p;
  p.push("<|channel|>analysis<|message|>Need weather.<|end|>"
         "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>"
         "ignored after the call");
  EXPECT_TRUE(p.done());
  ASSERT_EQ(p.messages().size(), 2u);
  const HarmonyMessage& call = p.messages()[1];
  EXPECT_EQ(call.role, "assistant");
  EXPECT_EQ(call.channel, "commentary");
  EXPECT_EQ(call.recipient, "functions.get_weather");
  EXPECT_EQ(call.content_type, "json");
  EXPECT_EQ(call.content, "{\"city\": \"Paris\"}");
  EXPECT_EQ(call.end, "<|call|>");
  EXPECT_TRUE(p.push("more").empty());

  // ... and the cookbook's (recipient after the channel, <|constrain|>).
  HarmonyParser q;
  q.push("<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}<|call|>");
  ASSERT_EQ(q.messages().size(), 1u);
  EXPECT_EQ(q.messages()[0].channel, "commentary");
  EXPECT_EQ(q.messages()[0].recipient, "functions.lookup");
  EXPECT_EQ(q.messages()[0].content_type, "json");
  EXPECT_EQ(q.messages()[0].content, "{}");
}

TEST(Harmony, OtherStartsAndMalformedOutput) {
  // Output that starts before <|start|> (a prompt that did not end with one).
  HarmonyParser a("", /*in_header=*/false);
  a.push("<|start|>assistant<|channel|>final<|message|>hi<|end|>");
  ASSERT_EQ(a.messages().size(), 1u);
  EXPECT_EQ(a.messages()[0].role, "assistant");
  EXPECT_EQ(a.text_of("final"), "hi");
  EXPECT_FALSE(a.done());

  // A header without a channel; a new header without <|end|> cuts the message; stray text between
  // messages is kept as a message without a channel.
  HarmonyParser b;
  b.push("<|message|>plain<|channel|>final<|message|>answer<|end|>stray<|start|>assistant<|channel|>final<|message|>more");
  b.finish();
  ASSERT_EQ(b.messages().size(), 4u);
  EXPECT_EQ(b.messages()[0].channel, "");
  EXPECT_EQ(b.messages()[0].content, "plain");
  EXPECT_EQ(b.messages()[0].end, "");
  EXPECT_EQ(b.messages()[1].channel, "final");
  EXPECT_EQ(b.messages()[1].role, "assistant");
  EXPECT_EQ(b.text_of(""), "plainstray");
  EXPECT_EQ(b.text_of("final"), "answermore");

  // A header cut off by the end of the generation gives nothing.
  HarmonyParser c;
  EXPECT_TRUE(c.push("<|channel|>analy").empty());
  EXPECT_TRUE(c.finish().empty());
  EXPECT_EQ(c.text_of(""), "");
}

}  // namespace
}  // namespace tq
