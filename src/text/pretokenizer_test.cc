#include "text/pretokenizer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "text/regex.h"
#include "text/unicode.h"

namespace tq {
namespace {

std::u32string cps_of(std::string_view s) {
  CodePointText t;
  t.assign(s);
  return std::u32string(t.cps.begin(), t.cps.end());
}

ptrdiff_t match(std::string_view pattern, std::string_view text, size_t pos = 0) {
  const Regex re(pattern);
  const std::u32string cps = cps_of(text);
  return re.match_at(cps.data(), cps.size(), pos);
}

std::vector<std::string> split(std::string_view text, const PatternMatcher& m,
                               SplitBehavior b = SplitBehavior::isolated, bool invert = false) {
  CodePointText t;
  t.assign(text);
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  split_by_pattern(t, m, b, invert, ranges);
  std::vector<std::string> out;
  for (auto [begin, end] : ranges) out.emplace_back(text.substr(begin, end - begin));
  return out;
}

std::vector<std::string> split_known(KnownPattern p, std::string_view text) {
  return split(text, *compile_pattern(known_pattern_text(p)));
}

using Strings = std::vector<std::string>;

// ------------------------------------------------------------------------------------------------ regex engine

TEST(Regex, AlternationIsLeftmostFirst) {
  EXPECT_EQ(match("a|ab", "ab"), 1);
  EXPECT_EQ(match("ab|a", "ab"), 2);
  EXPECT_EQ(match("(a|ab)(c|bcd)", "abcd"), 4);
  EXPECT_EQ(match("x|y", "z"), -1);
  EXPECT_EQ(match("a|", "b"), 0);  // an empty alternative matches the empty string
}

TEST(Regex, Quantifiers) {
  EXPECT_EQ(match("a+", "aaab"), 3);
  EXPECT_EQ(match("a+?", "aaab"), 1);
  EXPECT_EQ(match("a*?b", "aaab"), 4);
  EXPECT_EQ(match("a??a", "a"), 1);
  EXPECT_EQ(match("a*+a", "aaa"), -1);  // possessive: gives nothing back
  EXPECT_EQ(match("a*a", "aaa"), 3);
  EXPECT_EQ(match("(?:ab)+", "ababa"), 4);
  EXPECT_EQ(match("(?:a|ab)*c", "ababc"), 5);  // backtracks into the group repetition
  EXPECT_EQ(match("(?:ab)*+ab", "abab"), -1);
  EXPECT_EQ(match("\\p{N}{1,3}", "12345"), 3);
  EXPECT_EQ(match("a{2}", "aaa"), 2);
  EXPECT_EQ(match("a{2,}", "aaaa"), 4);
  EXPECT_EQ(match("a{,2}", "aaaa"), 2);
  EXPECT_EQ(match("a{2,3}?", "aaaa"), 2);
  EXPECT_EQ(match("a{x}", "a{x}"), 4);  // not an interval: literal braces, as in Oniguruma
  EXPECT_EQ(match("(?:a?){3}b", "ab"), 2);
  EXPECT_EQ(match("(?:)*x", "x"), 1);  // an empty loop body terminates
}

TEST(Regex, LookaheadAtomicAnchors) {
  EXPECT_EQ(match("\\s+(?!\\S)", "   x"), 2);
  EXPECT_EQ(match("\\s+(?!\\S)", "   "), 3);
  EXPECT_EQ(match("\\s+(?!\\S)", " x"), -1);
  EXPECT_EQ(match("a(?=b)", "ab"), 1);
  EXPECT_EQ(match("a(?=b)", "ac"), -1);
  EXPECT_EQ(match("(?>a+)a", "aaa"), -1);
  EXPECT_EQ(match("(?>a|ab)c", "abc"), -1);
  EXPECT_EQ(match("a$", "a\nb"), 1);  // $ is an end of line (Ruby syntax)
  EXPECT_EQ(match("a\\z", "a\nb"), -1);
  EXPECT_EQ(match("a\\Z", "a\n"), 1);
  EXPECT_EQ(match("^b", "a\nb", 2), 1);
  EXPECT_EQ(match("\\Ab", "a\nb", 2), -1);
}

TEST(Regex, ClassesAndProperties) {
  EXPECT_EQ(match("[^\\s\\p{L}\\p{N}]+", "!?( a"), 3);
  EXPECT_EQ(match("[a-c]+", "abcd"), 3);
  EXPECT_EQ(match("[\\-x]+", "-x-y"), 3);
  EXPECT_EQ(match("[]a]+", "]a]b"), 3);
  EXPECT_EQ(match("\\p{L}+", "na\u00efve!"), 5);
  EXPECT_EQ(match("\\P{L}+", "12ab"), 2);
  EXPECT_EQ(match("\\p{^L}+", "12ab"), 2);
  EXPECT_EQ(match("\\pN+", "\u0661\u0662x"), 2);  // Arabic-Indic digits
  EXPECT_EQ(match("[\\p{Lu}\\p{Lt}]+", "ABc"), 2);
  EXPECT_EQ(match("\\d+", "\u00b2"), -1);  // superscript two is No, not Nd
  EXPECT_EQ(match("\\w+", "a_1\u0301-"), 4);
  EXPECT_EQ(match("\\x41\\x{1F600}\\u00e9", "A\U0001F600\u00e9"), 3);
  EXPECT_EQ(match(".+", "ab\ncd"), 2);
  EXPECT_EQ(match("[\\r\\n]+", "\r\n\rx"), 3);
  EXPECT_EQ(match("\\s+", "\t\u3000\u2028x"), 3);
}

TEST(Regex, CaseInsensitive) {
  EXPECT_EQ(match("(?i:'s|'t)", "'S"), 2);
  EXPECT_EQ(match("(?i:'s)", "'\u017f"), 2);  // long s folds to s
  EXPECT_EQ(match("'s", "'S"), -1);
  EXPECT_EQ(match("(?i)ab", "AB"), 2);
  EXPECT_EQ(match("(?i:a)b", "AB"), -1);
  EXPECT_EQ(match("(?i:[a-c]+)", "AbC"), 3);
  EXPECT_EQ(match("(?i:k)", "\u212a"), 1);  // Kelvin sign
}

TEST(Regex, UnsupportedSyntaxIsAnError) {
  for (const char* bad : {"(?<=a)b", "\\bword", "[[:alpha:]]", "(abc", "abc)", "*a", "\\p{Foo}", "a{3,1}",
                          "\\1", "(?P<name>x)", "[abc", "x\\"}) {
    EXPECT_THROW(Regex{bad}, Error) << bad;
  }
  try {
    Regex r("(?<=a)b");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lookbehind"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(?<=a)b"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------------------------ known patterns

TEST(PreTokenizer, Gpt2Splits) {
  EXPECT_EQ(split_known(KnownPattern::gpt2, "Hello world"), (Strings{"Hello", " world"}));
  EXPECT_EQ(split_known(KnownPattern::gpt2, "I'm  here\n\nnow"), (Strings{"I", "'m", " ", " here", "\n", "\n", "now"}));
  EXPECT_EQ(split_known(KnownPattern::gpt2, "I'M"), (Strings{"I", "'", "M"}));
  EXPECT_EQ(split_known(KnownPattern::gpt2, "(hello) 12345 !?"), (Strings{"(", "hello", ")", " 12345", " !?"}));
  EXPECT_EQ(split_known(KnownPattern::gpt2, "end   "), (Strings{"end", "   "}));
  EXPECT_EQ(split_known(KnownPattern::gpt2, "\u65e5\u672c\u8a9e \U0001F916\U0001F680"),
            (Strings{"\u65e5\u672c\u8a9e", " \U0001F916\U0001F680"}));
}

TEST(PreTokenizer, Llama3AndQwen2Splits) {
  EXPECT_EQ(split_known(KnownPattern::llama3, "I'm  here\n\nnow"), (Strings{"I", "'m", " ", " here", "\n\n", "now"}));
  EXPECT_EQ(split_known(KnownPattern::llama3, "I'M"), (Strings{"I", "'M"}));
  EXPECT_EQ(split_known(KnownPattern::llama3, "(hello"), (Strings{"(hello"}));
  EXPECT_EQ(split_known(KnownPattern::llama3, "hello!!\n\nworld"), (Strings{"hello", "!!\n\n", "world"}));
  EXPECT_EQ(split_known(KnownPattern::llama3, "12345"), (Strings{"123", "45"}));
  EXPECT_EQ(split_known(KnownPattern::qwen2, "12345"), (Strings{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(split_known(KnownPattern::llama3, "  \n  x"), (Strings{"  \n", " ", " x"}));
  EXPECT_EQ(split_known(KnownPattern::llama3, "\tdef"), (Strings{"\tdef"}));
}

// The o200k pattern (GPT-4o, gpt-oss), split by the hand-written matcher and by the regex engine; every
// expectation below was worked out by hand from the pattern's alternatives (see O200kMatcher).
TEST(PreTokenizer, O200kSplits) {
  const auto fast = compile_pattern(known_pattern_text(KnownPattern::o200k));
  const auto slow = compile_regex_pattern(known_pattern_text(KnownPattern::o200k));
  ASSERT_TRUE(fast->is_fast());
  const std::vector<std::pair<std::string, Strings>> cases = {
      {"Hello World's 123456 abc/def\n\n", {"Hello", " World's", " ", "123", "456", " abc", "/def", "\n\n"}},
      // Case changes: lower-to-upper splits a word, an all-caps run keeps the lower-case letters after it.
      {"CamelCase HTTPServer", {"Camel", "Case", " HTTPServer"}},
      {"getHTTPResponseCode", {"get", "HTTPResponse", "Code"}},
      {"snake_case_name kebab-case", {"snake", "_case", "_name", " kebab", "-case"}},
      {"ABCdef's", {"ABCdef's"}},
      // Contractions join the word before them, in any case (?i:...), after lower- or upper-case words.
      {"I'm can't we'll they've she'd you're it's", {"I'm", " can't", " we'll", " they've", " she'd", " you're", " it's"}},
      {"I'M CAN'T WE'LL THEY'VE SHE'D YOU'RE IT'S", {"I'M", " CAN'T", " WE'LL", " THEY'VE", " SHE'D", " YOU'RE", " IT'S"}},
      {"don'T Don'Re we'lL we'Ve", {"don'T", " Don'Re", " we'lL", " we'Ve"}},
      {"it'\u017f", {"it'\u017f"}},  // long s folds to s
      {"(DON'T)", {"(DON'T", ")"}},
      {"rock'n'roll", {"rock", "'n", "'roll"}},
      {"'s 'S", {"'s", " '", "S"}},
      {"1990's", {"199", "0", "'s"}},
      {"o'clock O'Neil", {"o", "'clock", " O", "'Neil"}},
      // Numbers: runs of at most three, never joined to a space or letters.
      {"1234567", {"123", "456", "7"}},
      {"x1234 abc123def", {"x", "123", "4", " abc", "123", "def"}},
      {"3.14159", {"3", ".", "141", "59"}},
      {"$42.50 100%", {"$", "42", ".", "50", " ", "100", "%"}},
      {"\u0663\u0664\u0665\u0666", {"\u0663\u0664\u0665", "\u0666"}},  // Arabic-Indic digits (Nd)
      {"\u00bd\u00be\u2167", {"\u00bd\u00be\u2167"}},                    // No, No, Nl
      // Whitespace: the last space of a run goes to the next word; line breaks end a run.
      {"a  b", {"a", " ", " b"}},
      {"end   ", {"end", "   "}},
      {"\t\tx", {"\t", "\tx"}},
      {"\t!", {"\t", "!"}},
      {"a\n\nb", {"a", "\n\n", "b"}},
      {"a \n b", {"a", " \n", " b"}},
      {"x\r\n\r\ny", {"x", "\r\n\r\n", "y"}},
      {"  \n  x", {"  \n", " ", " x"}},
      {"\n x", {"\n", " x"}},
      {"a \n\n", {"a", " \n\n"}},
      {"   ", {"   "}},
      {"a\u00a0b c\u2028d", {"a", "\u00a0b", " c", "\u2028d"}},  // NBSP and LS are \s but may prefix a word
      // Punctuation takes the line breaks and slashes after it.
      {"hello!!\n\nworld", {"hello", "!!\n\n", "world"}},
      {"a/b/c path//to", {"a", "/b", "/c", " path", "//", "to"}},
      {"https://example.com/x?q=1", {"https", "://", "example", ".com", "/x", "?q", "=", "1"}},
      {" (hello (x", {" (", "hello", " (", "x"}},
      {"!!!???...,,,", {"!!!???...,,,"}},
      {"end.\n", {"end", ".\n"}},
      // Code.
      {"def f(x):\n    return x**2\n", {"def", " f", "(x", "):\n", "   ", " return", " x", "**", "2", "\n"}},
      {"for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
       {"for", " (", "int", " i", " =", " ", "0", ";", " i", " <", " n", ";", " ++", "i", ")", " {\n", "\tsum", " +=",
        " a", "[i", "];\n", "}"}},
      {"x = [1, 2]  // c\n", {"x", " =", " [", "1", ",", " ", "2", "]", " ", " //", " c", "\n"}},
      // Scripts without case: Lo is in both classes, so a run is one word.
      {"\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", {"\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8"}},
      {"\u4e2d\u6587\u6d4b\u8bd5\uff1a\u4f60\u597d\uff0c\u4e16\u754c\uff01",
       {"\u4e2d\u6587\u6d4b\u8bd5", "\uff1a\u4f60\u597d", "\uff0c\u4e16\u754c", "\uff01"}},
      {"\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", {"\ud55c\uad6d\uc5b4", " \ud14d\uc2a4\ud2b8"}},
      {"\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
       {"\u0645\u0631\u062d\u0628\u0627", " \u0628\u0627\u0644\u0639\u0627\u0644\u0645"}},
      // An upper-case letter after Lo: U*W+ gives back the letter (not in W), keeping only the Lo.
      {"\u65e5A", {"\u65e5", "A"}},
      {"A\u65e5", {"A\u65e5"}},
      // Accents, precomposed and combining; title case (Lt) and modifier letters (Lm).
      {"na\u00efve caf\u00e9 r\u00e9sum\u00e9", {"na\u00efve", " caf\u00e9", " r\u00e9sum\u00e9"}},
      {"cafe\u0301 x", {"cafe\u0301", " x"}},
      {"\u00c9COLE E\u0301COLE", {"\u00c9COLE", " E\u0301", "COLE"}},  // the mark is also in W: U*W+ stops after it
      {"\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u041f\u0420\u0418\u0412\u0415\u0422",
       {"\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", " \u041f\u0420\u0418\u0412\u0415\u0422"}},
      {"\u01c5emo \u02b0x", {"\u01c5emo", " \u02b0x"}},
      {" \u0301x !\u0301", {" \u0301x", " !\u0301"}},
      {"\u0915\u093e\u0903 \u0928\u092e\u0938\u094d\u0924\u0947", {"\u0915\u093e\u0903", " \u0928\u092e\u0938\u094d\u0924\u0947"}},
      // Emoji are symbols: a run of them (with ZWJ, skin tones, flags) is one piece.
      {"emoji \U0001F916\U0001F680\U0001F44D\U0001F3FD", {"emoji", " \U0001F916\U0001F680\U0001F44D\U0001F3FD"}},
      {"\U0001F468\u200d\U0001F469\u200d\U0001F467 and \U0001F1EB\U0001F1F7 flag",
       {"\U0001F468\u200d\U0001F469\u200d\U0001F467", " and", " \U0001F1EB\U0001F1F7", " flag"}},
      {"", {}},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_EQ(split(text, *fast), expected) << "fast matcher: " << text;
    EXPECT_EQ(split(text, *slow), expected) << "regex engine: " << text;
  }
}

TEST(PreTokenizer, GgufPreTokenizerNames) {
  EXPECT_EQ(gguf_pre_tokenizer_pattern("llama-bpe"), known_pattern_text(KnownPattern::llama3));
  EXPECT_EQ(gguf_pre_tokenizer_pattern("qwen2"), known_pattern_text(KnownPattern::qwen2));
  EXPECT_EQ(gguf_pre_tokenizer_pattern("gpt-2"), known_pattern_text(KnownPattern::gpt2));
  EXPECT_EQ(gguf_pre_tokenizer_pattern("gpt-4o"), known_pattern_text(KnownPattern::o200k));
  EXPECT_TRUE(gguf_pre_tokenizer_pattern("some-new-model").empty());
}

// The hand-written matchers against the regex engine on random text built from the characters the patterns
// care about: every class, the contraction letters in both cases, line breaks and other spaces.
TEST(PreTokenizer, FastMatchersAgreeWithRegexEngine) {
  const std::vector<char32_t> alphabet = {
      'a', 'b', 'Z', 's', 'S', 't', 'T', 'm', 'M', 'd', 'l', 'L', 'r', 'e', 'E', 'v', '\'', '\'', '\'', ' ', ' ',
      ' ', ' ', '\t', '\n', '\n', '\r', 0xA0, 0x3000, 0x2028, 0x85, '0', '9', 0xB2, 0x661, 0x2167, 0x65E5,
      0xE9, 0x301, '!', '.', ',', '(', '_', '-', 0x1F916, 0x17F, 0xFFFD, '\v', 0x1C,
      // for o200k's case classes: Lu, Lt, Lm, Lo, Mn, Mc, Me, upper/lower Greek, '/', an unassigned code point
      'A', 'Q', 0xC9, 0x1C5, 0x2B0, 0x4E2D, 0x93E, 0x903, 0x20DD, 0x395, 0x3BB, '/', '/', 0x378};
  SplitMix64 rng(1234);
  for (KnownPattern kp : {KnownPattern::gpt2, KnownPattern::llama3, KnownPattern::qwen2, KnownPattern::o200k}) {
    const auto fast = compile_pattern(known_pattern_text(kp));
    const auto slow = compile_regex_pattern(known_pattern_text(kp));
    ASSERT_TRUE(fast->is_fast());
    ASSERT_FALSE(slow->is_fast());
    for (int iter = 0; iter < 6000; ++iter) {
      std::string text;
      const int len = static_cast<int>(rng.next() % 24);
      for (int k = 0; k < len; ++k) append_utf8(text, alphabet[rng.next() % alphabet.size()]);
      const std::u32string cps = cps_of(text);
      for (size_t pos = 0; pos < cps.size(); ++pos) {
        ASSERT_EQ(fast->match_at(cps.data(), cps.size(), pos), slow->match_at(cps.data(), cps.size(), pos))
            << "pattern " << known_pattern_text(kp) << " text '" << text << "' position " << pos;
      }
      ASSERT_EQ(split(text, *fast), split(text, *slow)) << text;
    }
  }
}

// ------------------------------------------------------------------------------------------------ split steps

TEST(PreTokenizer, SplitBehaviorsFollowHuggingFace) {
  // The example of HF's SplitDelimiterBehavior documentation.
  const auto dash = literal_pattern("-");
  const std::string text = "the-final--countdown";
  EXPECT_EQ(split(text, *dash, SplitBehavior::removed), (Strings{"the", "final", "countdown"}));
  EXPECT_EQ(split(text, *dash, SplitBehavior::isolated), (Strings{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(split(text, *dash, SplitBehavior::merged_with_previous), (Strings{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(split(text, *dash, SplitBehavior::merged_with_next), (Strings{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(split(text, *dash, SplitBehavior::contiguous), (Strings{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(split(text, *dash, SplitBehavior::removed, true), (Strings{"-", "-", "-"}));
  // Zero-length matches split the text too.
  const auto empty_before_b = compile_regex_pattern("(?=b)");
  EXPECT_EQ(split("abab", *empty_before_b), (Strings{"a", "ba", "b"}));
}

Strings apply_step(const PreTokenizerStep& step, std::string_view text, bool at_start = true) {
  Pieces p;
  p.items.push_back({text, at_start});
  step.apply(p);
  Strings out;
  for (const auto& piece : p.items) out.emplace_back(piece.text);
  return out;
}

TEST(PreTokenizer, MetaspaceAndDigits) {
  const std::string m = "\u2581";
  const auto first = make_metaspace_step(m, PrependScheme::first, false);
  EXPECT_EQ(apply_step(*first, "Hello  world"), (Strings{m + "Hello" + m + m + "world"}));
  EXPECT_EQ(apply_step(*first, "Hello", false), (Strings{"Hello"}));
  EXPECT_EQ(apply_step(*first, " Hello"), (Strings{m + "Hello"}));  // no second replacement character
  const auto always_split = make_metaspace_step(m, PrependScheme::always, true);
  EXPECT_EQ(apply_step(*always_split, "Hello  world", false), (Strings{m + "Hello", m, m + "world"}));
  const auto never = make_metaspace_step(m, PrependScheme::never, false);
  EXPECT_EQ(apply_step(*never, "a b"), (Strings{"a" + m + "b"}));

  EXPECT_EQ(apply_step(*make_digits_step(true), "abc123d4"), (Strings{"abc", "1", "2", "3", "d", "4"}));
  EXPECT_EQ(apply_step(*make_digits_step(false), "abc123d4"), (Strings{"abc", "123", "d", "4"}));

  const auto byte_level = make_byte_level_step(true, true);
  EXPECT_EQ(apply_step(*byte_level, "Hello world"), (Strings{" Hello", " world"}));
}

}  // namespace
}  // namespace tq
