// The OpenAI API's request and response shapes, as turboquant-serve speaks them.
//
//   parse_generation_request   a /v1/chat/completions or /v1/completions body -> GenerationRequest,
//                              validated (wrong types and values are ApiError 400 naming the field;
//                              unknown fields are ignored, as OpenAI's clients expect)
//   error_body                 {"error": {"message", "type", "code", "param"}}
//   chat_* / completion_*      the response objects, streamed (chunks) and whole
//
// Nothing here touches the model: prompts are tokenized and the template applied by the server, which
// knows the tokenizer.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/sampler.h"
#include "text/tokenizer.h"

namespace tq::serve {

using json = nlohmann::ordered_json;

// A request the server refuses: the HTTP status and OpenAI's error fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, std::string code, const std::string& message, std::string param = "")
      : std::runtime_error(message), status(status), type(std::move(type)), code(std::move(code)), param(std::move(param)) {}
  int status;
  std::string type;   // invalid_request_error, authentication_error, not_found_error, unavailable_error, server_error
  std::string code;   // a short machine-readable reason ("" : null)
  std::string param;  // the request field at fault ("" : null)
};

// 400 invalid_request_error about `param`.
[[noreturn]] void bad_request(const std::string& param, const std::string& code, const std::string& message);

json error_body(const ApiError& e);
json error_body(int status, const std::string& type, const std::string& code, const std::string& message,
                const std::string& param = "");
// JSON text for responses: invalid UTF-8 (a token that is part of a character) becomes U+FFFD
// instead of an exception.
std::string dump(const json& j);

enum class Endpoint { chat, completion };

// One generation request, validated. Sampling starts from the server's defaults (generation_config.json)
// and takes what the request gives.
struct GenerationRequest {
  Endpoint endpoint = Endpoint::chat;
  bool stream = false;
  bool include_usage = false;      // stream_options.include_usage
  std::optional<int> max_tokens;   // max_tokens / max_completion_tokens (unset: up to the context)
  SamplingParams sampling;
  bool seeded = false;             // the request gave a seed (else the server draws one)
  std::vector<std::string> stop;   // non-empty stop strings
  int logprobs = -1;               // -1: none; else how many alternatives per token (0: the chosen token's only)
  bool ignore_eos = false;         // vLLM's and llama-server's extension: EOS is an ordinary token
  // chat: the messages, each {"role", "content": string}, content parts joined.
  json messages;
  // chat: variables for the chat template beside messages: chat_template_kwargs (llama-server's and
  // vLLM's extension), and reasoning_effort ("low", "medium", "high"; gpt-oss's template reads it),
  // which wins over a reasoning_effort in chat_template_kwargs.
  json template_vars = json::object();
  // completion: the prompt as text, or as token ids when prompt_is_tokens.
  std::string prompt_text;
  std::vector<int32_t> prompt_tokens;
  bool prompt_is_tokens = false;
};

// Parses and validates a body; vocab_size bounds logit_bias ids and token prompts. Throws ApiError.
GenerationRequest parse_generation_request(std::string_view body, Endpoint endpoint, const SamplingParams& defaults,
                                           int32_t vocab_size);

// Parses a body that must be a JSON object (400 otherwise).
json parse_object(std::string_view body);

// ---- responses

// One generated token as logprobs report it.
struct TokenReport {
  std::string text;   // the token's bytes in the output (possibly part of a UTF-8 character)
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;  // the most likely alternatives, largest first
};

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;  // prompt tokens reused from the prefix cache
};

// llama-server's timings object.
struct Timings {
  int prompt_n = 0;         // prompt tokens computed (not reused)
  double prompt_ms = 0;     // from admission to the first token
  int predicted_n = 0;      // generated tokens
  double predicted_ms = 0;  // from the first token to the last
  int cached_n = 0;         // prompt tokens reused from the prefix cache
  double queued_ms = 0;     // waiting for a slot or for KV room
};

struct ResponseHead {
  std::string id;      // chatcmpl-... / cmpl-...
  int64_t created = 0; // Unix seconds
  std::string model;
};

// One generated token's log-probabilities as the API reports them: its bytes in the output and the
// alternatives' (the tokenizer's pieces). The server and the Python package both build their logprobs here.
TokenReport token_report(const Tokenizer& tokenizer, int32_t id, const Logprobs& logprobs);

json usage_json(const Usage& u);
json timings_json(const Timings& t);
// chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completion: {tokens, token_logprobs,
// top_logprobs, text_offset} (text_offset counts bytes of the output from `offset0`).
json chat_logprobs_json(const std::vector<TokenReport>& tokens);
json completion_logprobs_json(const std::vector<TokenReport>& tokens, size_t offset0);

// A streamed chunk. delta_role: the first chat chunk; finish_reason "" : null.
json chat_chunk(const ResponseHead& h, const json& delta, const json& logprobs, const std::string& finish_reason);
json completion_chunk(const ResponseHead& h, const std::string& text, const json& logprobs, const std::string& finish_reason);
// The usage chunk after the last one: empty choices.
json usage_chunk(const ResponseHead& h, bool chat, const Usage& u);
// The chunks of one streamed piece of a chat answer: one with delta.reasoning_content, then one with
// delta.content, each only when it has text; the logprobs go with the first. With neither text but
// logprobs (tokens whose text is held back), one chunk of empty content carries them; else none.
std::vector<json> chat_delta_chunks(const ResponseHead& h, const std::string& reasoning, const std::string& content,
                                    const json& logprobs);
// message.reasoning_content is there only when the reasoning is not empty (a model that does not reason
// answers exactly as before).
json chat_response(const ResponseHead& h, const std::string& content, const std::string& reasoning, const json& logprobs,
                   const std::string& finish_reason, const Usage& u, const Timings& t);
json completion_response(const ResponseHead& h, const std::string& text, const json& logprobs, const std::string& finish_reason,
                         const Usage& u, const Timings& t);

}  // namespace tq::serve
