// The template lexer: splits source text into data and tag tokens with jinja2's whitespace rules
// as Hugging Face configures them (trim_blocks and lstrip_blocks on, keep_trailing_newline off).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tq::jinja {

// The template text after newline normalization, with a line table for error positions.
class Source {
 public:
  explicit Source(std::string_view raw);
  const std::string& text() const { return text_; }
  int line_of(size_t offset) const;    // 1-based
  int column_of(size_t offset) const;  // 1-based, in code points

 private:
  std::string text_;
  std::vector<size_t> line_starts_;  // [line count]: byte offset where each line begins
};

enum class TokenType : uint8_t {
  kData,           // literal text outside tags
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,   // text holds the decoded value
  kInteger,  // int_value
  kFloat,    // float_value
  kOperator, // text holds the operator: "+", "//", "(", ...
  kError,    // text the lexing error the parser raises when it gets here
  kEof,
};

struct Token {
  TokenType type = TokenType::kEof;
  std::string text;
  int64_t int_value = 0;
  double float_value = 0;
  size_t offset = 0;  // where the token starts in Source::text()
};

// Text no jinja2 lexer accepts ends the tokens with a kError token (then kEof).
std::vector<Token> tokenize(const Source& source);

}  // namespace tq::jinja
