// The tree-walking renderer: runs a parsed template against a context, with jinja2's scoping
// (a for loop body is a new scope each iteration; macros see the scope they were defined in, as it
// is when they are called; if blocks share their enclosing scope) and the sandbox's attribute rules.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>

#include "chat/ast.h"
#include "chat/lexer.h"
#include "chat/value.h"

namespace tq::jinja {

struct Scope {
  std::shared_ptr<Scope> parent;
  ObjectData vars;
};
using ScopePtr = std::shared_ptr<Scope>;

class Interpreter {
 public:
  // now: what strftime_now() reports; unset reads the local clock when called.
  Interpreter(const Source& source, std::optional<std::tm> now);

  // Renders body with the given top-level variables (the render() keyword arguments).
  std::string render(const Body& body, const ObjectData& context);

  // ---- services for builtins

  // Throws a TemplateError located at the expression being evaluated.
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void fail(TemplateError::Kind kind, const std::string& message) const;
  // Raises the UndefinedError an undefined value carries.
  [[noreturn]] void fail_undefined(const Value& undefined) const;

  Value call(const Value& callee, CallArgs& args);
  Value getattr(const Value& obj, const std::string& name);  // obj.name
  Value getitem(const Value& obj, const Value& key);         // obj[key]
  Value filter_by_name(const std::string& name, const Value& input, CallArgs& args);
  bool test_by_name(const std::string& name, const Value& input, CallArgs& args);
  // The items a for loop over v visits (dict keys, string characters, ...).
  std::vector<Value> iterate(const Value& v);
  // a < b as Python orders values; fails on values Python cannot order.
  bool less(const Value& a, const Value& b);
  // a op b for any comparison operator, with Python's semantics and error messages.
  bool compare_values(CompareOp op, const Value& a, const Value& b);
  bool contains(const Value& container, const Value& item);  // item in container
  std::tm now() const;
  // Registers a namespace-like object so that the end of the render can break its cycles.
  void track(const std::shared_ptr<NamespaceData>& ns);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out);
  Flow exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out);
  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out);
  Value eval(const Expr& e, const ScopePtr& scope);
  Value eval_filter(const Expr& e, const ScopePtr& scope, const Value* block_input);
  Value eval_call(const Expr& e, const ScopePtr& scope);
  Value eval_slice(const Value& obj, const Expr& slice, const ScopePtr& scope);
  void collect_args(const Expr& e, size_t first_positional, const ScopePtr& scope, CallArgs& args);
  Value binary(BinaryOp op, const Value& a, const Value& b);
  void assign(const Target& target, const Value& value, const ScopePtr& scope);
  Value lookup(const ScopePtr& scope, const std::string& name) const;
  Value make_macro(const Stmt& s, const ScopePtr& closure, const std::string& name);
  Value call_macro(const Stmt& s, const ScopePtr& closure, const std::string& name, CallArgs& args);
  void at(size_t offset) { offset_ = offset; }
  ScopePtr new_scope(const ScopePtr& parent);

  const Source& source_;
  std::optional<std::tm> now_;
  size_t offset_ = 0;  // the source position errors are reported at
  int call_depth_ = 0;
  ScopePtr globals_;
  // Everything a render made that can be part of a reference cycle (see render()).
  std::vector<std::weak_ptr<Scope>> scopes_;
  std::vector<std::weak_ptr<NamespaceData>> namespaces_;
  size_t live_scope_hint_ = 0;
  size_t live_namespace_hint_ = 0;
};

}  // namespace tq::jinja
