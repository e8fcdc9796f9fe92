// The values a template computes with: the Python objects a jinja2 template sees, reduced to what
// chat templates use. Strings are UTF-8. Lists, tuples and dicts are immutable once built (the
// HF environment is jinja2's ImmutableSandboxedEnvironment, so templates cannot mutate them),
// which lets copies share storage. Namespaces are the one mutable, shared object.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/errors.h"

namespace tq::jinja {

class Interpreter;
class Value;

// Arguments of a call: f(a, b, key=c).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
};

// Anything callable: a global (range, namespace, raise_exception), a bound method ('x'.strip),
// a macro or a loop helper (loop.cycle).
struct Function {
  std::string name;
  bool is_macro = false;
  std::function<Value(Interpreter&, CallArgs&)> call;
};

// A list, a tuple, the one-shot iterator that jinja2's select/map/items/reverse return (which
// is always true, has no len() and prints as a generator object), or a view of a dict's keys,
// values or items (sized and iterable, but not subscriptable).
enum class SeqKind : uint8_t { kList, kTuple, kIterator, kDictKeys, kDictValues, kDictItems };

struct ArrayData {
  std::vector<Value> items;
  SeqKind kind = SeqKind::kList;
};

// A dict in insertion order, as Python keeps it. Keys are strings (all JSON keys are).
struct ObjectData {
  std::vector<std::pair<std::string, Value>> entries;

  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string key, Value value);
};

// jinja2's namespace() object, and the loop object of a for loop: attributes without being a
// mapping. class_name is what Python would call the type ("Namespace", "LoopContext").
struct NamespaceData {
  std::string class_name;
  std::string module;  // for error messages: "jinja2.utils"
  ObjectData attrs;
};

class Value {
 public:
  enum class Kind : uint8_t {
    kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kNamespace, kFunction
  };

  Value() = default;  // undefined
  Value(bool b) : kind_(Kind::kBool) { num_.b = b; }
  Value(int i) : kind_(Kind::kInt) { num_.i = i; }
  Value(int64_t i) : kind_(Kind::kInt) { num_.i = i; }
  Value(double f) : kind_(Kind::kFloat) { num_.f = f; }
  Value(std::string s) : kind_(Kind::kString), str_(std::move(s)) {}
  Value(std::string_view s) : kind_(Kind::kString), str_(s) {}
  Value(const char* s) : kind_(Kind::kString), str_(s) {}

  // hint is the UndefinedError message a misuse of this value raises.
  static Value undefined(std::string hint);
  static Value none();
  static Value markup(std::string s);  // a str that jinja2 marked safe (Markup)
  static Value array(std::vector<Value> items, SeqKind kind = SeqKind::kList);
  static Value object(ObjectData data);
  static Value namespace_object(std::shared_ptr<NamespaceData> data);
  static Value function(std::shared_ptr<Function> fn);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // Python's bool is an int: True + 1 == 2.
  bool is_number() const { return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_integral() const { return kind_ == Kind::kBool || kind_ == Kind::kInt; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && markup_; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_list() const { return is_array() && array().kind == SeqKind::kList; }
  bool is_tuple() const { return is_array() && array().kind == SeqKind::kTuple; }
  bool is_iterator() const { return is_array() && array().kind == SeqKind::kIterator; }
  bool is_dict_view() const { return is_array() && array().kind >= SeqKind::kDictKeys; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_function() const { return kind_ == Kind::kFunction; }

  bool as_bool() const { return num_.b; }
  int64_t as_int() const { return kind_ == Kind::kBool ? (num_.b ? 1 : 0) : num_.i; }
  double as_double() const {
    return kind_ == Kind::kFloat ? num_.f : static_cast<double>(as_int());
  }
  const std::string& as_string() const { return str_; }
  const std::string& undefined_hint() const { return str_; }
  const ArrayData& array() const { return *static_cast<const ArrayData*>(ptr_.get()); }
  const ObjectData& object() const { return *static_cast<const ObjectData*>(ptr_.get()); }
  NamespaceData& namespace_data() const { return *static_cast<NamespaceData*>(ptr_.get()); }
  const Function& function() const { return *static_cast<const Function*>(ptr_.get()); }
  const void* identity() const { return ptr_.get(); }  // for `is sameas` on containers

 private:
  Kind kind_ = Kind::kUndefined;
  bool markup_ = false;
  union {
    bool b;
    int64_t i;
    double f;
  } num_{};
  std::string str_;            // kString: the text; kUndefined: the hint
  std::shared_ptr<void> ptr_;  // ArrayData, ObjectData, NamespaceData or Function, by kind
};

// ---- Python semantics on values

// Python's name of the type: "str", "int", "NoneType", "list", "dict", ...
std::string type_name(const Value& v);
// jinja2's object_type_repr: "dict object", "None", "jinja2.utils.Namespace object".
std::string object_type_repr(const Value& v);
bool truthy(const Value& v);
std::string to_str(const Value& v);   // str(v); undefined prints as ""
std::string to_repr(const Value& v);  // repr(v)
bool equals(const Value& a, const Value& b);  // a == b

// json.dumps(v, ensure_ascii=..., indent=..., separators=..., sort_keys=...). indent < 0 means
// None (one line); indent_text is used instead of spaces when not empty. Throws a kRuntime
// TemplateError for values JSON cannot hold (undefined, namespaces, functions).
struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent_text;  // the text for one level of indentation
  bool has_separators = false;
  std::string item_separator;
  std::string key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// Converts parsed JSON (nlohmann::json or nlohmann::ordered_json) into a value. Objects keep the
// order the JSON type keeps: use ordered_json to keep the order Python's json.load would.
template <typename Json>
Value from_json(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return Value::none();
    case Json::value_t::boolean:
      return Value(j.template get<bool>());
    case Json::value_t::number_integer:
      return Value(j.template get<int64_t>());
    case Json::value_t::number_unsigned: {
      const uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        throw TemplateError(TemplateError::Kind::kRuntime,
                            "integer " + std::to_string(u) + " in the context is too large");
      return Value(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float:
      return Value(j.template get<double>());
    case Json::value_t::string:
      return Value(j.template get_ref<const std::string&>());
    case Json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::array(std::move(items));
    }
    case Json::value_t::object: {
      ObjectData obj;
      obj.entries.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) obj.set(it.key(), from_json(it.value()));
      return Value::object(std::move(obj));
    }
    default:
      throw TemplateError(TemplateError::Kind::kRuntime,
                          "the context holds a JSON value of a type templates cannot use (binary)");
  }
}

}  // namespace tq::jinja
