#include "chat/chat_template.h"

#include "chat/interpreter.h"
#include "chat/parser.h"

namespace tq {

namespace jinja {
// A parsed template: the source (for error positions) and its statements.
struct Program {
  explicit Program(std::string_view text) : source(text), body(parse(source, tokenize(source))) {}
  Source source;
  Body body;
};
}  // namespace jinja

namespace {

std::string render_json(const jinja::Program& program, const nlohmann::ordered_json& context,
                        const RenderOptions& options) {
  if (!context.is_object())
    throw TemplateError(TemplateError::Kind::kRuntime, "the render context must be a JSON object");
  jinja::ObjectData vars;
  for (auto it = context.begin(); it != context.end(); ++it) vars.set(it.key(), jinja::from_json(it.value()));
  jinja::Interpreter interpreter(program.source, options.now);
  return interpreter.render(program.body, vars);
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source) : program_(std::make_shared<jinja::Program>(source)) {}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(const ChatTemplate&) = default;
ChatTemplate& ChatTemplate::operator=(const ChatTemplate&) = default;

std::string ChatTemplate::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  return render_json(*program_, context, options);
}

std::string apply_chat_template(const ChatTemplate& tpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token, const nlohmann::ordered_json& extra,
                                const RenderOptions& options) {
  if (!extra.is_object())
    throw TemplateError(TemplateError::Kind::kRuntime, "apply_chat_template: extra must be a JSON object");
  // The keyword arguments transformers passes to render(), in its order.
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = messages;
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = bos_token;
  context["eos_token"] = eos_token;
  for (auto it = extra.begin(); it != extra.end(); ++it) context[it.key()] = it.value();
  return tpl.render(context, options);
}

std::string apply_chat_template(std::string_view template_source, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token, const nlohmann::ordered_json& extra,
                                const RenderOptions& options) {
  return apply_chat_template(ChatTemplate(template_source), messages, add_generation_prompt, bos_token,
                             eos_token, extra, options);
}

}  // namespace tq
