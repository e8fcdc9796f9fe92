#include "chat/harmony.h"

#include <algorithm>
#include <array>

namespace tq {
namespace {

constexpr std::string_view kStart = "<|start|>", kEnd = "<|end|>", kMessage = "<|message|>",
                           kChannel = "<|channel|>", kConstrain = "<|constrain|>", kReturn = "<|return|>",
                           kCall = "<|call|>";
constexpr std::array<std::string_view, 7> kMarkers = {kStart, kEnd, kMessage, kChannel, kConstrain, kReturn, kCall};

// The length of the longest suffix of `s` that is a proper prefix of a marker: text that must wait for the
// next push before it can be shown (it may still become "<|end|>"). Longest first, so that "<<|e" keeps "<|e".
size_t held_back(std::string_view s) {
  const size_t longest = std::max_element(kMarkers.begin(), kMarkers.end(), [](auto a, auto b) {
                           return a.size() < b.size();
                         })->size();
  for (size_t n = std::min(s.size(), longest - 1); n > 0; --n) {
    const std::string_view tail = s.substr(s.size() - n);
    if (tail[0] != '<') continue;
    for (std::string_view m : kMarkers)
      if (m.substr(0, n) == tail) return n;
  }
  return 0;
}

// Splits on spaces (the header's words).
std::vector<std::string_view> words(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && s[i] == ' ') ++i;
    const size_t b = i;
    while (i < s.size() && s[i] != ' ') ++i;
    if (i > b) out.push_back(s.substr(b, i - b));
  }
  return out;
}

}  // namespace

HarmonyParser::HarmonyParser(std::string role, bool in_header) : state_(in_header ? State::header : State::between) {
  if (in_header) open_message(std::move(role));
}

void HarmonyParser::open_message(std::string role) {
  HarmonyMessage m;
  m.role = std::move(role);
  messages_.push_back(std::move(m));
}

// The header text is in pending_ up to the <|message|> that ends it: "{role} to={recipient}" before any
// marker, then "<|channel|>{channel} [to={recipient}] [{content type}]", or "<|constrain|>{content type}".
void HarmonyParser::close_header() {
  HarmonyMessage& m = messages_.back();
  const size_t at = pending_.find(kMessage);
  const std::string_view header = std::string_view(pending_).substr(0, at);
  size_t pos = 0;
  std::string_view section_marker;  // the marker the current section follows ("" for the first)
  while (pos <= header.size()) {
    size_t next = header.size();
    std::string_view next_marker;
    for (std::string_view mk : {kChannel, kConstrain}) {
      const size_t f = header.find(mk, pos);
      if (f < next) next = f, next_marker = mk;
    }
    bool first_word = true;
    for (std::string_view w : words(header.substr(pos, next - pos))) {
      if (w.substr(0, 3) == "to=") {
        m.recipient = std::string(w.substr(3));
      } else if (first_word && section_marker.empty()) {
        m.role = std::string(w);
      } else if (first_word && section_marker == kChannel) {
        m.channel = std::string(w);
      } else {
        m.content_type = std::string(w);  // after <|constrain|>, or "commentary json"
      }
      first_word = false;
    }
    if (next == header.size()) break;
    section_marker = next_marker;
    pos = next + next_marker.size();
  }
  pending_.erase(0, at + kMessage.size());
  state_ = State::content;
}

void HarmonyParser::emit(std::string_view text, std::vector<HarmonyDelta>& out) {
  if (text.empty()) return;
  const size_t index = messages_.size() - 1;
  messages_.back().content.append(text);
  if (!out.empty() && out.back().message == index)
    out.back().text.append(text);
  else
    out.push_back({index, messages_.back().channel, std::string(text)});
}

std::vector<HarmonyDelta> HarmonyParser::push(std::string_view text) {
  std::vector<HarmonyDelta> out;
  if (state_ == State::done) return out;
  pending_.append(text);
  while (true) {
    if (state_ == State::between) {
      // Only <|start|> may come between messages; a header that skips it is read as the same role's.
      if (pending_.empty() || held_back(pending_) == pending_.size()) return out;
      if (pending_.compare(0, kStart.size(), kStart) == 0) {
        pending_.erase(0, kStart.size());
        open_message("");
        state_ = State::header;
      } else if (pending_.compare(0, kChannel.size(), kChannel) == 0) {
        open_message(messages_.empty() ? "assistant" : messages_.back().role);
        state_ = State::header;
      } else {
        // Text outside any message: shown as a message without a channel rather than dropped.
        open_message("");
        state_ = State::content;
      }
    } else if (state_ == State::header) {
      if (pending_.find(kMessage) == std::string::npos) return out;
      close_header();
    } else if (state_ == State::content) {
      // The first marker that ends this message, if any.
      size_t first = std::string::npos;
      std::string_view marker;
      for (std::string_view mk : {kEnd, kReturn, kCall, kStart, kChannel}) {
        const size_t f = pending_.find(mk);
        if (f < first) first = f, marker = mk;
      }
      if (first == std::string::npos) {
        const size_t keep = held_back(pending_);
        emit(std::string_view(pending_).substr(0, pending_.size() - keep), out);
        pending_.erase(0, pending_.size() - keep);
        return out;
      }
      emit(std::string_view(pending_).substr(0, first), out);
      pending_.erase(0, first);
      if (marker == kStart || marker == kChannel) {
        // A new header without <|end|> first: this message was cut off; the marker starts the next one.
        state_ = State::between;
        continue;
      }
      messages_.back().end = std::string(marker);
      pending_.erase(0, marker.size());
      if (marker == kEnd) {
        state_ = State::between;
      } else {
        state_ = State::done;
        done_ = true;
        pending_.clear();
        return out;
      }
    } else {
      return out;
    }
  }
}

std::vector<HarmonyDelta> HarmonyParser::finish() {
  std::vector<HarmonyDelta> out;
  if (state_ == State::content) {
    emit(pending_, out);
  } else if (state_ == State::between && !pending_.empty()) {
    open_message("");
    emit(pending_, out);
  }
  pending_.clear();
  state_ = State::done;
  return out;
}

std::string HarmonyParser::text_of(std::string_view channel) const {
  std::string s;
  for (const HarmonyMessage& m : messages_)
    if (m.channel == channel) s += m.content;
  return s;
}

}  // namespace tq
