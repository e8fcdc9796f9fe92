// A small backtracking regular-expression engine for the pre-tokenizer patterns of tokenizer files.
//
// It implements the subset those patterns use, with the semantics of Oniguruma (Ruby syntax), the engine of
// Hugging Face `tokenizers`: leftmost-first alternation, greedy/lazy/possessive quantifiers, {n,m},
// (?:..), (?i:..), (?i), (?=..), (?!..), (?>..), ^ and $ as line anchors, \A \z \Z, character classes with
// ranges and negation, \s \S \d \D \w \W \h \H, \p{..}/\P{..}/\p{^..} general categories, \r \n \t \f \v \e
// \a \0 \xHH \x{H..} \uHHHH. Case-insensitive matching folds ASCII letters and the few non-ASCII characters
// that fold onto them (U+017F long s, U+212A Kelvin sign). Anything else (backreferences, lookbehind, \b,
// POSIX brackets, nested classes) is rejected with tq::Error, so a pattern is never silently misread.
//
// This engine is the slow reference: pretokenizer.cc has hand-written matchers for the common patterns,
// tested against it on random text, and uses the engine itself only for patterns it does not know.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace tq {

class Regex {
 public:
  // Throws tq::Error naming the pattern and the offending construct.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // Length in code points of the match that starts exactly at `pos` (the one a leftmost-first search
  // reports there), or -1 when no match starts at `pos`. `text` is [n] code points.
  ptrdiff_t match_at(const char32_t* text, size_t n, size_t pos) const;

  const std::string& pattern() const { return pattern_; }

  struct Node;

 private:
  std::string pattern_;
  std::unique_ptr<Node> root_;
};

}  // namespace tq
