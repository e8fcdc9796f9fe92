// Internal: the description of a tokenizer pipeline that the loaders fill in and build_tokenizer() turns
// into a Tokenizer. Not part of the public API (see tokenizer.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "text/bpe.h"
#include "text/pretokenizer.h"
#include "text/tokenizer.h"

namespace tq {

struct NormalizerStep {
  enum Kind { nfc, prepend, replace };
  Kind kind;
  std::string a;  // prepend: the prefix; replace: the pattern
  std::string b;  // replace: the replacement
};

enum class DecoderKind {
  byte_level,     // token characters map back to bytes through GPT-2's table (or stay as they are)
  sentencepiece,  // U+2581 -> ' ', <0xXX> -> the byte
};

struct TokenizerSpec {
  std::string source;  // file name or description, for messages
  TokenizerKind kind = TokenizerKind::byte_level_bpe;
  std::vector<NormalizerStep> normalizer;
  std::vector<std::unique_ptr<PreTokenizerStep>> pre_tokenizer;
  std::string pre_tokenizer_description;
  bool byte_level_input = false;  // the model's alphabet is GPT-2's byte-to-unicode characters
  std::unique_ptr<BpeModel> model;
  std::vector<AddedToken> added_tokens;
  std::vector<int32_t> prefix_ids, suffix_ids;  // what add_special_tokens puts around the text
  DecoderKind decoder = DecoderKind::byte_level;
  bool strip_leading_space = false;
  int32_t bos_id = -1, eos_id = -1, pad_id = -1, unk_id = -1;
};

std::unique_ptr<Tokenizer> build_tokenizer(TokenizerSpec spec);

// The byte-level mapping of `bytes` (each byte becomes its GPT-2 character), appended to `out`.
void append_byte_level(std::string_view bytes, std::string& out);

}  // namespace tq
