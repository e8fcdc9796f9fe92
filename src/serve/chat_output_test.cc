// A chat answer's way to the client, as the scheduler and the server assemble it: decoded text ->
// OutputFilter (harmony channels, stop strings) -> streamed chunks or the whole message. The text is
// gpt-oss's harmony output through the real gpt-oss tokenizer (tests/fixtures/text/gpt-oss-mini),
// decoded token by token with the special tokens written out, as the scheduler decodes it; and the same
// text in random pieces, so that markers arrive split.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "chat/chat_template.h"

#include "core/rng.h"
#include "runtime/generate.h"
#include "serve/api.h"
#include "serve/chat_output.h"
#include "text/tokenizer.h"

namespace tq::serve {
namespace {

const std::string kTokenizerDir = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/text/gpt-oss-mini";

const std::string kAnalysis = "The user asks for 2+2. Simple arithmetic: the sum is 4. Answer briefly.";
const std::string kFinal = "2 + 2 = **4**. \xe2\x9c\x93 Done.";
// What gpt-oss writes after the template's `<|start|>assistant`, up to the <|return|> that ends it (an
// EOS id: the scheduler stops there and never decodes it).
const std::string kOutput = "<|channel|>analysis<|message|>" + kAnalysis + "<|end|><|start|>assistant<|channel|>final<|message|>" + kFinal;

// The client's view of a stream: the chunks' deltas joined, in the order they came.
struct Client {
  std::vector<json> chunks;
  std::string reasoning, content;
  bool content_before_reasoning = false;  // a reasoning chunk after a content chunk

  void take(const OutputText& t) {
    for (const json& c : chat_delta_chunks(ResponseHead{"chatcmpl-x", 1, "gpt-oss"}, t.reasoning, t.content, nullptr)) {
      const json& d = c["choices"][0]["delta"];
      if (d.contains("reasoning_content")) {
        EXPECT_FALSE(d.contains("content"));
        if (!content.empty()) content_before_reasoning = true;
        reasoning += d["reasoning_content"].get<std::string>();
      }
      if (d.contains("content")) content += d["content"].get<std::string>();
      chunks.push_back(c);
    }
  }
};

// No delta shows a piece of a harmony marker: the texts here hold no '<' or '|' of their own.
void expect_no_marker(const Client& c) {
  for (const json& chunk : c.chunks) {
    const std::string s = dump(chunk["choices"][0]["delta"]);
    EXPECT_EQ(s.find('<'), std::string::npos) << s;
    EXPECT_EQ(s.find('|'), std::string::npos) << s;
  }
}

TEST(ChatOutput, HarmonyTokenByTokenSplitsReasoningFromContent) {
  const auto tok = load_tokenizer_dir(kTokenizerDir);
  ASSERT_TRUE(is_harmony_tokenizer(*tok));
  const std::vector<int32_t> ids = tok->encode(kOutput, /*add_special_tokens=*/false);
  // The markers are single special tokens (else this would not be what the model writes).
  ASSERT_NE(std::find(ids.begin(), ids.end(), tok->token_to_id("<|channel|>")), ids.end());
  ASSERT_NE(std::find(ids.begin(), ids.end(), tok->token_to_id("<|end|>")), ids.end());

  StreamDecoder decoder(*tok, /*skip_special_tokens=*/false, /*at_text_start=*/true);
  OutputFilter out({}, /*harmony=*/true);
  Client client;
  size_t reasoning_chunks = 0;
  for (int32_t id : ids) {
    EXPECT_FALSE(out.add(decoder.push(id)));
    const OutputText t = out.take();
    if (!t.reasoning.empty()) ++reasoning_chunks;
    client.take(t);
  }
  out.add(decoder.flush());
  client.take(out.flush());
  EXPECT_EQ(client.reasoning, kAnalysis);
  EXPECT_EQ(client.content, kFinal);
  EXPECT_FALSE(client.content_before_reasoning);
  EXPECT_GT(reasoning_chunks, 5u);  // streamed as it came, not at the end
  expect_no_marker(client);

  // The whole response: the same two texts.
  const json w = chat_response(ResponseHead{"chatcmpl-x", 1, "gpt-oss"}, client.content, client.reasoning, nullptr, "stop", Usage{10, 42, 0},
                               Timings{});
  const json& m = w["choices"][0]["message"];
  EXPECT_EQ(m["content"], kFinal);
  EXPECT_EQ(m["reasoning_content"], kAnalysis);
  EXPECT_EQ(w["usage"]["completion_tokens"], 42);
}

// The same output in random pieces of 1..12 bytes: markers and the header `assistant<|channel|>final`
// arrive split, and nothing of them is ever shown.
TEST(ChatOutput, HarmonyMarkersSplitAcrossPiecesNeverShow) {
  SplitMix64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    OutputFilter out({}, /*harmony=*/true);
    Client client;
    for (size_t i = 0; i < kOutput.size();) {
      const size_t n = trial == 0 ? 1 : 1 + rng.next() % 12;
      out.add(std::string_view(kOutput).substr(i, n));
      i += n;
      client.take(out.take());
    }
    client.take(out.flush());
    ASSERT_EQ(client.reasoning, kAnalysis) << "trial " << trial;
    ASSERT_EQ(client.content, kFinal) << "trial " << trial;
    EXPECT_FALSE(client.content_before_reasoning);
    expect_no_marker(client);
  }
}

// Stop strings apply to the content as the client sees it: the reasoning holds the stop string and goes
// on; the answer ends before it, and a stop string split over pieces is held back until it is decided.
TEST(ChatOutput, HarmonyStopStringsApplyToTheContentOnly) {
  for (size_t piece : {1u, 3u, 1000u}) {
    OutputFilter out({"Done", "sum"}, /*harmony=*/true);  // "sum" is in the reasoning only
    Client client;
    bool stopped = false;
    for (size_t i = 0; i < kOutput.size() && !stopped; i += piece) {
      stopped = out.add(std::string_view(kOutput).substr(i, piece));
      client.take(out.take());
      EXPECT_EQ(client.content.find('D'), std::string::npos) << "a possible stop string was shown early";
    }
    EXPECT_TRUE(stopped);
    client.take(out.flush());
    EXPECT_EQ(client.reasoning, kAnalysis);
    EXPECT_EQ(client.content, "2 + 2 = **4**. \xe2\x9c\x93 ");
    // After the stop, more text changes nothing.
    EXPECT_TRUE(out.add("more"));
    EXPECT_TRUE(out.take().empty());
  }
}

// The commentary channel (a preamble or a tool call, which this server does not execute) is reasoning,
// never the answer; the <|call|> that ends it is an EOS id, so the answer is empty.
TEST(ChatOutput, HarmonyCommentaryGoesToTheReasoning) {
  const auto tok = load_tokenizer_dir(kTokenizerDir);
  const std::string call = "<|channel|>analysis<|message|>Need weather.<|end|>"
                           "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}";
  StreamDecoder decoder(*tok, /*skip_special_tokens=*/false, /*at_text_start=*/true);
  OutputFilter out({}, /*harmony=*/true);
  OutputText all;
  for (int32_t id : tok->encode(call, false)) {
    out.add(decoder.push(id));
    const OutputText t = out.take();
    all.reasoning += t.reasoning;
    all.content += t.content;
  }
  const OutputText t = out.flush();
  all.reasoning += t.reasoning;
  all.content += t.content;
  EXPECT_EQ(all.reasoning, "Need weather.{\"city\": \"Paris\"}");
  EXPECT_EQ(all.content, "");
}

// Cut off by max_tokens in the middle of the answer, even inside what could have been a marker: the
// held-back text is content after all.
TEST(ChatOutput, HarmonyCutOffAnswerKeepsItsTail) {
  OutputFilter out({}, /*harmony=*/true);
  out.add("<|channel|>final<|message|>Hello <|en");
  OutputText t = out.take();
  EXPECT_EQ(t.content, "Hello ");
  t = out.flush();
  EXPECT_EQ(t.content, "<|en");
  EXPECT_EQ(t.reasoning, "");
}

// Every other model (and /v1/completions): the decoded text is the content, as before; text that looks
// like harmony is just text.
TEST(ChatOutput, PlainTextIsContentWithStopStrings) {
  OutputFilter out({"STOP"}, /*harmony=*/false);
  EXPECT_FALSE(out.add("<|channel|>final<|message|>abc ST"));
  OutputText t = out.take();
  EXPECT_EQ(t.content, "<|channel|>final<|message|>abc ");
  EXPECT_EQ(t.reasoning, "");
  EXPECT_TRUE(out.add("OP and more"));
  EXPECT_TRUE(out.take().empty());
  EXPECT_EQ(out.flush().content, "");

  OutputFilter cut({"STOP"}, /*harmony=*/false);
  cut.add("abc ST");
  cut.take();
  EXPECT_EQ(cut.flush().content, "ST");  // the generation ended: a partial stop string is text
}

// gpt-oss's own template (../shared/chat-templates, skipped when absent) with a request's fields: the
// reasoning effort is the one asked for, chat_template_kwargs reach it, and the prompt ends in
// `<|start|>assistant`, where OutputFilter's parser expects the output to start (inside a header).
TEST(ChatOutput, GptOssTemplateTakesTheRequestsReasoningEffort) {
  const std::filesystem::path path = std::filesystem::path(TQ_SHARED_DIR) / "chat-templates" / "gpt-oss.jinja";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no gpt-oss chat template at " << path;
  std::ifstream in(path);
  std::stringstream source;
  source << in.rdbuf();
  const ChatTemplate tpl(source.str());
  auto render = [&](const std::string& fields) {
    const GenerationRequest r = parse_generation_request(R"({"messages": [{"role": "user", "content": "What is 2+2?"}])" + fields + "}",
                                                         Endpoint::chat, SamplingParams{}, 100);
    return apply_chat_template(tpl, r.messages, true, "<|startoftext|>", "<|return|>", r.template_vars);
  };
  const std::string plain = render("");
  EXPECT_NE(plain.find("Reasoning: medium"), std::string::npos) << plain;  // the template's default
  EXPECT_TRUE(plain.ends_with("<|start|>assistant")) << plain;
  const std::string high = render(R"(, "reasoning_effort": "high")");
  EXPECT_NE(high.find("Reasoning: high"), std::string::npos) << high;
  EXPECT_EQ(high.find("Reasoning: medium"), std::string::npos) << high;
  const std::string custom = render(R"(, "chat_template_kwargs": {"reasoning_effort": "low", "model_identity": "You are TQ."})");
  EXPECT_NE(custom.find("Reasoning: low"), std::string::npos) << custom;
  EXPECT_NE(custom.find("You are TQ."), std::string::npos) << custom;
}

TEST(ChatOutput, ChunksAndMessageShapes) {
  const ResponseHead h{"chatcmpl-1", 5, "m"};
  // Both texts in one poll: reasoning first, logprobs on the first chunk only.
  const json lp{{"content", json::array()}, {"refusal", nullptr}};
  std::vector<json> c = chat_delta_chunks(h, "think", "say", lp);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0]["choices"][0]["delta"], (json{{"reasoning_content", "think"}}));
  EXPECT_EQ(c[0]["choices"][0]["logprobs"], lp);
  EXPECT_EQ(c[1]["choices"][0]["delta"], (json{{"content", "say"}}));
  EXPECT_TRUE(c[1]["choices"][0]["logprobs"].is_null());
  // Held-back text whose tokens' logprobs were asked: one empty content chunk carries them.
  c = chat_delta_chunks(h, "", "", lp);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0]["choices"][0]["delta"], (json{{"content", ""}}));
  EXPECT_TRUE(chat_delta_chunks(h, "", "", nullptr).empty());
  // No reasoning: the message is what it always was, without the field.
  const json plain = chat_response(h, "hi", "", nullptr, "stop", Usage{}, Timings{});
  EXPECT_FALSE(plain["choices"][0]["message"].contains("reasoning_content"));
  EXPECT_EQ(plain["choices"][0]["message"]["content"], "hi");
}

}  // namespace
}  // namespace tq::serve
