// Tokenizers: text <-> token ids for the model families the engine runs.
//
//   - byte-level BPE (GPT-2, Llama 3, Qwen 2/2.5/3): text is split by the family's pre-tokenizer regex, each
//     piece's bytes are mapped to GPT-2's byte-to-unicode alphabet and merged by merge rank;
//   - SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, TinyStories, llama2.c and GGUF "llama"
//     vocabularies): spaces become U+2581 with a dummy prefix, pieces merge by merge rank (tokenizer.json)
//     or by piece score (SentencePiece vocabularies), and unknown characters fall back to <0xXX> tokens.
//
// Both follow Hugging Face `tokenizers` step by step: added tokens are split out of the text first (leftmost-
// longest, before normalization for non-normalized tokens, after it for normalized ones, never merged with
// their neighbours), then normalizer, pre-tokenizer, BPE model and post-processor (BOS/EOS). Decoding maps
// each token to its bytes and drops the dummy-prefix space. Loaders throw tq::Error naming the file and what
// was wrong with it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tq {

// Piece kinds of SentencePiece and GGUF (tokenizer.ggml.token_type), same numbers.
enum class TokenType : int32_t { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

// A token matched as a whole in the input before anything else happens to it (HF AddedToken).
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = true;       // dropped by decode(skip_special_tokens); not matched when parse_special is off
  bool normalized = false;   // matched in the normalized text, against its normalized content
  bool lstrip = false;       // also swallows the whitespace on its left
  bool rstrip = false;       // ... on its right
  bool single_word = false;  // only matches when not inside a word
};

struct EncodeOptions {
  bool add_special_tokens = true;  // the post-processor's BOS/EOS (HF add_special_tokens)
  bool parse_special = true;       // match special added tokens in the text; false: they are plain text
};

enum class TokenizerKind { byte_level_bpe, sentencepiece_bpe };

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const {
    EncodeOptions o;
    o.add_special_tokens = add_special_tokens;
    return encode(text, o);
  }
  virtual std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const = 0;

  // UTF-8 text of a sequence of ids: ill-formed bytes become U+FFFD, ids outside the vocabulary are ignored
  // (as HF does), and the SentencePiece dummy-prefix space at the start is dropped.
  virtual std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = true) const = 0;

  // The bytes token `id` contributes to decoded text (possibly part of a UTF-8 character: "<0xE6>" is one
  // byte). Empty for ids outside the vocabulary.
  virtual const std::string& token_to_piece(int32_t id) const = 0;
  // The token as the vocabulary writes it ("Ġthe", "▁the", "<0x0A>", "<|endoftext|>"); empty when none.
  virtual const std::string& id_to_token(int32_t id) const = 0;
  // The id of a vocabulary string or added token's content, -1 when there is none.
  virtual int32_t token_to_id(std::string_view token) const = 0;

  virtual int32_t vocab_size() const = 0;  // one more than the largest id
  virtual int32_t bos_id() const = 0;      // -1 when the tokenizer has none
  virtual int32_t eos_id() const = 0;
  virtual int32_t pad_id() const = 0;
  virtual int32_t unk_id() const = 0;
  virtual bool is_special(int32_t id) const = 0;
  virtual const std::vector<AddedToken>& added_tokens() const = 0;
  virtual TokenizerKind kind() const = 0;
  // Decoding drops one leading space of the output (the SentencePiece dummy prefix).
  virtual bool strips_leading_space() const = 0;
  // One line for logs: kind, vocabulary size, pre-tokenizer, special ids.
  virtual std::string describe() const = 0;
};

// ------------------------------------------------------------------------------------------------ loaders

// A Hugging Face tokenizer.json with a BPE model. tokenizer_config.json and special_tokens_map.json next to
// it, when present, name the BOS/EOS/PAD/UNK tokens (without them, BOS is the post-processor's first token).
std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path);

// Which of tokenizer.json and vocab.json + merges.txt a folder has, loaded.
std::unique_ptr<Tokenizer> load_tokenizer_dir(const std::string& dir);

// vocab.json + merges.txt (with or without the "#version" line) in GPT-2's byte-level alphabet.
// tokenizer_config_json (may be empty) gives the added tokens (added_tokens_decoder), the special tokens,
// add_bos_token/add_eos_token, and through tokenizer_class the pre-tokenizer: "Qwen2Tokenizer" uses Qwen's
// regex and NFC; anything else (or no config) GPT-2's regex.
std::unique_ptr<Tokenizer> load_vocab_merges(const std::string& vocab_json, const std::string& merges_txt,
                                             const std::string& tokenizer_config_json);

// llama2.c's tokenizer.bin (e.g. tok512.bin): int32 max_token_length, then per id float32 score, int32 length,
// bytes. Spaces in the pieces stand for U+2581. Ids 0/1/2 are <unk>/BOS/EOS, byte pieces "<0xXX>". Encodes
// as llama2.c does: BOS, dummy prefix, merges by score, byte fallback.
std::unique_ptr<Tokenizer> load_llama2c_tokenizer(const std::string& path);

// A SentencePiece model file (tokenizer.model, protobuf) of type BPE with the identity normalizer. The
// sentencepiece library itself never matches control pieces in text; encode with parse_special = false
// to get its ids for text that contains them.
std::unique_ptr<Tokenizer> load_sentencepiece_model(const std::string& path);

// A tiktoken file (lines "base64(bytes) rank"), with the given pre-tokenizer regex and special tokens
// (content, id). Merges follow tiktoken: the adjacent pair whose concatenation has the lowest rank.
struct TiktokenSpecial {
  std::string content;
  int32_t id;
};
std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, std::string_view pattern,
                                         const std::vector<TiktokenSpecial>& specials, int32_t bos_id,
                                         int32_t eos_id, bool add_bos);
// Llama 3's tokenizer.model (tiktoken format) with its 256 special tokens, BOS <|begin_of_text|> added.
std::unique_ptr<Tokenizer> load_llama3_tiktoken(const std::string& path);
// gpt-oss's o200k_harmony: o200k_base.tiktoken with the o200k pattern and the special tokens of tiktoken's
// o200k_harmony encoding: <|startoftext|> 199998 (BOS, not added), <|endoftext|> 199999, <|return|> 200002
// (EOS, as gpt-oss's tokenizer_config.json names it), <|constrain|> 200003, <|channel|> 200005, <|start|>
// 200006, <|end|> 200007, <|message|> 200008, <|call|> 200012, <|endofprompt|> 200018 and <|reserved_N|>
// for every other id up to 201087. 200018 is matched as both <|endofprompt|> and <|reserved_200018|>
// and decodes as <|endofprompt|> (what gpt-oss's tokenizer.json calls it).
std::unique_ptr<Tokenizer> load_o200k_harmony_tiktoken(const std::string& path);

// ------------------------------------------------------------------------------------------------ vocabularies
// Constructors from a plain vocabulary, for GGUF (tokenizer.ggml.*) and other in-memory sources. Errors are
// tq::Error messages that start with `source` (a file name or description).

struct SpmOptions {
  std::string source = "SentencePiece vocabulary";
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;  // -1: none (unk: the first unknown piece)
  bool add_bos = true;
  bool add_eos = false;
  bool add_dummy_prefix = true;  // GGUF tokenizer.ggml.add_space_prefix
  bool byte_fallback = true;     // when the vocabulary has <0xXX> pieces
};
// SentencePiece BPE from pieces (U+2581 for spaces), scores and types (TokenType values; empty = all normal).
// Control and unknown pieces become special added tokens, user-defined pieces plain added tokens.
std::unique_ptr<Tokenizer> make_spm_tokenizer(std::vector<std::string> pieces, std::vector<float> scores,
                                              std::vector<int32_t> types, const SpmOptions& options);

struct ByteLevelBpeOptions {
  std::string source = "BPE vocabulary";
  std::string pattern;  // the pre-tokenizer regex; empty: GPT-2's. See known_pattern_text() in pretokenizer.h.
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  bool add_bos = false;
  bool add_eos = false;
  bool ignore_merges = false;  // Llama 3 (llama.cpp sets it for "llama-bpe")
};
// Byte-level BPE from tokens in GPT-2's alphabet, types (empty = all normal) and merges "left right" in rank
// order (GGUF tokenizer.ggml.merges). Control tokens become special added tokens, user-defined ones plain
// added tokens.
std::unique_ptr<Tokenizer> make_bpe_tokenizer_from_vocab(std::vector<std::string> tokens, std::vector<int32_t> types,
                                                         const std::vector<std::string>& merges,
                                                         const ByteLevelBpeOptions& options);

// GPT-2's byte-to-unicode map: the character (as UTF-8) standing for byte b in byte-level vocabularies.
const std::string& byte_level_char(uint8_t b);

// ------------------------------------------------------------------------------------------------ streaming

// Turns ids into text one at a time, as they are generated: each push() returns only complete UTF-8
// characters (the bytes of a character split over several tokens are held until it is whole) and applies
// the SentencePiece leading-space rule at the start of a text.
class StreamDecoder {
 public:
  // at_text_start: the first pushed token starts the text (its dummy-prefix space is dropped); false when
  // continuing text that is already shown (a prompt), so that the space between them stays.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = true, bool at_text_start = true);

  std::string push(int32_t id);
  // What is still held back (an incomplete character), as U+FFFD; the decoder is then empty.
  std::string flush();
  void reset(bool at_text_start = true);
  bool has_pending() const { return !pending_.empty(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  bool strip_next_space_;
  std::string pending_;  // bytes of an incomplete UTF-8 character
};

}  // namespace tq
