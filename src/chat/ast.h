// The parsed template: expressions and statements as jinja2's parser builds them.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/value.h"

namespace tq::jinja {

using FilterFn = Value (*)(Interpreter&, const Value& input, CallArgs& args);
using TestFn = bool (*)(Interpreter&, const Value& input, CallArgs& args);

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind : uint8_t {
  kConst,     // value
  kName,      // name
  kList,      // args: items
  kTuple,     // args: items
  kDict,      // args: key0, value0, key1, value1, ...
  kGetAttr,   // args[0].name
  kGetItem,   // args[0][args[1]]
  kSlice,     // args[0]:args[1]:args[2], each may be null
  kCall,      // args[0](args[1:], kwargs, *dyn_args, **dyn_kwargs)
  kFilter,    // args[0]|name(args[1:], kwargs); args[0] is null in filter blocks
  kTest,      // args[0] is name(args[1:], kwargs)
  kNeg,       // -args[0]
  kPos,       // +args[0]
  kNot,       // not args[0]
  kBinary,    // args[0] binary_op args[1]
  kAnd,       // args[0] and args[1]
  kOr,        // args[0] or args[1]
  kCompare,   // args[0] compare_ops[0] args[1] compare_ops[1] args[2] ...
  kConcat,    // args[0] ~ args[1] ~ ...
  kCondExpr,  // args[0] if args[1] else args[2] (args[2] may be null)
};

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CompareOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  ExprKind kind = ExprKind::kConst;
  size_t offset = 0;  // where the expression starts in the source, for error positions
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr dyn_args;    // *expr in a call
  ExprPtr dyn_kwargs;  // **expr in a call
  BinaryOp binary_op = BinaryOp::kAdd;
  std::vector<CompareOp> compare_ops;
  // Resolved at parse time. Null for an unknown name inside an if or inline-if, where jinja2
  // defers the error to the moment the filter or test runs.
  FilterFn filter = nullptr;
  TestFn test = nullptr;
};

// The left side of an assignment or a for loop: a name, a tuple of targets, or ns.attr.
struct Target {
  enum class Kind : uint8_t { kName, kTuple, kNamespaceAttr };
  Kind kind = Kind::kName;
  std::string name;
  std::string attr;
  std::vector<Target> items;
  size_t offset = 0;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

enum class StmtKind : uint8_t {
  kText,         // text
  kOutput,       // {{ expr }}
  kIf,           // conditions[i] -> bodies[i]; else_body
  kFor,          // for target in expr [if filter]: body; else_body
  kSet,          // set target = expr
  kSetBlock,     // set target [| expr filter chain] %}body{% endset
  kMacro,        // macro name(params = defaults): body
  kCallBlock,    // call(params) expr: body is the caller; also {% generation %} (expr null)
  kFilterBlock,  // filter expr: body
  kWith,         // with targets = values: body
  kBreak,
  kContinue,
};

struct Stmt {
  StmtKind kind = StmtKind::kText;
  size_t offset = 0;
  std::string text;
  std::string name;  // macro name
  ExprPtr expr;
  ExprPtr filter;    // the for loop's inline `if`, or the filter of a set/filter block
  Target target;
  std::vector<Target> targets;     // with
  std::vector<ExprPtr> values;     // with
  std::vector<ExprPtr> conditions; // if / elif
  std::vector<Body> bodies;        // if / elif
  Body body;
  Body else_body;
  // Macros and call blocks: parameter names and the defaults of the last defaults.size() of them.
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;
  // Whether the macro body mentions these names; jinja2 only accepts extra arguments then.
  bool uses_caller = false;
  bool uses_varargs = false;
  bool uses_kwargs = false;
};

}  // namespace tq::jinja
