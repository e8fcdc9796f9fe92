// Unicode facts the tokenizers need: UTF-8 decoding with the replacement rules of the standard, general
// categories (for the \p{..} classes of the pre-tokenizer patterns), Oniguruma's \s, and NFC normalization.
// The tables are generated from Python's unicodedata by tools/gen_unicode_tables.py (unicode_tables.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tq {

// Unicode general categories. Cn (unassigned) is 0; the order is the generator's CATEGORIES list.
enum class UnicodeCategory : uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps, Pe,
  Pi, Pf, Po, Sm, Sc, Sk, So, Zs, Zl, Zp, Cc, Cf, Cs, Co,
  kCount
};

// One bit per category, so that a class such as \p{L} or [\p{Ll}\p{M}] is a single mask test.
constexpr uint32_t category_bit(UnicodeCategory c) { return 1u << static_cast<unsigned>(c); }
constexpr uint32_t kCategoryLetter = category_bit(UnicodeCategory::Lu) | category_bit(UnicodeCategory::Ll) |
                                     category_bit(UnicodeCategory::Lt) | category_bit(UnicodeCategory::Lm) |
                                     category_bit(UnicodeCategory::Lo);
constexpr uint32_t kCategoryMark = category_bit(UnicodeCategory::Mn) | category_bit(UnicodeCategory::Mc) |
                                   category_bit(UnicodeCategory::Me);
constexpr uint32_t kCategoryNumber = category_bit(UnicodeCategory::Nd) | category_bit(UnicodeCategory::Nl) |
                                     category_bit(UnicodeCategory::No);
constexpr uint32_t kCategoryPunctuation =
    category_bit(UnicodeCategory::Pc) | category_bit(UnicodeCategory::Pd) | category_bit(UnicodeCategory::Ps) |
    category_bit(UnicodeCategory::Pe) | category_bit(UnicodeCategory::Pi) | category_bit(UnicodeCategory::Pf) |
    category_bit(UnicodeCategory::Po);
constexpr uint32_t kCategorySymbol = category_bit(UnicodeCategory::Sm) | category_bit(UnicodeCategory::Sc) |
                                     category_bit(UnicodeCategory::Sk) | category_bit(UnicodeCategory::So);
constexpr uint32_t kCategorySeparator = category_bit(UnicodeCategory::Zs) | category_bit(UnicodeCategory::Zl) |
                                        category_bit(UnicodeCategory::Zp);
constexpr uint32_t kCategoryOther = category_bit(UnicodeCategory::Cn) | category_bit(UnicodeCategory::Cc) |
                                    category_bit(UnicodeCategory::Cf) | category_bit(UnicodeCategory::Cs) |
                                    category_bit(UnicodeCategory::Co);

UnicodeCategory unicode_category(char32_t cp);
inline uint32_t unicode_category_bit(char32_t cp) { return category_bit(unicode_category(cp)); }

// The mask of a property name as written in \p{..}: one or two letters ("L", "Lu", "N", "Zs", ...) or the
// long forms "Letter", "Mark", "Number", "Punctuation", "Symbol", "Separator", "Other". 0 when unknown.
uint32_t unicode_category_mask_by_name(std::string_view name);
// The two-letter name of a category ("Lu").
const char* unicode_category_name(UnicodeCategory c);

// Oniguruma's \s for Unicode strings: U+0009..U+000D, U+0085 and the categories Zs, Zl, Zp.
bool is_unicode_whitespace(char32_t cp);

// Canonical combining class (0 for starters).
uint8_t canonical_combining_class(char32_t cp);

// The Unicode version of the tables ("14.0.0").
const char* unicode_tables_version();

// ------------------------------------------------------------------------------------------------ UTF-8

constexpr char32_t kReplacementChar = 0xFFFD;

// One step of UTF-8 decoding at the start of `s`.
struct Utf8Step {
  char32_t cp;     // the code point, or kReplacementChar when !valid
  uint32_t bytes;  // bytes consumed: the sequence, or the maximal ill-formed subpart (at least 1)
  bool valid;
  bool truncated;  // !valid only because `s` ends inside a sequence that could still be completed
};
Utf8Step decode_utf8_step(std::string_view s);

void append_utf8(std::string& out, char32_t cp);
// Length of the UTF-8 sequence a lead byte announces (1 for ASCII and for bytes that cannot lead).
inline uint32_t utf8_sequence_length(unsigned char lead) {
  return lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : lead < 0xF8 ? 4 : 1;
}

bool is_valid_utf8(std::string_view s);
// Replaces every maximal ill-formed subpart with U+FFFD (the "substitution of maximal subparts" of the
// Unicode standard, chapter 3, which Rust's from_utf8_lossy and WHATWG decoders also use).
std::string to_valid_utf8(std::string_view s);

// ------------------------------------------------------------------------------------------------ NFC

// Canonical composition (Unicode Normalization Form C). Ill-formed UTF-8 is first replaced as above.
std::string nfc_normalize(std::string_view s);
// True when `s` is certainly in NFC already (the quick-check algorithm of UAX #15 answered "yes").
bool nfc_quick_check(std::string_view s);

// ------------------------------------------------------------------------------------------------ tables
namespace unicode_data {
struct CodePointRange {
  uint32_t first;  // the value holds from here to the next range's first
  uint8_t value;
};
struct Decomposition {
  uint32_t cp, first, second;  // second == 0: a singleton
};
struct Composition {
  uint32_t first, second, composite;
};
extern const char* const kUnicodeVersion;
extern const CodePointRange kCategoryRanges[];
extern const size_t kCategoryRangeCount;
extern const CodePointRange kCombiningClassRanges[];
extern const size_t kCombiningClassRangeCount;
extern const CodePointRange kNfcQuickCheckRanges[];
extern const size_t kNfcQuickCheckRangeCount;
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionCount;
extern const Composition kCompositions[];
extern const size_t kCompositionCount;
}  // namespace unicode_data

}  // namespace tq
