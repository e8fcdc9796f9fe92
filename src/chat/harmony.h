// The harmony response format of gpt-oss: what the model writes after the prompt's `<|start|>assistant`,
// split into messages by channel, as the text streams in.
//
//   <|channel|>analysis<|message|>…reasoning…<|end|><|start|>assistant<|channel|>final<|message|>…answer…<|return|>
//   <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>
//
// A message is a header (role, `<|channel|>` name, ` to=` recipient, content type after `<|constrain|>` or
// as a last word) up to `<|message|>`, then content up to `<|end|>`, `<|return|>` or `<|call|>` (the last
// two end the generation). The parser reads the decoded text with the special tokens written out
// (StreamDecoder with skip_special_tokens = false): each push() returns the content that became final,
// never a piece of text that could still turn out to be the start of a marker, so a streamed answer never
// shows half of `<|end|>`. turboquant-generate shows the final channel; a server can put the analysis
// channel in `reasoning_content` and the final one in `content`.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tq {

struct HarmonyMessage {
  std::string role;          // "assistant" (the prompt's), or what follows <|start|>
  std::string channel;       // "analysis", "commentary", "final"; empty when the header names none
  std::string recipient;     // "functions.get_weather" for a tool call (` to=...`), else empty
  std::string content_type;  // "json" for `<|constrain|>json` or a trailing "json", else empty
  std::string content;
  std::string end;           // "<|end|>", "<|return|>", "<|call|>"; empty while open or cut off
};

// Content of one message that became final in a push(): `message` indexes messages().
struct HarmonyDelta {
  size_t message;
  std::string channel;
  std::string text;
};

class HarmonyParser {
 public:
  // in_header: the prompt ended with `<|start|>{role}`, so the model's output starts inside a header
  // (the gpt-oss template's generation prompt). false: it starts after <|start|> is expected.
  explicit HarmonyParser(std::string role = "assistant", bool in_header = true);

  // Adds generated text; returns the content that became final, in order.
  std::vector<HarmonyDelta> push(std::string_view text);
  // The end of the generation: held-back content is final (a cut-off `<|en` is text after all). A header
  // cut off before <|message|> has no content and gives nothing; stray text outside any message (which
  // the format does not allow) becomes the content of a message without a channel, so it is not lost.
  std::vector<HarmonyDelta> finish();

  const std::vector<HarmonyMessage>& messages() const { return messages_; }
  // The content of every message on `channel`, joined in order ("" = messages without a channel).
  std::string text_of(std::string_view channel) const;
  // <|return|> or <|call|> was read: the model is done; later text is ignored.
  bool done() const { return done_; }

 private:
  enum class State { between, header, content, done };
  void open_message(std::string role);
  void close_header();
  void emit(std::string_view text, std::vector<HarmonyDelta>& out);

  State state_;
  std::string pending_;  // text not yet consumed: a header being read, or a possible marker prefix
  std::vector<HarmonyMessage> messages_;
  bool done_ = false;
};

}  // namespace tq
