// Parity with python3-jinja2: every template in ../shared/chat-templates/ on a set of
// conversations, and a corpus of small feature snippets, must render exactly (byte for byte) as
// jinja2 rendered them in tests/fixtures/chat/expected.json (made by
// tools/fixtures/make_chat_fixtures.py), or fail the same way: the same kind of error and, for
// raise_exception and undefined values, the same message.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"

namespace tq {
namespace {

using Json = nlohmann::ordered_json;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const Json& expected() {
  static const Json doc = [] {
    const std::filesystem::path path = std::filesystem::path(TQ_SOURCE_DIR) / "tests/fixtures/chat/expected.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path.string());
    return Json::parse(in);
  }();
  return doc;
}

RenderOptions fixed_now() {
  const Json& now = expected()["now"];
  std::tm tm{};
  tm.tm_year = now["year"].get<int>() - 1900;
  tm.tm_mon = now["month"].get<int>() - 1;
  tm.tm_mday = now["day"].get<int>();
  tm.tm_hour = now["hour"].get<int>();
  tm.tm_min = now["minute"].get<int>();
  tm.tm_sec = now["second"].get<int>();
  std::mktime(&tm);  // fills in the weekday and day of the year
  RenderOptions options;
  options.now = tm;
  return options;
}

const char* kind_name(TemplateError::Kind kind) {
  switch (kind) {
    case TemplateError::Kind::kSyntax: return "syntax";
    case TemplateError::Kind::kRaised: return "raised";
    case TemplateError::Kind::kUndefined: return "undefined";
    case TemplateError::Kind::kRuntime: return "runtime";
  }
  return "?";
}

// Where two renderings first differ, with some context, for a readable failure.
std::string first_difference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  const size_t from = i > 40 ? i - 40 : 0;
  // Cutting mid-character is fine: the dump shows broken bytes as U+FFFD.
  auto quote = [](const std::string& s) { return Json(s).dump(-1, ' ', false, Json::error_handler_t::replace); };
  return "first difference at byte " + std::to_string(i) + "\n  want: " + quote(want.substr(from, 100)) +
         "\n  got:  " + quote(got.substr(from, 100));
}

// Renders and compares with an expected {"output": ...} or {"error": {...}} record.
void check(const std::string& what, const std::function<std::string()>& render, const Json& want) {
  std::string got;
  try {
    got = render();
  } catch (const TemplateError& e) {
    if (!want.contains("error")) {
      ADD_FAILURE() << what << ": unexpected error " << e.what();
      return;
    }
    const Json& err = want["error"];
    EXPECT_EQ(err["kind"].get<std::string>(), kind_name(e.kind())) << what << ": " << e.what();
    // The message must match jinja2's word for word (for raise_exception it is the template's).
    EXPECT_EQ(err["message"].get<std::string>(), e.message()) << what << " (" << err["python_type"] << ")";
    return;
  }
  if (want.contains("error")) {
    ADD_FAILURE() << what << ": rendered, but jinja2 failed with " << want["error"].dump() << "\n  got: " << Json(got).dump(-1, ' ', false, Json::error_handler_t::replace);
    return;
  }
  const std::string& output = want["output"].get_ref<const std::string&>();
  EXPECT_TRUE(output == got) << what << ": " << first_difference(output, got);
}

TEST(ChatFixtures, SharedTemplatesMatchJinja2) {
  const std::filesystem::path dir = std::filesystem::path(TQ_SHARED_DIR) / "chat-templates";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "no shared chat templates at " << dir;
  const RenderOptions options = fixed_now();
  const Json& doc = expected();
  std::map<std::string, std::unique_ptr<ChatTemplate>> templates;
  for (const auto& [name, info] : doc["templates"].items()) {
    const std::string source = read_file(dir / name);
    ASSERT_EQ(source.size(), info["bytes"].get<size_t>())
        << name << " differs from the one the fixtures were made with; rerun tools/fixtures/make_chat_fixtures.py";
    templates[name] = std::make_unique<ChatTemplate>(source);
  }
  int checked = 0;
  for (const Json& c : doc["cases"]) {
    const std::string name = c["template"];
    const Json& conv = doc["conversations"][c["conversation"].get<std::string>()];
    const Json& info = doc["templates"][name];
    // The render() arguments of transformers' apply_chat_template, as the script passed them.
    Json context = Json::object();
    context["messages"] = conv["messages"];
    context["tools"] = conv.contains("tools") ? conv["tools"] : Json(nullptr);
    context["documents"] = nullptr;
    context["add_generation_prompt"] = c["add_generation_prompt"];
    if (!info["bos_token"].is_null()) context["bos_token"] = info["bos_token"];
    if (!info["eos_token"].is_null()) context["eos_token"] = info["eos_token"];
    if (conv.contains("extra")) {
      for (const auto& [k, v] : conv["extra"].items()) context[k] = v;
    }
    const ChatTemplate& tpl = *templates[name];
    check(name + " / " + c["conversation"].get<std::string>() + (c["add_generation_prompt"].get<bool>() ? " + gen" : ""),
          [&] { return tpl.render(context, options); }, c);
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

// The same conversations through apply_chat_template(), which builds the context itself.
TEST(ChatFixtures, ApplyChatTemplateMatchesJinja2) {
  const std::filesystem::path dir = std::filesystem::path(TQ_SHARED_DIR) / "chat-templates";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "no shared chat templates at " << dir;
  const RenderOptions options = fixed_now();
  const Json& doc = expected();
  int checked = 0;
  for (const Json& c : doc["cases"]) {
    const std::string name = c["template"];
    const Json& conv = doc["conversations"][c["conversation"].get<std::string>()];
    const Json& info = doc["templates"][name];
    // apply_chat_template always passes both tokens; keep to the templates that had both.
    if (info["bos_token"].is_null() || info["eos_token"].is_null() || !c.contains("output")) continue;
    Json extra = conv.contains("extra") ? conv["extra"] : Json::object();
    if (conv.contains("tools")) extra["tools"] = conv["tools"];
    const std::string source = read_file(dir / name);
    check("apply_chat_template " + name + " / " + c["conversation"].get<std::string>(),
          [&] {
            return apply_chat_template(source, conv["messages"], c["add_generation_prompt"].get<bool>(),
                                       info["bos_token"], info["eos_token"], extra, options);
          },
          c);
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

TEST(ChatFixtures, SnippetsMatchJinja2) {
  const RenderOptions options = fixed_now();
  const Json& doc = expected();
  int checked = 0;
  for (const Json& s : doc["snippets"]) {
    const std::string source = s["template"];
    const Json context = s["context"].is_string() ? doc["snippet_contexts"][s["context"].get<std::string>()] : s["context"];
    check("snippet " + Json(source).dump(), [&] { return ChatTemplate(source).render(context, options); }, s);
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

}  // namespace
}  // namespace tq
