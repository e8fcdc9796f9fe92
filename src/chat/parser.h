// The template parser: tokens to statements, following jinja2's grammar and operator precedence.
#pragma once

#include <vector>

#include "chat/ast.h"
#include "chat/lexer.h"

namespace tq::jinja {

// Throws a kSyntax TemplateError with line and column on a template jinja2 would not compile:
// bad syntax, unclosed blocks, unknown tags, unknown filters and tests (outside conditionals).
Body parse(const Source& source, const std::vector<Token>& tokens);

}  // namespace tq::jinja
