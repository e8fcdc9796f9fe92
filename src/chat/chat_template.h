// Chat templates: the Jinja templates Hugging Face tokenizers ship (tokenizer_config.json's
// chat_template), rendered byte for byte as transformers' apply_chat_template renders them with
// python3-jinja2: an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
// loopcontrols extension, the {% generation %} tag, raise_exception(), strftime_now() and a
// tojson filter that is json.dumps(ensure_ascii=False).
//
//   tq::ChatTemplate tpl(source);              // parses once; tq::TemplateError on bad syntax
//   std::string prompt = tpl.render(context);  // context: messages, add_generation_prompt, ...
//
// What is supported is the Jinja subset chat templates use: see src/chat/README.md.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "chat/errors.h"

namespace tq {

namespace jinja {
struct Program;
}

struct RenderOptions {
  // What strftime_now() reports (local time, as Python's datetime.now()); unset: the clock at
  // render time. Tests set it for reproducible output.
  std::optional<std::tm> now;
};

class ChatTemplate {
 public:
  // Parses the template. Throws TemplateError (kind kSyntax, with line and column) when jinja2
  // would refuse it.
  explicit ChatTemplate(std::string_view source);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&);
  ChatTemplate& operator=(const ChatTemplate&);

  // Renders with the context's keys as template variables. The context is an ordered_json so that
  // the messages and tools keep their key order (tojson and items() show it); a nlohmann::json
  // converts implicitly, with its keys sorted. Throws TemplateError: kRaised for
  // raise_exception(), kUndefined and kRuntime for what jinja2 raises as UndefinedError,
  // TypeError and the like.
  std::string render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;

 private:
  std::shared_ptr<const jinja::Program> program_;
};

// transformers' apply_chat_template(tokenize=False): renders with messages, tools (null unless
// extra gives them), documents (null), add_generation_prompt, bos_token and eos_token, plus every
// key of extra (enable_thinking, builtin_tools, date_string, ...), which may override the others.
std::string apply_chat_template(const ChatTemplate& tpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token,
                                const nlohmann::ordered_json& extra = nlohmann::ordered_json::object(),
                                const RenderOptions& options = {});
std::string apply_chat_template(std::string_view template_source, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token,
                                const nlohmann::ordered_json& extra = nlohmann::ordered_json::object(),
                                const RenderOptions& options = {});

}  // namespace tq
