#include "chat/parser.h"

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "chat/builtins.h"
#include "chat/errors.h"

namespace tq::jinja {
namespace {

// Deeper nesting than this is refused rather than allowed to exhaust the stack.
constexpr int kMaxNesting = 150;

class Parser {
 public:
  Parser(const Source& source, const std::vector<Token>& tokens) : src_(source), tokens_(tokens) {}

  Body parse_template() {
    Body body = subparse({});
    // jinja2 reports unknown filters and tests when it compiles, after the whole template parsed.
    if (unknown_name_) throw *unknown_name_;
    return body;
  }

 private:
  // ---------------------------------------------------------------- token stream

  const Token& checked(const Token& t) const {
    if (t.type == TokenType::kError) fail(t.text, t.offset);
    return t;
  }
  const Token& current() const { return checked(tokens_[pos_]); }
  const Token& look() const { return checked(tokens_[pos_ + 1 < tokens_.size() ? pos_ + 1 : pos_]); }
  // Advancing onto a lexing error raises it, as jinja2's lazy token stream does.
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    checked(tokens_[pos_]);
    return t;
  }
  bool is_name(const Token& t, std::string_view name) const {
    return t.type == TokenType::kName && t.text == name;
  }
  bool is_op(const Token& t, std::string_view op) const {
    return t.type == TokenType::kOperator && t.text == op;
  }
  bool skip_name(std::string_view name) {
    if (!is_name(current(), name)) return false;
    next();
    return true;
  }
  bool skip_op(std::string_view op) {
    if (!is_op(current(), op)) return false;
    next();
    return true;
  }

  [[noreturn]] void fail(const std::string& message, size_t offset) const {
    throw TemplateError(TemplateError::Kind::kSyntax, message, src_.line_of(offset),
                        src_.column_of(offset));
  }

  void defer_unknown(const std::string& message, size_t offset) {
    if (!unknown_name_)
      unknown_name_.emplace(TemplateError::Kind::kSyntax, message, src_.line_of(offset), src_.column_of(offset));
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::kData: return "template data / text";
      case TokenType::kVariableBegin: return "begin of print statement";
      case TokenType::kVariableEnd: return "end of print statement";
      case TokenType::kBlockBegin: return "begin of statement block";
      case TokenType::kBlockEnd: return "end of statement block";
      case TokenType::kName: return t.text;
      case TokenType::kString: return "string";
      case TokenType::kInteger: return "integer";
      case TokenType::kFloat: return "float";
      case TokenType::kOperator: return t.text;
      case TokenType::kError: return "error";
      case TokenType::kEof: return "end of template";
    }
    return "token";
  }

  void expect_type(TokenType type, const char* what) {
    if (current().type == type) {
      next();
      return;
    }
    unexpected(what);
  }
  void expect_op(std::string_view op) {
    if (skip_op(op)) return;
    unexpected(std::string(op));
  }
  void expect_name(std::string_view name) {
    if (skip_name(name)) return;
    unexpected(std::string(name));
  }
  std::string expect_any_name() {
    if (current().type != TokenType::kName) unexpected("name");
    return next().text;
  }
  [[noreturn]] void unexpected(const std::string& expected) {
    if (current().type == TokenType::kEof)
      fail("unexpected end of template, expected '" + expected + "'.", current().offset);
    fail("expected token '" + expected + "', got '" + describe(current()) + "'", current().offset);
  }

  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser, size_t offset) : p(parser) {
      if (++p.depth_ > kMaxNesting) p.fail("the template nests too deeply", offset);
    }
    ~DepthGuard() { --p.depth_; }
  };

  static ExprPtr make(ExprKind kind, size_t offset) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->offset = offset;
    return e;
  }

  // ---------------------------------------------------------------- statements

  // Parses until one of end_tags starts a block (left as the current token) or the template ends.
  Body subparse(std::vector<std::string> end_tags) {
    DepthGuard guard(*this, current().offset);
    const bool has_end = !end_tags.empty();
    if (has_end) end_stack_.push_back(end_tags);
    Body body;
    while (current().type != TokenType::kEof) {
      const Token& t = current();
      if (t.type == TokenType::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->offset = t.offset;
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == TokenType::kVariableBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->offset = t.offset;
        s->expr = parse_tuple(true, {}, false);
        expect_type(TokenType::kVariableEnd, "end of print statement");
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        if (has_end && current().type == TokenType::kName) {
          bool is_end = false;
          for (const auto& tag : end_tags) is_end |= current().text == tag;
          if (is_end) {
            end_stack_.pop_back();
            return body;
          }
        }
        body.push_back(parse_statement());
        expect_type(TokenType::kBlockEnd, "end of statement block");
      } else {
        fail("unexpected '" + describe(t) + "'", t.offset);
      }
    }
    if (has_end) end_stack_.pop_back();
    return body;
  }

  // The body of a block statement: "%}" then statements up to one of end_tags.
  Body parse_statements(std::vector<std::string> end_tags, bool drop_needle) {
    skip_op(":");
    expect_type(TokenType::kBlockEnd, "end of statement block");
    Body body = subparse(end_tags);
    if (current().type == TokenType::kEof) fail_eof(nullptr, end_tags);
    if (drop_needle) next();
    return body;
  }

  [[noreturn]] void fail_eof(const std::string* unknown_tag, const std::vector<std::string>& looking) {
    std::string message = unknown_tag ? "Encountered unknown tag '" + *unknown_tag + "'."
                                      : "Unexpected end of template.";
    std::vector<std::string> current_tags = looking;
    if (current_tags.empty() && !end_stack_.empty()) current_tags = end_stack_.back();
    if (!current_tags.empty()) {
      std::string list;
      for (size_t i = 0; i < current_tags.size(); ++i)
        list += (i ? " or '" : "'") + current_tags[i] + "'";
      bool expected_elsewhere = false;
      if (unknown_tag)
        for (const auto& tags : end_stack_)
          for (const auto& tag : tags) expected_elsewhere |= tag == *unknown_tag;
      if (expected_elsewhere)
        message += " You probably made a nesting mistake. Jinja is expecting this tag, but currently looking for " + list + ".";
      else
        message += " Jinja was looking for the following tags: " + list + ".";
    }
    if (!tag_stack_.empty())
      message += " The innermost block that needs to be closed is '" + tag_stack_.back() + "'.";
    fail(message, current().offset);
  }

  StmtPtr parse_statement() {
    const Token& t = current();
    if (t.type != TokenType::kName) fail("tag name expected", t.offset);
    const std::string tag = t.text;
    tag_stack_.push_back(tag);
    StmtPtr s;
    if (tag == "if") s = parse_if();
    else if (tag == "for") s = parse_for();
    else if (tag == "set") s = parse_set();
    else if (tag == "macro") s = parse_macro();
    else if (tag == "call") s = parse_call_block();
    else if (tag == "filter") s = parse_filter_block();
    else if (tag == "with") s = parse_with();
    else if (tag == "generation") s = parse_generation();
    else if (tag == "break" || tag == "continue") s = parse_loop_control();
    else if (tag == "print") s = parse_print();
    else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
             tag == "from" || tag == "autoescape")
      fail("the '" + tag + "' tag is not supported by this chat-template interpreter", t.offset);
    else {
      tag_stack_.pop_back();
      fail_eof(&tag, {});
    }
    tag_stack_.pop_back();
    return s;
  }

  StmtPtr new_stmt(StmtKind kind) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->offset = current().offset;
    return s;
  }

  StmtPtr parse_if() {
    auto s = new_stmt(StmtKind::kIf);
    next();  // if
    ++soft_;
    while (true) {
      s->conditions.push_back(parse_tuple(false, {}, false));
      s->bodies.push_back(parse_statements({"elif", "else", "endif"}, false));
      const Token& t = next();
      if (t.text == "elif") continue;
      if (t.text == "else") s->else_body = parse_statements({"endif"}, true);
      break;
    }
    --soft_;
    return s;
  }

  StmtPtr parse_for() {
    auto s = new_stmt(StmtKind::kFor);
    next();  // for
    s->target = parse_assign_target(true, false, {"in"});
    expect_name("in");
    s->expr = parse_tuple(false, {"recursive"}, false);
    if (skip_name("if")) s->filter = parse_expression(true);
    if (is_name(current(), "recursive")) fail("recursive for loops are not supported", current().offset);
    // Filters in a loop body are checked at parse time again, as jinja2's inner frames are not soft.
    const int saved_soft = soft_;
    soft_ = 0;
    ++loop_depth_;
    s->body = parse_statements({"endfor", "else"}, false);
    --loop_depth_;
    if (next().text == "else") s->else_body = parse_statements({"endfor"}, true);
    soft_ = saved_soft;
    return s;
  }

  StmtPtr parse_set() {
    auto s = new_stmt(StmtKind::kSet);
    next();  // set
    s->target = parse_assign_target(true, true, {});
    if (skip_op("=")) {
      s->expr = parse_tuple(true, {}, false);
      return s;
    }
    s->kind = StmtKind::kSetBlock;
    if (s->target.kind == Target::Kind::kTuple) fail("can't assign to a tuple in a block set", s->offset);
    if (is_op(current(), "|")) s->filter = parse_filter_chain(nullptr, false);
    s->body = parse_statements({"endset"}, true);
    return s;
  }

  StmtPtr parse_macro() {
    auto s = new_stmt(StmtKind::kMacro);
    next();  // macro
    s->name = expect_any_name();
    parse_signature(*s);
    macro_uses_.push_back({});
    const int saved_soft = soft_, saved_loops = loop_depth_;
    soft_ = 0;
    loop_depth_ = 0;
    s->body = parse_statements({"endmacro"}, true);
    soft_ = saved_soft;
    loop_depth_ = saved_loops;
    s->uses_caller = macro_uses_.back().caller;
    s->uses_varargs = macro_uses_.back().varargs;
    s->uses_kwargs = macro_uses_.back().kwargs;
    macro_uses_.pop_back();
    return s;
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(current(), ")")) {
      if (!s.params.empty()) expect_op(",");
      const size_t at = current().offset;
      std::string param = expect_any_name();
      if (skip_op("=")) {
        s.defaults.push_back(parse_expression(true));
      } else if (!s.defaults.empty()) {
        fail("non-default argument follows default argument", at);
      }
      s.params.push_back(std::move(param));
    }
    expect_op(")");
  }

  StmtPtr parse_call_block() {
    auto s = new_stmt(StmtKind::kCallBlock);
    next();  // call
    if (is_op(current(), "(")) parse_signature(*s);
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::kCall) fail("expected call", s->offset);
    macro_uses_.push_back({});
    const int saved_soft = soft_, saved_loops = loop_depth_;
    soft_ = 0;
    loop_depth_ = 0;
    s->body = parse_statements({"endcall"}, true);
    soft_ = saved_soft;
    loop_depth_ = saved_loops;
    s->uses_varargs = macro_uses_.back().varargs;
    s->uses_kwargs = macro_uses_.back().kwargs;
    macro_uses_.pop_back();
    return s;
  }

  // transformers' {% generation %}...{% endgeneration %}: a call block whose caller's output is
  // the output (HF only records where it starts and ends, to build the assistant mask).
  StmtPtr parse_generation() {
    auto s = new_stmt(StmtKind::kCallBlock);
    next();  // generation
    const int saved_soft = soft_, saved_loops = loop_depth_;
    soft_ = 0;
    loop_depth_ = 0;
    s->body = parse_statements({"endgeneration"}, true);
    soft_ = saved_soft;
    loop_depth_ = saved_loops;
    return s;
  }

  StmtPtr parse_filter_block() {
    auto s = new_stmt(StmtKind::kFilterBlock);
    next();  // filter
    s->filter = parse_filter_chain(nullptr, true);
    const int saved_soft = soft_;
    soft_ = 0;
    s->body = parse_statements({"endfilter"}, true);
    soft_ = saved_soft;
    return s;
  }

  StmtPtr parse_with() {
    auto s = new_stmt(StmtKind::kWith);
    next();  // with
    while (current().type != TokenType::kBlockEnd) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(parse_assign_target(false, false, {}));
      expect_op("=");
      s->values.push_back(parse_expression(true));
    }
    const int saved_soft = soft_;
    soft_ = 0;
    s->body = parse_statements({"endwith"}, true);
    soft_ = saved_soft;
    return s;
  }

  StmtPtr parse_print() {
    auto s = new_stmt(StmtKind::kOutput);
    next();  // print
    s->expr = parse_tuple(true, {}, false);
    return s;
  }

  StmtPtr parse_loop_control() {
    const bool is_break = current().text == "break";
    auto s = new_stmt(is_break ? StmtKind::kBreak : StmtKind::kContinue);
    if (loop_depth_ == 0) fail(std::string("'") + (is_break ? "break" : "continue") + "' outside of a for loop", s->offset);
    next();
    return s;
  }

  // set/for targets: a name, names separated by commas, parenthesized tuples, or ns.attr.
  Target parse_assign_target(bool with_tuple, bool with_namespace, std::vector<std::string> extra_end) {
    Target target;
    target.offset = current().offset;
    if (with_namespace && current().type == TokenType::kName && is_op(look(), ".")) {
      target.kind = Target::Kind::kNamespaceAttr;
      target.name = next().text;
      next();  // .
      target.attr = expect_any_name();
      return target;
    }
    auto single = [&]() -> Target {
      Target t;
      t.offset = current().offset;
      if (skip_op("(")) {
        t.kind = Target::Kind::kTuple;
        while (!is_op(current(), ")")) {
          if (!t.items.empty()) expect_op(",");
          if (is_op(current(), ")")) break;
          t.items.push_back(parse_assign_target(false, false, {}));
        }
        expect_op(")");
        return t;
      }
      if (current().type != TokenType::kName) fail("can't assign to '" + describe(current()) + "'", current().offset);
      const std::string& name = current().text;
      if (name == "true" || name == "false" || name == "none" || name == "True" || name == "False" || name == "None")
        fail("can't assign to const", current().offset);
      t.name = next().text;
      return t;
    };
    if (!with_tuple) return single();
    std::vector<Target> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(single());
      if (is_op(current(), ",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (items.empty()) fail("Expected an expression, got '" + describe(current()) + "'", current().offset);
      return std::move(items[0]);
    }
    target.kind = Target::Kind::kTuple;
    target.items = std::move(items);
    return target;
  }

  // ---------------------------------------------------------------- expressions

  bool is_tuple_end(const std::vector<std::string>& extra_end) const {
    const Token& t = current();
    if (t.type == TokenType::kVariableEnd || t.type == TokenType::kBlockEnd || is_op(t, ")")) return true;
    for (const auto& name : extra_end)
      if (is_name(t, name)) return true;
    return false;
  }

  ExprPtr parse_tuple(bool with_condexpr, std::vector<std::string> extra_end, bool explicit_parens) {
    const size_t at = current().offset;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(current(), ",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens)
        fail("Expected an expression, got '" + describe(current()) + "'", current().offset);
    }
    auto e = make(ExprKind::kTuple, at);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this, current().offset);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    const size_t at = current().offset;
    ExprPtr expr = parse_or();
    while (is_name(current(), "if")) {
      next();
      ++soft_;
      auto cond = make(ExprKind::kCondExpr, at);
      ExprPtr test = parse_or();
      ExprPtr otherwise;
      if (skip_name("else")) otherwise = parse_condexpr();
      --soft_;
      cond->args.push_back(std::move(expr));
      cond->args.push_back(std::move(test));
      cond->args.push_back(std::move(otherwise));
      expr = std::move(cond);
    }
    return expr;
  }

  ExprPtr parse_or() {
    const size_t at = current().offset;
    ExprPtr left = parse_and();
    while (skip_name("or")) {
      auto e = make(ExprKind::kOr, at);
      e->args.push_back(std::move(left));
      e->args.push_back(parse_and());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_and() {
    const size_t at = current().offset;
    ExprPtr left = parse_not();
    while (skip_name("and")) {
      auto e = make(ExprKind::kAnd, at);
      e->args.push_back(std::move(left));
      e->args.push_back(parse_not());
      left = std::move(e);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name(current(), "not")) {
      DepthGuard guard(*this, current().offset);
      auto e = make(ExprKind::kNot, next().offset);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const size_t at = current().offset;
    ExprPtr expr = parse_math1();
    std::vector<CompareOp> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      const Token& t = current();
      CompareOp op;
      if (is_op(t, "==")) op = CompareOp::kEq;
      else if (is_op(t, "!=")) op = CompareOp::kNe;
      else if (is_op(t, "<")) op = CompareOp::kLt;
      else if (is_op(t, "<=")) op = CompareOp::kLe;
      else if (is_op(t, ">")) op = CompareOp::kGt;
      else if (is_op(t, ">=")) op = CompareOp::kGe;
      else if (is_name(t, "in")) op = CompareOp::kIn;
      else if (is_name(t, "not") && is_name(look(), "in")) {
        next();
        op = CompareOp::kNotIn;
      } else {
        break;
      }
      next();
      ops.push_back(op);
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return expr;
    auto e = make(ExprKind::kCompare, at);
    e->args.push_back(std::move(expr));
    for (auto& operand : operands) e->args.push_back(std::move(operand));
    e->compare_ops = std::move(ops);
    return e;
  }

  ExprPtr binary(BinaryOp op, ExprPtr left, ExprPtr right, size_t at) {
    auto e = make(ExprKind::kBinary, at);
    e->binary_op = op;
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprPtr parse_math1() {
    const size_t at = current().offset;
    ExprPtr left = parse_concat();
    while (is_op(current(), "+") || is_op(current(), "-")) {
      const BinaryOp op = next().text == "+" ? BinaryOp::kAdd : BinaryOp::kSub;
      left = binary(op, std::move(left), parse_concat(), at);
    }
    return left;
  }

  ExprPtr parse_concat() {
    const size_t at = current().offset;
    ExprPtr first = parse_math2();
    if (!is_op(current(), "~")) return first;
    auto e = make(ExprKind::kConcat, at);
    e->args.push_back(std::move(first));
    while (skip_op("~")) e->args.push_back(parse_math2());
    return e;
  }

  ExprPtr parse_math2() {
    const size_t at = current().offset;
    ExprPtr left = parse_pow();
    while (true) {
      BinaryOp op;
      if (is_op(current(), "*")) op = BinaryOp::kMul;
      else if (is_op(current(), "/")) op = BinaryOp::kDiv;
      else if (is_op(current(), "//")) op = BinaryOp::kFloorDiv;
      else if (is_op(current(), "%")) op = BinaryOp::kMod;
      else break;
      next();
      left = binary(op, std::move(left), parse_pow(), at);
    }
    return left;
  }

  ExprPtr parse_pow() {
    const size_t at = current().offset;
    ExprPtr left = parse_unary(true);
    while (skip_op("**")) left = binary(BinaryOp::kPow, std::move(left), parse_unary(true), at);
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this, current().offset);
    const size_t at = current().offset;
    ExprPtr node;
    if (is_op(current(), "-") || is_op(current(), "+")) {
      const bool neg = next().text == "-";
      node = make(neg ? ExprKind::kNeg : ExprKind::kPos, at);
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = current();
    switch (t.type) {
      case TokenType::kName: {
        next();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto e = make(ExprKind::kConst, t.offset);
          e->value = Value(t.text == "true" || t.text == "True");
          return e;
        }
        if (t.text == "none" || t.text == "None") {
          auto e = make(ExprKind::kConst, t.offset);
          e->value = Value::none();
          return e;
        }
        auto e = make(ExprKind::kName, t.offset);
        e->name = t.text;
        for (auto& uses : macro_uses_) {
          uses.caller |= t.text == "caller";
          uses.varargs |= t.text == "varargs";
          uses.kwargs |= t.text == "kwargs";
        }
        return e;
      }
      case TokenType::kString: {
        // Adjacent string literals concatenate, as in Python.
        auto e = make(ExprKind::kConst, t.offset);
        std::string s;
        while (current().type == TokenType::kString) s += next().text;
        e->value = Value(std::move(s));
        return e;
      }
      case TokenType::kInteger: {
        next();
        auto e = make(ExprKind::kConst, t.offset);
        e->value = Value(t.int_value);
        return e;
      }
      case TokenType::kFloat: {
        next();
        auto e = make(ExprKind::kConst, t.offset);
        e->value = Value(t.float_value);
        return e;
      }
      case TokenType::kOperator:
        if (t.text == "(") {
          next();
          ExprPtr e = parse_tuple(true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default:
        break;
    }
    if (t.type == TokenType::kEof) fail("unexpected end of template", t.offset);
    fail("unexpected '" + describe(t) + "'", t.offset);
  }

  ExprPtr parse_list() {
    auto e = make(ExprKind::kList, next().offset);  // [
    while (!is_op(current(), "]")) {
      if (!e->args.empty()) expect_op(",");
      if (is_op(current(), "]")) break;
      e->args.push_back(parse_expression(true));
    }
    expect_op("]");
    return e;
  }

  ExprPtr parse_dict() {
    auto e = make(ExprKind::kDict, next().offset);  // {
    while (!is_op(current(), "}")) {
      if (!e->args.empty()) expect_op(",");
      if (is_op(current(), "}")) break;
      e->args.push_back(parse_expression(true));
      expect_op(":");
      e->args.push_back(parse_expression(true));
    }
    expect_op("}");
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(current(), ".") || is_op(current(), "[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op(current(), "(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op(current(), "|")) {
        node = parse_filter_chain(std::move(node), false);
      } else if (is_name(current(), "is")) {
        node = parse_test(std::move(node));
      } else if (is_op(current(), "(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    if (t.text == ".") {
      const Token& attr = current();
      next();  // jinja2 moves past the token before looking at it
      if (attr.type == TokenType::kName) {
        auto e = make(ExprKind::kGetAttr, node->offset);
        e->name = attr.text;
        e->args.push_back(std::move(node));
        return e;
      }
      if (attr.type != TokenType::kInteger) fail("expected name or number", attr.offset);
      auto e = make(ExprKind::kGetItem, node->offset);
      auto key = make(ExprKind::kConst, attr.offset);
      key->value = Value(attr.int_value);
      e->args.push_back(std::move(node));
      e->args.push_back(std::move(key));
      return e;
    }
    // [ subscripts ]
    std::vector<ExprPtr> keys;
    while (!is_op(current(), "]")) {
      if (!keys.empty()) expect_op(",");
      keys.push_back(parse_subscribed());
    }
    expect_op("]");
    auto e = make(ExprKind::kGetItem, node->offset);
    e->args.push_back(std::move(node));
    if (keys.size() == 1) {
      e->args.push_back(std::move(keys[0]));
    } else {
      auto tuple = make(ExprKind::kTuple, t.offset);
      tuple->args = std::move(keys);
      e->args.push_back(std::move(tuple));
    }
    return e;
  }

  ExprPtr parse_subscribed() {
    const size_t at = current().offset;
    std::vector<ExprPtr> parts;
    if (is_op(current(), ":")) {
      next();
      parts.push_back(nullptr);
    } else {
      ExprPtr node = parse_expression(true);
      if (!is_op(current(), ":")) return node;
      next();
      parts.push_back(std::move(node));
    }
    if (is_op(current(), ":")) {
      parts.push_back(nullptr);
    } else if (!is_op(current(), "]") && !is_op(current(), ",")) {
      parts.push_back(parse_expression(true));
    } else {
      parts.push_back(nullptr);
    }
    if (skip_op(":")) {
      if (!is_op(current(), "]") && !is_op(current(), ","))
        parts.push_back(parse_expression(true));
      else
        parts.push_back(nullptr);
    } else {
      parts.push_back(nullptr);
    }
    auto e = make(ExprKind::kSlice, at);
    e->args = std::move(parts);
    return e;
  }

  // ( args, key=value, *args, **kwargs ) into e->args (after any already there) and kwargs.
  void parse_call_args(Expr& e) {
    const size_t at = current().offset;
    expect_op("(");
    bool require_comma = false;
    while (!is_op(current(), ")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(current(), ")")) break;
      }
      if (skip_op("*")) {
        if (e.dyn_args || e.dyn_kwargs) fail("invalid syntax for function call expression", at);
        e.dyn_args = parse_expression(true);
      } else if (skip_op("**")) {
        if (e.dyn_kwargs) fail("invalid syntax for function call expression", at);
        e.dyn_kwargs = parse_expression(true);
      } else if (current().type == TokenType::kName && is_op(look(), "=")) {
        if (e.dyn_kwargs) fail("invalid syntax for function call expression", at);
        std::string key = next().text;
        next();  // =
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (e.dyn_args || e.dyn_kwargs || !e.kwargs.empty())
          fail("invalid syntax for function call expression", at);
        e.args.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(ExprKind::kCall, node->offset);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  std::string parse_dotted_name() {
    std::string name = expect_any_name();
    while (skip_op(".")) {
      name.push_back('.');
      name += expect_any_name();
    }
    return name;
  }

  // One or more "| name(args)" filters applied to node (null: the input comes later, as in a
  // filter block). With start_inline the first filter has no leading pipe.
  ExprPtr parse_filter_chain(ExprPtr node, bool start_inline) {
    while (is_op(current(), "|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      const size_t at = current().offset;
      auto e = make(ExprKind::kFilter, node ? node->offset : at);
      e->name = parse_dotted_name();
      e->filter = find_filter(e->name);
      if (!e->filter && soft_ == 0) defer_unknown("No filter named '" + e->name + "'.", at);
      e->args.push_back(std::move(node));
      if (is_op(current(), "(")) parse_call_args(*e);
      node = std::move(e);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    next();  // is
    const bool negated = skip_name("not");
    const size_t at = current().offset;
    auto e = make(ExprKind::kTest, node->offset);
    e->name = parse_dotted_name();
    e->test = find_test(e->name);
    if (!e->test && soft_ == 0) defer_unknown("No test named '" + e->name + "'.", at);
    e->args.push_back(std::move(node));
    const Token& t = current();
    if (is_op(t, "(")) {
      parse_call_args(*e);
    } else if ((t.type == TokenType::kName || t.type == TokenType::kString ||
                t.type == TokenType::kInteger || t.type == TokenType::kFloat || is_op(t, "[") ||
                is_op(t, "{")) &&
               !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and")) {
      if (is_name(t, "is")) fail("You cannot chain multiple tests with is", t.offset);
      ExprPtr arg = parse_postfix(parse_primary());
      e->args.push_back(std::move(arg));
    }
    if (!negated) return e;
    auto n = make(ExprKind::kNot, e->offset);
    n->args.push_back(std::move(e));
    return n;
  }

  struct MacroUses {
    bool caller = false, varargs = false, kwargs = false;
  };

  const Source& src_;
  const std::vector<Token>& tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int soft_ = 0;        // > 0 inside an if statement or inline if (jinja2's "soft" frames)
  int loop_depth_ = 0;  // for break/continue
  std::vector<std::vector<std::string>> end_stack_;
  std::vector<std::string> tag_stack_;
  std::vector<MacroUses> macro_uses_;
  std::optional<TemplateError> unknown_name_;  // the first unknown filter or test outside ifs
};

}  // namespace

Body parse(const Source& source, const std::vector<Token>& tokens) {
  return Parser(source, tokens).parse_template();
}

}  // namespace tq::jinja
