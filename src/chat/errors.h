// The one error type of the chat-template interpreter. It names where in the template the problem
// is (line and column, 1-based; 0 when the problem has no place, such as a bad context value).
#pragma once

#include <string>

#include "core/error.h"

namespace tq {

class TemplateError : public Error {
 public:
  enum class Kind {
    kSyntax,     // the template does not parse (jinja2's TemplateSyntaxError)
    kRaised,     // the template called raise_exception(message)
    kUndefined,  // an undefined value was used where jinja2 raises UndefinedError
    kRuntime,    // any other failure while rendering (a TypeError in Python, say)
  };

  TemplateError(Kind kind, std::string message, int line = 0, int column = 0)
      : Error(describe(kind, message, line, column)),
        kind_(kind),
        message_(std::move(message)),
        line_(line),
        column_(column) {}

  Kind kind() const { return kind_; }
  // The message alone, as jinja2 would print it (for kRaised: exactly the template's text).
  const std::string& message() const { return message_; }
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  static std::string describe(Kind kind, const std::string& message, int line, int column) {
    std::string out = "chat template";
    if (kind == Kind::kSyntax) out += " syntax error";
    if (kind == Kind::kRaised) out += " raised an exception";
    if (line > 0) out += " at line " + std::to_string(line) + ", column " + std::to_string(column);
    return out + ": " + message;
  }

  Kind kind_;
  std::string message_;
  int line_;
  int column_;
};

}  // namespace tq
