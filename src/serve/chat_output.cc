#include "serve/chat_output.h"

namespace tq::serve {

namespace {

// The channels a client sees as the answer: final, and text that was in no channel at all.
bool is_answer(const std::string& channel) { return channel == "final" || channel.empty(); }

}  // namespace

// The gpt-oss template's generation prompt ends with `<|start|>assistant`: the output starts in a header.
OutputFilter::OutputFilter(std::vector<std::string> stops, bool harmony)
    : harmony_(harmony), channels_("assistant", /*in_header=*/true), stops_(std::move(stops)) {}

void OutputFilter::route(const std::vector<HarmonyDelta>& deltas) {
  for (const HarmonyDelta& d : deltas) {
    if (stopped_) return;
    if (is_answer(d.channel)) stopped_ = stops_.add(d.text);
    else reasoning_ += d.text;
  }
}

bool OutputFilter::add(std::string_view text) {
  if (stopped_) return true;
  if (harmony_) route(channels_.push(text));
  else stopped_ = stops_.add(text);
  return stopped_;
}

OutputText OutputFilter::take() {
  OutputText out;
  out.reasoning.swap(reasoning_);
  out.content = stops_.take();
  return out;
}

OutputText OutputFilter::flush() {
  if (harmony_ && !stopped_) route(channels_.finish());
  OutputText out;
  out.reasoning.swap(reasoning_);
  // After a stop the held-back tail was cut at the stop string already; flush() gives the rest before it.
  out.content = stops_.flush();
  return out;
}

}  // namespace tq::serve
