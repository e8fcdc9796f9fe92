#include "chat/interpreter.h"

#include <cmath>
#include <limits>

#include "chat/builtins.h"
#include "chat/text.h"

namespace tq::jinja {
namespace {

// Python runs out of stack (RecursionError) long before this; we stop well before ours does.
constexpr int kMaxCallDepth = 100;

// Python's slice.indices(): clamps start/stop/step against a sequence of length n.
struct SliceRange {
  int64_t start, stop, step;
};

SliceRange adjust_slice(int64_t n, const std::optional<int64_t>& a, const std::optional<int64_t>& b,
                        int64_t step) {
  auto clamp = [&](const std::optional<int64_t>& v, bool is_start) -> int64_t {
    if (!v) return step < 0 ? (is_start ? n - 1 : -1) : (is_start ? 0 : n);
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= n) {
      x = step < 0 ? n - 1 : n;
    }
    return x;
  };
  return {clamp(a, true), clamp(b, false), step};
}

// Floor division and modulo of floats with the results Python gives (sign of the divisor,
// floor rounding corrected for the inexact quotient).
void float_divmod(double vx, double wx, double* floordiv, double* mod) {
  double m = std::fmod(vx, wx);
  double div = (vx - m) / wx;
  if (m != 0.0) {
    if ((wx < 0) != (m < 0)) {
      m += wx;
      div -= 1.0;
    }
  } else {
    m = std::copysign(0.0, wx);
  }
  double fd;
  if (div != 0.0) {
    fd = std::floor(div);
    if (div - fd > 0.5) fd += 1.0;
  } else {
    fd = std::copysign(0.0, vx / wx);
  }
  *floordiv = fd;
  *mod = m;
}

}  // namespace

Interpreter::Interpreter(const Source& source, std::optional<std::tm> now)
    : source_(source), now_(now), globals_(std::make_shared<Scope>()) {
  add_globals(globals_->vars);
}

std::string Interpreter::render(const Body& body, const ObjectData& context) {
  // Macros hold the scope they were defined in and namespaces can hold themselves: reference
  // cycles. Nothing a template makes outlives its render (the result is a string), so emptying
  // every scope and namespace at the end frees them all.
  struct Teardown {
    Interpreter& in;
    ~Teardown() {
      for (auto& weak : in.scopes_)
        if (auto scope = weak.lock()) scope->vars.entries.clear();
      for (auto& weak : in.namespaces_)
        if (auto ns = weak.lock()) ns->attrs.entries.clear();
      in.scopes_.clear();
      in.namespaces_.clear();
    }
  } teardown{*this};
  auto root = new_scope(globals_);
  root->vars = context;
  std::string out;
  try {
    exec(body, root, out);
  } catch (const TemplateError& e) {
    if (e.line() > 0) throw;
    // Raised without a position (deep in a value helper): place it at the current expression.
    throw TemplateError(e.kind(), e.message(), source_.line_of(offset_), source_.column_of(offset_));
  }
  return out;
}

ScopePtr Interpreter::new_scope(const ScopePtr& parent) {
  auto scope = std::make_shared<Scope>();
  scope->parent = parent;
  if (scopes_.size() >= 2 * live_scope_hint_ + 64) {
    // Forget the scopes that are already gone, so that long loops keep this list short.
    std::erase_if(scopes_, [](const std::weak_ptr<Scope>& w) { return w.expired(); });
    live_scope_hint_ = scopes_.size();
  }
  scopes_.push_back(scope);
  return scope;
}

void Interpreter::track(const std::shared_ptr<NamespaceData>& ns) {
  if (namespaces_.size() >= 2 * live_namespace_hint_ + 64) {
    std::erase_if(namespaces_, [](const std::weak_ptr<NamespaceData>& w) { return w.expired(); });
    live_namespace_hint_ = namespaces_.size();
  }
  namespaces_.push_back(ns);
}

void Interpreter::fail(const std::string& message) const { fail(TemplateError::Kind::kRuntime, message); }

void Interpreter::fail(TemplateError::Kind kind, const std::string& message) const {
  throw TemplateError(kind, message, source_.line_of(offset_), source_.column_of(offset_));
}

void Interpreter::fail_undefined(const Value& undefined) const {
  fail(TemplateError::Kind::kUndefined,
       undefined.undefined_hint().empty() ? "undefined value" : undefined.undefined_hint());
}

std::tm Interpreter::now() const {
  if (now_) return *now_;
  const std::time_t t = std::time(nullptr);
  std::tm local{};
  localtime_r(&t, &local);
  return local;
}

// ---------------------------------------------------------------- statements

Interpreter::Flow Interpreter::exec(const Body& body, const ScopePtr& scope, std::string& out) {
  for (const StmtPtr& s : body) {
    const Flow flow = exec_stmt(*s, scope, out);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out) {
  switch (s.kind) {
    case StmtKind::kText:
      out += s.text;
      return Flow::kNormal;
    case StmtKind::kOutput:
      out += to_str(eval(*s.expr, scope));
      return Flow::kNormal;
    case StmtKind::kIf:
      for (size_t i = 0; i < s.conditions.size(); ++i)
        if (truthy(eval(*s.conditions[i], scope))) return exec(s.bodies[i], scope, out);
      return exec(s.else_body, scope, out);
    case StmtKind::kFor:
      return exec_for(s, scope, out);
    case StmtKind::kSet:
      assign(s.target, eval(*s.expr, scope), scope);
      return Flow::kNormal;
    case StmtKind::kSetBlock: {
      auto inner = new_scope(scope);
      std::string text;
      exec(s.body, inner, text);
      Value value(std::move(text));
      if (s.filter) value = eval_filter(*s.filter, scope, &value);
      assign(s.target, value, scope);
      return Flow::kNormal;
    }
    case StmtKind::kMacro:
      scope->vars.set(s.name, make_macro(s, scope, s.name));
      return Flow::kNormal;
    case StmtKind::kCallBlock: {
      if (!s.expr) {  // {% generation %}: the body's output, rendered as a caller would be
        auto inner = new_scope(scope);
        exec(s.body, inner, out);
        return Flow::kNormal;
      }
      const Expr& call = *s.expr;
      Value callee = eval(*call.args[0], scope);
      CallArgs args;
      collect_args(call, 1, scope, args);
      args.keywords.emplace_back("caller", make_macro(s, scope, "caller"));
      at(call.offset);
      out += to_str(this->call(callee, args));
      return Flow::kNormal;
    }
    case StmtKind::kFilterBlock: {
      auto inner = new_scope(scope);
      std::string text;
      exec(s.body, inner, text);
      const Value input(std::move(text));
      out += to_str(eval_filter(*s.filter, scope, &input));
      return Flow::kNormal;
    }
    case StmtKind::kWith: {
      std::vector<Value> values;
      for (const auto& v : s.values) values.push_back(eval(*v, scope));
      auto inner = new_scope(scope);
      for (size_t i = 0; i < s.targets.size(); ++i) assign(s.targets[i], values[i], inner);
      return exec(s.body, inner, out);
    }
    case StmtKind::kBreak:
      return Flow::kBreak;
    case StmtKind::kContinue:
      return Flow::kContinue;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
  const Value iterable = eval(*s.expr, scope);
  at(s.expr->offset);
  std::vector<Value> items = iterate(iterable);
  if (s.filter) {
    // `for x in xs if cond`: the condition sees the loop variable but not `loop`.
    std::vector<Value> kept;
    for (Value& item : items) {
      auto probe = new_scope(scope);
      assign(s.target, item, probe);
      if (truthy(eval(*s.filter, probe))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  // loop.cycle(a, b, ...) picks by position; loop.changed(x) compares with its previous call.
  auto index0 = std::make_shared<int64_t>(0);
  auto cycle = std::make_shared<Function>();
  cycle->name = "cycle";
  cycle->call = [index0](Interpreter& in, CallArgs& args) -> Value {
    if (args.positional.empty()) in.fail("no items for cycling given");
    return args.positional[static_cast<size_t>(*index0) % args.positional.size()];
  };
  auto last_changed = std::make_shared<std::optional<Value>>();
  auto changed = std::make_shared<Function>();
  changed->name = "changed";
  changed->call = [last_changed](Interpreter&, CallArgs& args) -> Value {
    const Value now = Value::array(args.positional);
    if (*last_changed && equals(**last_changed, now)) return Value(false);
    *last_changed = now;
    return Value(true);
  };
  bool completed_an_iteration = false;
  const Value cycle_value = Value::function(cycle);
  const Value changed_value = Value::function(changed);
  for (int64_t i = 0; i < n; ++i) {
    *index0 = i;
    auto inner = new_scope(scope);
    assign(s.target, items[static_cast<size_t>(i)], inner);
    auto loop = std::make_shared<NamespaceData>();
    track(loop);
    loop->class_name = "LoopContext";
    loop->module = "jinja2.runtime";
    ObjectData& a = loop->attrs;
    a.entries.reserve(14);
    a.set("index", Value(i + 1));
    a.set("index0", Value(i));
    a.set("revindex", Value(n - i));
    a.set("revindex0", Value(n - i - 1));
    a.set("first", Value(i == 0));
    a.set("last", Value(i == n - 1));
    a.set("length", Value(n));
    a.set("depth", Value(1));
    a.set("depth0", Value(0));
    a.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("there is no previous item"));
    a.set("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value::undefined("there is no next item"));
    a.set("cycle", cycle_value);
    a.set("changed", changed_value);
    inner->vars.set("loop", Value::namespace_object(std::move(loop)));
    const Flow flow = exec(s.body, inner, out);
    if (flow == Flow::kBreak) break;
    if (flow == Flow::kNormal) completed_an_iteration = true;
  }
  // jinja2 clears its "no iteration" flag at the end of the loop body, which continue and break
  // skip: the else block runs unless some iteration ran its body to the end.
  // The else block sits outside the loop: a break or continue there is the enclosing loop's.
  if (!completed_an_iteration) return exec(s.else_body, new_scope(scope), out);
  return Flow::kNormal;
}

void Interpreter::assign(const Target& target, const Value& value, const ScopePtr& scope) {
  switch (target.kind) {
    case Target::Kind::kName:
      scope->vars.set(target.name, value);
      return;
    case Target::Kind::kNamespaceAttr: {
      at(target.offset);
      const Value ns = lookup(scope, target.name);
      if (!ns.is_namespace() || ns.namespace_data().class_name != "Namespace")
        fail("cannot assign attribute on non-namespace object");
      ns.namespace_data().attrs.set(target.attr, value);
      return;
    }
    case Target::Kind::kTuple: {
      at(target.offset);
      if (!value.is_array() && !value.is_string() && !value.is_object() && !value.is_undefined())
        fail("cannot unpack non-iterable " + type_name(value) + " object");
      const std::vector<Value> items = iterate(value);
      const size_t want = target.items.size();
      if (items.size() < want)
        fail("not enough values to unpack (expected " + std::to_string(want) + ", got " +
             std::to_string(items.size()) + ")");
      if (items.size() > want) fail("too many values to unpack (expected " + std::to_string(want) + ")");
      for (size_t i = 0; i < want; ++i) assign(target.items[i], items[i], scope);
      return;
    }
  }
}

Value Interpreter::lookup(const ScopePtr& scope, const std::string& name) const {
  for (const Scope* s = scope.get(); s; s = s->parent.get())
    if (const Value* v = s->vars.find(name)) return *v;
  return Value::undefined("'" + name + "' is undefined");
}

// ---------------------------------------------------------------- macros

Value Interpreter::make_macro(const Stmt& s, const ScopePtr& closure, const std::string& name) {
  auto fn = std::make_shared<Function>();
  fn->name = name;
  fn->is_macro = true;
  const Stmt* stmt = &s;
  // The closure holds the defining scope; a macro value cannot outlive the render that made it.
  fn->call = [stmt, closure, name](Interpreter& in, CallArgs& args) -> Value {
    return in.call_macro(*stmt, closure, name, args);
  };
  return Value::function(std::move(fn));
}

Value Interpreter::call_macro(const Stmt& s, const ScopePtr& closure, const std::string& name,
                              CallArgs& args) {
  if (call_depth_ >= kMaxCallDepth) fail("maximum recursion depth exceeded");
  auto scope = new_scope(closure);
  const size_t n_params = s.params.size();
  const size_t first_default = n_params - s.defaults.size();
  std::vector<bool> bound(n_params, false);
  for (size_t i = 0; i < args.positional.size() && i < n_params; ++i) {
    scope->vars.set(s.params[i], args.positional[i]);
    bound[i] = true;
  }
  ObjectData extra_kwargs;
  Value caller;
  for (auto& [key, value] : args.keywords) {
    size_t i = 0;
    while (i < n_params && s.params[i] != key) ++i;
    if (i < n_params) {
      if (bound[i]) fail("macro '" + name + "' got multiple values for argument '" + key + "'");
      scope->vars.set(key, value);
      bound[i] = true;
    } else if (key == "caller" && s.uses_caller) {
      caller = value;
    } else if (s.uses_kwargs) {
      extra_kwargs.set(key, value);
    } else {
      fail("macro '" + name + "' takes no keyword argument '" + key + "'");
    }
  }
  if (args.positional.size() > n_params && !s.uses_varargs)
    fail("macro '" + name + "' takes not more than " + std::to_string(n_params) + " argument(s)");
  for (size_t i = 0; i < n_params; ++i) {
    if (bound[i]) continue;
    // Defaults are evaluated at call time, in the macro's scope: they may use earlier parameters.
    if (i >= first_default) scope->vars.set(s.params[i], eval(*s.defaults[i - first_default], scope));
    else scope->vars.set(s.params[i], Value::undefined("parameter '" + s.params[i] + "' was not provided"));
  }
  if (s.uses_varargs) {
    std::vector<Value> rest;
    for (size_t i = n_params; i < args.positional.size(); ++i) rest.push_back(args.positional[i]);
    scope->vars.set("varargs", Value::array(std::move(rest), SeqKind::kTuple));
  }
  if (s.uses_kwargs) scope->vars.set("kwargs", Value::object(std::move(extra_kwargs)));
  if (s.uses_caller) {
    scope->vars.set("caller", caller.is_undefined() ? Value::undefined("No caller defined") : caller);
  }
  ++call_depth_;
  std::string out;
  try {
    exec(s.body, scope, out);
  } catch (...) {
    --call_depth_;
    throw;
  }
  --call_depth_;
  return Value(std::move(out));
}

// ---------------------------------------------------------------- expressions

Value Interpreter::eval(const Expr& e, const ScopePtr& scope) {
  switch (e.kind) {
    case ExprKind::kConst:
      return e.value;
    case ExprKind::kName:
      return lookup(scope, e.name);
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) items.push_back(eval(*a, scope));
      return Value::array(std::move(items), e.kind == ExprKind::kList ? SeqKind::kList : SeqKind::kTuple);
    }
    case ExprKind::kDict: {
      ObjectData obj;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value key = eval(*e.args[i], scope);
        Value value = eval(*e.args[i + 1], scope);
        at(e.args[i]->offset);
        if (!key.is_string()) fail("dict keys must be strings in chat templates, not " + type_name(key));
        obj.set(key.as_string(), std::move(value));
      }
      return Value::object(std::move(obj));
    }
    case ExprKind::kGetAttr: {
      Value obj = eval(*e.args[0], scope);
      at(e.offset);
      return getattr(obj, e.name);
    }
    case ExprKind::kGetItem: {
      Value obj = eval(*e.args[0], scope);
      if (e.args[1]->kind == ExprKind::kSlice) return eval_slice(obj, *e.args[1], scope);
      Value key = eval(*e.args[1], scope);
      at(e.offset);
      return getitem(obj, key);
    }
    case ExprKind::kSlice:
      at(e.offset);
      fail("a slice can only be used as a subscript");
    case ExprKind::kCall:
      return eval_call(e, scope);
    case ExprKind::kFilter:
      return eval_filter(e, scope, nullptr);
    case ExprKind::kTest: {
      Value input = eval(*e.args[0], scope);
      CallArgs args;
      collect_args(e, 1, scope, args);
      at(e.offset);
      if (!e.test) fail("No test named '" + e.name + "' found.");
      return Value(e.test(*this, input, args));
    }
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      Value v = eval(*e.args[0], scope);
      at(e.offset);
      if (v.is_undefined()) fail_undefined(v);
      if (!v.is_number())
        fail(std::string("bad operand type for unary ") + (e.kind == ExprKind::kNeg ? "-" : "+") + ": '" + type_name(v) + "'");
      if (e.kind == ExprKind::kPos) return v.is_float() ? v : Value(v.as_int());
      if (v.is_float()) return Value(-v.as_double());
      if (v.as_int() == std::numeric_limits<int64_t>::min()) fail("integer overflow");
      return Value(-v.as_int());
    }
    case ExprKind::kNot:
      return Value(!truthy(eval(*e.args[0], scope)));
    case ExprKind::kBinary: {
      Value a = eval(*e.args[0], scope);
      Value b = eval(*e.args[1], scope);
      at(e.offset);
      return binary(e.binary_op, a, b);
    }
    case ExprKind::kAnd: {
      Value a = eval(*e.args[0], scope);
      return truthy(a) ? eval(*e.args[1], scope) : a;
    }
    case ExprKind::kOr: {
      Value a = eval(*e.args[0], scope);
      return truthy(a) ? a : eval(*e.args[1], scope);
    }
    case ExprKind::kCompare: {
      // Python chains: a < b < c means a < b and b < c, each operand evaluated once.
      Value left = eval(*e.args[0], scope);
      for (size_t i = 0; i < e.compare_ops.size(); ++i) {
        Value right = eval(*e.args[i + 1], scope);
        at(e.offset);
        if (!compare_values(e.compare_ops[i], left, right)) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case ExprKind::kConcat: {
      std::string out;
      for (const auto& a : e.args) out += to_str(eval(*a, scope));
      return Value(std::move(out));
    }
    case ExprKind::kCondExpr: {
      if (truthy(eval(*e.args[1], scope))) return eval(*e.args[0], scope);
      if (e.args[2]) return eval(*e.args[2], scope);
      return Value::undefined("the inline if-expression on line " + std::to_string(source_.line_of(e.offset)) +
                              " evaluated to false and no else section was defined.");
    }
  }
  return Value();
}

void Interpreter::collect_args(const Expr& e, size_t first_positional, const ScopePtr& scope, CallArgs& args) {
  for (size_t i = first_positional; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i], scope));
  for (const auto& [key, value] : e.kwargs) args.keywords.emplace_back(key, eval(*value, scope));
  if (e.dyn_args) {
    Value extra = eval(*e.dyn_args, scope);
    at(e.dyn_args->offset);
    for (Value& v : iterate(extra)) args.positional.push_back(std::move(v));
  }
  if (e.dyn_kwargs) {
    Value extra = eval(*e.dyn_kwargs, scope);
    at(e.dyn_kwargs->offset);
    if (!extra.is_object()) fail("argument after ** must be a mapping, not " + type_name(extra));
    for (const auto& [key, value] : extra.object().entries) args.keywords.emplace_back(key, value);
  }
}

Value Interpreter::eval_call(const Expr& e, const ScopePtr& scope) {
  Value callee = eval(*e.args[0], scope);
  CallArgs args;
  collect_args(e, 1, scope, args);
  at(e.offset);
  return call(callee, args);
}

Value Interpreter::eval_filter(const Expr& e, const ScopePtr& scope, const Value* block_input) {
  Value input;
  if (e.args[0]) {
    input = e.args[0]->kind == ExprKind::kFilter ? eval_filter(*e.args[0], scope, block_input)
                                                 : eval(*e.args[0], scope);
  } else if (block_input) {
    input = *block_input;
  }
  CallArgs args;
  collect_args(e, 1, scope, args);
  at(e.offset);
  if (!e.filter) fail("No filter named '" + e.name + "' found.");
  return e.filter(*this, input, args);
}

Value Interpreter::eval_slice(const Value& obj, const Expr& slice, const ScopePtr& scope) {
  Value bounds[3];
  for (int i = 0; i < 3; ++i)
    if (slice.args[static_cast<size_t>(i)]) bounds[i] = eval(*slice.args[static_cast<size_t>(i)], scope);
    else bounds[i] = Value::none();
  at(slice.offset);
  if (obj.is_undefined()) fail_undefined(obj);
  auto as_index = [](const Value& v, bool* ok) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (!v.is_integral()) {
      *ok = false;
      return std::nullopt;
    }
    return v.as_int();
  };
  bool ok = true;
  const auto start = as_index(bounds[0], &ok);
  const auto stop = as_index(bounds[1], &ok);
  const auto step_opt = as_index(bounds[2], &ok);
  const bool sliceable = obj.is_string() || obj.is_list() || obj.is_tuple();
  if (!ok || !sliceable) {
    // Python raises TypeError, which jinja2's getitem turns into an undefined value.
    return Value::undefined(object_type_repr(obj) + " has no element slice(" + to_repr(bounds[0]) + ", " +
                            to_repr(bounds[1]) + ", " + to_repr(bounds[2]) + ")");
  }
  const int64_t step = step_opt.value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  if (obj.is_string()) {
    const std::u32string cps = text::decode(obj.as_string());
    const SliceRange r = adjust_slice(static_cast<int64_t>(cps.size()), start, stop, step);
    std::u32string out;
    for (int64_t i = r.start; step > 0 ? i < r.stop : i > r.stop; i += step) out.push_back(cps[static_cast<size_t>(i)]);
    return Value(text::encode(out));
  }
  const auto& items = obj.array().items;
  const SliceRange r = adjust_slice(static_cast<int64_t>(items.size()), start, stop, step);
  std::vector<Value> out;
  for (int64_t i = r.start; step > 0 ? i < r.stop : i > r.stop; i += step) out.push_back(items[static_cast<size_t>(i)]);
  return Value::array(std::move(out), obj.array().kind);
}

// ---------------------------------------------------------------- object protocol

Value Interpreter::call(const Value& callee, CallArgs& args) {
  if (callee.is_function()) return callee.function().call(*this, args);
  if (callee.is_undefined()) fail_undefined(callee);
  fail("'" + type_name(callee) + "' object is not callable");
}

Value Interpreter::getattr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      fail_undefined(obj);
    case Value::Kind::kObject: {
      // The sandbox looks for a Python attribute first (dict methods), then for a key.
      bool found = false;
      Value method = find_method(obj, name, &found);
      if (found) return method;
      if (const Value* v = obj.object().find(name)) return *v;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    case Value::Kind::kNamespace:
      if (const Value* v = obj.namespace_data().attrs.find(name)) return *v;
      break;
    case Value::Kind::kString:
    case Value::Kind::kArray: {
      bool found = false;
      Value method = find_method(obj, name, &found);
      if (found) return method;
      break;
    }
    default:
      break;
  }
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
}

Value Interpreter::getitem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_object() && key.is_string()) {
    if (const Value* v = obj.object().find(key.as_string())) return *v;
  } else if ((obj.is_list() || obj.is_tuple() || obj.is_string()) && key.is_integral()) {
    const int64_t n = obj.is_string() ? static_cast<int64_t>(text::length(obj.as_string()))
                                      : static_cast<int64_t>(obj.array().items.size());
    int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i >= 0 && i < n) {
      if (!obj.is_string()) return obj.array().items[static_cast<size_t>(i)];
      std::string ch;
      text::append_utf8(ch, text::decode(obj.as_string())[static_cast<size_t>(i)]);
      return Value(std::move(ch));
    }
    return Value::undefined(object_type_repr(obj) + " has no element " + to_repr(key));
  }
  // obj[key] failed: jinja2 falls back to the attribute of that name when the key is a string.
  if (key.is_string()) {
    if (obj.is_namespace()) {
      if (const Value* v = obj.namespace_data().attrs.find(key.as_string())) return *v;
    } else {
      bool found = false;
      Value method = find_method(obj, key.as_string(), &found);
      if (found) return method;
    }
    return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + key.as_string() + "'");
  }
  return Value::undefined(object_type_repr(obj) + " has no element " + to_repr(key));
}

Value Interpreter::filter_by_name(const std::string& name, const Value& input, CallArgs& args) {
  const FilterFn f = find_filter(name);
  if (!f) fail("No filter named '" + name + "'.");
  return f(*this, input, args);
}

bool Interpreter::test_by_name(const std::string& name, const Value& input, CallArgs& args) {
  const TestFn t = find_test(name);
  if (!t) fail("No test named '" + name + "'.");
  return t(*this, input, args);
}

std::vector<Value> Interpreter::iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kArray:
      return v.array().items;
    case Value::Kind::kObject: {
      std::vector<Value> keys;
      keys.reserve(v.object().entries.size());
      for (const auto& [k, item] : v.object().entries) keys.emplace_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      std::vector<Value> chars;
      for (char32_t c : text::decode(v.as_string())) {
        std::string ch;
        text::append_utf8(ch, c);
        chars.emplace_back(std::move(ch));
      }
      return chars;
    }
    default:
      fail("'" + type_name(v) + "' object is not iterable");
  }
}

bool Interpreter::less(const Value& a, const Value& b) { return compare_values(CompareOp::kLt, a, b); }

bool Interpreter::compare_values(CompareOp op, const Value& a, const Value& b) {
  switch (op) {
    case CompareOp::kEq: return equals(a, b);
    case CompareOp::kNe: return !equals(a, b);
    case CompareOp::kIn: return contains(b, a);
    case CompareOp::kNotIn: return !contains(b, a);
    default: break;
  }
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  // Python orders numbers, strings (by code point, which is UTF-8 byte order) and sequences of
  // the same type (by their first differing items, then by length).
  int order;  // <0, 0, >0
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.as_double(), y = b.as_double();
      if (std::isnan(x) || std::isnan(y)) return false;
      order = x < y ? -1 : x > y ? 1 : 0;
    } else {
      order = a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    }
  } else if (a.is_string() && b.is_string()) {
    const int c = a.as_string().compare(b.as_string());
    order = c < 0 ? -1 : c > 0 ? 1 : 0;
  } else if ((a.is_list() && b.is_list()) || (a.is_tuple() && b.is_tuple())) {
    const auto& x = a.array().items;
    const auto& y = b.array().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equals(x[i], y[i])) return compare_values(op, x[i], y[i]);
    order = x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  } else {
    const char* symbol = op == CompareOp::kLt ? "<" : op == CompareOp::kLe ? "<=" : op == CompareOp::kGt ? ">" : ">=";
    fail(std::string("'") + symbol + "' not supported between instances of '" + type_name(a) + "' and '" +
         type_name(b) + "'");
  }
  switch (op) {
    case CompareOp::kLt: return order < 0;
    case CompareOp::kLe: return order <= 0;
    case CompareOp::kGt: return order > 0;
    default: return order >= 0;
  }
}

bool Interpreter::contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;  // an undefined value iterates as empty
    case Value::Kind::kString:
      if (!item.is_string())
        fail("'in <string>' requires string as left operand, not " + type_name(item));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kArray:
      for (const Value& v : container.array().items)
        if (equals(v, item)) return true;
      return false;
    case Value::Kind::kObject:
      if (item.is_array() && !item.is_tuple()) fail("unhashable type: '" + type_name(item) + "'");
      if (item.is_object()) fail("unhashable type: 'dict'");
      return item.is_string() && container.object().find(item.as_string()) != nullptr;
    default:
      fail("argument of type '" + type_name(container) + "' is not iterable");
  }
}

Value Interpreter::binary(BinaryOp op, const Value& a, const Value& b) {
  // str % x is formatting, which accepts an undefined argument; every other operator on an
  // undefined value raises its UndefinedError.
  if (op == BinaryOp::kMod && a.is_markup()) return Value::markup(percent_format(*this, a.as_string(), b, true));
  if (op == BinaryOp::kMod && a.is_string()) return Value(percent_format(*this, a.as_string(), b));
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  static const char* const kSymbols[] = {"+", "-", "*", "/", "//", "%", "** or pow()"};
  const std::string symbol = kSymbols[static_cast<int>(op)];
  auto unsupported = [&]() {
    fail("unsupported operand type(s) for " + symbol + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_integral() && b.is_integral();
    const int64_t x = a.as_int(), y = b.as_int();
    const double fx = a.as_double(), fy = b.as_double();
    int64_t r = 0;
    switch (op) {
      case BinaryOp::kAdd:
        if (!ints) return Value(fx + fy);
        if (__builtin_add_overflow(x, y, &r)) fail("integer overflow");
        return Value(r);
      case BinaryOp::kSub:
        if (!ints) return Value(fx - fy);
        if (__builtin_sub_overflow(x, y, &r)) fail("integer overflow");
        return Value(r);
      case BinaryOp::kMul:
        if (!ints) return Value(fx * fy);
        if (__builtin_mul_overflow(x, y, &r)) fail("integer overflow");
        return Value(r);
      case BinaryOp::kDiv:
        if (fy == 0.0) fail(ints ? "division by zero" : "float division by zero");
        return Value(fx / fy);
      case BinaryOp::kFloorDiv:
      case BinaryOp::kMod:
        if (ints) {
          if (y == 0) fail(op == BinaryOp::kMod ? "integer modulo by zero" : "integer division or modulo by zero");
          if (x == std::numeric_limits<int64_t>::min() && y == -1) fail("integer overflow");
          int64_t q = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) {
            m += y;
            q -= 1;
          }
          return Value(op == BinaryOp::kFloorDiv ? q : m);
        } else {
          if (fy == 0.0) fail(op == BinaryOp::kMod ? "float modulo" : "float floor division by zero");
          double fd, fm;
          float_divmod(fx, fy, &fd, &fm);
          return Value(op == BinaryOp::kFloorDiv ? fd : fm);
        }
      case BinaryOp::kPow:
        if (ints && y >= 0) {
          int64_t result = 1, base = x, e = y;
          while (e > 0) {
            if (e & 1)
              if (__builtin_mul_overflow(result, base, &result)) fail("integer overflow");
            e >>= 1;
            if (e > 0 && __builtin_mul_overflow(base, base, &base)) fail("integer overflow");
          }
          return Value(result);
        }
        if (fx == 0.0 && fy < 0) fail("0.0 cannot be raised to a negative power");
        if (fx < 0 && fy != std::floor(fy)) fail("complex results are not supported");
        return Value(std::pow(fx, fy));
    }
  }
  switch (op) {
    case BinaryOp::kAdd:
      if (a.is_string() && b.is_string()) {
        // Markup + str escapes the plain side (markupsafe), in either order.
        if (a.is_markup() != b.is_markup())
          return Value::markup((a.is_markup() ? a.as_string() : html_escape(a.as_string())) +
                               (b.is_markup() ? b.as_string() : html_escape(b.as_string())));
        if (a.is_markup()) return Value::markup(a.as_string() + b.as_string());
        return Value(a.as_string() + b.as_string());
      }
      if ((a.is_list() && b.is_list()) || (a.is_tuple() && b.is_tuple())) {
        std::vector<Value> items = a.array().items;
        items.insert(items.end(), b.array().items.begin(), b.array().items.end());
        return Value::array(std::move(items), a.array().kind);
      }
      if ((a.is_string() && !a.is_markup()) || a.is_list() || a.is_tuple())
        fail("can only concatenate " + type_name(a) + " (not \"" + type_name(b) + "\") to " + type_name(a));
      unsupported();
      return Value();
    case BinaryOp::kMul: {
      const Value* seq = nullptr;
      const Value* count = nullptr;
      if ((a.is_string() || a.is_list() || a.is_tuple()) && b.is_integral()) seq = &a, count = &b;
      if ((b.is_string() || b.is_list() || b.is_tuple()) && a.is_integral()) seq = &b, count = &a;
      if (!seq) {
        const bool a_seq = a.is_string() || a.is_list() || a.is_tuple();
        if (a_seq || b.is_string() || b.is_list() || b.is_tuple())
          fail("can't multiply sequence by non-int of type '" + type_name(a_seq ? b : a) + "'");
        unsupported();
      }
      const int64_t times = std::max<int64_t>(0, count->as_int());
      const size_t unit = seq->is_string() ? seq->as_string().size() : seq->array().items.size();
      if (unit > 0 && static_cast<uint64_t>(times) > (size_t{1} << 26) / unit)
        fail("repetition result is too large");
      if (seq->is_string()) {
        std::string out;
        for (int64_t i = 0; i < times; ++i) out += seq->as_string();
        return Value(std::move(out));
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < times; ++i)
        items.insert(items.end(), seq->array().items.begin(), seq->array().items.end());
      return Value::array(std::move(items), seq->array().kind);
    }
    case BinaryOp::kMod:
      unsupported();
      return Value();
    default:
      unsupported();
      return Value();
  }
  return Value();
}

}  // namespace tq::jinja
