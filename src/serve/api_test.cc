// Request validation and response shapes of the OpenAI API, without a model.
#include <gtest/gtest.h>

#include <string>

#include "serve/api.h"

namespace tq::serve {
namespace {

constexpr int32_t kVocab = 100;

GenerationRequest chat(const std::string& body) { return parse_generation_request(body, Endpoint::chat, SamplingParams{}, kVocab); }
GenerationRequest completion(const std::string& body) {
  return parse_generation_request(body, Endpoint::completion, SamplingParams{}, kVocab);
}

// The ApiError a body gets: its status, and the field it names.
ApiError refusal(Endpoint e, const std::string& body) {
  try {
    parse_generation_request(body, e, SamplingParams{}, kVocab);
  } catch (const ApiError& err) {
    return err;
  }
  ADD_FAILURE() << "accepted: " << body;
  return ApiError(0, "", "", "");
}

TEST(Api, ChatRequestFieldsAreRead) {
  const GenerationRequest r = chat(R"({"model": "x", "messages": [{"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
      "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "seed": 12,
      "stop": ["a", ""], "presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
      "logit_bias": {"5": -100, "7": 2.5}, "logprobs": true, "top_logprobs": 3, "stream": true,
      "stream_options": {"include_usage": true}, "n": 1, "some_unknown_field": {"x": 1}})");
  EXPECT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[1]["content"], "hi there");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, 12u);
  EXPECT_TRUE(r.seeded);
  EXPECT_EQ(r.stop, std::vector<std::string>{"a"});  // empty stop strings are dropped
  EXPECT_EQ(r.sampling.presence_penalty, 1.0f);
  EXPECT_EQ(r.sampling.frequency_penalty, -0.5f);
  ASSERT_EQ(r.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(r.sampling.logit_bias[0], (std::pair<int32_t, float>{5, -100.0f}));
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

// reasoning_effort and chat_template_kwargs become the chat template's variables; the top-level
// reasoning_effort wins over one in chat_template_kwargs; null is "not set".
TEST(Api, TemplateVariablesFromReasoningEffortAndKwargs) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_EQ(chat("{" + msgs + "}").template_vars, json::object());
  EXPECT_EQ(chat("{" + msgs + R"(, "reasoning_effort": null, "chat_template_kwargs": null})").template_vars, json::object());
  for (const char* effort : {"low", "medium", "high"})
    EXPECT_EQ(chat("{" + msgs + R"(, "reasoning_effort": ")" + effort + R"("})").template_vars, (json{{"reasoning_effort", effort}}));
  const GenerationRequest r = chat("{" + msgs + R"(, "chat_template_kwargs": {"enable_thinking": false, "builtin_tools": ["browser"],
      "reasoning_effort": "low"}, "reasoning_effort": "high"})");
  EXPECT_EQ(r.template_vars["enable_thinking"], false);
  EXPECT_EQ(r.template_vars["builtin_tools"], json::array({"browser"}));
  EXPECT_EQ(r.template_vars["reasoning_effort"], "high");
  EXPECT_EQ(chat("{" + msgs + R"(, "chat_template_kwargs": {"reasoning_effort": "low"}})").template_vars["reasoning_effort"], "low");
}

TEST(Api, CompletionPromptsAsTextOrTokens) {
  EXPECT_EQ(completion(R"({"prompt": "abc"})").prompt_text, "abc");
  EXPECT_EQ(completion(R"({"prompt": ["abc"]})").prompt_text, "abc");
  const GenerationRequest t = completion(R"({"prompt": [1, 2, 3], "logprobs": 2, "max_tokens": 4})");
  EXPECT_TRUE(t.prompt_is_tokens);
  EXPECT_EQ(t.prompt_tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(t.logprobs, 2);
  EXPECT_EQ(*t.max_tokens, 4);
  EXPECT_EQ(completion(R"({"prompt": "a", "stop": "x"})").stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(completion(R"({"prompt": "a", "ignore_eos": true})").ignore_eos);
  EXPECT_FALSE(completion(R"({"prompt": "a", "seed": null, "max_tokens": null})").max_tokens.has_value());
}

TEST(Api, WrongTypesAndValuesNameTheField) {
  struct Case {
    Endpoint e;
    const char* body;
    const char* param;
  } cases[] = {
      {Endpoint::completion, R"({"prompt": "a", "temperature": "hot"})", "temperature"},
      {Endpoint::completion, R"({"prompt": "a", "max_tokens": 1.5})", "max_tokens"},
      {Endpoint::completion, R"({"prompt": "a", "max_tokens": 0})", "max_tokens"},
      {Endpoint::completion, R"({"prompt": "a", "stream": "yes"})", "stream"},
      {Endpoint::completion, R"({"prompt": "a", "stop": [1]})", "stop[0]"},
      {Endpoint::completion, R"({"prompt": "a", "top_p": 0})", "top_p"},
      {Endpoint::completion, R"({"prompt": "a", "logit_bias": {"x": 1}})", "logit_bias"},
      {Endpoint::completion, R"({"prompt": "a", "logit_bias": {"100": 1}})", "logit_bias"},
      {Endpoint::completion, R"({"prompt": "a", "n": 2})", "n"},
      {Endpoint::completion, R"({"prompt": [1, 200]})", "prompt"},
      {Endpoint::completion, R"({"prompt": ["a", "b"]})", "prompt"},
      {Endpoint::completion, R"({"prompt": 5})", "prompt"},
      {Endpoint::completion, R"({})", "prompt"},
      {Endpoint::chat, R"({"messages": "hi"})", "messages"},
      {Endpoint::chat, R"({"messages": []})", "messages"},
      {Endpoint::chat, R"({"messages": [{"role": "robot", "content": "x"}]})", "messages[0].role"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": 3}]})", "messages[0].content"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "messages[0].content[0].type"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3})", "presence_penalty"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": 2})", "reasoning_effort"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"})", "reasoning_effort"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": ["low"]})", "reasoning_effort"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "x"})", "chat_template_kwargs"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]})", "chat_template_kwargs"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}})", "chat_template_kwargs"},
      {Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"add_generation_prompt": false}})", "chat_template_kwargs"},
  };
  for (const Case& c : cases) {
    const ApiError e = refusal(c.e, c.body);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(c.param), std::string::npos) << c.body << ": " << e.what();
  }
  EXPECT_EQ(refusal(Endpoint::chat, "{not json").code, "invalid_json");
  EXPECT_EQ(refusal(Endpoint::chat, "[1, 2]").code, "invalid_json");
}

TEST(Api, ErrorBodiesAndLogprobShapes) {
  const json e = error_body(ApiError(401, "authentication_error", "invalid_api_key", "invalid API key"));
  EXPECT_EQ(e["error"]["message"], "invalid API key");
  EXPECT_EQ(e["error"]["type"], "authentication_error");
  EXPECT_EQ(e["error"]["code"], "invalid_api_key");
  EXPECT_TRUE(e["error"]["param"].is_null());

  const std::vector<TokenReport> t = {{"ab", -0.5f, {{"ab", -0.5f}, {"c", -1.5f}}}, {"\xe6", -0.1f, {}}};
  const json c = chat_logprobs_json(t);
  ASSERT_EQ(c["content"].size(), 2u);
  EXPECT_EQ(c["content"][0]["bytes"], json::array({97, 98}));
  EXPECT_EQ(c["content"][0]["top_logprobs"][1]["token"], "c");
  EXPECT_EQ(c["content"][1]["bytes"], json::array({0xe6}));
  // Part of a UTF-8 character dumps as U+FFFD instead of throwing.
  EXPECT_NE(dump(c).find("\xef\xbf\xbd"), std::string::npos);
  const json l = completion_logprobs_json(t, 10);
  EXPECT_EQ(l["text_offset"], json::array({10, 12}));
  EXPECT_EQ(l["tokens"][0], "ab");
  EXPECT_FLOAT_EQ(l["top_logprobs"][0]["c"].get<float>(), -1.5f);

  const ResponseHead h{"chatcmpl-1", 5, "m"};
  const json u = usage_chunk(h, true, Usage{3, 4, 1});
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["total_tokens"], 7);
  EXPECT_EQ(u["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
  const json chunk = chat_chunk(h, json{{"content", "x"}}, nullptr, "");
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
}

}  // namespace
}  // namespace tq::serve
