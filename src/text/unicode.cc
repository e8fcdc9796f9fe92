#include "text/unicode.h"

#include <algorithm>
#include <array>
#include <vector>

namespace tq {
namespace {

using unicode_data::CodePointRange;

static_assert(static_cast<int>(UnicodeCategory::kCount) == 30, "the generator's CATEGORIES list has 30 entries");

// The value of the range holding cp: the last range whose first is <= cp (tables start at 0).
uint8_t range_lookup(const CodePointRange* ranges, size_t count, char32_t cp) {
  const CodePointRange* end = ranges + count;
  const CodePointRange* it =
      std::upper_bound(ranges, end, static_cast<uint32_t>(cp),
                       [](uint32_t value, const CodePointRange& r) { return value < r.first; });
  return (it - 1)->value;
}

// Most text the tokenizers see is in the first 2048 code points (Latin, Greek, Cyrillic, Hebrew, Arabic):
// those categories come from a direct table instead of a binary search.
constexpr char32_t kDirectCategoryLimit = 0x800;
const std::array<uint8_t, kDirectCategoryLimit>& direct_categories() {
  static const std::array<uint8_t, kDirectCategoryLimit> table = [] {
    std::array<uint8_t, kDirectCategoryLimit> t{};
    for (char32_t cp = 0; cp < kDirectCategoryLimit; ++cp)
      t[cp] = range_lookup(unicode_data::kCategoryRanges, unicode_data::kCategoryRangeCount, cp);
    return t;
  }();
  return table;
}

constexpr const char* kCategoryNames[] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                          "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                          "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};

bool is_continuation(unsigned char b) { return (b & 0xC0) == 0x80; }

// ------------------------------------------------------------------------------------------------ NFC
constexpr char32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161, kHangulTBase = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulNCount = kHangulVCount * kHangulTCount, kHangulSCount = kHangulLCount * kHangulNCount;

void decompose_into(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kHangulSBase && cp < kHangulSBase + kHangulSCount) {
    const char32_t s = cp - kHangulSBase;
    out.push_back(kHangulLBase + s / kHangulNCount);
    out.push_back(kHangulVBase + (s % kHangulNCount) / kHangulTCount);
    if (s % kHangulTCount != 0) out.push_back(kHangulTBase + s % kHangulTCount);
    return;
  }
  const auto* begin = unicode_data::kDecompositions;
  const auto* end = begin + unicode_data::kDecompositionCount;
  const auto* it = std::lower_bound(begin, end, static_cast<uint32_t>(cp),
                                    [](const unicode_data::Decomposition& d, uint32_t v) { return d.cp < v; });
  if (it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  // The table holds one level; the full decomposition recurses (at most a few levels deep).
  decompose_into(it->first, out);
  if (it->second != 0) decompose_into(it->second, out);
}

// The primary composite of (first, second), or 0.
char32_t compose_pair(char32_t first, char32_t second) {
  if (first >= kHangulLBase && first < kHangulLBase + kHangulLCount && second >= kHangulVBase &&
      second < kHangulVBase + kHangulVCount) {
    return kHangulSBase + ((first - kHangulLBase) * kHangulVCount + (second - kHangulVBase)) * kHangulTCount;
  }
  if (first >= kHangulSBase && first < kHangulSBase + kHangulSCount && (first - kHangulSBase) % kHangulTCount == 0 &&
      second > kHangulTBase && second < kHangulTBase + kHangulTCount) {
    return first + (second - kHangulTBase);
  }
  const auto* begin = unicode_data::kCompositions;
  const auto* end = begin + unicode_data::kCompositionCount;
  const auto* it = std::lower_bound(begin, end, std::pair<uint32_t, uint32_t>(first, second),
                                    [](const unicode_data::Composition& c, const std::pair<uint32_t, uint32_t>& v) {
                                      return c.first != v.first ? c.first < v.first : c.second < v.second;
                                    });
  if (it == end || it->first != first || it->second != second) return 0;
  return it->composite;
}

uint8_t nfc_quick_check_value(char32_t cp) {
  if (cp < 0x300) return 0;  // nothing below U+0300 is "maybe" or "no"
  return range_lookup(unicode_data::kNfcQuickCheckRanges, unicode_data::kNfcQuickCheckRangeCount, cp);
}

}  // namespace

UnicodeCategory unicode_category(char32_t cp) {
  if (cp < kDirectCategoryLimit) return static_cast<UnicodeCategory>(direct_categories()[cp]);
  if (cp > 0x10FFFF) return UnicodeCategory::Cn;
  return static_cast<UnicodeCategory>(
      range_lookup(unicode_data::kCategoryRanges, unicode_data::kCategoryRangeCount, cp));
}

const char* unicode_category_name(UnicodeCategory c) {
  const auto i = static_cast<size_t>(c);
  return i < std::size(kCategoryNames) ? kCategoryNames[i] : "??";
}

uint32_t unicode_category_mask_by_name(std::string_view name) {
  if (name == "L" || name == "Letter") return kCategoryLetter;
  if (name == "M" || name == "Mark") return kCategoryMark;
  if (name == "N" || name == "Number") return kCategoryNumber;
  if (name == "P" || name == "Punctuation") return kCategoryPunctuation;
  if (name == "S" || name == "Symbol") return kCategorySymbol;
  if (name == "Z" || name == "Separator") return kCategorySeparator;
  if (name == "C" || name == "Other") return kCategoryOther;
  for (size_t i = 0; i < std::size(kCategoryNames); ++i)
    if (name == kCategoryNames[i]) return 1u << i;
  return 0;
}

bool is_unicode_whitespace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  if (cp == 0x85) return true;
  return (unicode_category_bit(cp) & kCategorySeparator) != 0;
}

uint8_t canonical_combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  return range_lookup(unicode_data::kCombiningClassRanges, unicode_data::kCombiningClassRangeCount, cp);
}

const char* unicode_tables_version() { return unicode_data::kUnicodeVersion; }

Utf8Step decode_utf8_step(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const unsigned char b0 = p[0];
  if (b0 < 0x80) return {b0, 1, true, false};
  // Allowed range of the second byte; the others are always 80..BF (Unicode Table 3-7).
  unsigned char lo = 0x80, hi = 0xBF;
  uint32_t len;
  char32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2, cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3, cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4, cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {kReplacementChar, 1, false, false};
  }
  for (uint32_t k = 1; k < len; ++k) {
    if (k >= n) return {kReplacementChar, k, false, true};
    const unsigned char b = p[k];
    const bool ok = k == 1 ? (b >= lo && b <= hi) : is_continuation(b);
    if (!ok) return {kReplacementChar, k, false, false};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {cp, len, true, false};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = decode_utf8_step(s.substr(i));
    if (!step.valid) return false;
    i += step.bytes;
  }
  return true;
}

std::string to_valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      out.push_back(s[i++]);
      continue;
    }
    const Utf8Step step = decode_utf8_step(s.substr(i));
    if (step.valid)
      out.append(s.data() + i, step.bytes);
    else
      append_utf8(out, kReplacementChar);
    i += step.bytes;
  }
  return out;
}

bool nfc_quick_check(std::string_view s) {
  uint8_t last_ccc = 0;
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      last_ccc = 0;
      ++i;
      continue;
    }
    const Utf8Step step = decode_utf8_step(s.substr(i));
    if (!step.valid) return false;
    i += step.bytes;
    const uint8_t ccc = canonical_combining_class(step.cp);
    if (ccc != 0 && last_ccc > ccc) return false;
    if (nfc_quick_check_value(step.cp) != 0) return false;
    last_ccc = ccc;
  }
  return true;
}

std::string nfc_normalize(std::string_view s) {
  if (nfc_quick_check(s)) return std::string(s);
  // Full canonical decomposition. [code points of the decomposed text]
  std::vector<char32_t> cps;
  cps.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Step step = decode_utf8_step(s.substr(i));
    decompose_into(step.cp, cps);
    i += step.bytes;
  }
  // Canonical ordering: a stable sort of every run of non-starters by combining class.
  for (size_t a = 0; a < cps.size();) {
    if (canonical_combining_class(cps[a]) == 0) {
      ++a;
      continue;
    }
    size_t b = a;
    while (b < cps.size() && canonical_combining_class(cps[b]) != 0) ++b;
    std::stable_sort(cps.begin() + a, cps.begin() + b, [](char32_t x, char32_t y) {
      return canonical_combining_class(x) < canonical_combining_class(y);
    });
    a = b;
  }
  // Canonical composition: each character combines with the last starter unless something between them
  // blocks it (a starter, or a mark of the same or higher class).
  std::vector<char32_t> composed;  // [code points of the result]
  composed.reserve(cps.size());
  ptrdiff_t starter = -1;  // index in `composed` of the last starter, -1 before the first
  int last_ccc = 0;
  for (char32_t cp : cps) {
    const int ccc = canonical_combining_class(cp);
    if (starter >= 0) {
      const bool adjacent = static_cast<size_t>(starter) + 1 == composed.size();
      const bool blocked = !adjacent && (last_ccc == 0 || last_ccc >= ccc);
      if (!blocked) {
        const char32_t c = compose_pair(composed[static_cast<size_t>(starter)], cp);
        if (c != 0) {
          composed[static_cast<size_t>(starter)] = c;
          continue;
        }
      }
    }
    if (ccc == 0) starter = static_cast<ptrdiff_t>(composed.size());
    last_ccc = ccc;
    composed.push_back(cp);
  }
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : composed) append_utf8(out, cp);
  return out;
}

}  // namespace tq
