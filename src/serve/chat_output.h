// What a generated text becomes on its way to the client: the answer (`content`), stop strings applied
// to it, and for gpt-oss the reasoning (`reasoning_content`) split off by the harmony channels.
//
//   plain (every model but gpt-oss, and /v1/completions): the decoded text is the content; the end that
//     could still become a stop string is held back (tq::StopFilter).
//   harmony (chat on a gpt-oss model): the decoder writes the special tokens out and HarmonyParser reads
//     the channels. The final channel (and text in no channel, which the format does not allow but which
//     must not be lost) is the content; the analysis channel is the reasoning, and so is the commentary
//     channel (preambles and tool calls: this server does no tool calling, and reasoning_content is
//     where a client that knows nothing of harmony sees them without mistaking them for the answer).
//     Stop strings apply to the content only, as the client reads it: a stop string that the reasoning
//     happens to contain does not cut the answer off before it starts.
//
// take() returns what became final since the last take(). Within one take the reasoning comes before the
// content, which is the order harmony writes them in (analysis, then commentary, then final).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "chat/harmony.h"
#include "runtime/stop_filter.h"

namespace tq::serve {

struct OutputText {
  std::string reasoning;
  std::string content;
  bool empty() const { return reasoning.empty() && content.empty(); }
};

class OutputFilter {
 public:
  OutputFilter(std::vector<std::string> stops, bool harmony);

  // Adds decoded text; true when a stop string completed in the content (what follows it is dropped,
  // and so is everything added later).
  bool add(std::string_view text);
  // What became final since the last take().
  OutputText take();
  // The generation ended without a stop string: what was held back is final (a cut-off `<|en` is text,
  // a partial stop string is content).
  OutputText flush();

  bool harmony() const { return harmony_; }

 private:
  void route(const std::vector<HarmonyDelta>& deltas);

  bool harmony_;
  bool stopped_ = false;
  HarmonyParser channels_;
  StopFilter stops_;      // over the content
  std::string reasoning_;  // final reasoning not yet taken
};

}  // namespace tq::serve
