#include "serve/api.h"

#include <cmath>
#include <sstream>

namespace tq::serve {

void bad_request(const std::string& param, const std::string& code, const std::string& message) {
  throw ApiError(400, "invalid_request_error", code, message, param);
}

json error_body(int status, const std::string& type, const std::string& code, const std::string& message,
                const std::string& param) {
  json e = json::object();
  e["message"] = message;
  e["type"] = type;
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", e}};
}

json error_body(const ApiError& e) { return error_body(e.status, e.type, e.code, e.what(), e.param); }

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

namespace {

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "an unknown value";
  }
}

[[noreturn]] void wrong_type(const std::string& name, const char* expected, const json& got) {
  bad_request(name, "invalid_type", "'" + name + "' must be " + expected + ", got " + type_name(got));
}

std::string number_text(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// A field of an object; nullptr when absent or null (clients send null for "not set").
const json* field(const json& o, const char* name) {
  const auto it = o.find(name);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

std::optional<bool> get_bool(const json& o, const char* name) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(name, "a boolean", *v);
  return v->get<bool>();
}

// A number in [lo, hi] (an open bound when lo_open).
std::optional<double> get_number(const json& o, const char* name, double lo, double hi, bool lo_open = false) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(name, "a number", *v);
  const double x = v->get<double>();
  if (!std::isfinite(x) || (lo_open ? x <= lo : x < lo) || x > hi)
    bad_request(name, "invalid_value", "'" + std::string(name) + "' must be in " + (lo_open ? "(" : "[") + number_text(lo) + ", " +
                                           number_text(hi) + "], got " + number_text(x));
  return x;
}

// An integer (a number with no fraction, as JavaScript clients may send 5.0) in [lo, hi].
std::optional<int64_t> get_int(const json& o, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(o, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(name, "an integer", *v);
  int64_t x = 0;
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9e15) wrong_type(name, "an integer", *v);
    x = static_cast<int64_t>(d);
  } else if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    x = u > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u);
  } else {
    x = v->get<int64_t>();
  }
  if (x < lo || x > hi)
    bad_request(name, "invalid_value",
                "'" + std::string(name) + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(x));
  return x;
}

// Chat content: a string, or an array of {"type": "text", "text": ...} parts (joined).
std::string message_content(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (!content.is_array()) wrong_type(where, "a string or an array of content parts", content);
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!part.is_object()) wrong_type(at, "an object", part);
    const json* type = field(part, "type");
    if (!type || !type->is_string()) bad_request(at + ".type", "invalid_type", "'" + at + ".type' must be a string");
    if (type->get<std::string>() != "text")
      bad_request(at + ".type", "invalid_value",
                  "'" + at + ".type' is '" + type->get<std::string>() + "': only 'text' content parts are supported");
    const json* t = field(part, "text");
    if (!t || !t->is_string()) bad_request(at + ".text", "invalid_type", "'" + at + ".text' must be a string");
    text += t->get<std::string>();
  }
  return text;
}

json parse_messages(const json& body) {
  const json* m = field(body, "messages");
  if (!m) bad_request("messages", "missing_required_parameter", "'messages' is required");
  if (!m->is_array()) wrong_type("messages", "an array", *m);
  if (m->empty()) bad_request("messages", "invalid_value", "'messages' must hold at least one message");
  json out = json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) wrong_type(at, "an object", msg);
    const json* role = field(msg, "role");
    if (!role) bad_request(at + ".role", "missing_required_parameter", "'" + at + ".role' is required");
    if (!role->is_string()) wrong_type(at + ".role", "a string", *role);
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant")
      bad_request(at + ".role", "invalid_value", "'" + at + ".role' must be system, user or assistant, got '" + r + "'");
    const auto c = msg.find("content");
    if (c == msg.end() || (c->is_null() && r != "assistant"))
      bad_request(at + ".content", "missing_required_parameter", "'" + at + ".content' is required");
    out.push_back(json{{"role", r}, {"content", message_content(*c, at + ".content")}});
  }
  return out;
}

void parse_prompt(const json& body, int32_t vocab_size, GenerationRequest& r) {
  const json* p = field(body, "prompt");
  if (!p) bad_request("prompt", "missing_required_parameter", "'prompt' is required");
  // A string, a list of one string, a list of token ids, or a list of one such list (one prompt: n = 1).
  const json* one = p;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) one = &(*p)[0];
  if (one->is_string()) {
    r.prompt_text = one->get<std::string>();
    return;
  }
  if (!one->is_array()) wrong_type("prompt", "a string, an array of token ids, or an array of one of those", *p);
  for (size_t i = 0; i < one->size(); ++i) {
    const json& t = (*one)[i];
    if (t.is_string() || t.is_array())
      bad_request("prompt", "invalid_value", "'prompt' holds several prompts; this server answers one prompt per request (n = 1)");
    if (!t.is_number_integer()) wrong_type("prompt[" + std::to_string(i) + "]", "a token id (an integer)", t);
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= vocab_size)
      bad_request("prompt", "invalid_value", "token id " + std::to_string(id) + " in 'prompt' is outside the vocabulary (" +
                                                 std::to_string(vocab_size) + ")");
    r.prompt_tokens.push_back(static_cast<int32_t>(id));
  }
  r.prompt_is_tokens = true;
}

// chat_template_kwargs and reasoning_effort: what the template reads beside the messages.
void parse_template_vars(const json& body, GenerationRequest& r) {
  if (const json* k = field(body, "chat_template_kwargs")) {
    if (!k->is_object()) wrong_type("chat_template_kwargs", "an object of template variables", *k);
    for (const auto& [key, value] : k->items()) {
      // The server renders the messages and the generation prompt itself: a template made to render
      // something else would produce a prompt whose answer the server reads wrongly.
      if (key == "messages" || key == "add_generation_prompt")
        bad_request("chat_template_kwargs", "invalid_value",
                    "'chat_template_kwargs." + key + "' is set by the server and cannot be given");
      r.template_vars[key] = value;
    }
  }
  if (const json* e = field(body, "reasoning_effort")) {
    if (!e->is_string()) wrong_type("reasoning_effort", "a string (low, medium or high)", *e);
    const std::string effort = e->get<std::string>();
    if (effort != "low" && effort != "medium" && effort != "high")
      bad_request("reasoning_effort", "invalid_value", "'reasoning_effort' must be low, medium or high, got '" + effort + "'");
    r.template_vars["reasoning_effort"] = effort;
  }
}

}  // namespace

json parse_object(std::string_view body) {
  json j = json::parse(body.begin(), body.end(), nullptr, false);
  if (j.is_discarded()) bad_request("", "invalid_json", "the request body is not valid JSON");
  if (!j.is_object()) bad_request("", "invalid_json", std::string("the request body must be a JSON object, got ") + type_name(j));
  return j;
}

GenerationRequest parse_generation_request(std::string_view body, Endpoint endpoint, const SamplingParams& defaults,
                                           int32_t vocab_size) {
  const json j = parse_object(body);
  GenerationRequest r;
  r.endpoint = endpoint;
  r.sampling = defaults;
  if (const json* m = field(j, "model"); m && !m->is_string()) wrong_type("model", "a string", *m);
  if (auto n = get_int(j, "n", 1, 1 << 20); n && *n != 1)
    bad_request("n", "invalid_value", "'n' must be 1: this server returns one choice per request, got " + std::to_string(*n));
  r.stream = get_bool(j, "stream").value_or(false);
  r.ignore_eos = get_bool(j, "ignore_eos").value_or(false);
  if (const json* so = field(j, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    r.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  // max_completion_tokens is the newer name; either may be given.
  constexpr int64_t kMaxTokens = 1 << 30;
  if (auto m = get_int(j, "max_completion_tokens", 1, kMaxTokens)) r.max_tokens = static_cast<int>(*m);
  else if (auto m2 = get_int(j, "max_tokens", 1, kMaxTokens)) r.max_tokens = static_cast<int>(*m2);
  if (auto t = get_number(j, "temperature", 0, 2)) r.sampling.temperature = static_cast<float>(*t);
  if (auto t = get_number(j, "top_p", 0, 1, /*lo_open=*/true)) r.sampling.top_p = static_cast<float>(*t);
  // top_k: vLLM and llama-server take -1 or 0 for "off".
  if (auto t = get_int(j, "top_k", -1, 1 << 30)) r.sampling.top_k = static_cast<int>(std::max<int64_t>(*t, 0));
  if (auto t = get_number(j, "min_p", 0, 1)) {
    if (*t >= 1) bad_request("min_p", "invalid_value", "'min_p' must be below 1, got " + number_text(*t));
    r.sampling.min_p = static_cast<float>(*t);
  }
  if (auto t = get_number(j, "presence_penalty", -2, 2)) r.sampling.presence_penalty = static_cast<float>(*t);
  if (auto t = get_number(j, "frequency_penalty", -2, 2)) r.sampling.frequency_penalty = static_cast<float>(*t);
  if (auto t = get_number(j, "repetition_penalty", 0, 100, /*lo_open=*/true)) r.sampling.repetition_penalty = static_cast<float>(*t);
  if (const json* s = field(j, "seed")) {
    if (!s->is_number_integer()) wrong_type("seed", "an integer", *s);
    // Negative seeds (JavaScript clients) are taken as their two's complement.
    r.sampling.seed = s->is_number_unsigned() ? s->get<uint64_t>() : static_cast<uint64_t>(s->get<int64_t>());
    r.seeded = true;
  }
  if (const json* s = field(j, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 16) bad_request("stop", "invalid_value", "'stop' holds " + std::to_string(s->size()) + " strings, at most 16 are allowed");
      for (size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string()) wrong_type("stop[" + std::to_string(i) + "]", "a string", (*s)[i]);
        r.stop.push_back((*s)[i].get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *s);
    }
    std::erase_if(r.stop, [](const std::string& x) { return x.empty(); });
  }
  if (const json* b = field(j, "logit_bias")) {
    if (!b->is_object()) wrong_type("logit_bias", "an object mapping token ids to biases", *b);
    for (const auto& [key, value] : b->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (...) {
        used = 0;
      }
      if (used != key.size() || key.empty())
        bad_request("logit_bias", "invalid_value", "'logit_bias' keys must be token ids, got '" + key + "'");
      if (id < 0 || id >= vocab_size)
        bad_request("logit_bias", "invalid_value", "token id " + key + " in 'logit_bias' is outside the vocabulary (" + std::to_string(vocab_size) + ")");
      if (!value.is_number()) wrong_type("logit_bias." + key, "a number", value);
      const double v = value.get<double>();
      if (!(v >= -100 && v <= 100))
        bad_request("logit_bias", "invalid_value", "'logit_bias' values must be in [-100, 100], got " + number_text(v) + " for token " + key);
      r.sampling.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(v));
    }
  }
  if (endpoint == Endpoint::chat) {
    const bool want = get_bool(j, "logprobs").value_or(false);
    const auto top = get_int(j, "top_logprobs", 0, 20);
    if (top && !want) bad_request("top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
    if (want) r.logprobs = static_cast<int>(top.value_or(0));
    r.messages = parse_messages(j);
    parse_template_vars(j, r);
  } else {
    // The legacy API: logprobs is the number of alternatives (0..5 at OpenAI; up to 20 here).
    if (const json* l = field(j, "logprobs"); l && l->is_boolean()) {
      r.logprobs = l->get<bool>() ? 0 : -1;
    } else if (auto n = get_int(j, "logprobs", 0, 20)) {
      r.logprobs = static_cast<int>(*n);
    }
    if (get_bool(j, "echo").value_or(false)) bad_request("echo", "unsupported_value", "'echo' is not supported by this server");
    if (const json* s = field(j, "suffix"); s && !(s->is_string() && s->get<std::string>().empty()))
      bad_request("suffix", "unsupported_value", "'suffix' (insertion) is not supported by this server");
    if (auto b = get_int(j, "best_of", 1, 1 << 20); b && *b != 1)
      bad_request("best_of", "invalid_value", "'best_of' must be 1 on this server, got " + std::to_string(*b));
    parse_prompt(j, vocab_size, r);
  }
  try {
    r.sampling.validate();
  } catch (const std::exception& e) {
    bad_request("", "invalid_value", e.what());
  }
  return r;
}

// ---- responses

json usage_json(const Usage& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", json{{"cached_tokens", u.cached_tokens}}}};
}

json timings_json(const Timings& t) {
  return json{{"prompt_n", t.prompt_n},
              {"prompt_ms", t.prompt_ms},
              {"prompt_per_second", t.prompt_ms > 0 ? t.prompt_n * 1000.0 / t.prompt_ms : 0.0},
              {"predicted_n", t.predicted_n},
              {"predicted_ms", t.predicted_ms},
              {"predicted_per_second", t.predicted_ms > 0 ? t.predicted_n * 1000.0 / t.predicted_ms : 0.0},
              {"cached_n", t.cached_n},
              {"queued_ms", t.queued_ms}};
}

namespace {

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

}  // namespace

TokenReport token_report(const Tokenizer& tokenizer, int32_t id, const Logprobs& logprobs) {
  TokenReport rep{tokenizer.token_to_piece(id), logprobs.chosen, {}};
  for (const TokenLogprob& a : logprobs.top) rep.top.emplace_back(tokenizer.token_to_piece(a.id), a.logprob);
  return rep;
}

json chat_logprobs_json(const std::vector<TokenReport>& tokens) {
  json content = json::array();
  for (const TokenReport& t : tokens) {
    json top = json::array();
    for (const auto& [text, lp] : t.top) top.push_back(json{{"token", text}, {"logprob", lp}, {"bytes", bytes_of(text)}});
    content.push_back(json{{"token", t.text}, {"logprob", t.logprob}, {"bytes", bytes_of(t.text)}, {"top_logprobs", top}});
  }
  return json{{"content", content}, {"refusal", nullptr}};
}

json completion_logprobs_json(const std::vector<TokenReport>& tokens, size_t offset0) {
  json toks = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  size_t offset = offset0;
  for (const TokenReport& t : tokens) {
    toks.push_back(t.text);
    lps.push_back(t.logprob);
    json top = json::object();
    for (const auto& [text, lp] : t.top)
      if (!top.contains(text)) top[text] = lp;  // a map: two ids with the same text keep the likelier
    tops.push_back(top);
    offsets.push_back(offset);
    offset += t.text.size();
  }
  return json{{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

namespace {

json head_json(const ResponseHead& h, const char* object) {
  return json{{"id", h.id}, {"object", object}, {"created", h.created}, {"model", h.model}, {"system_fingerprint", "turboquant"}};
}

json reason(const std::string& r) { return r.empty() ? json(nullptr) : json(r); }

}  // namespace

json chat_chunk(const ResponseHead& h, const json& delta, const json& logprobs, const std::string& finish_reason) {
  json j = head_json(h, "chat.completion.chunk");
  j["choices"] = json::array({json{{"index", 0}, {"delta", delta}, {"logprobs", logprobs}, {"finish_reason", reason(finish_reason)}}});
  return j;
}

json completion_chunk(const ResponseHead& h, const std::string& text, const json& logprobs, const std::string& finish_reason) {
  json j = head_json(h, "text_completion");
  j["choices"] = json::array({json{{"index", 0}, {"text", text}, {"logprobs", logprobs}, {"finish_reason", reason(finish_reason)}}});
  return j;
}

json usage_chunk(const ResponseHead& h, bool chat, const Usage& u) {
  json j = head_json(h, chat ? "chat.completion.chunk" : "text_completion");
  j["choices"] = json::array();
  j["usage"] = usage_json(u);
  return j;
}

std::vector<json> chat_delta_chunks(const ResponseHead& h, const std::string& reasoning, const std::string& content,
                                    const json& logprobs) {
  std::vector<json> out;
  if (!reasoning.empty()) out.push_back(chat_chunk(h, json{{"reasoning_content", reasoning}}, logprobs, ""));
  if (!content.empty() || (out.empty() && !logprobs.is_null()))
    out.push_back(chat_chunk(h, json{{"content", content}}, out.empty() ? logprobs : json(nullptr), ""));
  return out;
}

json chat_response(const ResponseHead& h, const std::string& content, const std::string& reasoning, const json& logprobs,
                   const std::string& finish_reason, const Usage& u, const Timings& t) {
  json j = head_json(h, "chat.completion");
  json message{{"role", "assistant"}, {"content", content}};
  if (!reasoning.empty()) message["reasoning_content"] = reasoning;
  message["refusal"] = nullptr;
  j["choices"] = json::array({json{{"index", 0}, {"message", message}, {"logprobs", logprobs}, {"finish_reason", reason(finish_reason)}}});
  j["usage"] = usage_json(u);
  j["timings"] = timings_json(t);
  return j;
}

json completion_response(const ResponseHead& h, const std::string& text, const json& logprobs, const std::string& finish_reason,
                         const Usage& u, const Timings& t) {
  json j = head_json(h, "text_completion");
  j["choices"] = json::array({json{{"index", 0}, {"text", text}, {"logprobs", logprobs}, {"finish_reason", reason(finish_reason)}}});
  j["usage"] = usage_json(u);
  j["timings"] = timings_json(t);
  return j;
}

}  // namespace tq::serve
