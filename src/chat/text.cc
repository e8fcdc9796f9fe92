#include "chat/text.h"

#include <locale.h>
#include <wctype.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <system_error>

namespace tq::jinja::text {
namespace {

// glibc's C.UTF-8 locale carries the Unicode character classes and simple case mappings.
// Without it (a stripped system) we fall back to ASCII rules rather than fail.
locale_t unicode_locale() {
  static const locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  return loc;
}

bool ascii_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool ascii_digit(char32_t c) { return c >= '0' && c <= '9'; }

// Code points Python's repr() escapes although a C library may call them printable: every space
// separator but U+0020 (Zs), the line and paragraph separators (Zl, Zp) and format characters (Cf).
bool python_unprintable_extra(char32_t c) {
  if (c == 0xA0 || c == 0xAD || c == 0x1680 || c == 0x180E || c == 0x2028 || c == 0x2029 ||
      c == 0x202F || c == 0x205F || c == 0x3000 || c == 0xFEFF || c == 0x061C || c == 0x06DD ||
      c == 0x070F || c == 0x08E2 || c == 0x110BD || c == 0x110CD || c == 0xE0001)
    return true;
  if (c >= 0x2000 && c <= 0x200F) return true;  // spaces, zero-width chars, direction marks
  if (c >= 0x202A && c <= 0x202E) return true;
  if (c >= 0x2060 && c <= 0x206F) return true;
  if (c >= 0x0600 && c <= 0x0605) return true;
  if (c >= 0xFFF9 && c <= 0xFFFB) return true;
  if (c >= 0x13430 && c <= 0x1343F) return true;
  if (c >= 0x1BCA0 && c <= 0x1BCA3) return true;
  if (c >= 0x1D173 && c <= 0x1D17A) return true;
  if (c >= 0xE0020 && c <= 0xE007F) return true;
  if (c >= 0xD800 && c <= 0xDFFF) return true;    // surrogates (Cs)
  if (c >= 0xE000 && c <= 0xF8FF) return true;    // private use (Co)
  if (c >= 0xF0000) return true;                  // private use planes 15 and 16
  return false;
}

}  // namespace

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const unsigned char b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      out.push_back(b0);
      ++i;
      continue;
    }
    int extra = 0;
    char32_t cp = 0;
    char32_t min_cp = 0;
    if ((b0 & 0xE0) == 0xC0) {
      extra = 1, cp = b0 & 0x1F, min_cp = 0x80;
    } else if ((b0 & 0xF0) == 0xE0) {
      extra = 2, cp = b0 & 0x0F, min_cp = 0x800;
    } else if ((b0 & 0xF8) == 0xF0) {
      extra = 3, cp = b0 & 0x07, min_cp = 0x10000;
    } else {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    bool ok = i + static_cast<size_t>(extra) < n;  // all continuation bytes present
    for (int k = 1; ok && k <= extra; ++k) {
      const unsigned char b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) ok = false;
      else cp = (cp << 6) | (b & 0x3F);
    }
    if (!ok || cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += 1 + extra;
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string encode(std::u32string_view cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t c : cps) append_utf8(out, c);
  return out;
}

size_t length(std::string_view s) {
  // Equal to decode(s).size() for any input, without building the UTF-32 copy for ASCII.
  bool ascii = true;
  for (char ch : s) {
    if (static_cast<unsigned char>(ch) >= 0x80) {
      ascii = false;
      break;
    }
  }
  return ascii ? s.size() : decode(s).size();
}

bool is_space(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D:
    case 0x1C: case 0x1D: case 0x1E: case 0x1F: case 0x20:
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029:
    case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_linebreak(char32_t c) {
  switch (c) {
    case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x1C: case 0x1D: case 0x1E:
    case 0x85: case 0x2028: case 0x2029:
      return true;
    default:
      return false;
  }
}

bool is_alpha(char32_t c) {
  if (c < 0x80) return ascii_alpha(c);
  locale_t loc = unicode_locale();
  return loc != nullptr && iswalpha_l(static_cast<wint_t>(c), loc);
}

bool is_digit(char32_t c) {
  if (c < 0x80) return ascii_digit(c);
  // Non-ASCII digits (Arabic-Indic, fullwidth, ...): alphanumeric but not alphabetic.
  locale_t loc = unicode_locale();
  return loc != nullptr && iswalnum_l(static_cast<wint_t>(c), loc) &&
         !iswalpha_l(static_cast<wint_t>(c), loc);
}

bool is_alnum(char32_t c) { return is_alpha(c) || is_digit(c); }

bool is_upper(char32_t c) {
  if (c < 0x80) return c >= 'A' && c <= 'Z';
  locale_t loc = unicode_locale();
  return loc != nullptr && iswupper_l(static_cast<wint_t>(c), loc);
}

bool is_lower(char32_t c) {
  if (c < 0x80) return c >= 'a' && c <= 'z';
  locale_t loc = unicode_locale();
  return loc != nullptr && iswlower_l(static_cast<wint_t>(c), loc);
}

bool is_word(char32_t c) { return c == '_' || is_alnum(c); }

bool is_printable(char32_t c) {
  if (c < 0x80) return c >= 0x20 && c < 0x7F;
  if (c < 0xA0) return false;
  if (python_unprintable_extra(c)) return false;
  locale_t loc = unicode_locale();
  return loc == nullptr || iswprint_l(static_cast<wint_t>(c), loc);
}

char32_t to_upper(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  locale_t loc = unicode_locale();
  return loc ? static_cast<char32_t>(towupper_l(static_cast<wint_t>(c), loc)) : c;
}

char32_t to_lower(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  locale_t loc = unicode_locale();
  return loc ? static_cast<char32_t>(towlower_l(static_cast<wint_t>(c), loc)) : c;
}

std::string upper(std::string_view s) {
  std::u32string cps = decode(s);
  for (char32_t& c : cps) c = to_upper(c);
  return encode(cps);
}

std::string lower(std::string_view s) {
  std::u32string cps = decode(s);
  for (char32_t& c : cps) c = to_lower(c);
  return encode(cps);
}

std::string repr(std::string_view s) {
  const std::u32string cps = decode(s);
  bool has_single = false, has_double = false;
  for (char32_t c : cps) {
    has_single |= c == '\'';
    has_double |= c == '"';
  }
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out;
  out.push_back(quote);
  char buf[16];
  for (char32_t c : cps) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (is_printable(c)) {
      append_utf8(out, c);
    } else if (c <= 0xFF) {
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else if (c <= 0xFFFF) {
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    }
  }
  out.push_back(quote);
  return out;
}

std::string json_quote(std::string_view s, bool ensure_ascii) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  char buf[16];
  auto escape_unit = [&](unsigned unit) {
    std::snprintf(buf, sizeof buf, "\\u%04x", unit);
    out += buf;
  };
  const std::u32string cps = decode(s);
  for (char32_t c : cps) {
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20) {
      escape_unit(static_cast<unsigned>(c));
    } else if (c < 0x7F || !ensure_ascii) {
      append_utf8(out, c);
    } else if (c == 0x7F) {
      append_utf8(out, c);  // DEL is ASCII: json.dumps keeps it even with ensure_ascii
    } else if (c <= 0xFFFF) {
      escape_unit(static_cast<unsigned>(c));
    } else {
      const unsigned v = static_cast<unsigned>(c) - 0x10000;
      escape_unit(0xD800 + (v >> 10));
      escape_unit(0xDC00 + (v & 0x3FF));
    }
  }
  out.push_back('"');
  return out;
}

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  // The shortest round-trip digits, in scientific form: "-d.ddde+XX".
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string out;
  size_t i = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    i = 1;
  }
  std::string digits;
  for (; i < sci.size() && sci[i] != 'e'; ++i)
    if (sci[i] != '.') digits.push_back(sci[i]);
  const int exp10 = std::atoi(sci.c_str() + i + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  // Python (float_repr_style "short") switches to scientific notation below 1e-4 and from 1e16.
  const int decpt = exp10 + 1;  // digits d1 d2 ... with the decimal point after position decpt
  const int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out.push_back(digits[0]);
    if (n > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    std::snprintf(buf, sizeof buf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += buf;
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= n) {
    out += digits;
    out.append(static_cast<size_t>(decpt - n), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<size_t>(decpt));
    out.push_back('.');
    out.append(digits, static_cast<size_t>(decpt), std::string::npos);
  }
  return out;
}

}  // namespace tq::jinja::text
