#include "text/unicode.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/rng.h"

namespace tq {
namespace {

std::string fixture_path(const std::string& name) { return std::string(TQ_SOURCE_DIR) + "/tests/fixtures/text/" + name; }

nlohmann::json load_fixture(const std::string& name) {
  std::ifstream f(fixture_path(name));
  EXPECT_TRUE(f.good()) << "missing fixture " << fixture_path(name);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::string utf8(std::u32string_view cps) {
  std::string s;
  for (char32_t c : cps) append_utf8(s, c);
  return s;
}

TEST(Unicode, CategoriesMatchPythonUnicodedata) {
  // Reference values written by tools/gen_unicode_tables.py from the same unicodedata as the tables, for a
  // spread of code points including both sides of many range boundaries.
  const nlohmann::json cases = load_fixture("unicode_cases.json");
  EXPECT_EQ(cases["unicode_version"].get<std::string>(), unicode_tables_version());
  int checked = 0;
  for (const auto& c : cases["categories"]) {
    const auto cp = c[0].get<uint32_t>();
    EXPECT_EQ(unicode_category_name(unicode_category(cp)), c[1].get<std::string>()) << "U+" << std::hex << cp;
    ++checked;
  }
  EXPECT_GT(checked, 500);
}

TEST(Unicode, KnownCategoriesAndMasks) {
  EXPECT_EQ(unicode_category('A'), UnicodeCategory::Lu);
  EXPECT_EQ(unicode_category('z'), UnicodeCategory::Ll);
  EXPECT_EQ(unicode_category('7'), UnicodeCategory::Nd);
  EXPECT_EQ(unicode_category(0x00B2), UnicodeCategory::No);  // superscript two
  EXPECT_EQ(unicode_category(0x65E5), UnicodeCategory::Lo);  // 日
  EXPECT_EQ(unicode_category(0x0301), UnicodeCategory::Mn);
  EXPECT_EQ(unicode_category(0x1F916), UnicodeCategory::So);  // 🤖
  EXPECT_EQ(unicode_category(0x1F3FD), UnicodeCategory::Sk);  // skin tone modifier
  EXPECT_EQ(unicode_category(0x10FFFF), UnicodeCategory::Cn);
  EXPECT_EQ(unicode_category(0x110000), UnicodeCategory::Cn);
  EXPECT_EQ(unicode_category_mask_by_name("L"), kCategoryLetter);
  EXPECT_EQ(unicode_category_mask_by_name("Number"), kCategoryNumber);
  EXPECT_EQ(unicode_category_mask_by_name("Lu"), category_bit(UnicodeCategory::Lu));
  EXPECT_EQ(unicode_category_mask_by_name("Xx"), 0u);
}

TEST(Unicode, WhitespaceIsOnigurumaSpace) {
  const char32_t spaces[] = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x200A,
                             0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
  for (char32_t c : spaces) EXPECT_TRUE(is_unicode_whitespace(c)) << std::hex << static_cast<uint32_t>(c);
  // Zero-width space and BOM are Cf, not whitespace; U+001C..1F are not \s in Oniguruma either.
  for (char32_t c : {U'a', U'\0', char32_t(0x1C), char32_t(0x200B), char32_t(0xFEFF), char32_t(0x180E)})
    EXPECT_FALSE(is_unicode_whitespace(c)) << std::hex << static_cast<uint32_t>(c);
}

TEST(Unicode, Utf8RoundTripsEveryScalarValue) {
  std::string s;
  for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    s.clear();
    append_utf8(s, cp);
    const Utf8Step step = decode_utf8_step(s);
    ASSERT_TRUE(step.valid) << std::hex << static_cast<uint32_t>(cp);
    ASSERT_EQ(step.cp, cp);
    ASSERT_EQ(step.bytes, s.size());
    ASSERT_EQ(step.bytes, utf8_sequence_length(static_cast<unsigned char>(s[0])));
  }
}

TEST(Unicode, IllFormedUtf8IsReplacedByMaximalSubparts) {
  // The example of the Unicode standard (chapter 3, "U+FFFD Substitution of Maximal Subparts").
  const std::string in = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  EXPECT_EQ(to_valid_utf8(in), "a\uFFFD\uFFFD\uFFFDb\uFFFDc\uFFFD\uFFFDd");
  EXPECT_FALSE(is_valid_utf8(in));
  // Surrogates, overlong forms and code points above U+10FFFF: every byte is its own subpart.
  EXPECT_EQ(to_valid_utf8("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");
  EXPECT_EQ(to_valid_utf8("\xC0\xAF"), "\uFFFD\uFFFD");
  EXPECT_EQ(to_valid_utf8("\xF4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");
  EXPECT_EQ(to_valid_utf8("\xFF"), "\uFFFD");
  // A character cut short by the end of the input is one subpart, and flagged as truncated.
  const Utf8Step cut = decode_utf8_step("\xF0\x9F\xA4");
  EXPECT_FALSE(cut.valid);
  EXPECT_TRUE(cut.truncated);
  EXPECT_EQ(cut.bytes, 3u);
  EXPECT_FALSE(decode_utf8_step("\xF0\x9F\x41").truncated);  // cut by a non-continuation: not truncated
  EXPECT_EQ(to_valid_utf8("ok \xF0\x9F\xA4"), "ok \uFFFD");
  EXPECT_TRUE(is_valid_utf8("na\xC3\xAFve \xF0\x9F\xA4\x96"));
}

TEST(Unicode, NfcMatchesPythonUnicodedata) {
  const nlohmann::json cases = load_fixture("unicode_cases.json");
  int checked = 0;
  for (const auto& c : cases["nfc"]) {
    const std::string in = c[0].get<std::string>(), expected = c[1].get<std::string>();
    EXPECT_EQ(nfc_normalize(in), expected) << in;
    EXPECT_EQ(nfc_normalize(expected), expected) << "NFC is idempotent: " << expected;
    ++checked;
  }
  EXPECT_GT(checked, 400);
}

TEST(Unicode, NfcHandWrittenCases) {
  EXPECT_EQ(nfc_normalize("cafe\u0301"), "caf\u00e9");
  EXPECT_EQ(nfc_normalize("\u1100\u1161\u11a8"), "\uac01");  // Hangul L V T
  EXPECT_EQ(nfc_normalize("\u212b"), "\u00c5");               // Angstrom sign is a singleton
  EXPECT_EQ(nfc_normalize("a\u0301\u0316"), "\u00e1\u0316");  // reordered, then composed
  EXPECT_EQ(nfc_normalize("plain ascii"), "plain ascii");
  EXPECT_TRUE(nfc_quick_check("na\u00efve caf\u00e9 \u65e5\u672c"));
  EXPECT_FALSE(nfc_quick_check("cafe\u0301"));
}

TEST(Unicode, NfcIsIdempotentOnRandomMarkSoup) {
  // Random strings of letters, combining marks of several classes, Hangul jamo and syllables, and
  // composition exclusions: NFC(NFC(x)) == NFC(x), the output passes no "no" quick-check character, and
  // the marks after each starter are in canonical order.
  const std::vector<char32_t> alphabet = {'a', 'e', 'o', 'A', 'K', 0x0300, 0x0301, 0x0308, 0x0316, 0x0323, 0x0327,
                                          0x0344, 0x0958, 0x1100, 0x1161, 0x11A8, 0xAC00, 0x212B, 0x05B0, 0x05B8,
                                          0x0B47, 0x0B3E, 0x30AB, 0x3099, 0x00C5, 0x1E0B, 0x0307};
  SplitMix64 rng(7);
  for (int iter = 0; iter < 3000; ++iter) {
    std::u32string cps;
    const int len = 1 + static_cast<int>(rng.next() % 8);
    for (int k = 0; k < len; ++k) cps.push_back(alphabet[rng.next() % alphabet.size()]);
    const std::string once = nfc_normalize(utf8(cps));
    ASSERT_EQ(nfc_normalize(once), once) << "iteration " << iter;
    int last_ccc = 0;
    size_t i = 0;
    while (i < once.size()) {
      const Utf8Step s = decode_utf8_step(std::string_view(once).substr(i));
      const int ccc = canonical_combining_class(s.cp);
      if (ccc != 0) {
        ASSERT_GE(ccc, last_ccc) << "marks out of order after NFC, iteration " << iter;
      }
      last_ccc = ccc;
      i += s.bytes;
    }
  }
}

}  // namespace
}  // namespace tq
