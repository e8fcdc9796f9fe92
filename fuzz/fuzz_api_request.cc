// libFuzzer target: a /v1/chat/completions or /v1/completions request body through what turboquant-serve
// does with it before the model runs (serve/server.cc job_spec): parse_generation_request for both
// endpoints (every field's type and range, stop strings, logit_bias against the vocabulary, logprobs,
// stream_options, chat_template_kwargs, content parts), the chat messages rendered by a ChatML template
// with the request's template variables, and the sampling parameters run by a Sampler over fixed logits
// (temperature, top-k/p, min-p, penalties, biases, seed), as the first generated token would be.
// Input: the body. Seeds: requests of the OpenAI clients (tests/serve) and of serve/api_test.cc.
#include <cmath>

#include "chat/chat_template.h"
#include "fuzz/fuzz_util.h"
#include "runtime/sampler.h"
#include "serve/api.h"

namespace {

constexpr int32_t kVocab = 64;

// Qwen 2.5's ChatML shape, short (the real templates are fuzzed in fuzz_chat_template).
constexpr const char* kTemplate =
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";

void run_request(std::string_view body, tq::serve::Endpoint endpoint) {
  static const tq::ChatTemplate tpl(kTemplate);
  tq::SamplingParams defaults;
  defaults.temperature = 0.7f;
  defaults.top_p = 0.9f;
  tq::serve::GenerationRequest r;
  try {
    r = tq::serve::parse_generation_request(body, endpoint, defaults, kVocab);
  } catch (const tq::serve::ApiError& e) {
    if (e.status < 400 || e.status > 499) __builtin_trap();  // a body is the client's fault, never a 5xx
    (void)tq::serve::error_body(e).dump();
    return;
  }
  if (endpoint == tq::serve::Endpoint::chat) {
    try {
      (void)tq::apply_chat_template(tpl, r.messages, true, "<s>", "</s>", r.template_vars);
    } catch (const tq::TemplateError&) {
      // The server answers 400 naming the template's refusal.
    }
  }
  for (int32_t id : r.prompt_tokens)
    if (id < 0 || id >= kVocab) __builtin_trap();  // parse_generation_request bounds token prompts
  std::vector<float> logits(kVocab);  // [vocab]
  for (int32_t i = 0; i < kVocab; ++i) logits[static_cast<size_t>(i)] = std::sin(static_cast<float>(i));
  const std::vector<int32_t> history = {1, 5, 5, 9};
  tq::Sampler sampler(r.sampling);
  const int32_t token = sampler.sample(logits, history, 2);
  if (token < 0 || token >= kVocab) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  tq::fuzz::refused([&] { run_request(body, tq::serve::Endpoint::chat); });
  tq::fuzz::refused([&] { run_request(body, tq::serve::Endpoint::completion); });
  return 0;
}
