#include "chat/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <initializer_list>
#include <optional>
#include <string>
#include <unordered_map>

#include "chat/interpreter.h"
#include "chat/text.h"

namespace tq::jinja {
namespace {

// ---------------------------------------------------------------- argument binding

// Binds a call's arguments to named parameters the way Python does: positional arguments fill
// the parameters in order, keywords by name; too many or unknown ones are errors.
class Params {
 public:
  Params(Interpreter& in, const std::string& fname, const CallArgs& args,
         std::initializer_list<const char*> names)
      : in_(in), fname_(fname), names_(names), slots_(names.size(), nullptr) {
    if (args.positional.size() > names_.size())
      in.fail(fname + "() takes at most " + std::to_string(names_.size()) + " argument(s) (" +
              std::to_string(args.positional.size()) + " given)");
    for (size_t i = 0; i < args.positional.size(); ++i) slots_[i] = &args.positional[i];
    for (const auto& [key, value] : args.keywords) {
      size_t i = 0;
      while (i < names_.size() && key != names_[i]) ++i;
      if (i == names_.size()) in.fail(fname + "() got an unexpected keyword argument '" + key + "'");
      if (slots_[i]) in.fail(fname + "() got multiple values for argument '" + key + "'");
      slots_[i] = &value;
    }
  }

  bool has(size_t i) const { return slots_[i] != nullptr; }
  // By value: fallbacks are often temporaries.
  Value get(size_t i, const Value& fallback) const { return slots_[i] ? *slots_[i] : fallback; }
  const Value& required(size_t i) const {
    if (!slots_[i]) in_.fail(fname_ + "() missing required argument '" + names_[i] + "'");
    return *slots_[i];
  }
  int64_t get_int(size_t i, int64_t fallback) const {
    if (!slots_[i] || slots_[i]->is_none()) return fallback;
    if (!slots_[i]->is_integral())
      in_.fail(fname_ + "(): argument '" + names_[i] + "' must be an integer, not " + type_name(*slots_[i]));
    return slots_[i]->as_int();
  }
  bool get_bool(size_t i, bool fallback) const { return slots_[i] ? truthy(*slots_[i]) : fallback; }
  // A str argument (None counts as absent).
  std::optional<std::string> get_str(size_t i) const {
    if (!slots_[i] || slots_[i]->is_none()) return std::nullopt;
    if (!slots_[i]->is_string())
      in_.fail(fname_ + "(): argument '" + names_[i] + "' must be str, not " + type_name(*slots_[i]));
    return slots_[i]->as_string();
  }

 private:
  Interpreter& in_;
  std::string fname_;
  std::vector<const char*> names_;
  std::vector<const Value*> slots_;
};

// jinja2's soft_str: strings stay as they are, everything else goes through str().
std::string soft_str(const Value& v) { return v.is_string() ? v.as_string() : to_str(v); }

Value iterator_of(std::vector<Value> items) { return Value::array(std::move(items), SeqKind::kIterator); }

Value tuple_of(std::vector<Value> items) { return Value::array(std::move(items), SeqKind::kTuple); }

// len(v) as Python computes it.
int64_t py_len(Interpreter& in, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return static_cast<int64_t>(text::length(v.as_string()));
    case Value::Kind::kArray:
      if (v.is_iterator()) break;
      return static_cast<int64_t>(v.array().items.size());
    case Value::Kind::kObject: return static_cast<int64_t>(v.object().entries.size());
    default: break;
  }
  in.fail("object of type '" + type_name(v) + "' has no len()");
}

// ---------------------------------------------------------------- Python str helpers

using U32 = std::u32string;

bool in_set(char32_t c, const U32* chars) { return chars ? chars->find(c) != U32::npos : text::is_space(c); }

std::string py_strip(const std::string& s, const std::optional<std::string>& chars, bool left, bool right) {
  const U32 cps = text::decode(s);
  std::optional<U32> set;
  if (chars) set = text::decode(*chars);
  const U32* p = set ? &*set : nullptr;
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && in_set(cps[b], p)) ++b;
  if (right)
    while (e > b && in_set(cps[e - 1], p)) --e;
  return text::encode(U32(cps, b, e - b));
}

std::vector<Value> py_split(Interpreter& in, const std::string& s, const std::optional<std::string>& sep,
                            int64_t maxsplit, bool from_right) {
  std::vector<Value> out;
  const int64_t max_count = maxsplit < 0 ? INT64_MAX : maxsplit;
  if (!sep) {
    const U32 cps = text::decode(s);
    const int64_t n = static_cast<int64_t>(cps.size());
    int64_t count = max_count;
    if (!from_right) {
      int64_t i = 0;
      while (count-- > 0) {
        while (i < n && text::is_space(cps[static_cast<size_t>(i)])) ++i;
        if (i == n) break;
        const int64_t j = i++;
        while (i < n && !text::is_space(cps[static_cast<size_t>(i)])) ++i;
        out.emplace_back(text::encode(U32(cps, static_cast<size_t>(j), static_cast<size_t>(i - j))));
      }
      if (i < n) {
        while (i < n && text::is_space(cps[static_cast<size_t>(i)])) ++i;
        if (i != n) out.emplace_back(text::encode(U32(cps, static_cast<size_t>(i))));
      }
    } else {
      int64_t i = n - 1;
      while (count-- > 0) {
        while (i >= 0 && text::is_space(cps[static_cast<size_t>(i)])) --i;
        if (i < 0) break;
        const int64_t j = i--;
        while (i >= 0 && !text::is_space(cps[static_cast<size_t>(i)])) --i;
        out.emplace_back(text::encode(U32(cps, static_cast<size_t>(i + 1), static_cast<size_t>(j - i))));
      }
      if (i >= 0) {
        while (i >= 0 && text::is_space(cps[static_cast<size_t>(i)])) --i;
        if (i >= 0) out.emplace_back(text::encode(U32(cps, 0, static_cast<size_t>(i + 1))));
      }
      std::reverse(out.begin(), out.end());
    }
    return out;
  }
  if (sep->empty()) in.fail("empty separator");
  // Byte search is code-point safe on valid UTF-8.
  int64_t count = max_count;
  if (!from_right) {
    size_t start = 0;
    while (count-- > 0) {
      const size_t at = s.find(*sep, start);
      if (at == std::string::npos) break;
      out.emplace_back(s.substr(start, at - start));
      start = at + sep->size();
    }
    out.emplace_back(s.substr(start));
  } else {
    size_t end = s.size();
    while (count-- > 0) {
      if (end < sep->size()) break;
      const size_t at = s.rfind(*sep, end - sep->size());
      if (at == std::string::npos) break;
      out.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
      end = at;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
  }
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  const U32 cps = text::decode(s);
  std::vector<std::string> out;
  size_t i = 0, start = 0;
  while (i < cps.size()) {
    if (!text::is_linebreak(cps[i])) {
      ++i;
      continue;
    }
    size_t eol = i + 1;
    if (cps[i] == '\r' && eol < cps.size() && cps[eol] == '\n') ++eol;
    out.push_back(text::encode(U32(cps, start, (keepends ? eol : i) - start)));
    i = start = eol;
  }
  if (start < cps.size()) out.push_back(text::encode(U32(cps, start)));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old.empty()) {
    // "abc".replace("", "-") == "-a-b-c-": the replacement goes around every character.
    const U32 cps = text::decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (done < count) {
        out += repl;
        ++done;
      }
      if (i < cps.size()) text::append_utf8(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (done < count) {
    const size_t at = s.find(old, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += repl;
    start = at + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

// The code point range [start, end) of a string of n code points, as s[start:end] clamps it.
void clamp_range(int64_t n, const Value& start, const Value& end, int64_t* b, int64_t* e) {
  auto fix = [n](int64_t x) {
    if (x < 0) x += n;
    return std::clamp<int64_t>(x, 0, n);
  };
  *b = start.is_integral() ? fix(start.as_int()) : 0;
  *e = end.is_integral() ? fix(end.as_int()) : n;
}

bool is_cased(char32_t c) { return text::is_upper(c) || text::is_lower(c); }

std::string py_title(const std::string& s) {
  U32 cps = text::decode(s);
  bool previous_cased = false;
  for (char32_t& c : cps) {
    c = previous_cased ? text::to_lower(c) : text::to_upper(c);
    previous_cased = is_cased(c);
  }
  return text::encode(cps);
}

std::string py_capitalize(const std::string& s) {
  U32 cps = text::decode(s);
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? text::to_upper(cps[i]) : text::to_lower(cps[i]);
  return text::encode(cps);
}

std::string py_pad(const std::string& s, int64_t width, char32_t fill, int where /* -1 left, 0 center, 1 right */) {
  const int64_t n = static_cast<int64_t>(text::length(s));
  if (width <= n) return s;
  const int64_t marg = width - n;
  int64_t left = 0;
  if (where == 1) left = marg;  // rjust
  if (where == 0) left = marg / 2 + (marg & width & 1);
  std::string pad_left, pad_right;
  for (int64_t i = 0; i < left; ++i) text::append_utf8(pad_left, fill);
  for (int64_t i = 0; i < marg - left; ++i) text::append_utf8(pad_right, fill);
  return pad_left + s + pad_right;
}

// ---------------------------------------------------------------- attribute paths

// jinja2's make_attrgetter: "a.b.0" looks up item a, then b, then index 0.
Value lookup_path(Interpreter& in, Value item, const Value& attribute, const Value* fallback) {
  std::vector<Value> parts;
  if (attribute.is_string()) {
    for (Value& part : py_split(in, attribute.as_string(), std::string("."), -1, false)) {
      const std::string& p = part.as_string();
      const bool digits = !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
      parts.push_back(digits ? Value(static_cast<int64_t>(std::strtoll(p.c_str(), nullptr, 10))) : part);
    }
  } else {
    parts.push_back(attribute);
  }
  for (const Value& part : parts) {
    item = in.getitem(item, part);
    if (fallback && !fallback->is_none() && item.is_undefined()) item = *fallback;
  }
  return item;
}

Value ignore_case(const Value& v) { return v.is_string() ? Value(text::lower(v.as_string())) : v; }

// ---------------------------------------------------------------- filters

Value f_abs(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "abs", args, {});
  if (v.is_float()) return Value(std::fabs(v.as_double()));
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) in.fail("integer overflow");
    return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  in.fail("bad operand type for abs(): '" + type_name(v) + "'");
}

Value f_attr(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "attr", args, {"name"});
  const Value& name = p.required(0);
  if (!name.is_string()) in.fail("attribute name must be string, not '" + type_name(name) + "'");
  return in.getattr(v, name.as_string());
}

Value f_batch(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "batch", args, {"linecount", "fill_with"});
  const int64_t linecount = p.get_int(0, 0);
  if (linecount <= 0) in.fail("batch(): linecount must be positive");
  const Value fill = p.get(1, Value::none());
  std::vector<Value> out, tmp;
  for (Value& item : in.iterate(v)) {
    if (static_cast<int64_t>(tmp.size()) == linecount) {
      out.push_back(Value::array(std::move(tmp)));
      tmp.clear();
    }
    tmp.push_back(std::move(item));
  }
  if (!tmp.empty()) {
    if (!fill.is_none())
      while (static_cast<int64_t>(tmp.size()) < linecount) tmp.push_back(fill);
    out.push_back(Value::array(std::move(tmp)));
  }
  return iterator_of(std::move(out));
}

Value f_capitalize(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "capitalize", args, {});
  return Value(py_capitalize(soft_str(v)));
}

Value f_center(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "center", args, {"width"});
  return Value(py_pad(soft_str(v), p.get_int(0, 80), ' ', 0));
}

Value f_length(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "length", args, {});
  return Value(py_len(in, v));
}

Value f_default(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "default", args, {"default_value", "boolean"});
  const bool boolean = p.get_bool(1, false);
  if (v.is_undefined() || (boolean && !truthy(v))) return p.get(0, Value(""));
  return v;
}

Value f_dictsort(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "dictsort", args, {"case_sensitive", "by", "reverse"});
  const bool case_sensitive = p.get_bool(0, false);
  const std::string by = p.get_str(1).value_or("key");
  const bool reverse = p.get_bool(2, false);
  if (by != "key" && by != "value") in.fail("You can only sort by either \"key\" or \"value\"");
  if (v.is_undefined()) in.fail_undefined(v);
  if (!v.is_object()) in.fail("'" + type_name(v) + "' object has no attribute 'items'");
  std::vector<Value> items;
  for (const auto& [k, item] : v.object().entries) items.push_back(tuple_of({Value(k), item}));
  const size_t pos = by == "key" ? 0 : 1;
  auto key = [&](const Value& pair) {
    const Value& x = pair.array().items[pos];
    return case_sensitive ? x : ignore_case(x);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? in.less(key(b), key(a)) : in.less(key(a), key(b));
  });
  return Value::array(std::move(items));
}

Value f_escape(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "escape", args, {});
  if (v.is_markup()) return v;
  return Value::markup(html_escape(to_str(v)));
}

Value f_forceescape(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "forceescape", args, {});
  return Value::markup(html_escape(to_str(v)));
}

Value f_first(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "first", args, {});
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "last", args, {});
  if (v.is_iterator() || !(v.is_array() || v.is_object() || v.is_string() || v.is_undefined()))
    in.fail("'" + type_name(v) + "' object is not reversible");
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

// Python's float(str): surrounding whitespace, '_' between digits, inf/nan spellings.
std::optional<double> parse_py_float(std::string s) {
  s = py_strip(s, std::nullopt, true, true);
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') {
      const bool ok = i > 0 && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
                      std::isdigit(static_cast<unsigned char>(s[i + 1]));
      if (!ok) return std::nullopt;
      continue;
    }
    clean.push_back(s[i]);
  }
  if (clean.empty()) return std::nullopt;
  std::string lowered = text::lower(clean);
  const char* body = lowered.c_str();
  if (*body == '+' || *body == '-') ++body;
  const std::string word = body;
  if (word == "inf" || word == "infinity" || word == "nan") {
    const double x = word == "nan" ? NAN : INFINITY;
    return lowered[0] == '-' ? -x : x;
  }
  for (char c : word)
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == '+' || c == '-')) return std::nullopt;
  char* end = nullptr;
  const double x = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return x;
}

// Python's int(str, base) for base 10 (and 2/8/16 with or without the matching prefix).
std::optional<int64_t> parse_py_int(std::string s, int base) {
  s = py_strip(s, std::nullopt, true, true);
  if (s.empty()) return std::nullopt;
  bool negative = false;
  size_t i = 0;
  if (s[0] == '+' || s[0] == '-') {
    negative = s[0] == '-';
    i = 1;
  }
  if (i + 1 < s.size() && s[i] == '0') {
    const char p = static_cast<char>(s[i + 1] | 32);
    if ((p == 'x' && base == 16) || (p == 'o' && base == 8) || (p == 'b' && base == 2)) {
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (i >= s.size()) return std::nullopt;
  int64_t v = 0;
  bool last_digit = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_') {
      if (!last_digit) return std::nullopt;
      last_digit = false;
      continue;
    }
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    else if ((c | 32) >= 'a' && (c | 32) <= 'z') d = (c | 32) - 'a' + 10;
    if (d < 0 || d >= base) return std::nullopt;
    if (__builtin_mul_overflow(v, base, &v) || __builtin_add_overflow(v, d, &v)) return std::nullopt;
    last_digit = true;
  }
  if (!last_digit) return std::nullopt;
  return negative ? -v : v;
}

Value f_float(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "float", args, {"default"});
  const Value fallback = p.get(0, Value(0.0));
  if (v.is_undefined()) in.fail_undefined(v);  // Undefined.__float__ raises
  if (v.is_number()) return Value(v.as_double());
  if (v.is_string()) {
    if (auto x = parse_py_float(v.as_string())) return Value(*x);
  }
  return fallback;
}

Value f_int(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "int", args, {"default", "base"});
  const Value fallback = p.get(0, Value(0));
  const int64_t base = p.get_int(1, 10);
  if (v.is_undefined()) in.fail_undefined(v);  // Undefined.__int__ raises
  if (v.is_integral()) return Value(v.as_int());
  if (v.is_float()) {
    const double x = v.as_double();
    if (std::isnan(x)) return fallback;
    if (std::isinf(x) || std::fabs(x) >= 9.2e18) in.fail("cannot convert float infinity to integer");
    return Value(static_cast<int64_t>(x));
  }
  if (v.is_string()) {
    if (base >= 2 && base <= 36)
      if (auto x = parse_py_int(v.as_string(), static_cast<int>(base))) return Value(*x);
    // "42.23"|int is 42: jinja2 retries through float().
    if (auto x = parse_py_float(v.as_string())) {
      if (std::isnan(*x)) return fallback;
      if (std::isinf(*x) || std::fabs(*x) >= 9.2e18) in.fail("cannot convert float infinity to integer");
      return Value(static_cast<int64_t>(*x));
    }
  }
  return fallback;
}

Value f_indent(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "indent", args, {"width", "first", "blank"});
  std::string indention;
  const Value& width = p.get(0, Value(4));
  if (width.is_string()) indention = width.as_string();
  else indention = std::string(static_cast<size_t>(std::max<int64_t>(0, p.get_int(0, 4))), ' ');
  const bool first = p.get_bool(1, false);
  const bool blank = p.get_bool(2, false);
  // jinja2 appends a newline (`s += newline`) so that splitlines keeps a trailing empty line,
  // which fails for anything but a string.
  if (!v.is_string()) {
    if (v.is_undefined()) in.fail_undefined(v);
    if (v.is_list()) in.fail("'list' object has no attribute 'splitlines'");
    if (v.is_tuple()) in.fail("can only concatenate tuple (not \"str\") to tuple");
    in.fail("unsupported operand type(s) for +=: '" + type_name(v) + "' and 'str'");
  }
  const std::string s = v.as_string() + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) rv += "\n" + indention;
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return v.is_markup() ? Value::markup(rv) : Value(rv);
}

Value f_items(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "items", args, {});
  if (v.is_undefined()) return iterator_of({});
  if (!v.is_object()) in.fail("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, item] : v.object().entries) out.push_back(tuple_of({Value(k), item}));
  return iterator_of(std::move(out));
}

Value f_join(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "join", args, {"d", "attribute"});
  const std::string sep = to_str(p.get(0, Value("")));
  std::string out;
  bool first = true;
  for (const Value& item : in.iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(p.has(1) && !p.get(1, Value()).is_none() ? lookup_path(in, item, p.get(1, Value()), nullptr) : item);
  }
  return Value(std::move(out));
}

Value f_list(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "list", args, {});
  return Value::array(in.iterate(v));
}

Value f_lower(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "lower", args, {});
  return Value(text::lower(soft_str(v)));
}

Value f_upper(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "upper", args, {});
  return Value(text::upper(soft_str(v)));
}

Value f_map(Interpreter& in, const Value& v, CallArgs& args) {
  std::vector<Value> out;
  if (!truthy(v)) return iterator_of({});
  const Value* attribute = nullptr;
  const Value* fallback = nullptr;
  for (const auto& [k, value] : args.keywords) {
    if (k == "attribute") attribute = &value;
    if (k == "default") fallback = &value;
  }
  if (args.positional.empty() && attribute) {
    for (const auto& [k, value] : args.keywords)
      if (k != "attribute" && k != "default") in.fail("Unexpected keyword argument '" + k + "'");
    for (const Value& item : in.iterate(v)) out.push_back(lookup_path(in, item, *attribute, fallback));
    return iterator_of(std::move(out));
  }
  if (args.positional.empty()) in.fail("map requires a filter argument");
  if (!args.positional[0].is_string()) in.fail("map: the filter name must be a string");
  const std::string name = args.positional[0].as_string();
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keywords = args.keywords;
  for (const Value& item : in.iterate(v)) {
    CallArgs copy = rest;
    out.push_back(in.filter_by_name(name, item, copy));
  }
  return iterator_of(std::move(out));
}

Value min_or_max(Interpreter& in, const Value& v, CallArgs& args, bool want_max, const char* fname) {
  Params p(in, fname, args, {"case_sensitive", "attribute"});
  const bool case_sensitive = p.get_bool(0, false);
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  auto key = [&](const Value& item) {
    Value k = p.has(1) && !p.get(1, Value()).is_none() ? lookup_path(in, item, p.get(1, Value()), nullptr) : item;
    return case_sensitive ? k : ignore_case(k);
  };
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    // Python's max/min keep the first of equal items.
    if (in.compare_values(want_max ? CompareOp::kGt : CompareOp::kLt, k, best_key)) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}

Value f_max(Interpreter& in, const Value& v, CallArgs& args) { return min_or_max(in, v, args, true, "max"); }
Value f_min(Interpreter& in, const Value& v, CallArgs& args) { return min_or_max(in, v, args, false, "min"); }

// select / reject / selectattr / rejectattr.
Value select_or_reject(Interpreter& in, const Value& v, CallArgs& args, bool keep_when, bool by_attr) {
  if (!truthy(v)) return iterator_of({});
  size_t off = 0;
  Value attribute;
  if (by_attr) {
    if (args.positional.empty()) in.fail("Missing parameter for attribute name");
    attribute = args.positional[0];
    off = 1;
  }
  std::optional<std::string> test;
  CallArgs test_args;
  if (args.positional.size() > off) {
    if (!args.positional[off].is_string()) in.fail("the test name must be a string");
    test = args.positional[off].as_string();
    test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(off + 1), args.positional.end());
    test_args.keywords = args.keywords;
  }
  std::vector<Value> out;
  for (const Value& item : in.iterate(v)) {
    const Value probe = by_attr ? lookup_path(in, item, attribute, nullptr) : item;
    bool result;
    if (test) {
      CallArgs copy = test_args;
      result = in.test_by_name(*test, probe, copy);
    } else {
      result = truthy(probe);
    }
    if (result == keep_when) out.push_back(item);
  }
  return iterator_of(std::move(out));
}

Value f_select(Interpreter& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, true, false); }
Value f_reject(Interpreter& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, false, false); }
Value f_selectattr(Interpreter& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, true, true); }
Value f_rejectattr(Interpreter& in, const Value& v, CallArgs& a) { return select_or_reject(in, v, a, false, true); }

Value f_replace(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "replace", args, {"old", "new", "count"});
  const std::string old_text = to_str(p.required(0));
  const std::string new_text = to_str(p.required(1));
  return Value(py_replace(soft_str(v), old_text, new_text, p.get_int(2, -1)));
}

Value f_reverse(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "reverse", args, {});
  if (v.is_string()) {
    U32 cps = text::decode(v.as_string());
    std::reverse(cps.begin(), cps.end());
    return Value(text::encode(cps));
  }
  if (!v.is_array() && !v.is_object() && !v.is_undefined()) in.fail("argument must be iterable");
  std::vector<Value> items = in.iterate(v);
  std::reverse(items.begin(), items.end());
  // reversed() of a list is an iterator; a generator is first made a list.
  return v.is_iterator() ? Value::array(std::move(items)) : iterator_of(std::move(items));
}

// Python's round(x, ndigits) for floats: the correctly rounded decimal (round half to even on the
// exact binary value), which glibc's printf computes.
double py_round_float(double x, int64_t ndigits) {
  if (!std::isfinite(x) || x == 0.0) return x;
  if (ndigits > 300) return x;
  if (ndigits >= 0) {
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(ndigits), x);
    return std::strtod(buf, nullptr);
  }
  const double scale = std::pow(10.0, static_cast<double>(-ndigits));
  if (!std::isfinite(scale)) return std::copysign(0.0, x);
  return std::nearbyint(x / scale) * scale;
}

Value f_round(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "round", args, {"precision", "method"});
  const int64_t precision = p.get_int(0, 0);
  const std::string method = p.get_str(1).value_or("common");
  if (method != "common" && method != "ceil" && method != "floor") in.fail("method must be common, ceil or floor");
  if (!v.is_number()) in.fail("type " + type_name(v) + " doesn't define __round__ method");
  if (method == "common") {
    if (v.is_integral()) {
      if (precision >= 0) return Value(v.as_int());
      // round(1250, -2) == 1200: half to even on the integer.
      int64_t scale = 1;
      for (int64_t i = 0; i < -precision && scale <= INT64_MAX / 10; ++i) scale *= 10;
      const int64_t x = v.as_int();
      int64_t q = x / scale, r = x % scale;
      if (r < 0) r += scale, q -= 1;
      if (2 * r > scale || (2 * r == scale && (q & 1))) ++q;
      return Value(q * scale);
    }
    return Value(py_round_float(v.as_double(), precision));
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * scale;
  return Value((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value f_safe(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "safe", args, {});
  return Value::markup(to_str(v));
}

Value f_sort(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "sort", args, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = p.get_bool(0, false);
  const bool case_sensitive = p.get_bool(1, false);
  std::vector<Value> attributes;  // "a,b" sorts by a, then b
  if (p.has(2) && !p.get(2, Value()).is_none()) {
    const Value& attr = p.get(2, Value());
    if (attr.is_string()) attributes = py_split(in, attr.as_string(), std::string(","), -1, false);
    else attributes.push_back(attr);
  }
  std::vector<Value> items = in.iterate(v);
  auto key = [&](const Value& item) -> Value {
    if (attributes.empty()) return case_sensitive ? item : ignore_case(item);
    std::vector<Value> parts;
    for (const Value& a : attributes) {
      Value k = lookup_path(in, item, a, nullptr);
      parts.push_back(case_sensitive ? k : ignore_case(k));
    }
    return parts.size() == 1 ? parts[0] : Value::array(std::move(parts));
  };
  std::vector<std::pair<Value, Value>> keyed;
  for (Value& item : items) keyed.emplace_back(key(item), std::move(item));
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? in.less(b.first, a.first) : in.less(a.first, b.first);
  });
  std::vector<Value> out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return Value::array(std::move(out));
}

Value f_string(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "string", args, {});
  return v.is_string() ? v : Value(to_str(v));
}

Value f_sum(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "sum", args, {"attribute", "start"});
  Value total = p.get(1, Value(0));
  for (const Value& item : in.iterate(v)) {
    const Value x = p.has(0) && !p.get(0, Value()).is_none() ? lookup_path(in, item, p.get(0, Value()), nullptr) : item;
    if (total.is_string()) in.fail("sum() can't sum strings [use ''.join(seq) instead]");
    if (!(total.is_number() && x.is_number()) && !(total.is_array() && x.is_array())) {
      if (x.is_undefined()) in.fail_undefined(x);
      in.fail("unsupported operand type(s) for +: '" + type_name(total) + "' and '" + type_name(x) + "'");
    }
    if (total.is_number()) {
      if (total.is_float() || x.is_float()) total = Value(total.as_double() + x.as_double());
      else {
        int64_t r;
        if (__builtin_add_overflow(total.as_int(), x.as_int(), &r)) in.fail("integer overflow");
        total = Value(r);
      }
    } else {
      std::vector<Value> items = total.array().items;
      items.insert(items.end(), x.array().items.begin(), x.array().items.end());
      total = Value::array(std::move(items), total.array().kind);
    }
  }
  return total;
}

Value f_title(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "title", args, {});
  // jinja2 capitalizes each piece between runs of whitespace, '-', '(', '{', '[' and '<'.
  const U32 cps = text::decode(soft_str(v));
  auto separator = [](char32_t c) { return text::is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<'; };
  U32 out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    const bool sep = separator(cps[i]);
    while (j < cps.size() && separator(cps[j]) == sep) ++j;
    for (size_t k = i; k < j; ++k) out.push_back(k == i ? text::to_upper(cps[k]) : text::to_lower(cps[k]));
    i = j;
  }
  return Value(text::encode(out));
}

// transformers replaces jinja2's tojson with json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False), so non-ASCII text and HTML characters pass through.
Value f_tojson(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions opt;
  opt.ensure_ascii = p.get_bool(0, false);
  const Value& indent = p.get(1, Value::none());
  if (!indent.is_none()) {
    opt.has_indent = true;
    if (indent.is_string()) opt.indent_text = indent.as_string();
    else if (indent.is_integral()) opt.indent_text = std::string(static_cast<size_t>(std::clamp<int64_t>(indent.as_int(), 0, 1000)), ' ');
    else in.fail("tojson(): indent must be an int or a str, not " + type_name(indent));
  }
  const Value& separators = p.get(2, Value::none());
  if (!separators.is_none()) {
    if (!separators.is_array() || separators.array().items.size() != 2 ||
        !separators.array().items[0].is_string() || !separators.array().items[1].is_string())
      in.fail("tojson(): separators must be a pair of strings");
    opt.has_separators = true;
    opt.item_separator = separators.array().items[0].as_string();
    opt.key_separator = separators.array().items[1].as_string();
  }
  opt.sort_keys = p.get_bool(3, false);
  return Value(to_json(v, opt));
}

Value f_trim(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "trim", args, {"chars"});
  return Value(py_strip(soft_str(v), p.get_str(0), true, true));
}

Value f_truncate(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "truncate", args, {"length", "killwords", "end", "leeway"});
  const int64_t length = p.get_int(0, 255);
  const bool killwords = p.get_bool(1, false);
  const std::string end = p.get_str(2).value_or("...");
  const int64_t leeway = p.get_int(3, 5);
  const int64_t end_len = static_cast<int64_t>(text::length(end));
  if (length < end_len) in.fail("expected length >= " + std::to_string(end_len) + ", got " + std::to_string(length));
  if (leeway < 0) in.fail("expected leeway >= 0, got " + std::to_string(leeway));
  // jinja2 measures and slices the value itself: other sized values come back unchanged when
  // short enough and fail otherwise.
  if (!v.is_string()) {
    if (py_len(in, v) <= length + leeway) return v;
    in.fail("truncate() needs a string, not " + type_name(v));
  }
  const std::string& s = v.as_string();
  const U32 cps = text::decode(s);
  if (static_cast<int64_t>(cps.size()) <= length + leeway) return v;
  const std::string head = text::encode(U32(cps, 0, static_cast<size_t>(length - end_len)));
  if (killwords) return Value(head + end);
  std::vector<Value> parts = py_split(in, head, std::string(" "), 1, true);
  return Value(parts[0].as_string() + end);
}

Value f_unique(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "unique", args, {"case_sensitive", "attribute"});
  const bool case_sensitive = p.get_bool(0, false);
  std::vector<Value> seen, out;
  for (const Value& item : in.iterate(v)) {
    Value key = p.has(1) && !p.get(1, Value()).is_none() ? lookup_path(in, item, p.get(1, Value()), nullptr) : item;
    if (!case_sensitive) key = ignore_case(key);
    if (key.is_list() || key.is_object() || key.is_dict_view())  // unique() keeps a set of keys
      in.fail("unhashable type: '" + type_name(key) + "'");
    bool dup = false;
    for (const Value& s : seen) dup = dup || equals(s, key);
    if (dup) continue;
    seen.push_back(std::move(key));
    out.push_back(item);
  }
  return iterator_of(std::move(out));
}

Value f_wordcount(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "wordcount", args, {});
  int64_t words = 0;
  bool in_word = false;
  for (char32_t c : text::decode(soft_str(v))) {
    const bool w = text::is_word(c);
    if (w && !in_word) ++words;
    in_word = w;
  }
  return Value(words);
}

Value f_format(Interpreter& in, const Value& v, CallArgs& args) {
  if (!args.keywords.empty()) in.fail("format(): keyword arguments are not supported");
  // "%s, %s"|format(a, b) is "%s, %s" % (a, b).
  return Value(percent_format(in, soft_str(v), Value::array(args.positional, SeqKind::kTuple)));
}

const std::unordered_map<std::string_view, FilterFn>& filter_table() {
  static const std::unordered_map<std::string_view, FilterFn> table = {
      {"abs", f_abs},           {"attr", f_attr},         {"batch", f_batch},
      {"capitalize", f_capitalize}, {"center", f_center}, {"count", f_length},
      {"d", f_default},         {"default", f_default},   {"dictsort", f_dictsort},
      {"e", f_escape},          {"escape", f_escape},     {"first", f_first},
      {"float", f_float},       {"forceescape", f_forceescape}, {"format", f_format},
      {"indent", f_indent},     {"int", f_int},           {"items", f_items},
      {"join", f_join},         {"last", f_last},         {"length", f_length},
      {"list", f_list},         {"lower", f_lower},       {"map", f_map},
      {"max", f_max},           {"min", f_min},           {"reject", f_reject},
      {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse},
      {"round", f_round},       {"safe", f_safe},         {"select", f_select},
      {"selectattr", f_selectattr}, {"sort", f_sort},     {"string", f_string},
      {"sum", f_sum},           {"title", f_title},       {"tojson", f_tojson},
      {"trim", f_trim},         {"truncate", f_truncate}, {"unique", f_unique},
      {"upper", f_upper},       {"wordcount", f_wordcount},
  };
  return table;
}

// ---------------------------------------------------------------- tests

Value modulo(Interpreter& in, const Value& a, const Value& b) {
  if (a.is_undefined()) in.fail_undefined(a);
  if (!a.is_number() || !b.is_number()) {
    if (a.is_string()) in.fail("not all arguments converted during string formatting");
    in.fail("unsupported operand type(s) for %: '" + type_name(a) + "' and '" + type_name(b) + "'");
  }
  if (a.is_integral() && b.is_integral()) {
    if (b.as_int() == 0) in.fail("integer modulo by zero");
    int64_t m = a.as_int() % b.as_int();
    if (m != 0 && ((m < 0) != (b.as_int() < 0))) m += b.as_int();
    return Value(m);
  }
  if (b.as_double() == 0.0) in.fail("float modulo");
  double m = std::fmod(a.as_double(), b.as_double());
  if (m != 0.0 && ((m < 0) != (b.as_double() < 0))) m += b.as_double();
  return Value(m);
}

const Value& test_arg(Interpreter& in, CallArgs& args, const char* test, const char* name) {
  Params p(in, test, args, {name});
  return p.required(0);
}

bool t_odd(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "odd", args, {});
  return equals(modulo(in, v, Value(2)), Value(1));
}
bool t_even(Interpreter& in, const Value& v, CallArgs& args) {
  Params p(in, "even", args, {});
  return equals(modulo(in, v, Value(2)), Value(0));
}
bool t_divisibleby(Interpreter& in, const Value& v, CallArgs& args) {
  return equals(modulo(in, v, test_arg(in, args, "divisibleby", "num")), Value(0));
}
bool t_defined(Interpreter&, const Value& v, CallArgs&) { return !v.is_undefined(); }
bool t_undefined(Interpreter&, const Value& v, CallArgs&) { return v.is_undefined(); }
bool t_none(Interpreter&, const Value& v, CallArgs&) { return v.is_none(); }
bool t_boolean(Interpreter&, const Value& v, CallArgs&) { return v.is_bool(); }
bool t_false(Interpreter&, const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }
bool t_true(Interpreter&, const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }
bool t_integer(Interpreter&, const Value& v, CallArgs&) { return v.is_int(); }
bool t_float(Interpreter&, const Value& v, CallArgs&) { return v.is_float(); }
bool t_number(Interpreter&, const Value& v, CallArgs&) { return v.is_number(); }
bool t_string(Interpreter&, const Value& v, CallArgs&) { return v.is_string(); }
bool t_mapping(Interpreter&, const Value& v, CallArgs&) { return v.is_object(); }
bool t_callable(Interpreter&, const Value& v, CallArgs&) { return v.is_function() || v.is_undefined(); }
bool t_escaped(Interpreter&, const Value& v, CallArgs&) { return v.is_markup(); }
// Python's Sequence duck test (len() and [] both work): str, list, tuple, dict, and Undefined,
// whose class defines both.
bool t_sequence(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() || v.is_list() || v.is_tuple() || v.is_object() || v.is_undefined();
}
bool t_iterable(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() || v.is_array() || v.is_object() || v.is_undefined() ||
         (v.is_namespace() && v.namespace_data().class_name == "LoopContext");
}
bool t_lower(Interpreter&, const Value& v, CallArgs&) {
  bool cased = false;
  for (char32_t c : text::decode(to_str(v))) {
    if (text::is_upper(c)) return false;
    cased = cased || text::is_lower(c);
  }
  return cased;
}
bool t_upper(Interpreter&, const Value& v, CallArgs&) {
  bool cased = false;
  for (char32_t c : text::decode(to_str(v))) {
    if (text::is_lower(c)) return false;
    cased = cased || text::is_upper(c);
  }
  return cased;
}
bool t_sameas(Interpreter& in, const Value& v, CallArgs& args) {
  const Value& other = test_arg(in, args, "sameas", "other");
  if (v.kind() != other.kind()) return false;
  switch (v.kind()) {
    case Value::Kind::kNone:
    case Value::Kind::kUndefined: return v.is_none();  // None is a singleton; each Undefined is new
    case Value::Kind::kBool: return v.as_bool() == other.as_bool();
    // CPython caches the small ints, so they are the same object.
    case Value::Kind::kInt: return v.as_int() == other.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
    case Value::Kind::kFloat:
    case Value::Kind::kString: return false;
    default: return v.identity() == other.identity();
  }
}
bool t_in(Interpreter& in, const Value& v, CallArgs& args) {
  return in.contains(test_arg(in, args, "in", "seq"), v);
}
bool t_eq(Interpreter& in, const Value& v, CallArgs& args) { return equals(v, test_arg(in, args, "eq", "other")); }
bool t_ne(Interpreter& in, const Value& v, CallArgs& args) { return !equals(v, test_arg(in, args, "ne", "other")); }
bool t_lt(Interpreter& in, const Value& v, CallArgs& args) { return in.compare_values(CompareOp::kLt, v, test_arg(in, args, "lt", "other")); }
bool t_gt(Interpreter& in, const Value& v, CallArgs& args) { return in.compare_values(CompareOp::kGt, v, test_arg(in, args, "gt", "other")); }
bool t_le(Interpreter& in, const Value& v, CallArgs& args) { return in.compare_values(CompareOp::kLe, v, test_arg(in, args, "le", "other")); }
bool t_ge(Interpreter& in, const Value& v, CallArgs& args) { return in.compare_values(CompareOp::kGe, v, test_arg(in, args, "ge", "other")); }
bool t_filter(Interpreter&, const Value& v, CallArgs&) { return v.is_string() && find_filter(v.as_string()) != nullptr; }
bool t_test(Interpreter&, const Value& v, CallArgs&) { return v.is_string() && find_test(v.as_string()) != nullptr; }

const std::unordered_map<std::string_view, TestFn>& test_table() {
  static const std::unordered_map<std::string_view, TestFn> table = {
      {"odd", t_odd},         {"even", t_even},         {"divisibleby", t_divisibleby},
      {"defined", t_defined}, {"undefined", t_undefined}, {"none", t_none},
      {"boolean", t_boolean}, {"false", t_false},       {"true", t_true},
      {"integer", t_integer}, {"float", t_float},       {"number", t_number},
      {"string", t_string},   {"mapping", t_mapping},   {"callable", t_callable},
      {"escaped", t_escaped}, {"sequence", t_sequence}, {"iterable", t_iterable},
      {"lower", t_lower},     {"upper", t_upper},       {"sameas", t_sameas},
      {"in", t_in},           {"==", t_eq},             {"eq", t_eq},
      {"equalto", t_eq},      {"!=", t_ne},             {"ne", t_ne},
      {"<", t_lt},            {"lt", t_lt},             {"lessthan", t_lt},
      {">", t_gt},            {"gt", t_gt},             {"greaterthan", t_gt},
      {"<=", t_le},           {"le", t_le},             {">=", t_ge},
      {"ge", t_ge},           {"filter", t_filter},     {"test", t_test},
  };
  return table;
}

// ---------------------------------------------------------------- methods

using Method = Value (*)(Interpreter&, const Value& self, CallArgs& args);

Value m_strip_impl(Interpreter& in, const Value& self, CallArgs& args, const char* name, bool l, bool r) {
  Params p(in, name, args, {"chars"});
  return Value(py_strip(self.as_string(), p.get_str(0), l, r));
}
Value m_strip(Interpreter& in, const Value& s, CallArgs& a) { return m_strip_impl(in, s, a, "strip", true, true); }
Value m_lstrip(Interpreter& in, const Value& s, CallArgs& a) { return m_strip_impl(in, s, a, "lstrip", true, false); }
Value m_rstrip(Interpreter& in, const Value& s, CallArgs& a) { return m_strip_impl(in, s, a, "rstrip", false, true); }

Value m_split_impl(Interpreter& in, const Value& self, CallArgs& args, bool right) {
  Params p(in, right ? "rsplit" : "split", args, {"sep", "maxsplit"});
  return Value::array(py_split(in, self.as_string(), p.get_str(0), p.get_int(1, -1), right));
}
Value m_split(Interpreter& in, const Value& s, CallArgs& a) { return m_split_impl(in, s, a, false); }
Value m_rsplit(Interpreter& in, const Value& s, CallArgs& a) { return m_split_impl(in, s, a, true); }

Value m_splitlines(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "splitlines", args, {"keepends"});
  std::vector<Value> out;
  for (auto& line : py_splitlines(self.as_string(), p.get_bool(0, false))) out.emplace_back(std::move(line));
  return Value::array(std::move(out));
}

// startswith / endswith: prefix may be a tuple of candidates; start and end slice first.
Value m_affix(Interpreter& in, const Value& self, CallArgs& args, bool prefix) {
  const char* name = prefix ? "startswith" : "endswith";
  Params p(in, name, args, {"prefix", "start", "end"});
  const Value& what = p.required(0);
  std::string s = self.as_string();
  if (p.has(1) || p.has(2)) {
    const U32 cps = text::decode(s);
    int64_t b, e;
    clamp_range(static_cast<int64_t>(cps.size()), p.get(1, Value::none()), p.get(2, Value::none()), &b, &e);
    s = b < e ? text::encode(U32(cps, static_cast<size_t>(b), static_cast<size_t>(e - b))) : "";
  }
  auto check = [&](const Value& cand) {
    if (!cand.is_string())
      in.fail(std::string(name) + " first arg must be str or a tuple of str, not " + type_name(cand));
    const std::string& c = cand.as_string();
    if (c.size() > s.size()) return false;
    return prefix ? s.compare(0, c.size(), c) == 0 : s.compare(s.size() - c.size(), c.size(), c) == 0;
  };
  if (what.is_tuple()) {
    for (const Value& cand : what.array().items)
      if (check(cand)) return Value(true);
    return Value(false);
  }
  return Value(check(what));
}
Value m_startswith(Interpreter& in, const Value& s, CallArgs& a) { return m_affix(in, s, a, true); }
Value m_endswith(Interpreter& in, const Value& s, CallArgs& a) { return m_affix(in, s, a, false); }

Value m_upper(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "upper", a, {});
  return Value(text::upper(s.as_string()));
}
Value m_lower(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "lower", a, {});
  return Value(text::lower(s.as_string()));
}
Value m_title(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "title", a, {});
  return Value(py_title(s.as_string()));
}
Value m_capitalize(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "capitalize", a, {});
  return Value(py_capitalize(s.as_string()));
}
Value m_swapcase(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "swapcase", a, {});
  U32 cps = text::decode(s.as_string());
  for (char32_t& c : cps) c = text::is_upper(c) ? text::to_lower(c) : text::is_lower(c) ? text::to_upper(c) : c;
  return Value(text::encode(cps));
}
Value m_replace(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "replace", a, {"old", "new", "count"});
  const Value& o = p.required(0);
  const Value& n = p.required(1);
  if (!o.is_string() || !n.is_string()) in.fail("replace() arguments must be str");
  return Value(py_replace(s.as_string(), o.as_string(), n.as_string(), p.get_int(2, -1)));
}

// find / rfind / index / rindex / count over the code points of s[start:end].
Value m_search(Interpreter& in, const Value& self, CallArgs& args, const char* name) {
  Params p(in, name, args, {"sub", "start", "end"});
  const Value& sub_v = p.required(0);
  if (!sub_v.is_string()) in.fail(std::string("must be str, not ") + type_name(sub_v));
  const U32 cps = text::decode(self.as_string());
  const U32 sub = text::decode(sub_v.as_string());
  int64_t b, e;
  clamp_range(static_cast<int64_t>(cps.size()), p.get(1, Value::none()), p.get(2, Value::none()), &b, &e);
  const std::string_view n = name;
  if (n == "count") {
    if (b > e) return Value(0);
    if (sub.empty()) return Value(e - b + 1);
    int64_t count = 0;
    for (int64_t i = b; i + static_cast<int64_t>(sub.size()) <= e;) {
      if (cps.compare(static_cast<size_t>(i), sub.size(), sub) == 0) {
        ++count;
        i += static_cast<int64_t>(sub.size());
      } else {
        ++i;
      }
    }
    return Value(count);
  }
  const bool reverse = n == "rfind" || n == "rindex";
  int64_t found = -1;
  const int64_t last_start = e - static_cast<int64_t>(sub.size());
  if (b <= last_start || (sub.empty() && b <= e)) {
    if (!reverse) {
      for (int64_t i = b; i <= last_start; ++i)
        if (cps.compare(static_cast<size_t>(i), sub.size(), sub) == 0) {
          found = i;
          break;
        }
    } else {
      for (int64_t i = last_start; i >= b; --i)
        if (cps.compare(static_cast<size_t>(i), sub.size(), sub) == 0) {
          found = i;
          break;
        }
    }
  }
  if (found < 0 && (n == "index" || n == "rindex")) in.fail("substring not found");
  return Value(found);
}
Value m_find(Interpreter& in, const Value& s, CallArgs& a) { return m_search(in, s, a, "find"); }
Value m_rfind(Interpreter& in, const Value& s, CallArgs& a) { return m_search(in, s, a, "rfind"); }
Value m_index(Interpreter& in, const Value& s, CallArgs& a) { return m_search(in, s, a, "index"); }
Value m_rindex(Interpreter& in, const Value& s, CallArgs& a) { return m_search(in, s, a, "rindex"); }
Value m_count(Interpreter& in, const Value& s, CallArgs& a) { return m_search(in, s, a, "count"); }

Value m_join(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "join", args, {"iterable"});
  std::string out;
  bool first = true;
  for (const Value& item : in.iterate(p.required(0))) {
    if (!item.is_string()) in.fail("sequence item: expected str instance, " + type_name(item) + " found");
    if (!first) out += self.as_string();
    first = false;
    out += item.as_string();
  }
  return Value(std::move(out));
}

template <bool (*Pred)(char32_t)>
Value m_is_all(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "is*", args, {});
  const U32 cps = text::decode(self.as_string());
  if (cps.empty()) return Value(false);
  for (char32_t c : cps)
    if (!Pred(c)) return Value(false);
  return Value(true);
}

Value m_isupper(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "isupper", a, {});
  CallArgs none;
  return Value(t_upper(in, s, none));
}
Value m_islower(Interpreter& in, const Value& s, CallArgs& a) {
  Params p(in, "islower", a, {});
  CallArgs none;
  return Value(t_lower(in, s, none));
}

Value m_pad(Interpreter& in, const Value& self, CallArgs& args, const char* name, int where) {
  Params p(in, name, args, {"width", "fillchar"});
  const int64_t width = p.get_int(0, 0);
  char32_t fill = ' ';
  if (auto f = p.get_str(1)) {
    const U32 cps = text::decode(*f);
    if (cps.size() != 1) in.fail("The fill character must be exactly one character long");
    fill = cps[0];
  }
  return Value(py_pad(self.as_string(), width, fill, where));
}
Value m_center(Interpreter& in, const Value& s, CallArgs& a) { return m_pad(in, s, a, "center", 0); }
Value m_ljust(Interpreter& in, const Value& s, CallArgs& a) { return m_pad(in, s, a, "ljust", -1); }
Value m_rjust(Interpreter& in, const Value& s, CallArgs& a) { return m_pad(in, s, a, "rjust", 1); }

Value m_zfill(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "zfill", args, {"width"});
  const U32 cps = text::decode(self.as_string());
  const int64_t width = p.get_int(0, 0);
  if (static_cast<int64_t>(cps.size()) >= width) return self;
  const size_t fill = static_cast<size_t>(width) - cps.size();
  U32 out;
  size_t start = 0;
  if (!cps.empty() && (cps[0] == '+' || cps[0] == '-')) {
    out.push_back(cps[0]);
    start = 1;
  }
  out.append(fill, U'0');
  out.append(cps, start, U32::npos);
  return Value(text::encode(out));
}

Value m_removeaffix(Interpreter& in, const Value& self, CallArgs& args, bool prefix) {
  Params p(in, prefix ? "removeprefix" : "removesuffix", args, {"affix"});
  const Value& a = p.required(0);
  if (!a.is_string()) in.fail("argument must be str, not " + type_name(a));
  const std::string& s = self.as_string();
  const std::string& x = a.as_string();
  if (x.size() > s.size()) return self;
  if (prefix && s.compare(0, x.size(), x) == 0) return Value(s.substr(x.size()));
  if (!prefix && s.compare(s.size() - x.size(), x.size(), x) == 0) return Value(s.substr(0, s.size() - x.size()));
  return self;
}
Value m_removeprefix(Interpreter& in, const Value& s, CallArgs& a) { return m_removeaffix(in, s, a, true); }
Value m_removesuffix(Interpreter& in, const Value& s, CallArgs& a) { return m_removeaffix(in, s, a, false); }

Value m_partition_impl(Interpreter& in, const Value& self, CallArgs& args, bool right) {
  Params p(in, right ? "rpartition" : "partition", args, {"sep"});
  const Value& sep = p.required(0);
  if (!sep.is_string()) in.fail("must be str, not " + type_name(sep));
  if (sep.as_string().empty()) in.fail("empty separator");
  const std::string& s = self.as_string();
  const size_t at = right ? s.rfind(sep.as_string()) : s.find(sep.as_string());
  if (at == std::string::npos)
    return right ? tuple_of({Value(""), Value(""), self}) : tuple_of({self, Value(""), Value("")});
  return tuple_of({Value(s.substr(0, at)), sep, Value(s.substr(at + sep.as_string().size()))});
}
Value m_partition(Interpreter& in, const Value& s, CallArgs& a) { return m_partition_impl(in, s, a, false); }
Value m_rpartition(Interpreter& in, const Value& s, CallArgs& a) { return m_partition_impl(in, s, a, true); }

Value m_format(Interpreter& in, const Value&, CallArgs&) {
  in.fail("str.format() is not supported by this chat-template interpreter");
}

bool is_space_pred(char32_t c) { return text::is_space(c); }
bool is_alpha_pred(char32_t c) { return text::is_alpha(c); }
bool is_digit_pred(char32_t c) { return text::is_digit(c); }
bool is_alnum_pred(char32_t c) { return text::is_alnum(c); }

const std::unordered_map<std::string_view, Method>& str_methods() {
  static const std::unordered_map<std::string_view, Method> table = {
      {"strip", m_strip},       {"lstrip", m_lstrip},       {"rstrip", m_rstrip},
      {"split", m_split},       {"rsplit", m_rsplit},       {"splitlines", m_splitlines},
      {"startswith", m_startswith}, {"endswith", m_endswith}, {"upper", m_upper},
      {"lower", m_lower},       {"casefold", m_lower},      {"title", m_title},
      {"capitalize", m_capitalize}, {"swapcase", m_swapcase}, {"replace", m_replace},
      {"find", m_find},         {"rfind", m_rfind},         {"index", m_index},
      {"rindex", m_rindex},     {"count", m_count},         {"join", m_join},
      {"isspace", m_is_all<is_space_pred>}, {"isalpha", m_is_all<is_alpha_pred>},
      {"isdigit", m_is_all<is_digit_pred>}, {"isdecimal", m_is_all<is_digit_pred>},
      {"isnumeric", m_is_all<is_digit_pred>}, {"isalnum", m_is_all<is_alnum_pred>},
      {"isupper", m_isupper},   {"islower", m_islower},     {"center", m_center},
      {"ljust", m_ljust},       {"rjust", m_rjust},         {"zfill", m_zfill},
      {"removeprefix", m_removeprefix}, {"removesuffix", m_removesuffix},
      {"partition", m_partition}, {"rpartition", m_rpartition}, {"format", m_format},
  };
  return table;
}

Value m_dict_get(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "get", args, {"key", "default"});
  const Value& key = p.required(0);
  if (key.is_string())
    if (const Value* v = self.object().find(key.as_string())) return *v;
  return p.get(1, Value::none());
}
Value m_dict_items(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "items", args, {});
  std::vector<Value> out;
  for (const auto& [k, v] : self.object().entries) out.push_back(tuple_of({Value(k), v}));
  return Value::array(std::move(out), SeqKind::kDictItems);
}
Value m_dict_keys(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "keys", args, {});
  std::vector<Value> out;
  for (const auto& kv : self.object().entries) out.emplace_back(kv.first);
  return Value::array(std::move(out), SeqKind::kDictKeys);
}
Value m_dict_values(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "values", args, {});
  std::vector<Value> out;
  for (const auto& kv : self.object().entries) out.push_back(kv.second);
  return Value::array(std::move(out), SeqKind::kDictValues);
}
Value m_copy(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "copy", args, {});
  return self;  // values are immutable, so a copy is the same value
}

const std::unordered_map<std::string_view, Method>& dict_methods() {
  static const std::unordered_map<std::string_view, Method> table = {
      {"get", m_dict_get}, {"items", m_dict_items}, {"keys", m_dict_keys},
      {"values", m_dict_values}, {"copy", m_copy},
  };
  return table;
}

Value m_list_index(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "index", args, {"value"});
  const Value& x = p.required(0);
  const auto& items = self.array().items;
  for (size_t i = 0; i < items.size(); ++i)
    if (equals(items[i], x)) return Value(static_cast<int64_t>(i));
  in.fail(to_repr(x) + " is not in " + type_name(self));
}
Value m_list_count(Interpreter& in, const Value& self, CallArgs& args) {
  Params p(in, "count", args, {"value"});
  const Value& x = p.required(0);
  int64_t n = 0;
  for (const Value& item : self.array().items) n += equals(item, x) ? 1 : 0;
  return Value(n);
}

const std::unordered_map<std::string_view, Method>& list_methods() {
  static const std::unordered_map<std::string_view, Method> table = {
      {"index", m_list_index}, {"count", m_list_count}, {"copy", m_copy},
  };
  return table;
}

Value bind(const Value& self, const std::string& name, Method method) {
  auto fn = std::make_shared<Function>();
  fn->name = name;
  fn->call = [self, method](Interpreter& in, CallArgs& args) { return method(in, self, args); };
  return Value::function(std::move(fn));
}

// ---------------------------------------------------------------- globals

std::shared_ptr<Function> native(std::string name, std::function<Value(Interpreter&, CallArgs&)> call) {
  auto fn = std::make_shared<Function>();
  fn->name = std::move(name);
  fn->call = std::move(call);
  return fn;
}

Value g_range(Interpreter& in, CallArgs& args) {
  if (!args.keywords.empty()) in.fail("range() takes no keyword arguments");
  const size_t n = args.positional.size();
  if (n < 1 || n > 3) in.fail("range expected at most 3 arguments, got " + std::to_string(n));
  for (const Value& v : args.positional)
    if (!v.is_integral()) in.fail("'" + type_name(v) + "' object cannot be interpreted as an integer");
  int64_t start = 0, stop, step = 1;
  if (n == 1) {
    stop = args.positional[0].as_int();
  } else {
    start = args.positional[0].as_int();
    stop = args.positional[1].as_int();
    if (n == 3) step = args.positional[2].as_int();
  }
  if (step == 0) in.fail("range() arg 3 must not be zero");
  int64_t count = 0;
  if (step > 0 && start < stop) count = (stop - start - 1) / step + 1;
  if (step < 0 && start > stop) count = (start - stop - 1) / (-step) + 1;
  // The sandbox refuses ranges larger than MAX_RANGE.
  if (count > 100000) in.fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  std::vector<Value> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.emplace_back(start + i * step);
  return Value::array(std::move(out));
}

// dict(mapping or pairs, **kwargs), as Python builds it.
ObjectData build_dict(Interpreter& in, CallArgs& args, const char* fname) {
  if (args.positional.size() > 1)
    in.fail(std::string(fname) + " expected at most 1 argument, got " + std::to_string(args.positional.size()));
  ObjectData obj;
  if (!args.positional.empty()) {
    const Value& src = args.positional[0];
    if (src.is_object()) {
      obj = src.object();
    } else {
      for (const Value& pair : in.iterate(src)) {
        if (!pair.is_array() || pair.is_iterator() || pair.array().items.size() != 2)
          in.fail(std::string(fname) + ": sequence elements must be pairs");
        const Value& k = pair.array().items[0];
        if (!k.is_string()) in.fail("dict keys must be strings in chat templates");
        obj.set(k.as_string(), pair.array().items[1]);
      }
    }
  }
  for (auto& [k, v] : args.keywords) obj.set(k, v);
  return obj;
}

Value g_dict(Interpreter& in, CallArgs& args) { return Value::object(build_dict(in, args, "dict")); }

Value g_namespace(Interpreter& in, CallArgs& args) {
  auto ns = std::make_shared<NamespaceData>();
  ns->class_name = "Namespace";
  ns->module = "jinja2.utils";
  ns->attrs = build_dict(in, args, "namespace");
  in.track(ns);
  return Value::namespace_object(std::move(ns));
}

Value g_joiner(Interpreter& in, CallArgs& args) {
  Params p(in, "joiner", args, {"sep"});
  const std::string sep = to_str(p.get(0, Value(", ")));
  auto used = std::make_shared<bool>(false);
  return Value::function(native("joiner", [sep, used](Interpreter&, CallArgs&) -> Value {
    if (!*used) {
      *used = true;
      return Value("");
    }
    return Value(sep);
  }));
}

Value g_cycler(Interpreter& in, CallArgs& args) {
  if (args.positional.empty()) in.fail("at least one item has to be provided");
  auto ns = std::make_shared<NamespaceData>();
  ns->class_name = "Cycler";
  ns->module = "jinja2.utils";
  in.track(ns);
  auto items = std::make_shared<std::vector<Value>>(args.positional);
  auto pos = std::make_shared<size_t>(0);
  std::weak_ptr<NamespaceData> weak = ns;  // the cycler's methods update its `current`
  ns->attrs.set("current", (*items)[0]);
  ns->attrs.set("next", Value::function(native("next", [items, pos, weak](Interpreter&, CallArgs&) -> Value {
    const Value rv = (*items)[*pos];
    *pos = (*pos + 1) % items->size();
    if (auto self = weak.lock()) self->attrs.set("current", (*items)[*pos]);
    return rv;
  })));
  ns->attrs.set("reset", Value::function(native("reset", [items, pos, weak](Interpreter&, CallArgs&) -> Value {
    *pos = 0;
    if (auto self = weak.lock()) self->attrs.set("current", (*items)[0]);
    return Value::none();
  })));
  return Value::namespace_object(std::move(ns));
}

Value g_raise_exception(Interpreter& in, CallArgs& args) {
  Params p(in, "raise_exception", args, {"message"});
  in.fail(TemplateError::Kind::kRaised, to_str(p.required(0)));
}

Value g_strftime_now(Interpreter& in, CallArgs& args) {
  Params p(in, "strftime_now", args, {"format"});
  const Value& format = p.required(0);
  if (!format.is_string()) in.fail("strftime() argument 1 must be str, not " + type_name(format));
  const std::tm now = in.now();
  std::string out(256, '\0');
  // strftime returns 0 both for "too small" and for an empty result; grow a few times, then accept.
  for (int attempt = 0; attempt < 6; ++attempt) {
    const size_t n = std::strftime(out.data(), out.size(), format.as_string().c_str(), &now);
    if (n > 0 || format.as_string().empty()) {
      out.resize(n);
      return Value(out);
    }
    out.resize(out.size() * 4);
  }
  return Value("");
}

}  // namespace

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::string percent_format(Interpreter& in, const std::string& fmt, const Value& args, bool escape_args) {
  std::vector<Value> items;
  if (args.is_tuple()) items = args.array().items;
  else items.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out.push_back(fmt[i]);
      continue;
    }
    if (++i >= fmt.size()) in.fail("incomplete format");
    const char c = fmt[i];
    if (c == '%') {
      out.push_back('%');
      continue;
    }
    const Value* arg;
    std::string key_name;
    if (c == '(') {
      // %(name)s takes the value from a dict argument.
      const size_t close = fmt.find(')', i);
      if (close == std::string::npos) in.fail("incomplete format key");
      if (!args.is_object()) in.fail("format requires a mapping");
      key_name = fmt.substr(i + 1, close - i - 1);
      arg = args.object().find(key_name);
      if (!arg) in.fail("'" + key_name + "'");
      i = close + 1;
      if (i >= fmt.size()) in.fail("incomplete format");
    } else {
      if (next >= items.size()) in.fail("not enough arguments for format string");
      arg = &items[next++];
    }
    const Value& v = *arg;
    switch (fmt[i]) {
      case 's': out += escape_args && !v.is_markup() ? html_escape(to_str(v)) : to_str(v); break;
      case 'r': out += escape_args ? html_escape(to_repr(v)) : to_repr(v); break;
      case 'd': case 'i':
        if (v.is_undefined()) in.fail_undefined(v);
        if (!v.is_number()) in.fail("%" + std::string(1, fmt[i]) + " format: a real number is required, not " + type_name(v));
        out += std::to_string(v.is_float() ? static_cast<int64_t>(v.as_double()) : v.as_int());
        break;
      case 'f': {
        if (v.is_undefined()) in.fail_undefined(v);
        if (!v.is_number()) in.fail("must be real number, not " + type_name(v));
        char buf[64];
        std::snprintf(buf, sizeof buf, "%f", v.as_double());
        out += buf;
        break;
      }
      default:
        in.fail("unsupported format character '" + std::string(1, fmt[i]) + "' in a % format");
    }
  }
  // A lone list or dict argument may go unused (Python treats anything subscriptable as a
  // mapping here); a leftover value or tuple item may not.
  const bool mapping_like = !args.is_tuple() && (args.is_object() || args.is_list() || args.is_undefined());
  if (next < items.size() && !(mapping_like && next == 0))
    in.fail("not all arguments converted during string formatting");
  return out;
}

FilterFn find_filter(std::string_view name) {
  const auto& table = filter_table();
  const auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

TestFn find_test(std::string_view name) {
  const auto& table = test_table();
  const auto it = table.find(name);
  return it == table.end() ? nullptr : it->second;
}

void add_globals(ObjectData& globals) {
  globals.set("range", Value::function(native("range", g_range)));
  globals.set("dict", Value::function(native("dict", g_dict)));
  globals.set("namespace", Value::function(native("namespace", g_namespace)));
  globals.set("joiner", Value::function(native("joiner", g_joiner)));
  globals.set("cycler", Value::function(native("cycler", g_cycler)));
  globals.set("raise_exception", Value::function(native("raise_exception", g_raise_exception)));
  globals.set("strftime_now", Value::function(native("strftime_now", g_strftime_now)));
}

Value find_method(const Value& obj, const std::string& name, bool* found) {
  *found = false;
  const std::unordered_map<std::string_view, Method>* table = nullptr;
  const char* type = nullptr;
  std::initializer_list<const char*> unsafe = {};
  static const std::initializer_list<const char*> kDictUnsafe = {"clear", "pop", "popitem", "setdefault", "update"};
  static const std::initializer_list<const char*> kListUnsafe = {"append", "clear", "extend", "insert",
                                                                 "pop", "remove", "reverse", "sort"};
  if (obj.is_string()) {
    table = &str_methods();
    type = "str";
  } else if (obj.is_object()) {
    table = &dict_methods();
    type = "dict";
    unsafe = kDictUnsafe;
  } else if (obj.is_list()) {
    table = &list_methods();
    type = "list";
    unsafe = kListUnsafe;
  } else if (obj.is_tuple()) {
    static const std::unordered_map<std::string_view, Method> kTuple = {{"index", m_list_index}, {"count", m_list_count}};
    table = &kTuple;
    type = "tuple";
  } else {
    return Value();
  }
  const auto it = table->find(name);
  if (it != table->end()) {
    *found = true;
    return bind(obj, name, it->second);
  }
  for (const char* u : unsafe) {
    if (name == u) {
      *found = true;
      // The immutable sandbox hides methods that would modify the object.
      return Value::undefined("access to attribute '" + name + "' of '" + type + "' object is unsafe.");
    }
  }
  return Value();
}

}  // namespace tq::jinja
