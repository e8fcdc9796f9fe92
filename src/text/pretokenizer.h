// Pre-tokenization: splitting text into the pieces that BPE encodes one at a time, with the pattern and the
// split behaviours of Hugging Face `tokenizers` (Split, the ByteLevel regex, Metaspace, Digits).
//
// Patterns are matched on code points. The four patterns that byte-level models use (GPT-2, Llama 3,
// Qwen 2, o200k) have hand-written matchers; any other pattern runs on the backtracking engine of regex.h, which is
// also the reference the fast matchers are tested against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tq {

// The pre-tokenizer regexes of the common byte-level BPE families, exactly as their tokenizer files write
// them (one backslash, as after JSON decoding), each with a hand-written matcher. o200k is GPT-4o's and
// gpt-oss's (o200k_harmony uses the same pattern).
enum class KnownPattern { gpt2, llama3, qwen2, o200k };
std::string_view known_pattern_text(KnownPattern p);

// The pattern a GGUF file's tokenizer.ggml.pre names, for the names llama.cpp writes for these families
// ("default", "gpt-2", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "gpt-4o", ...); empty when the
// name is not one of them (the caller then has to refuse the file or supply the pattern).
std::string_view gguf_pre_tokenizer_pattern(std::string_view pre);

// Text decoded into code points, with the byte offset of each in the source string.
struct CodePointText {
  std::vector<char32_t> cps;      // [n]; ill-formed UTF-8 bytes become U+FFFD (one per maximal subpart)
  std::vector<uint32_t> offsets;  // [n + 1]; offsets[n] is the source size
  void assign(std::string_view s);
};

class PatternMatcher {
 public:
  virtual ~PatternMatcher() = default;
  // Length in code points of the match starting exactly at `pos`, or -1 (leftmost-first semantics).
  virtual ptrdiff_t match_at(const char32_t* cps, size_t n, size_t pos) const = 0;
  virtual bool is_fast() const { return false; }  // a hand-written matcher (for tests and reports)
};

// The fast matcher when `pattern` is one of the known ones, else the regex engine. Throws tq::Error for a
// pattern the engine does not support.
std::unique_ptr<PatternMatcher> compile_pattern(std::string_view pattern);
// Always the regex engine (the reference).
std::unique_ptr<PatternMatcher> compile_regex_pattern(std::string_view pattern);
// A literal string (Split with {"String": ...}).
std::unique_ptr<PatternMatcher> literal_pattern(std::string_view text);

// How matches and the text between them become pieces (HF SplitDelimiterBehavior).
enum class SplitBehavior { isolated, removed, merged_with_previous, merged_with_next, contiguous };

// Byte ranges [begin, end) of the pieces of `text`, in order, without empty pieces. `invert` swaps the
// roles of matches and gaps. Zero-length matches split the text, as in HF.
void split_by_pattern(const CodePointText& text, const PatternMatcher& matcher, SplitBehavior behavior,
                      bool invert, std::vector<std::pair<uint32_t, uint32_t>>& out);

// Pieces flowing through the pre-tokenizer: views into the input or into `storage` (pieces a step rewrote).
struct Pieces {
  struct Piece {
    std::string_view text;
    bool at_text_start;  // starts at offset 0 of the original input (Metaspace "first")
  };
  std::vector<Piece> items;
  std::deque<std::string> storage;
  std::string_view store(std::string s) { return storage.emplace_back(std::move(s)); }
};

// One step of a pre-tokenizer pipeline.
class PreTokenizerStep {
 public:
  virtual ~PreTokenizerStep() = default;
  virtual void apply(Pieces& pieces) const = 0;
};

std::unique_ptr<PreTokenizerStep> make_split_step(std::unique_ptr<PatternMatcher> matcher, SplitBehavior behavior,
                                                  bool invert);
// ByteLevel with use_regex: the GPT-2 pattern, isolated; add_prefix_space puts a space before each piece
// that does not start with one. (The byte-to-unicode mapping itself is done by the model input stage.)
std::unique_ptr<PreTokenizerStep> make_byte_level_step(bool add_prefix_space, bool use_regex);
enum class PrependScheme { always, first, never };
// Metaspace: spaces become `replacement`; the replacement is prepended (per the scheme) unless the piece
// already starts with it; with `split`, each piece is split before every replacement character.
std::unique_ptr<PreTokenizerStep> make_metaspace_step(std::string replacement, PrependScheme scheme, bool split);
// Digits: numbers (categories N*) isolated one by one, or as contiguous runs.
std::unique_ptr<PreTokenizerStep> make_digits_step(bool individual_digits);

}  // namespace tq
