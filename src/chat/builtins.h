// The filters, tests, globals and methods templates can call: jinja2's builtins as the HF
// environment sets them up (tojson replaced by json.dumps with ensure_ascii=False,
// raise_exception and strftime_now added), and the str/dict/list methods the sandbox allows.
#pragma once

#include <string>
#include <string_view>

#include "chat/ast.h"
#include "chat/value.h"

namespace tq::jinja {

FilterFn find_filter(std::string_view name);  // null when jinja2 has no such filter
TestFn find_test(std::string_view name);      // null when jinja2 has no such test

// Adds range, dict, namespace, joiner, raise_exception and strftime_now to a globals table.
void add_globals(ObjectData& globals);

// obj.name for a str, dict or list when Python has such an attribute (*found set): the bound
// method, or for a method the sandbox forbids (list.append, dict.update) an undefined value that
// says so. *found is false when Python has no such attribute.
Value find_method(const Value& obj, const std::string& name, bool* found);

// markupsafe's escape: & < > " ' as HTML entities.
std::string html_escape(const std::string& s);

// Python's printf-style "fmt % args" for %s %r %d %i %f and %%; args is one value, a tuple or a
// dict (for %(name)s). escape_args: Markup's version, which HTML-escapes what it inserts.
std::string percent_format(Interpreter& in, const std::string& fmt, const Value& args, bool escape_args = false);

}  // namespace tq::jinja
