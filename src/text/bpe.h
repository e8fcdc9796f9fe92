// The BPE model: a word (a string in the model's alphabet: GPT-2's byte-to-unicode characters for
// byte-level models, text with U+2581 for SentencePiece ones) becomes token ids by starting from its
// characters and repeatedly merging the best adjacent pair.
//
// "Best" is either
//   - merge_rank: the pair's position in the merges list (Hugging Face `tokenizers`, GGUF "gpt2"); or from
//     the vocabulary's own ranks (tiktoken: the pair whose concatenation has the lowest rank), or
//   - piece_score: the highest score of the concatenated piece (SentencePiece BPE, GGUF "llama", llama2.c),
// with ties going to the leftmost pair. Characters that are not in the vocabulary become <0xXX> byte tokens
// (byte_fallback), the unknown token (fused when fuse_unk), or are dropped (no unknown token), as in HF.
//
// encode_word() uses a priority queue (O(n log n), needed because SentencePiece-style tokenizers without a
// pre-tokenizer hand the whole text over as one word); encode_word_reference() is the plain quadratic
// rescan, the reference the tests compare it with.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "text/flat_map.h"

namespace tq {

class BpeModel {
 public:
  enum class Priority { merge_rank, piece_score };
  struct Options {
    Priority priority = Priority::merge_rank;
    bool byte_fallback = false;
    bool fuse_unk = false;
    bool ignore_merges = false;  // a word that is itself a token is emitted whole (Llama 3)
    int32_t unk_id = -1;
  };

  // `vocab`: [vocab size] token text of each id in the model's alphabet; "" for an id without one.
  BpeModel(std::vector<std::string> vocab, const Options& options);
  BpeModel(const BpeModel&) = delete;  // the lookup tables point into vocab_
  BpeModel& operator=(const BpeModel&) = delete;

  // merge_rank: the merges in rank order. Throws tq::Error for a merge whose parts or result are not in the
  // vocabulary (the message names the merge's index).
  void set_merges(const std::vector<std::pair<std::string, std::string>>& merges);
  // merge_rank without a merges list: the rank of a merge is the id of its result, as in tiktoken.
  void set_merges_from_vocab_ranks();
  // piece_score: [vocab size] scores, and whether each piece may be produced from text (SentencePiece
  // normal and user-defined pieces; not control, byte or unused ones).
  void set_scores(std::vector<float> scores, std::vector<uint8_t> mergeable);

  // Cuts a long word where no merge can ever join the two sides: between characters a and b when no
  // token (no mergeable piece, for piece_score) has a directly followed by b. Encoding the chunks one by
  // one gives the same ids as encoding the word (a merge across the cut would make a token containing
  // "ab"), much faster for SentencePiece tokenizers that hand the whole text over as one word. Without
  // cuts (or with ignore_merges, which looks at whole words) `chunks` is just the word.
  void split_chunks(std::string_view word, std::vector<std::string_view>& chunks) const;

  struct Scratch;  // reusable buffers; one per thread
  void encode_word(std::string_view word, std::vector<int32_t>& out, Scratch& scratch) const;
  void encode_word_reference(std::string_view word, std::vector<int32_t>& out) const;

  int32_t vocab_size() const { return static_cast<int32_t>(vocab_.size()); }
  const std::string& token(int32_t id) const { return vocab_[static_cast<size_t>(id)]; }
  int32_t find(std::string_view text) const;  // -1 when absent
  const Options& options() const { return options_; }
  size_t merge_count() const { return merges_.size(); }

  struct Symbol {
    int32_t id;      // token id; -1 for a character not in the vocabulary (piece_score only)
    uint32_t start;  // byte range in the word
    uint32_t len;
    int32_t prev, next;  // neighbours in the live list, -1 at the ends
  };
  struct Candidate {
    double cost;  // lower is better: the rank, or minus the score
    int32_t new_id;
  };
  struct Scratch {
    std::vector<Symbol> symbols;  // [characters (or bytes) of the word]
    struct Entry {
      double cost;
      uint32_t left, left_len, right_len;
      int32_t new_id;
    };
    std::vector<Entry> heap;  // [pending pairs]
  };

 private:
  void build_symbols(std::string_view word, std::vector<Symbol>& symbols) const;
  bool candidate(std::string_view word, const Symbol& a, const Symbol& b, Candidate& c) const;
  void emit(std::string_view word, const std::vector<Symbol>& symbols, std::vector<int32_t>& out) const;
  int32_t char_id(std::string_view ch, char32_t cp) const;
  void build_bigrams();

  std::vector<std::string> vocab_;
  Options options_;
  StringIdIndex ids_;                    // all tokens (first id of a duplicate)
  StringIdIndex mergeable_ids_;          // piece_score: the mergeable pieces only
  std::vector<int32_t> small_char_ids_;  // [0x800] id of each small code point, or -1
  MergeTable merges_;                    // (left id, right id) -> merge
  std::vector<float> scores_;
  std::unordered_set<uint64_t> bigrams_;  // (a, b) code point pairs adjacent inside some token
  int32_t byte_ids_[256];  // id of <0xXX>, -1 when absent
};

}  // namespace tq
