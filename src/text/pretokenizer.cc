#include "text/pretokenizer.h"

#include <algorithm>
#include <array>

#include "core/error.h"
#include "text/regex.h"
#include "text/unicode.h"

namespace tq {
namespace {

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kO200kPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The three classes the known patterns are made of. A code point is at most one of them (letters and
// numbers are not whitespace); "other" ([^\s\p{L}\p{N}]) is none of them.
enum : uint8_t { kLetter = 1, kNumber = 2, kSpace = 4 };

uint8_t classify(char32_t c) {
  static const std::array<uint8_t, 128> ascii = [] {
    std::array<uint8_t, 128> t{};
    for (char32_t a = 0; a < 128; ++a) {
      if ((a >= 'a' && a <= 'z') || (a >= 'A' && a <= 'Z')) t[a] = kLetter;
      if (a >= '0' && a <= '9') t[a] = kNumber;
      if (is_unicode_whitespace(a)) t[a] = kSpace;
    }
    return t;
  }();
  if (c < 128) return ascii[c];
  const uint32_t bit = unicode_category_bit(c);
  if (bit & kCategoryLetter) return kLetter;
  if (bit & kCategoryNumber) return kNumber;
  return is_unicode_whitespace(c) ? kSpace : 0;
}

size_t run_of(const char32_t* cps, size_t n, size_t pos, uint8_t cls) {
  size_t e = pos;
  while (e < n && classify(cps[e]) == cls) ++e;
  return e - pos;
}

// 's 't 're 've 'm 'll 'd at `pos` (which holds an apostrophe). Case-insensitive matching also accepts the
// upper-case letters and U+017F (long s, which case-folds to 's' in Oniguruma).
size_t contraction_at(const char32_t* cps, size_t n, size_t pos, bool case_insensitive) {
  if (pos + 1 >= n) return 0;
  auto fold = [&](char32_t c) -> char32_t {
    if (!case_insensitive) return c;
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c == 0x17F) return 's';
    return c;
  };
  const char32_t a = fold(cps[pos + 1]);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (pos + 2 >= n) return 0;
  const char32_t b = fold(cps[pos + 2]);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// The length of `\s+(?!\S)|\s+` at a whitespace run of length r: the run, except that before a
// non-space the last space is left for the next piece (unless it is the only one).
size_t whitespace_tail(size_t pos, size_t r, size_t n) { return (pos + r == n || r == 1) ? r : r - 1; }

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
class Gpt2Matcher final : public PatternMatcher {
 public:
  ptrdiff_t match_at(const char32_t* cps, size_t n, size_t pos) const override {
    const char32_t c = cps[pos];
    if (c == '\'') {
      if (size_t k = contraction_at(cps, n, pos, false)) return static_cast<ptrdiff_t>(k);
    }
    // ` ?X+` for X in letters, numbers, other: a leading space joins a following run of any of them. The
    // space is not in X, so trying "without the space" can never succeed when c is a space.
    const size_t start = (c == ' ' && pos + 1 < n) ? pos + 1 : pos;
    const uint8_t cls = classify(cps[start]);
    if (start == pos + 1 && cls == kSpace) {
      // fall through to the whitespace alternatives
    } else if (cls != kSpace) {
      return static_cast<ptrdiff_t>(start - pos + run_of(cps, n, start, cls));
    }
    const size_t r = run_of(cps, n, pos, kSpace);
    return static_cast<ptrdiff_t>(whitespace_tail(pos, r, n));
  }
  bool is_fast() const override { return true; }
};

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|
// \s+(?!\S)|\s+  with D = 3 (Llama 3) or 1 (Qwen 2).
class Llama3Matcher final : public PatternMatcher {
 public:
  explicit Llama3Matcher(size_t max_digits) : max_digits_(max_digits) {}
  ptrdiff_t match_at(const char32_t* cps, size_t n, size_t pos) const override {
    const char32_t c = cps[pos];
    const uint8_t cls = classify(c);
    if (c == '\'') {
      if (size_t k = contraction_at(cps, n, pos, true)) return static_cast<ptrdiff_t>(k);
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (cls == kLetter) return static_cast<ptrdiff_t>(run_of(cps, n, pos, kLetter));
    if (cls != kNumber && c != '\r' && c != '\n' && pos + 1 < n && classify(cps[pos + 1]) == kLetter)
      return static_cast<ptrdiff_t>(1 + run_of(cps, n, pos + 1, kLetter));
    // \p{N}{1,D}
    if (cls == kNumber) return static_cast<ptrdiff_t>(std::min(max_digits_, run_of(cps, n, pos, kNumber)));
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    const size_t start = (c == ' ' && pos + 1 < n && classify(cps[pos + 1]) == 0) ? pos + 1 : pos;
    if (classify(cps[start]) == 0) {
      size_t e = start + run_of(cps, n, start, 0);
      while (e < n && (cps[e] == '\r' || cps[e] == '\n')) ++e;
      return static_cast<ptrdiff_t>(e - pos);
    }
    // c is whitespace. `\s*[\r\n]+`: the greedy \s* backs off to the last line break of the run, and
    // [\r\n]+ then takes just that one (nothing after it in the run is a line break).
    const size_t r = run_of(cps, n, pos, kSpace);
    for (size_t j = pos + r; j-- > pos;)
      if (cps[j] == '\r' || cps[j] == '\n') return static_cast<ptrdiff_t>(j + 1 - pos);
    return static_cast<ptrdiff_t>(whitespace_tail(pos, r, n));
  }
  bool is_fast() const override { return true; }

 private:
  size_t max_digits_;
};

// The o200k (GPT-4o, gpt-oss) pattern, alternative by alternative:
//   1  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//   2  [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//   3  \p{N}{1,3}
//   4   ?[^\s\p{L}\p{N}]+[\r\n/]*
//   5  \s*[\r\n]+      6  \s+(?!\S)      7  \s+
// Words are split where case goes from lower to upper ("CamelCase" -> "Camel", "Case") and an all-caps
// run keeps its following lower-case letters ("HTTPServer"). The "upper" class U = Lu Lt Lm Lo M and the
// "lower" class W = Ll Lm Lo M overlap (Lm, Lo and marks are in both), so the backtracking of 1 is
// reproduced exactly below rather than simplified. Marks are also in the optional prefix class (they are
// not \p{L}), which is why a prefix is tried and then dropped, as the regex engine does.
class O200kMatcher final : public PatternMatcher {
 public:
  ptrdiff_t match_at(const char32_t* cps, size_t n, size_t pos) const override {
    const uint8_t c = flags(cps[pos]);
    // [^\r\n\p{L}\p{N}]? is greedy: the alternative is tried with the prefix first, then without it.
    const bool prefix = !(c & (kL | kN | kCrLf)) && pos + 1 < n;
    ptrdiff_t e = -1;
    if (prefix) e = lower_word(cps, n, pos + 1);
    if (e < 0) e = lower_word(cps, n, pos);
    if (e < 0 && prefix) e = upper_word(cps, n, pos + 1);
    if (e < 0) e = upper_word(cps, n, pos);
    if (e >= 0) return e - static_cast<ptrdiff_t>(pos);
    if (c & kN) {
      size_t k = 1;
      while (k < 3 && pos + k < n && (flags(cps[pos + k]) & kN)) ++k;
      return static_cast<ptrdiff_t>(k);
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n/]*
    const size_t start = (cps[pos] == ' ' && pos + 1 < n && is_other(flags(cps[pos + 1]))) ? pos + 1 : pos;
    if (is_other(flags(cps[start]))) {
      size_t j = start + 1;
      while (j < n && is_other(flags(cps[j]))) ++j;
      while (j < n && (cps[j] == '\r' || cps[j] == '\n' || cps[j] == '/')) ++j;
      return static_cast<ptrdiff_t>(j - pos);
    }
    // Only whitespace is left (letters and marks matched 1 or 2, numbers 3, anything else 4). \s*[\r\n]+
    // ends after the last line break of the run; otherwise \s+(?!\S) leaves the last space to the word
    // that follows.
    size_t r = 0;
    while (pos + r < n && (flags(cps[pos + r]) & kS)) ++r;
    for (size_t j = pos + r; j-- > pos;)
      if (cps[j] == '\r' || cps[j] == '\n') return static_cast<ptrdiff_t>(j + 1 - pos);
    return static_cast<ptrdiff_t>(whitespace_tail(pos, r, n));
  }
  bool is_fast() const override { return true; }

 private:
  enum : uint8_t { kUpper = 1, kLower = 2, kL = 4, kN = 8, kS = 16, kCrLf = 32 };

  static uint8_t flags(char32_t ch) {
    static const std::array<uint8_t, 128> ascii = [] {
      std::array<uint8_t, 128> t{};
      for (char32_t a = 0; a < 128; ++a) t[a] = compute(a);
      return t;
    }();
    return ch < 128 ? ascii[ch] : compute(ch);
  }
  static uint8_t compute(char32_t ch) {
    using C = UnicodeCategory;
    const uint32_t bit = unicode_category_bit(ch);
    const uint32_t both = category_bit(C::Lm) | category_bit(C::Lo) | kCategoryMark;
    uint8_t f = 0;
    if (bit & (both | category_bit(C::Lu) | category_bit(C::Lt))) f |= kUpper;
    if (bit & (both | category_bit(C::Ll))) f |= kLower;
    if (bit & kCategoryLetter) f |= kL;
    if (bit & kCategoryNumber) f |= kN;
    if (is_unicode_whitespace(ch)) f |= kS;
    if (ch == '\r' || ch == '\n') f |= kCrLf;
    return f;
  }
  // [^\s\p{L}\p{N}]: punctuation, symbols, marks, controls other than \s, unassigned.
  static bool is_other(uint8_t f) { return !(f & (kS | kL | kN)); }

  static size_t run(const char32_t* cps, size_t n, size_t q, uint8_t flag) {
    size_t e = q;
    while (e < n && (flags(cps[e]) & flag)) ++e;
    return e;
  }
  // The optional contraction after a word ends at `e`.
  static ptrdiff_t with_contraction(const char32_t* cps, size_t n, size_t e) {
    if (e < n && cps[e] == '\'') e += contraction_at(cps, n, e, true);
    return static_cast<ptrdiff_t>(e);
  }
  // U*W+ at q: the greedy U* takes the whole run of U, then gives back one character at a time until the
  // character after it is in W; W+ then takes its whole run. -1 when no split works.
  static ptrdiff_t lower_word(const char32_t* cps, size_t n, size_t q) {
    const size_t a = run(cps, n, q, kUpper);
    for (size_t i = a + 1; i-- > q;)
      if (i < n && (flags(cps[i]) & kLower)) return with_contraction(cps, n, run(cps, n, i, kLower));
    return -1;
  }
  // U+W* at q: nothing after W* can fail, so no backtracking.
  static ptrdiff_t upper_word(const char32_t* cps, size_t n, size_t q) {
    const size_t a = run(cps, n, q, kUpper);
    if (a == q) return -1;
    return with_contraction(cps, n, run(cps, n, a, kLower));
  }
};

class RegexMatcher final : public PatternMatcher {
 public:
  explicit RegexMatcher(std::string_view pattern) : regex_(pattern) {}
  ptrdiff_t match_at(const char32_t* cps, size_t n, size_t pos) const override {
    return regex_.match_at(cps, n, pos);
  }

 private:
  Regex regex_;
};

class LiteralMatcher final : public PatternMatcher {
 public:
  explicit LiteralMatcher(std::string_view text) {
    CodePointText t;
    t.assign(text);
    cps_ = std::move(t.cps);
  }
  ptrdiff_t match_at(const char32_t* cps, size_t n, size_t pos) const override {
    if (cps_.empty() || n - pos < cps_.size()) return -1;
    return std::equal(cps_.begin(), cps_.end(), cps + pos) ? static_cast<ptrdiff_t>(cps_.size()) : -1;
  }
  bool is_fast() const override { return true; }

 private:
  std::vector<char32_t> cps_;
};

// Matches one code point of the number categories (for Digits).
class NumberMatcher final : public PatternMatcher {
 public:
  ptrdiff_t match_at(const char32_t* cps, size_t, size_t pos) const override {
    return (unicode_category_bit(cps[pos]) & kCategoryNumber) ? 1 : -1;
  }
  bool is_fast() const override { return true; }
};

class SplitStep final : public PreTokenizerStep {
 public:
  SplitStep(std::unique_ptr<PatternMatcher> m, SplitBehavior b, bool invert)
      : matcher_(std::move(m)), behavior_(b), invert_(invert) {}
  void apply(Pieces& pieces) const override {
    std::vector<Pieces::Piece> out;
    out.reserve(pieces.items.size() * 4);
    CodePointText cpt;
    std::vector<std::pair<uint32_t, uint32_t>> ranges;
    for (const Pieces::Piece& p : pieces.items) {
      cpt.assign(p.text);
      ranges.clear();
      split_by_pattern(cpt, *matcher_, behavior_, invert_, ranges);
      for (const auto& [b, e] : ranges) out.push_back({p.text.substr(b, e - b), p.at_text_start && b == 0});
    }
    pieces.items = std::move(out);
  }

 private:
  std::unique_ptr<PatternMatcher> matcher_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevelStep final : public PreTokenizerStep {
 public:
  ByteLevelStep(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space) {
    if (use_regex) split_ = std::make_unique<SplitStep>(std::make_unique<Gpt2Matcher>(), SplitBehavior::isolated, false);
  }
  void apply(Pieces& pieces) const override {
    if (add_prefix_space_) {
      for (Pieces::Piece& p : pieces.items)
        if (p.text.empty() || p.text[0] != ' ') {
          std::string s(1, ' ');
          s.append(p.text);
          p.text = pieces.store(std::move(s));
        }
    }
    if (split_) split_->apply(pieces);
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<SplitStep> split_;
};

class MetaspaceStep final : public PreTokenizerStep {
 public:
  MetaspaceStep(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void apply(Pieces& pieces) const override {
    std::vector<Pieces::Piece> out;
    for (const Pieces::Piece& p : pieces.items) {
      std::string s;
      s.reserve(p.text.size() + 8);
      for (char ch : p.text) {
        if (ch == ' ')
          s += replacement_;
        else
          s.push_back(ch);
      }
      const bool prepend = scheme_ == PrependScheme::always || (scheme_ == PrependScheme::first && p.at_text_start);
      if (prepend && s.compare(0, replacement_.size(), replacement_) != 0) s.insert(0, replacement_);
      const std::string_view stored = pieces.store(std::move(s));
      if (!split_) {
        out.push_back({stored, p.at_text_start});
        continue;
      }
      // MergedWithNext on the replacement: every piece but the first starts with it.
      size_t begin = 0;
      for (size_t at = stored.find(replacement_, 1); at != std::string_view::npos;
           at = stored.find(replacement_, at + replacement_.size())) {
        if (at > begin) out.push_back({stored.substr(begin, at - begin), p.at_text_start && begin == 0});
        begin = at;
      }
      if (begin < stored.size()) out.push_back({stored.substr(begin), p.at_text_start && begin == 0});
    }
    pieces.items = std::move(out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

}  // namespace

std::string_view known_pattern_text(KnownPattern p) {
  switch (p) {
    case KnownPattern::gpt2: return kGpt2Pattern;
    case KnownPattern::llama3: return kLlama3Pattern;
    case KnownPattern::qwen2: return kQwen2Pattern;
    case KnownPattern::o200k: return kO200kPattern;
  }
  return kGpt2Pattern;
}

std::string_view gguf_pre_tokenizer_pattern(std::string_view pre) {
  if (pre == "default" || pre == "gpt-2" || pre == "gpt2") return kGpt2Pattern;
  if (pre == "llama-bpe" || pre == "llama3" || pre == "smaug-bpe") return kLlama3Pattern;
  if (pre == "qwen2" || pre == "deepseek-r1-qwen") return kQwen2Pattern;
  if (pre == "gpt-4o") return kO200kPattern;
  return {};
}

void CodePointText::assign(std::string_view s) {
  cps.clear();
  offsets.clear();
  cps.reserve(s.size());
  offsets.reserve(s.size() + 1);
  size_t i = 0;
  while (i < s.size()) {
    offsets.push_back(static_cast<uint32_t>(i));
    const unsigned char b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      cps.push_back(b);
      ++i;
      continue;
    }
    const Utf8Step step = decode_utf8_step(s.substr(i));
    cps.push_back(step.cp);
    i += step.bytes;
  }
  offsets.push_back(static_cast<uint32_t>(s.size()));
}

std::unique_ptr<PatternMatcher> compile_pattern(std::string_view pattern) {
  if (pattern == kGpt2Pattern) return std::make_unique<Gpt2Matcher>();
  if (pattern == kLlama3Pattern) return std::make_unique<Llama3Matcher>(3);
  if (pattern == kQwen2Pattern) return std::make_unique<Llama3Matcher>(1);
  if (pattern == kO200kPattern) return std::make_unique<O200kMatcher>();
  return std::make_unique<RegexMatcher>(pattern);
}

std::unique_ptr<PatternMatcher> compile_regex_pattern(std::string_view pattern) {
  return std::make_unique<RegexMatcher>(pattern);
}

std::unique_ptr<PatternMatcher> literal_pattern(std::string_view text) {
  return std::make_unique<LiteralMatcher>(text);
}

void split_by_pattern(const CodePointText& text, const PatternMatcher& matcher, SplitBehavior behavior, bool invert,
                      std::vector<std::pair<uint32_t, uint32_t>>& out) {
  const size_t n = text.cps.size();
  // Matches and gaps in order, as code point ranges, flagged as matches. [pieces]
  struct Span {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Span> spans;
  size_t gap_start = 0;
  size_t pos = 0;
  while (pos < n) {
    const ptrdiff_t len = matcher.match_at(text.cps.data(), n, pos);
    if (len < 0) {
      ++pos;
      continue;
    }
    if (gap_start < pos) spans.push_back({gap_start, pos, false});
    spans.push_back({pos, pos + static_cast<size_t>(len), true});
    // After an empty match the search resumes one character later, as a regex find-all loop does.
    pos += len > 0 ? static_cast<size_t>(len) : 1;
    gap_start = pos - (len > 0 ? 0 : 1);
  }
  if (gap_start < n) spans.push_back({gap_start, n, false});
  if (invert)
    for (Span& s : spans) s.is_match = !s.is_match;

  // The behaviours, as HF folds them.
  std::vector<Span> merged;
  merged.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::isolated: merged = spans; break;
    case SplitBehavior::removed:
      for (const Span& s : spans)
        if (!s.is_match) merged.push_back(s);
      break;
    case SplitBehavior::merged_with_previous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !merged.empty())
          merged.back().end = s.end;
        else
          merged.push_back(s);
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      bool previous_match = false;
      for (size_t k = spans.size(); k-- > 0;) {
        const Span& s = spans[k];
        if (s.is_match && !previous_match && !merged.empty())
          merged.back().begin = s.begin;
        else
          merged.push_back(s);
        previous_match = s.is_match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    }
    case SplitBehavior::contiguous: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !merged.empty())
          merged.back().end = s.end;
        else
          merged.push_back(s);
        previous_match = s.is_match;
      }
      break;
    }
  }
  for (const Span& s : merged)
    if (s.end > s.begin) out.emplace_back(text.offsets[s.begin], text.offsets[s.end]);
}

std::unique_ptr<PreTokenizerStep> make_split_step(std::unique_ptr<PatternMatcher> matcher, SplitBehavior behavior,
                                                  bool invert) {
  return std::make_unique<SplitStep>(std::move(matcher), behavior, invert);
}
std::unique_ptr<PreTokenizerStep> make_byte_level_step(bool add_prefix_space, bool use_regex) {
  return std::make_unique<ByteLevelStep>(add_prefix_space, use_regex);
}
std::unique_ptr<PreTokenizerStep> make_metaspace_step(std::string replacement, PrependScheme scheme, bool split) {
  return std::make_unique<MetaspaceStep>(std::move(replacement), scheme, split);
}
std::unique_ptr<PreTokenizerStep> make_digits_step(bool individual_digits) {
  return std::make_unique<SplitStep>(std::make_unique<NumberMatcher>(),
                                     individual_digits ? SplitBehavior::isolated : SplitBehavior::contiguous, false);
}

}  // namespace tq
