#include "chat/lexer.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "chat/errors.h"
#include "chat/text.h"

namespace tq::jinja {
namespace {

// Decodes the code point at s[pos] and reports its byte length (1 for invalid bytes).
char32_t code_point_at(const std::string& s, size_t pos, size_t* len) {
  const unsigned char b = static_cast<unsigned char>(s[pos]);
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  size_t n = (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 1;
  if (pos + n > s.size()) n = 1;
  const std::u32string cp = text::decode(std::string_view(s).substr(pos, n));
  if (cp.size() != 1) {
    *len = 1;
    return 0xFFFD;
  }
  *len = n;
  return cp[0];
}

// Skips Python whitespace (regex \s*) from pos.
size_t skip_space(const std::string& s, size_t pos) {
  while (pos < s.size()) {
    size_t len;
    if (!text::is_space(code_point_at(s, pos, &len))) break;
    pos += len;
  }
  return pos;
}

// The end of s[begin, end) once trailing Python whitespace is removed (str.rstrip()).
size_t rstrip_end(const std::string& s, size_t begin, size_t end) {
  size_t keep = begin;
  size_t pos = begin;
  while (pos < end) {
    size_t len;
    const char32_t c = code_point_at(s, pos, &len);
    pos += len;
    if (!text::is_space(c)) keep = pos;
  }
  return keep;
}

bool all_space(const std::string& s, size_t begin, size_t end) {
  return rstrip_end(s, begin, end) == begin;
}

bool starts_with(const std::string& s, size_t pos, std::string_view what) {
  return s.compare(pos, what.size(), what) == 0;
}

bool is_name_start(char32_t c) {
  return c == '_' || (c < 0x80 ? ((c | 32) >= 'a' && (c | 32) <= 'z') : text::is_alpha(c));
}
bool is_name_char(char32_t c) { return is_name_start(c) || (c < 0x80 ? (c >= '0' && c <= '9') : text::is_alnum(c)); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

class Lexer {
 public:
  explicit Lexer(const Source& source) : src_(source), s_(source.text()) {}

  std::vector<Token> run() {
    try {
      lex_all();
    } catch (const LexError& e) {
      tokens_.push_back(Token{TokenType::kError, e.message, 0, 0, e.offset});
    }
    tokens_.push_back(Token{TokenType::kEof, "", 0, 0, s_.size()});
    return std::move(tokens_);
  }

 private:
  void lex_all() {
    bool line_starting = true;  // did the previous match end with a newline?
    while (pos_ < s_.size()) {
      const size_t tag = find_tag_start(pos_);
      if (tag == std::string::npos) {
        emit_data(pos_, s_.size());
        pos_ = s_.size();
        break;
      }
      const char kind = s_[tag + 1];
      size_t after = tag + 2;
      char sign = 0;
      if (after < s_.size() && (s_[after] == '-' || s_[after] == '+')) sign = s_[after++];
      size_t raw_body = 0;
      const bool raw = kind == '%' && match_raw_begin(after, &raw_body);
      // Whitespace control on the text before the tag: '-' strips all of it; otherwise
      // lstrip_blocks removes the indentation before a block or comment tag that starts a line.
      size_t data_end = tag;
      if (sign == '-') {
        data_end = rstrip_end(s_, pos_, tag);
      } else if (sign != '+' && kind != '{') {
        const size_t nl = s_.rfind('\n', tag == 0 ? 0 : tag - 1);
        const size_t line_begin = (nl == std::string::npos || nl < pos_) ? pos_ : nl + 1;
        const bool newline_in_text = nl != std::string::npos && nl >= pos_ && tag > 0;
        if ((newline_in_text || line_starting) && line_begin < tag && all_space(s_, line_begin, tag))
          data_end = line_begin;
      }
      emit_data(pos_, data_end);
      if (kind == '#') {
        line_starting = lex_comment(tag, after);
      } else if (raw) {
        line_starting = lex_raw(tag, raw_body);
      } else {
        line_starting = lex_tag(tag, after, kind == '%');
      }
    }
  }

  // jinja2 lexes lazily, so a parse error before a bad token wins over it: a lexing error
  // becomes an error token that the parser raises when it reaches it.
  struct LexError {
    std::string message;
    size_t offset;
  };
  [[noreturn]] void fail(const std::string& message, size_t offset) const { throw LexError{message, offset}; }

  size_t find_tag_start(size_t from) const {
    for (size_t p = s_.find('{', from); p != std::string::npos; p = s_.find('{', p + 1)) {
      if (p + 1 < s_.size() && (s_[p + 1] == '{' || s_[p + 1] == '%' || s_[p + 1] == '#'))
        return p;
    }
    return std::string::npos;
  }

  void emit_data(size_t begin, size_t end) {
    if (end > begin) tokens_.push_back(Token{TokenType::kData, s_.substr(begin, end - begin), 0, 0, begin});
  }

  // {% raw %} or {%- raw -%}: on a match, *body is where the raw text starts.
  bool match_raw_begin(size_t pos, size_t* body) const {
    pos = skip_space(s_, pos);
    if (!starts_with(s_, pos, "raw")) return false;
    pos = skip_space(s_, pos + 3);
    if (starts_with(s_, pos, "-%}")) {
      *body = skip_space(s_, pos + 3);
      return true;
    }
    if (starts_with(s_, pos, "%}")) {
      *body = pos + 2;  // the raw start tag never trims a newline
      return true;
    }
    return false;
  }

  // The end of a block tag at pos: "+%}", "-%}" plus whitespace, or "%}" plus one newline
  // (trim_blocks). Returns the end offset or npos.
  size_t match_block_end(size_t pos) const {
    if (starts_with(s_, pos, "+%}")) return pos + 3;
    if (starts_with(s_, pos, "-%}")) return skip_space(s_, pos + 3);
    if (starts_with(s_, pos, "%}")) {
      pos += 2;
      if (pos < s_.size() && s_[pos] == '\n') ++pos;
      return pos;
    }
    return std::string::npos;
  }

  bool ends_with_newline(size_t end) const { return end > 0 && s_[end - 1] == '\n'; }

  bool lex_comment(size_t tag, size_t body) {
    for (size_t p = s_.find("#}", body); p != std::string::npos; p = s_.find("#}", p + 1)) {
      size_t end;
      if (p > body && s_[p - 1] == '-') {
        end = skip_space(s_, p + 2);
      } else if (p > body && s_[p - 1] == '+') {
        end = p + 2;
      } else {
        end = p + 2;
        if (end < s_.size() && s_[end] == '\n') ++end;
      }
      pos_ = end;
      return ends_with_newline(end);
    }
    fail("Missing end of comment tag", tag);
  }

  bool lex_raw(size_t tag, size_t body) {
    for (size_t p = s_.find("{%", body); p != std::string::npos; p = s_.find("{%", p + 1)) {
      size_t q = p + 2;
      char sign = 0;
      if (q < s_.size() && (s_[q] == '-' || s_[q] == '+')) sign = s_[q++];
      q = skip_space(s_, q);
      if (!starts_with(s_, q, "endraw")) continue;
      const size_t end = match_block_end(skip_space(s_, q + 6));
      if (end == std::string::npos) continue;
      size_t data_end = p;
      if (sign == '-') {
        data_end = rstrip_end(s_, body, p);
      } else if (sign != '+') {
        const size_t nl = s_.rfind('\n', p == 0 ? 0 : p - 1);
        const bool newline_in_text = nl != std::string::npos && nl >= body && p > 0;
        const size_t line_begin = newline_in_text ? nl + 1 : body;
        if ((newline_in_text || ends_with_newline(body)) && line_begin < p && all_space(s_, line_begin, p))
          data_end = line_begin;
      }
      emit_data(body, data_end);
      pos_ = end;
      return ends_with_newline(end);
    }
    fail("Missing end of raw directive", tag);
  }

  // Lexes the inside of {{ ... }} or {% ... %} and its end. Returns whether the end consumed a
  // trailing newline.
  bool lex_tag(size_t tag, size_t pos, bool block) {
    tokens_.push_back(Token{block ? TokenType::kBlockBegin : TokenType::kVariableBegin, "", 0, 0, tag});
    std::vector<char> balance;  // the closing brackets we are waiting for
    while (pos < s_.size()) {
      if (balance.empty()) {
        size_t end = std::string::npos;
        if (block) {
          end = match_block_end(pos);
        } else if (starts_with(s_, pos, "-}}")) {
          end = skip_space(s_, pos + 3);
        } else if (starts_with(s_, pos, "}}")) {
          end = pos + 2;
        }
        if (end != std::string::npos) {
          tokens_.push_back(Token{block ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", 0, 0, pos});
          pos_ = end;
          return ends_with_newline(end);
        }
      }
      size_t len;
      const char32_t c = code_point_at(s_, pos, &len);
      if (text::is_space(c)) {
        pos += len;
        continue;
      }
      if (is_digit(s_[pos])) {
        pos = lex_number(pos);
        continue;
      }
      if (is_name_start(c)) {
        size_t end = pos + len;
        while (end < s_.size()) {
          size_t l;
          if (!is_name_char(code_point_at(s_, end, &l))) break;
          end += l;
        }
        tokens_.push_back(Token{TokenType::kName, s_.substr(pos, end - pos), 0, 0, pos});
        pos = end;
        continue;
      }
      if (c == '\'' || c == '"') {
        pos = lex_string(pos);
        continue;
      }
      const size_t op_len = operator_length(pos);
      if (op_len == 0) {
        const std::string ch = s_.substr(pos, len);
        fail("unexpected char " + text::repr(ch) + " at " + std::to_string(text::length(std::string_view(s_).substr(0, pos))), pos);
      }
      const std::string op = s_.substr(pos, op_len);
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) fail("unexpected '" + op + "'", pos);
        if (balance.back() != op[0])
          fail("unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'", pos);
        balance.pop_back();
      }
      tokens_.push_back(Token{TokenType::kOperator, op, 0, 0, pos});
      pos += op_len;
    }
    pos_ = s_.size();  // the parser reports the missing end of the tag
    return false;
  }

  size_t operator_length(size_t pos) const {
    static const char* const kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : kTwo)
      if (starts_with(s_, pos, op)) return 2;
    static const std::string_view kOne = "+-/*%~[](){}><=.:|,;";
    return kOne.find(s_[pos]) != std::string_view::npos ? 1 : 0;
  }

  // Digits with optional '_' separators; returns the end of the run (pos itself if none).
  size_t digit_run(size_t pos, bool (*digit)(char)) const {
    size_t p = pos;
    if (p >= s_.size() || !digit(s_[p])) return pos;
    ++p;
    while (p < s_.size()) {
      if (digit(s_[p])) {
        ++p;
      } else if (s_[p] == '_' && p + 1 < s_.size() && digit(s_[p + 1])) {
        p += 2;
      } else {
        break;
      }
    }
    return p;
  }

  size_t lex_number(size_t pos) {
    auto strip = [](std::string t) {
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      return t;
    };
    // Floats first, as jinja2 tries them first: digits with a fraction and/or an exponent.
    const bool after_dot = pos > 0 && s_[pos - 1] == '.';
    const size_t int_end = digit_run(pos, [](char ch) { return is_digit(ch); });
    if (!after_dot) {
      size_t p = int_end;
      bool fraction = false;
      if (p < s_.size() && s_[p] == '.') {
        const size_t f = digit_run(p + 1, [](char ch) { return is_digit(ch); });
        if (f > p + 1) {
          fraction = true;
          p = f;
        }
      }
      size_t exp_end = p;
      if (p < s_.size() && (s_[p] == 'e' || s_[p] == 'E')) {
        size_t q = p + 1;
        if (q < s_.size() && (s_[q] == '+' || s_[q] == '-')) ++q;
        const size_t e = digit_run(q, [](char ch) { return is_digit(ch); });
        if (e > q) exp_end = e;
      }
      if (fraction || exp_end > p) {
        const std::string t = strip(s_.substr(pos, exp_end - pos));
        tokens_.push_back(Token{TokenType::kFloat, t, 0, std::strtod(t.c_str(), nullptr), pos});
        return exp_end;
      }
    }
    // Integers: 0b / 0o / 0x prefixes, decimal without leading zeros, or zeros.
    int base = 10;
    size_t digits_begin = pos;
    size_t end = int_end;
    if (s_[pos] == '0' && pos + 1 < s_.size()) {
      const char p = static_cast<char>(s_[pos + 1] | 32);
      auto run_prefixed = [&](bool (*digit)(char)) {
        // 0x_ff is allowed: an optional '_' before each digit.
        size_t q = pos + 2;
        size_t last = q;
        while (q < s_.size()) {
          size_t r = q;
          if (s_[r] == '_') ++r;
          if (r < s_.size() && digit(s_[r])) {
            q = r + 1;
            last = q;
          } else {
            break;
          }
        }
        return last;
      };
      size_t e = pos;
      if (p == 'b') base = 2, e = run_prefixed([](char ch) { return ch == '0' || ch == '1'; });
      if (p == 'o') base = 8, e = run_prefixed([](char ch) { return ch >= '0' && ch <= '7'; });
      if (p == 'x') {
        base = 16;
        e = run_prefixed([](char ch) {
          return is_digit(ch) || ((ch | 32) >= 'a' && (ch | 32) <= 'f');
        });
      }
      if (base != 10 && e > pos + 2) {
        digits_begin = pos + 2;
        end = e;
      } else {
        base = 10;
        // "0", "00", "0_0": a decimal zero; a following digit starts a new token, as in jinja2.
        end = pos + 1;
        while (end < s_.size()) {
          size_t r = end;
          if (s_[r] == '_') ++r;
          if (r < s_.size() && s_[r] == '0') end = r + 1;
          else break;
        }
      }
    }
    const std::string t = strip(s_.substr(digits_begin, end - digits_begin));
    errno = 0;
    char* parse_end = nullptr;
    const long long v = std::strtoll(t.c_str(), &parse_end, base);
    if (errno == ERANGE) fail("integer literal " + s_.substr(pos, end - pos) + " is too large", pos);
    tokens_.push_back(Token{TokenType::kInteger, s_.substr(pos, end - pos), v, 0, pos});
    return end;
  }

  static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    c = static_cast<char>(c | 32);
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  // A quoted string, unescaped as Python's "unicode-escape" codec does (what jinja2 uses).
  size_t lex_string(size_t pos) {
    const char quote = s_[pos];
    size_t p = pos + 1;
    while (p < s_.size() && s_[p] != quote) p += (s_[p] == '\\' && p + 1 < s_.size()) ? 2 : 1;
    if (p >= s_.size()) fail(std::string("unexpected char ") + (quote == '\'' ? "\"'\"" : "'\"'") + " at " + std::to_string(text::length(std::string_view(s_).substr(0, pos))), pos);
    const size_t end = p + 1;
    std::string out;
    for (size_t i = pos + 1; i < p;) {
      if (s_[i] != '\\') {
        out.push_back(s_[i++]);
        continue;
      }
      const size_t esc = i;
      if (i + 1 >= p) fail("\\ at end of string", esc);
      const char c = s_[i + 1];
      i += 2;
      switch (c) {
        case '\n': break;  // line continuation
        case '\\': out.push_back('\\'); break;
        case '\'': out.push_back('\''); break;
        case '"': out.push_back('"'); break;
        case 'a': out.push_back('\a'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'v': out.push_back('\v'); break;
        case 'x': case 'u': case 'U': {
          const int digits = c == 'x' ? 2 : c == 'u' ? 4 : 8;
          uint32_t v = 0;
          for (int k = 0; k < digits; ++k) {
            const int h = i + k < p ? hex_value(s_[i + k]) : -1;
            if (h < 0) {
              const char* what = c == 'x' ? "truncated \\xXX escape" : c == 'u' ? "truncated \\uXXXX escape" : "truncated \\UXXXXXXXX escape";
              fail(what, esc);
            }
            v = v * 16 + static_cast<uint32_t>(h);
          }
          i += static_cast<size_t>(digits);
          if (v > 0x10FFFF) fail("illegal Unicode character", esc);
          text::append_utf8(out, v);
          break;
        }
        case 'N':
          fail("\\N{...} escapes are not supported", esc);
        default:
          if (c >= '0' && c <= '7') {
            uint32_t v = static_cast<uint32_t>(c - '0');
            for (int k = 0; k < 2 && i < p && s_[i] >= '0' && s_[i] <= '7'; ++k) v = v * 8 + static_cast<uint32_t>(s_[i++] - '0');
            text::append_utf8(out, v);
          } else if (static_cast<unsigned char>(c) >= 0x80) {
            // Python first turns the non-ASCII character into its own \x/\u escape, so the
            // backslash before it escapes that escape's backslash.
            size_t len;
            const char32_t cp = code_point_at(s_, i - 1, &len);
            i = i - 1 + len;
            char buf[16];
            if (cp <= 0xFF) std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(cp));
            else if (cp <= 0xFFFF) std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
            else std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(cp));
            out += buf;
          } else {
            out.push_back('\\');  // unknown escapes stay as written
            out.push_back(c);
          }
      }
    }
    tokens_.push_back(Token{TokenType::kString, std::move(out), 0, 0, pos});
    return end;
  }

  const Source& src_;
  const std::string& s_;
  size_t pos_ = 0;
  std::vector<Token> tokens_;
};

}  // namespace

Source::Source(std::string_view raw) {
  // jinja2 normalizes \r\n and \r to \n, then drops one trailing newline.
  text_.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == '\r') {
      text_.push_back('\n');
      if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
    } else {
      text_.push_back(raw[i]);
    }
  }
  if (!text_.empty() && text_.back() == '\n') text_.pop_back();
  line_starts_.push_back(0);
  for (size_t i = 0; i < text_.size(); ++i)
    if (text_[i] == '\n') line_starts_.push_back(i + 1);
}

int Source::line_of(size_t offset) const {
  const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
  return static_cast<int>(it - line_starts_.begin());
}

int Source::column_of(size_t offset) const {
  const size_t start = line_starts_[static_cast<size_t>(line_of(offset) - 1)];
  offset = std::min(offset, text_.size());
  return static_cast<int>(text::length(std::string_view(text_).substr(start, offset - start))) + 1;
}

std::vector<Token> tokenize(const Source& source) { return Lexer(source).run(); }

}  // namespace tq::jinja
