#include "chat/value.h"

#include <algorithm>
#include <cmath>

#include "chat/text.h"

namespace tq::jinja {

const Value* ObjectData::find(std::string_view key) const {
  for (const auto& [k, v] : entries)
    if (k == key) return &v;
  return nullptr;
}

Value* ObjectData::find(std::string_view key) {
  for (auto& [k, v] : entries)
    if (k == key) return &v;
  return nullptr;
}

void ObjectData::set(std::string key, Value value) {
  if (Value* existing = find(key)) {
    *existing = std::move(value);
    return;
  }
  entries.emplace_back(std::move(key), std::move(value));
}

Value Value::undefined(std::string hint) {
  Value v;
  v.str_ = std::move(hint);
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::markup(std::string s) {
  Value v(std::move(s));
  v.markup_ = true;
  return v;
}

Value Value::array(std::vector<Value> items, SeqKind kind) {
  Value v;
  v.kind_ = Kind::kArray;
  v.ptr_ = std::make_shared<ArrayData>(ArrayData{std::move(items), kind});
  return v;
}

Value Value::object(ObjectData data) {
  Value v;
  v.kind_ = Kind::kObject;
  v.ptr_ = std::make_shared<ObjectData>(std::move(data));
  return v;
}

Value Value::namespace_object(std::shared_ptr<NamespaceData> data) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.ptr_ = std::move(data);
  return v;
}

Value Value::function(std::shared_ptr<Function> fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.ptr_ = std::move(fn);
  return v;
}

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return v.is_markup() ? "Markup" : "str";
    case Value::Kind::kArray:
      switch (v.array().kind) {
        case SeqKind::kList: return "list";
        case SeqKind::kTuple: return "tuple";
        case SeqKind::kIterator: return "generator";
        case SeqKind::kDictKeys: return "dict_keys";
        case SeqKind::kDictValues: return "dict_values";
        case SeqKind::kDictItems: return "dict_items";
      }
      return "list";
    case Value::Kind::kObject: return "dict";
    case Value::Kind::kNamespace: return v.namespace_data().class_name;
    case Value::Kind::kFunction: return v.function().is_macro ? "Macro" : "function";
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_namespace()) return v.namespace_data().module + "." + v.namespace_data().class_name + " object";
  if (v.is_markup()) return "markupsafe.Markup object";
  if (v.is_function() && v.function().is_macro) return "jinja2.runtime.Macro object";
  return type_name(v) + " object";
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.as_bool();
    case Value::Kind::kInt: return v.as_int() != 0;
    case Value::Kind::kFloat: return v.as_double() != 0.0;
    case Value::Kind::kString: return !v.as_string().empty();
    case Value::Kind::kArray:
      // A generator object is always true, however many items it would yield.
      return v.array().kind == SeqKind::kIterator || !v.array().items.empty();
    case Value::Kind::kObject: return !v.object().entries.empty();
    case Value::Kind::kNamespace: return true;
    case Value::Kind::kFunction: return true;
  }
  return false;
}

namespace {

void append_repr(std::string& out, const Value& v);

void append_dict_repr(std::string& out, const ObjectData& obj) {
  out.push_back('{');
  bool first = true;
  for (const auto& [k, item] : obj.entries) {
    if (!first) out += ", ";
    first = false;
    out += text::repr(k);
    out += ": ";
    append_repr(out, item);
  }
  out.push_back('}');
}

void append_repr(std::string& out, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      out += "Undefined";
      return;
    case Value::Kind::kString:
      if (v.is_markup()) {
        out += "Markup(" + text::repr(v.as_string()) + ")";
      } else {
        out += text::repr(v.as_string());
      }
      return;
    case Value::Kind::kArray: {
      const ArrayData& arr = v.array();
      if (arr.kind == SeqKind::kIterator) {
        out += "<generator object>";
        return;
      }
      if (v.is_dict_view()) out += type_name(v) + "(";
      const bool tuple = arr.kind == SeqKind::kTuple;
      out.push_back(tuple ? '(' : '[');
      for (size_t i = 0; i < arr.items.size(); ++i) {
        if (i) out += ", ";
        append_repr(out, arr.items[i]);
      }
      if (tuple && arr.items.size() == 1) out.push_back(',');
      out.push_back(tuple ? ')' : ']');
      if (v.is_dict_view()) out.push_back(')');
      return;
    }
    case Value::Kind::kObject:
      append_dict_repr(out, v.object());
      return;
    default:
      out += to_str(v);
      return;
  }
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat: return text::float_repr(v.as_double());
    case Value::Kind::kString: return v.as_string();
    case Value::Kind::kNamespace: {
      const NamespaceData& ns = v.namespace_data();
      if (ns.class_name == "LoopContext") {
        const Value* index = ns.attrs.find("index");
        const Value* length = ns.attrs.find("length");
        return "<LoopContext " + (index ? to_str(*index) : "?") + "/" +
               (length ? to_str(*length) : "?") + ">";
      }
      std::string out = "<" + ns.class_name + " ";
      append_dict_repr(out, ns.attrs);
      return out + ">";
    }
    case Value::Kind::kFunction:
      if (v.function().is_macro) return "<Macro " + text::repr(v.function().name) + ">";
      return "<built-in function " + v.function().name + ">";
    default: {
      std::string out;
      append_repr(out, v);
      return out;
    }
  }
}

std::string to_repr(const Value& v) {
  std::string out;
  append_repr(out, v);
  return out;
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kArray: {
      const ArrayData& x = a.array();
      const ArrayData& y = b.array();
      if (x.kind == SeqKind::kIterator || y.kind == SeqKind::kIterator) return &x == &y;
      if (x.kind != y.kind || x.items.size() != y.items.size()) return false;
      if (x.kind == SeqKind::kDictValues) return &x == &y;  // values views compare by identity
      if (x.kind == SeqKind::kDictKeys || x.kind == SeqKind::kDictItems) {
        // Keys and items views compare as sets.
        for (const Value& item : x.items) {
          bool found = false;
          for (const Value& other : y.items) found = found || equals(item, other);
          if (!found) return false;
        }
        return true;
      }
      for (size_t i = 0; i < x.items.size(); ++i)
        if (!equals(x.items[i], y.items[i])) return false;
      return true;
    }
    case Value::Kind::kObject: {
      const ObjectData& x = a.object();
      const ObjectData& y = b.object();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [k, item] : x.entries) {
        const Value* other = y.find(k);
        if (!other || !equals(item, *other)) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

namespace {

void append_json(std::string& out, const Value& v, const JsonOptions& opt, int depth) {
  if (depth > 500)
    throw TemplateError(TemplateError::Kind::kRuntime, "tojson: value is nested too deeply");
  auto newline = [&](int level) {
    out.push_back('\n');
    for (int i = 0; i < level; ++i) out += opt.indent_text;
  };
  const std::string item_sep =
      opt.has_separators ? opt.item_separator : (opt.has_indent ? "," : ", ");
  const std::string key_sep = opt.has_separators ? opt.key_separator : ": ";
  switch (v.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat: {
      const double f = v.as_double();
      if (std::isnan(f)) out += "NaN";
      else if (std::isinf(f)) out += f < 0 ? "-Infinity" : "Infinity";
      else out += text::float_repr(f);
      return;
    }
    case Value::Kind::kString:
      out += text::json_quote(v.as_string(), opt.ensure_ascii);
      return;
    case Value::Kind::kArray: {
      if (!v.is_list() && !v.is_tuple()) break;
      const auto& items = v.array().items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        if (opt.has_indent) newline(depth + 1);
        append_json(out, items[i], opt, depth + 1);
      }
      if (opt.has_indent) newline(depth);
      out.push_back(']');
      return;
    }
    case Value::Kind::kObject: {
      const auto& entries = v.object().entries;
      if (entries.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> order;
      order.reserve(entries.size());
      for (const auto& e : entries) order.push_back(&e);
      // Python compares str keys by code point, which is the byte order of their UTF-8.
      if (opt.sort_keys)
        std::stable_sort(order.begin(), order.end(),
                         [](const auto* x, const auto* y) { return x->first < y->first; });
      out.push_back('{');
      for (size_t i = 0; i < order.size(); ++i) {
        if (i) out += item_sep;
        if (opt.has_indent) newline(depth + 1);
        out += text::json_quote(order[i]->first, opt.ensure_ascii);
        out += key_sep;
        append_json(out, order[i]->second, opt, depth + 1);
      }
      if (opt.has_indent) newline(depth);
      out.push_back('}');
      return;
    }
    default:
      break;
  }
  throw TemplateError(TemplateError::Kind::kRuntime,
                      "Object of type " + type_name(v) + " is not JSON serializable");
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  append_json(out, v, options, 0);
  return out;
}

}  // namespace tq::jinja
