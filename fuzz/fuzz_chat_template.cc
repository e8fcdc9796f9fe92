// libFuzzer target: a Jinja chat template and the conversation it renders (src/chat): lexer, parser (every
// statement and expression form, whitespace control), then the interpreter with its builtins and filters,
// run as transformers' apply_chat_template runs it (messages, add_generation_prompt, bos/eos tokens, extra
// variables such as enable_thinking), with the clock fixed so that a render is reproducible.
// Input: the template, the separator line of fuzz_util.h, then the conversation as JSON: a list of
// messages or an object {"messages": [...], <extra variables>}; a conversation that is not valid JSON
// renders a fixed one. Seeds: the templates of /work/shared/chat-templates with a conversation each.
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "fuzz/fuzz_util.h"

namespace {

const nlohmann::ordered_json& fixed_conversation() {
  static const nlohmann::ordered_json c = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Adding."},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]}])");
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string_view> parts = tq::fuzz::split_parts(data, size, 2);
  nlohmann::ordered_json conversation =
      nlohmann::ordered_json::parse(parts[1].begin(), parts[1].end(), nullptr, /*allow_exceptions=*/false);
  nlohmann::ordered_json messages, extra = nlohmann::ordered_json::object();
  if (conversation.is_array()) {
    messages = std::move(conversation);
  } else if (conversation.is_object()) {
    for (auto it = conversation.begin(); it != conversation.end(); ++it) {
      if (it.key() == "messages")
        messages = it.value();
      else
        extra[it.key()] = it.value();
    }
  }
  if (messages.is_null()) messages = fixed_conversation();
  tq::RenderOptions options;
  options.now = std::tm{};
  options.now->tm_year = 126;
  options.now->tm_mon = 11;
  options.now->tm_mday = 2;
  tq::fuzz::refused([&] {
    const tq::ChatTemplate tpl(parts[0]);
    for (bool add_generation_prompt : {true, false})
      (void)tq::apply_chat_template(tpl, messages, add_generation_prompt, "<s>", "</s>", extra, options);
  });
  return 0;
}
