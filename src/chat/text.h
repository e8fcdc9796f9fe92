// Python string semantics on UTF-8 text: what str.strip(), str.upper(), repr() and json.dumps()
// do, so that templates render byte for byte as python3-jinja2 renders them.
//
// Python strings index by code point, so anything that counts or slices decodes to UTF-32 first.
// Invalid UTF-8 decodes to U+FFFD (Python itself never sees invalid text: the JSON and template
// readers reject it first); valid text round-trips exactly.
#pragma once

#include <string>
#include <string_view>

namespace tq::jinja::text {

std::u32string decode(std::string_view utf8);
std::string encode(std::u32string_view code_points);
void append_utf8(std::string& out, char32_t c);
size_t length(std::string_view utf8);  // in code points, as Python's len()

// Character classes as Python's str methods define them (str.isspace() and friends).
bool is_space(char32_t c);
bool is_linebreak(char32_t c);  // what str.splitlines() splits on
bool is_alpha(char32_t c);
bool is_digit(char32_t c);
bool is_alnum(char32_t c);
bool is_upper(char32_t c);
bool is_lower(char32_t c);
bool is_word(char32_t c);       // regex \w
bool is_printable(char32_t c);  // str.isprintable(): what repr() leaves unescaped
char32_t to_upper(char32_t c);
char32_t to_lower(char32_t c);

std::string upper(std::string_view s);
std::string lower(std::string_view s);

// Python's repr() of a str: picks the quote, escapes what is not printable.
std::string repr(std::string_view s);
// json.dumps() of a str (with ensure_ascii as given).
std::string json_quote(std::string_view s, bool ensure_ascii);
// Python's repr() of a float: the shortest text that reads back to the same double.
std::string float_repr(double x);

}  // namespace tq::jinja::text
