#include "text/regex.h"

#include <utility>
#include <vector>

#include "core/error.h"
#include "text/unicode.h"

namespace tq {
namespace {

// One item of a character class.
struct ClassItem {
  enum Kind { range, category, not_category, space, not_space, digit, not_digit, word, not_word, hex, not_hex };
  Kind kind;
  char32_t lo = 0, hi = 0;  // range
  uint32_t mask = 0;        // category masks
};

bool is_word_char(char32_t c) {
  const uint32_t bit = unicode_category_bit(c);
  return (bit & (kCategoryLetter | kCategoryMark)) != 0 || bit == category_bit(UnicodeCategory::Nd) ||
         bit == category_bit(UnicodeCategory::Pc);
}
bool is_hex_char(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

bool item_matches(const ClassItem& it, char32_t c) {
  switch (it.kind) {
    case ClassItem::range: return c >= it.lo && c <= it.hi;
    case ClassItem::category: return (unicode_category_bit(c) & it.mask) != 0;
    case ClassItem::not_category: return (unicode_category_bit(c) & it.mask) == 0;
    case ClassItem::space: return is_unicode_whitespace(c);
    case ClassItem::not_space: return !is_unicode_whitespace(c);
    case ClassItem::digit: return unicode_category(c) == UnicodeCategory::Nd;
    case ClassItem::not_digit: return unicode_category(c) != UnicodeCategory::Nd;
    case ClassItem::word: return is_word_char(c);
    case ClassItem::not_word: return !is_word_char(c);
    case ClassItem::hex: return is_hex_char(c);
    case ClassItem::not_hex: return !is_hex_char(c);
  }
  return false;
}

struct CharClass {
  std::vector<ClassItem> items;
  bool negated = false;
  bool test(char32_t c) const {
    bool in = false;
    for (const ClassItem& it : items)
      if (item_matches(it, c)) {
        in = true;
        break;
      }
    return in != negated;
  }
  void add_range(char32_t lo, char32_t hi) { items.push_back({ClassItem::range, lo, hi, 0}); }
};

// Adds the characters that case-fold together with the range [lo, hi] (ASCII letters, U+017F, U+212A).
void add_case_variants(CharClass& cls, char32_t lo, char32_t hi) {
  for (char32_t c = lo; c <= hi && c < 0x80; ++c) {
    if (c >= 'a' && c <= 'z') cls.add_range(c - 32, c - 32);
    if (c >= 'A' && c <= 'Z') cls.add_range(c + 32, c + 32);
    if (c == 's' || c == 'S') cls.add_range(0x17F, 0x17F);
    if (c == 'k' || c == 'K') cls.add_range(0x212A, 0x212A);
  }
  if (lo <= 0x17F && 0x17F <= hi) cls.add_range('s', 's'), cls.add_range('S', 'S');
  if (lo <= 0x212A && 0x212A <= hi) cls.add_range('k', 'k'), cls.add_range('K', 'K');
}

}  // namespace

struct Regex::Node {
  enum Kind { chars, seq, alt, repeat, atomic, look_ahead, neg_look_ahead, line_start, line_end, text_start,
              text_end, text_end_newline };
  enum Greed { greedy, lazy, possessive };
  Kind kind;
  CharClass cls;                             // chars
  std::vector<std::unique_ptr<Node>> kids;   // seq, alt; repeat/atomic/look: one
  int min = 0, max = -1;                     // repeat; max -1 = unbounded
  Greed greed = greedy;
  explicit Node(Kind k) : kind(k) {}
};

namespace {

using Node = Regex::Node;

class Parser {
 public:
  explicit Parser(std::string_view pattern) : pattern_(pattern) {
    size_t i = 0;
    while (i < pattern.size()) {
      const Utf8Step s = decode_utf8_step(pattern.substr(i));
      TQ_CHECK(s.valid, "pre-tokenizer regex '", pattern_, "': ill-formed UTF-8");
      cps_.push_back(s.cp);
      i += s.bytes;
    }
  }

  std::unique_ptr<Node> parse() {
    bool ci = false;
    auto root = parse_alt(ci);
    if (pos_ < cps_.size()) fail_here("unbalanced ')'");
    return root;
  }

 private:
  [[noreturn]] void fail_here(const std::string& what) {
    tq::fail("pre-tokenizer regex '", pattern_, "': ", what, " at character ", pos_);
  }
  bool at_end() const { return pos_ >= cps_.size(); }
  char32_t peek(size_t ahead = 0) const { return pos_ + ahead < cps_.size() ? cps_[pos_ + ahead] : 0; }
  char32_t next() {
    if (at_end()) fail_here("unexpected end of pattern");
    return cps_[pos_++];
  }

  // `ci` is the case-insensitive flag of the enclosing group; (?i) inside changes it for the rest of it.
  std::unique_ptr<Node> parse_alt(bool& ci) {
    auto alt = std::make_unique<Node>(Node::alt);
    alt->kids.push_back(parse_seq(ci));
    while (!at_end() && peek() == '|') {
      ++pos_;
      alt->kids.push_back(parse_seq(ci));
    }
    if (alt->kids.size() == 1) return std::move(alt->kids[0]);
    return alt;
  }

  std::unique_ptr<Node> parse_seq(bool& ci) {
    auto seq = std::make_unique<Node>(Node::seq);
    while (!at_end() && peek() != '|' && peek() != ')') {
      auto atom = parse_atom(ci);
      if (!atom) continue;  // an inline flag group such as (?i)
      seq->kids.push_back(parse_quantifiers(std::move(atom)));
    }
    if (seq->kids.size() == 1) return std::move(seq->kids[0]);
    return seq;
  }

  std::unique_ptr<Node> parse_quantifiers(std::unique_ptr<Node> atom) {
    while (!at_end()) {
      int min, max;
      const size_t start = pos_;
      const char32_t c = peek();
      if (c == '*') {
        min = 0, max = -1, ++pos_;
      } else if (c == '+') {
        min = 1, max = -1, ++pos_;
      } else if (c == '?') {
        min = 0, max = 1, ++pos_;
      } else if (c == '{' && parse_interval(min, max)) {
        // parsed
      } else {
        break;
      }
      if (atom->kind == Node::line_start || atom->kind == Node::line_end || atom->kind == Node::text_start ||
          atom->kind == Node::text_end || atom->kind == Node::text_end_newline) {
        pos_ = start;
        fail_here("quantifier after an anchor");
      }
      auto rep = std::make_unique<Node>(Node::repeat);
      rep->min = min, rep->max = max;
      // Ruby syntax: ?, *, + may be followed by ? (lazy) or + (possessive); after {n,m} a '+' is a new
      // quantifier on the repetition, and only '?' makes it lazy.
      const bool interval = c == '{';
      if (!at_end() && peek() == '?') {
        rep->greed = Node::lazy, ++pos_;
      } else if (!interval && !at_end() && peek() == '+') {
        rep->greed = Node::possessive, ++pos_;
      }
      rep->kids.push_back(std::move(atom));
      atom = std::move(rep);
    }
    return atom;
  }

  // {n}, {n,}, {n,m}, {,m}. Returns false (and consumes nothing) when '{' is not an interval: then it is
  // a literal, as in Oniguruma.
  bool parse_interval(int& min, int& max) {
    size_t p = pos_ + 1;
    auto read_int = [&](int& v) {
      size_t start = p;
      long long x = 0;
      while (p < cps_.size() && cps_[p] >= '0' && cps_[p] <= '9') {
        x = x * 10 + (cps_[p] - '0');
        if (x > 100000) fail_here("repeat count too large");
        ++p;
      }
      v = static_cast<int>(x);
      return p > start;
    };
    int a = 0, b = -1;
    const bool has_a = read_int(a);
    if (p < cps_.size() && cps_[p] == '}') {
      if (!has_a) return false;
      min = max = a;
      pos_ = p + 1;
      return true;
    }
    if (p >= cps_.size() || cps_[p] != ',') return false;
    ++p;
    const bool has_b = read_int(b);
    if (p >= cps_.size() || cps_[p] != '}' || (!has_a && !has_b)) return false;
    if (has_b && b < a) fail_here("repeat range {n,m} with m < n");
    min = has_a ? a : 0;
    max = has_b ? b : -1;
    pos_ = p + 1;
    return true;
  }

  std::unique_ptr<Node> literal(char32_t c, bool ci) {
    auto n = std::make_unique<Node>(Node::chars);
    n->cls.add_range(c, c);
    if (ci) add_case_variants(n->cls, c, c);
    return n;
  }

  std::unique_ptr<Node> parse_atom(bool& ci) {
    const char32_t c = next();
    switch (c) {
      case '(': return parse_group(ci);
      case '[': {
        auto n = std::make_unique<Node>(Node::chars);
        parse_class(n->cls, ci);
        return n;
      }
      case '.': {
        auto n = std::make_unique<Node>(Node::chars);
        n->cls.add_range('\n', '\n');
        n->cls.negated = true;
        return n;
      }
      case '^': return std::make_unique<Node>(Node::line_start);
      case '$': return std::make_unique<Node>(Node::line_end);
      case '\\': {
        const char32_t e = peek();
        if (e == 'A') return ++pos_, std::make_unique<Node>(Node::text_start);
        if (e == 'z') return ++pos_, std::make_unique<Node>(Node::text_end);
        if (e == 'Z') return ++pos_, std::make_unique<Node>(Node::text_end_newline);
        auto n = std::make_unique<Node>(Node::chars);
        char32_t single;
        if (parse_escape(n->cls, single)) {
          n->cls.add_range(single, single);
          if (ci) add_case_variants(n->cls, single, single);
        }
        return n;
      }
      case '*':
      case '+':
      case '?':
        --pos_;
        fail_here("quantifier without anything to repeat");
      case ')': --pos_, fail_here("unbalanced ')'");
      default: return literal(c, ci);
    }
  }

  std::unique_ptr<Node> parse_group(bool& outer_ci) {
    bool ci = outer_ci;
    Node::Kind wrapper = Node::seq;  // seq = a plain (capturing or not) group
    if (peek() == '?') {
      ++pos_;
      const char32_t k = next();
      if (k == ':') {
      } else if (k == '=') {
        wrapper = Node::look_ahead;
      } else if (k == '!') {
        wrapper = Node::neg_look_ahead;
      } else if (k == '>') {
        wrapper = Node::atomic;
      } else if (k == 'i' || k == '-') {
        // (?i:..), (?-i:..), (?i), (?-i)
        bool on = k == 'i';
        if (k == '-') {
          if (next() != 'i') fail_here("unsupported group option");
        }
        const char32_t t = next();
        if (t == ')') {
          outer_ci = on;  // applies to the rest of the enclosing group
          return nullptr;
        }
        if (t != ':') fail_here("unsupported group option");
        ci = on;
      } else if (k == '<' && (peek() == '=' || peek() == '!')) {
        fail_here("lookbehind is not supported");
      } else {
        fail_here("unsupported group kind");
      }
    }
    auto body = parse_alt(ci);
    if (at_end() || next() != ')') fail_here("missing ')'");
    if (wrapper == Node::seq) return body;
    auto n = std::make_unique<Node>(wrapper);
    n->kids.push_back(std::move(body));
    return n;
  }

  // Parses \p{..}, \P{..}, \p{^..} after the 'p'/'P' letter. Adds the item to `cls`.
  void parse_property(CharClass& cls, bool negated) {
    std::string name;
    if (peek() == '{') {
      ++pos_;
      if (peek() == '^') negated = !negated, ++pos_;
      while (!at_end() && peek() != '}') {
        const char32_t c = next();
        if (c >= 0x80) fail_here("bad property name");
        name.push_back(static_cast<char>(c));
      }
      if (at_end()) fail_here("missing '}'");
      ++pos_;
    } else {
      const char32_t c = next();
      if (c >= 0x80) fail_here("bad property name");
      name.push_back(static_cast<char>(c));
    }
    const uint32_t mask = unicode_category_mask_by_name(name);
    if (mask == 0) fail_here("unknown property \\p{" + name + "}");
    cls.items.push_back({negated ? ClassItem::not_category : ClassItem::category, 0, 0, mask});
  }

  uint32_t parse_hex_digits(size_t min_digits, size_t max_digits) {
    uint32_t v = 0;
    size_t k = 0;
    while (k < max_digits && is_hex_char(peek()) && !at_end()) {
      const char32_t c = next();
      v = v * 16 + static_cast<uint32_t>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
      ++k;
    }
    if (k < min_digits) fail_here("bad hexadecimal escape");
    return v;
  }

  // After a backslash. Either adds class items to `cls` and returns false, or returns true with the single
  // character the escape stands for in `single`.
  bool parse_escape(CharClass& cls, char32_t& single) {
    const char32_t e = next();
    switch (e) {
      case 's': cls.items.push_back({ClassItem::space}); return false;
      case 'S': cls.items.push_back({ClassItem::not_space}); return false;
      case 'd': cls.items.push_back({ClassItem::digit}); return false;
      case 'D': cls.items.push_back({ClassItem::not_digit}); return false;
      case 'w': cls.items.push_back({ClassItem::word}); return false;
      case 'W': cls.items.push_back({ClassItem::not_word}); return false;
      case 'h': cls.items.push_back({ClassItem::hex}); return false;
      case 'H': cls.items.push_back({ClassItem::not_hex}); return false;
      case 'p': parse_property(cls, false); return false;
      case 'P': parse_property(cls, true); return false;
      case 'r': single = '\r'; return true;
      case 'n': single = '\n'; return true;
      case 't': single = '\t'; return true;
      case 'f': single = '\f'; return true;
      case 'v': single = '\v'; return true;
      case 'a': single = 0x07; return true;
      case 'e': single = 0x1B; return true;
      case '0': single = 0; return true;
      case 'x':
        if (peek() == '{') {
          ++pos_;
          single = parse_hex_digits(1, 8);
          if (next() != '}') fail_here("bad \\x{..} escape");
        } else {
          single = parse_hex_digits(1, 2);
        }
        return true;
      case 'u': single = parse_hex_digits(4, 4); return true;
      default:
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '1' && e <= '9')) {
          --pos_;
          fail_here(std::string("unsupported escape \\") + static_cast<char>(e));
        }
        single = e;  // escaped punctuation or any other character stands for itself
        return true;
    }
  }

  void parse_class(CharClass& cls, bool ci) {
    if (peek() == '^') cls.negated = true, ++pos_;
    bool first = true;
    while (true) {
      if (at_end()) fail_here("missing ']'");
      char32_t c = next();
      if (c == ']' && !first) break;
      first = false;
      if (c == '[') fail_here("nested character classes are not supported");
      char32_t lo;
      if (c == '\\') {
        if (!parse_escape(cls, lo)) continue;
      } else {
        lo = c;
      }
      char32_t hi = lo;
      if (peek() == '-' && peek(1) != ']' && pos_ + 1 < cps_.size()) {
        ++pos_;
        char32_t h = next();
        if (h == '\\') {
          CharClass scratch;
          if (!parse_escape(scratch, h)) fail_here("a class escape cannot end a range");
        }
        if (h < lo) fail_here("range out of order in a character class");
        hi = h;
      }
      cls.add_range(lo, hi);
      if (ci) add_case_variants(cls, lo, hi);
    }
  }

  std::string pattern_;
  std::vector<char32_t> cps_;
  size_t pos_ = 0;
};

// A non-owning reference to a continuation "the rest of the pattern, from position i".
class Cont {
 public:
  template <typename F>
  explicit Cont(const F& f) : ctx_(&f), fn_([](const void* c, size_t i) { return (*static_cast<const F*>(c))(i); }) {}
  bool operator()(size_t i) const { return fn_(ctx_, i); }

 private:
  const void* ctx_;
  bool (*fn_)(const void*, size_t);
};

class Matcher {
 public:
  Matcher(const char32_t* text, size_t n) : text_(text), n_(n) {}

  bool match(const Node* node, size_t i, const Cont& k) const {
    switch (node->kind) {
      case Node::chars: return i < n_ && node->cls.test(text_[i]) && k(i + 1);
      case Node::seq: return match_seq(node, 0, i, k);
      case Node::alt:
        for (const auto& kid : node->kids)
          if (match(kid.get(), i, k)) return true;
        return false;
      case Node::repeat:
        if (node->kids[0]->kind == Node::chars) return match_char_repeat(node, i, k);
        if (node->greed == Node::possessive) {
          size_t end = 0;
          auto accept = [&](size_t j) { return end = j, true; };
          if (!match_repeat(node, 0, i, Cont(accept))) return false;
          return k(end);
        }
        return match_repeat(node, 0, i, k);
      case Node::atomic: {
        size_t end = 0;
        auto accept = [&](size_t j) { return end = j, true; };
        if (!match(node->kids[0].get(), i, Cont(accept))) return false;
        return k(end);
      }
      case Node::look_ahead:
      case Node::neg_look_ahead: {
        auto accept = [](size_t) { return true; };
        const bool found = match(node->kids[0].get(), i, Cont(accept));
        return found == (node->kind == Node::look_ahead) && k(i);
      }
      case Node::line_start: return (i == 0 || text_[i - 1] == '\n') && k(i);
      case Node::line_end: return (i == n_ || text_[i] == '\n') && k(i);
      case Node::text_start: return i == 0 && k(i);
      case Node::text_end: return i == n_ && k(i);
      case Node::text_end_newline: return (i == n_ || (i + 1 == n_ && text_[i] == '\n')) && k(i);
    }
    return false;
  }

 private:
  bool match_seq(const Node* node, size_t index, size_t i, const Cont& k) const {
    if (index == node->kids.size()) return k(i);
    auto rest = [&](size_t j) { return match_seq(node, index + 1, j, k); };
    return match(node->kids[index].get(), i, Cont(rest));
  }

  // A repetition of a single character class needs no recursion per iteration: count the run, then try the
  // continuation at each allowed length in the order the quantifier prefers.
  bool match_char_repeat(const Node* node, size_t i, const Cont& k) const {
    const CharClass& cls = node->kids[0]->cls;
    const size_t limit = node->max < 0 ? n_ - i : std::min(n_ - i, static_cast<size_t>(node->max));
    size_t run = 0;
    while (run < limit && cls.test(text_[i + run])) ++run;
    const size_t min = static_cast<size_t>(node->min);
    if (run < min) return false;
    switch (node->greed) {
      case Node::greedy:
        for (size_t len = run + 1; len-- > min;)
          if (k(i + len)) return true;
        return false;
      case Node::lazy:
        for (size_t len = min; len <= run; ++len)
          if (k(i + len)) return true;
        return false;
      case Node::possessive: return k(i + run);
    }
    return false;
  }

  bool match_repeat(const Node* node, int count, size_t i, const Cont& k) const {
    const bool can_stop = count >= node->min;
    const bool can_go = node->max < 0 || count < node->max;
    auto again = [&](size_t j) {
      // An iteration that consumed nothing cannot make progress: only count it towards the minimum.
      if (j == i) return count + 1 >= node->min ? k(j) : match_repeat(node, count + 1, j, k);
      return match_repeat(node, count + 1, j, k);
    };
    if (node->greed == Node::lazy) {
      if (can_stop && k(i)) return true;
      return can_go && match(node->kids[0].get(), i, Cont(again));
    }
    if (can_go && match(node->kids[0].get(), i, Cont(again))) return true;
    return can_stop && k(i);
  }

  const char32_t* text_;
  size_t n_;
};

}  // namespace

Regex::Regex(std::string_view pattern) : pattern_(pattern) { root_ = Parser(pattern).parse(); }
Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

ptrdiff_t Regex::match_at(const char32_t* text, size_t n, size_t pos) const {
  Matcher m(text, n);
  ptrdiff_t end = -1;
  auto accept = [&](size_t j) { return end = static_cast<ptrdiff_t>(j), true; };
  if (!m.match(root_.get(), pos, Cont(accept))) return -1;
  return end - static_cast<ptrdiff_t>(pos);
}

}  // namespace tq
