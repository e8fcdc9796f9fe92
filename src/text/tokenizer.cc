#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "text/tokenizer_impl.h"
#include "text/unicode.h"

namespace tq {
namespace {

// GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the other 68 bytes for
// U+0100.. in byte order, so that every byte is a visible character.
struct ByteLevelTable {
  std::array<std::string, 256> chars;  // UTF-8 of the character standing for each byte
  std::array<int16_t, 0x200> bytes;    // byte of each character below U+0200, or -1
  ByteLevelTable() {
    bytes.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      append_utf8(chars[static_cast<size_t>(b)], cp);
      bytes[cp] = static_cast<int16_t>(b);
    }
  }
};
const ByteLevelTable& byte_level_table() {
  static const ByteLevelTable table;
  return table;
}

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581

// The bytes a token stands for in decoded text.
std::string decoded_piece(const std::string& token, DecoderKind decoder) {
  if (decoder == DecoderKind::byte_level) {
    // Every character must be one of the table's; otherwise the token is kept as it is (as HF does).
    const ByteLevelTable& t = byte_level_table();
    std::string out;
    size_t i = 0;
    while (i < token.size()) {
      const Utf8Step step = decode_utf8_step(std::string_view(token).substr(i));
      if (!step.valid || step.cp >= 0x200 || t.bytes[step.cp] < 0) return token;
      out.push_back(static_cast<char>(t.bytes[step.cp]));
      i += step.bytes;
    }
    return out;
  }
  // <0xXX> is a byte (HF ByteFallback); otherwise U+2581 reads as a space (HF Replace).
  if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>') {
    auto hex = [](char c) { return (c >= '0' && c <= '9') ? c - '0' : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1; };
    const int hi = hex(token[3]), lo = hex(token[4]);
    if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
  }
  std::string out;
  size_t i = 0;
  while (i < token.size()) {
    if (token.compare(i, kMetaspace.size(), kMetaspace) == 0) {
      out.push_back(' ');
      i += kMetaspace.size();
    } else {
      out.push_back(token[i++]);
    }
  }
  return out;
}

// \w of Rust's regex crate, which HF uses for single_word: letters, marks, decimal and letter numbers,
// connector punctuation and the two join controls (Alphabetic approximated by L and Nl).
bool is_word_char(char32_t c) {
  constexpr uint32_t kWord = kCategoryLetter | kCategoryMark | category_bit(UnicodeCategory::Nd) |
                             category_bit(UnicodeCategory::Nl) | category_bit(UnicodeCategory::Pc);
  return c == 0x200C || c == 0x200D || (unicode_category_bit(c) & kWord) != 0;
}

// The last code point of s (s non-empty, well-formed or not).
char32_t last_code_point(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && s.size() - i < 4 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  const Utf8Step step = decode_utf8_step(s.substr(i));
  return step.valid && i + step.bytes == s.size() ? step.cp : kReplacementChar;
}

// Added tokens matched leftmost-longest, as HF's Aho-Corasick automaton does.
class AddedTokenMatcher {
 public:
  struct Segment {
    uint32_t begin, end;
    int32_t token;  // index into the added tokens, or -1 for text
  };

  void add(std::string pattern, int32_t token) {
    if (pattern.empty()) return;
    entries_.push_back({std::move(pattern), token});
  }
  void finish() {
    for (auto& list : by_first_byte_) list.clear();
    for (size_t i = 0; i < entries_.size(); ++i)
      by_first_byte_[static_cast<unsigned char>(entries_[i].pattern[0])].push_back(static_cast<uint32_t>(i));
    for (auto& list : by_first_byte_)
      std::stable_sort(list.begin(), list.end(), [&](uint32_t a, uint32_t b) {
        return entries_[a].pattern.size() > entries_[b].pattern.size();
      });
  }
  bool empty() const { return entries_.empty(); }

  void split(std::string_view s, const std::vector<AddedToken>& tokens, bool parse_special,
             std::vector<Segment>& out) const {
    out.clear();
    size_t start_offset = 0;
    size_t pos = 0;
    while (pos < s.size()) {
      const auto& candidates = by_first_byte_[static_cast<unsigned char>(s[pos])];
      const Entry* found = nullptr;
      for (uint32_t idx : candidates) {
        const Entry& e = entries_[idx];
        if (s.compare(pos, e.pattern.size(), e.pattern) == 0) {
          found = &e;
          break;
        }
      }
      if (!found) {
        ++pos;
        continue;
      }
      size_t start = pos, stop = pos + found->pattern.size();
      pos = stop;  // the automaton moves past a match even when it is then discarded
      const AddedToken& tok = tokens[static_cast<size_t>(found->token)];
      if (!parse_special && tok.special) continue;
      if (tok.single_word) {
        const bool word_before = start > 0 && is_word_char(last_code_point(s.substr(0, start)));
        const bool word_after = stop < s.size() && is_word_char(decode_utf8_step(s.substr(stop)).cp);
        if (word_before || word_after) continue;
      }
      if (tok.lstrip) {
        // The start of the whitespace that ends s[start_offset, start).
        size_t ws_start = start, i = start_offset;
        while (i < start) {
          const Utf8Step step = decode_utf8_step(s.substr(i, start - i));
          if (!is_unicode_whitespace(step.cp) || !step.valid) ws_start = i + step.bytes;
          i += step.bytes;
        }
        start = std::max(ws_start, start_offset);
      }
      if (tok.rstrip) {
        while (stop < s.size()) {
          const Utf8Step step = decode_utf8_step(s.substr(stop));
          if (!step.valid || !is_unicode_whitespace(step.cp)) break;
          stop += step.bytes;
        }
        pos = stop;
      }
      if (start_offset < start)
        out.push_back({static_cast<uint32_t>(start_offset), static_cast<uint32_t>(start), -1});
      out.push_back({static_cast<uint32_t>(start), static_cast<uint32_t>(stop), found->token});
      start_offset = stop;
    }
    if (start_offset < s.size())
      out.push_back({static_cast<uint32_t>(start_offset), static_cast<uint32_t>(s.size()), -1});
  }

 private:
  struct Entry {
    std::string pattern;
    int32_t token;
  };
  std::vector<Entry> entries_;
  std::array<std::vector<uint32_t>, 256> by_first_byte_;  // entries by first byte, longest first
};

constexpr int32_t kMaxTokenId = 1 << 22;

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(TokenizerSpec spec) : spec_(std::move(spec)) {
    TQ_CHECK(spec_.model != nullptr, spec_.source, ": no BPE model");
    const BpeModel& model = *spec_.model;
    int32_t size = model.vocab_size();
    for (const AddedToken& t : spec_.added_tokens) {
      TQ_CHECK(t.id >= 0, spec_.source, ": added token '", t.content, "' has a negative id ", t.id);
      TQ_CHECK(!t.content.empty(), spec_.source, ": added token ", t.id, " has no content");
      // Every id below the largest gets a slot in the tables below (about 40 bytes each): an id no vocabulary
      // reaches (a corrupt file's 2000000000) would size them by it (found by fuzz/fuzz_tokenizer_json). Ids may
      // be sparse (the gpt-oss fixture keeps o200k's 199998.. over a vocabulary of 1536), so the bound is on the
      // id: 2^22, 16 times the largest vocabularies (Gemma's 262144, o200k's 201088).
      TQ_CHECK(t.id < kMaxTokenId, spec_.source, ": added token '", t.content, "' has id ", t.id, ", more than the ", kMaxTokenId,
               " ids any vocabulary has");
      size = std::max(size, t.id + 1);
    }
    vocab_size_ = size;
    special_.assign(static_cast<size_t>(size), 0);
    added_index_.assign(static_cast<size_t>(size), -1);
    for (size_t i = 0; i < spec_.added_tokens.size(); ++i) {
      const AddedToken& t = spec_.added_tokens[i];
      added_index_[static_cast<size_t>(t.id)] = static_cast<int32_t>(i);
      if (t.special) special_[static_cast<size_t>(t.id)] = 1;
      added_ids_.emplace(t.content, t.id);  // the first of a repeated content
    }
    pieces_.resize(static_cast<size_t>(size));
    for (int32_t id = 0; id < size; ++id) pieces_[static_cast<size_t>(id)] = decoded_piece(id_to_token(id), spec_.decoder);

    for (size_t i = 0; i < spec_.added_tokens.size(); ++i) {
      const AddedToken& t = spec_.added_tokens[i];
      if (t.normalized)
        normalized_matcher_.add(normalize(t.content), static_cast<int32_t>(i));
      else
        raw_matcher_.add(t.content, static_cast<int32_t>(i));
    }
    raw_matcher_.finish();
    normalized_matcher_.finish();
    for (int32_t id : spec_.prefix_ids) check_id(id, "post-processor token");
    for (int32_t id : spec_.suffix_ids) check_id(id, "post-processor token");
    for (int32_t id : {spec_.bos_id, spec_.eos_id, spec_.pad_id, spec_.unk_id})
      if (id != -1) check_id(id, "special token");
  }

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& options) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    if (options.add_special_tokens) out.insert(out.end(), spec_.prefix_ids.begin(), spec_.prefix_ids.end());
    EncodeState st;
    std::vector<AddedTokenMatcher::Segment> segments, sub_segments;
    raw_matcher_.split(text, spec_.added_tokens, options.parse_special, segments);
    for (const auto& seg : segments) {
      if (seg.token >= 0) {
        out.push_back(spec_.added_tokens[static_cast<size_t>(seg.token)].id);
        continue;
      }
      const std::string_view piece = text.substr(seg.begin, seg.end - seg.begin);
      const bool at_start = seg.begin == 0;
      if (spec_.normalizer.empty() && normalized_matcher_.empty()) {
        encode_text(piece, at_start, st, out);
        continue;
      }
      const std::string normalized = normalize(piece);
      normalized_matcher_.split(normalized, spec_.added_tokens, options.parse_special, sub_segments);
      for (const auto& sub : sub_segments) {
        if (sub.token >= 0)
          out.push_back(spec_.added_tokens[static_cast<size_t>(sub.token)].id);
        else
          encode_text(std::string_view(normalized).substr(sub.begin, sub.end - sub.begin), at_start && sub.begin == 0,
                      st, out);
      }
    }
    if (options.add_special_tokens) out.insert(out.end(), spec_.suffix_ids.begin(), spec_.suffix_ids.end());
    return out;
  }

  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    std::string bytes;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size()) continue;
      if (skip_special_tokens && special_[static_cast<size_t>(id)]) continue;
      bytes += pieces_[static_cast<size_t>(id)];
    }
    std::string text = is_valid_utf8(bytes) ? std::move(bytes) : to_valid_utf8(bytes);
    if (spec_.strip_leading_space && !text.empty() && text[0] == ' ') text.erase(0, 1);
    return text;
  }

  const std::string& token_to_piece(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? pieces_[static_cast<size_t>(id)] : empty_;
  }
  const std::string& id_to_token(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return empty_;
    const int32_t added = added_index_[static_cast<size_t>(id)];
    if (added >= 0) return spec_.added_tokens[static_cast<size_t>(added)].content;
    return id < spec_.model->vocab_size() ? spec_.model->token(id) : empty_;
  }
  int32_t token_to_id(std::string_view token) const override {
    // Added contents win over vocabulary strings, as in HF.
    const auto it = added_ids_.find(std::string(token));
    return it != added_ids_.end() ? it->second : spec_.model->find(token);
  }
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return spec_.bos_id; }
  int32_t eos_id() const override { return spec_.eos_id; }
  int32_t pad_id() const override { return spec_.pad_id; }
  int32_t unk_id() const override { return spec_.unk_id; }
  bool is_special(int32_t id) const override {
    return id >= 0 && id < vocab_size() && special_[static_cast<size_t>(id)] != 0;
  }
  const std::vector<AddedToken>& added_tokens() const override { return spec_.added_tokens; }
  TokenizerKind kind() const override { return spec_.kind; }
  bool strips_leading_space() const override { return spec_.strip_leading_space; }

  std::string describe() const override {
    std::ostringstream os;
    os << (spec_.kind == TokenizerKind::byte_level_bpe ? "byte-level BPE" : "SentencePiece BPE") << ", "
       << vocab_size() << " tokens";
    if (spec_.model->options().priority == BpeModel::Priority::piece_score)
      os << " (merges by score)";
    else
      os << " (" << spec_.model->merge_count() << " merges)";
    os << ", " << spec_.added_tokens.size() << " added";
    if (!spec_.pre_tokenizer_description.empty()) os << ", pre-tokenizer " << spec_.pre_tokenizer_description;
    os << ", bos " << spec_.bos_id << ", eos " << spec_.eos_id;
    return os.str();
  }

 private:
  struct EncodeState {
    BpeModel::Scratch scratch;
    std::string word;
    std::string key;
    // Words seen in this call and their ids: natural text repeats its words a lot.
    std::unordered_map<std::string, std::vector<int32_t>> cache;
  };
  static constexpr size_t kCachedWordMaxBytes = 64;
  static constexpr size_t kCacheMaxEntries = 1 << 16;

  void check_id(int32_t id, const char* what) const {
    TQ_CHECK(id >= 0 && id < vocab_size(), spec_.source, ": ", what, " id ", id, " is outside the vocabulary of ",
             vocab_size());
  }

  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (const NormalizerStep& step : spec_.normalizer) {
      switch (step.kind) {
        case NormalizerStep::nfc: s = nfc_normalize(s); break;
        case NormalizerStep::prepend:
          if (!s.empty()) s.insert(0, step.a);
          break;
        case NormalizerStep::replace: {
          if (step.a.empty()) break;
          std::string r;
          r.reserve(s.size() + s.size() / 4);
          size_t i = 0;
          for (size_t at = s.find(step.a); at != std::string::npos; at = s.find(step.a, i)) {
            r.append(s, i, at - i);
            r += step.b;
            i = at + step.a.size();
          }
          r.append(s, i, std::string::npos);
          s = std::move(r);
          break;
        }
      }
    }
    return s;
  }

  void encode_text(std::string_view text, bool at_start, EncodeState& st, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    Pieces pieces;
    pieces.items.push_back({text, at_start});
    for (const auto& step : spec_.pre_tokenizer) step->apply(pieces);
    for (const Pieces::Piece& p : pieces.items) {
      if (p.text.size() <= kCachedWordMaxBytes) {
        encode_cached(p.text, st, out);
        continue;
      }
      // A long word (SentencePiece tokenizers without a pre-tokenizer see the whole text as one): cut it
      // where no merge can cross (in the model's alphabet), and encode the chunks.
      std::string_view word = p.text;
      std::string mapped;
      if (spec_.byte_level_input) {
        append_byte_level(p.text, mapped);
        word = mapped;
      }
      std::vector<std::string_view> chunks;
      spec_.model->split_chunks(word, chunks);
      for (std::string_view chunk : chunks) {
        if (chunk.size() <= kCachedWordMaxBytes && !spec_.byte_level_input)
          encode_cached(chunk, st, out);
        else
          spec_.model->encode_word(chunk, out, st.scratch);
      }
    }
  }

  // Encodes a word of the input (before any byte-level mapping) through the per-call cache.
  void encode_cached(std::string_view text, EncodeState& st, std::vector<int32_t>& out) const {
    st.key.assign(text);
    const auto it = st.cache.find(st.key);
    if (it != st.cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    std::string_view word = text;
    if (spec_.byte_level_input) {
      st.word.clear();
      append_byte_level(text, st.word);
      word = st.word;
    }
    const size_t before = out.size();
    spec_.model->encode_word(word, out, st.scratch);
    if (st.cache.size() >= kCacheMaxEntries) st.cache.clear();
    st.cache.emplace(st.key, std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(before), out.end()));
  }

  TokenizerSpec spec_;
  int32_t vocab_size_ = 0;
  std::vector<std::string> pieces_;    // [vocab size] decoded bytes
  std::vector<uint8_t> special_;       // [vocab size] 1 for special added tokens
  std::vector<int32_t> added_index_;   // [vocab size] index into spec_.added_tokens, or -1
  std::unordered_map<std::string, int32_t> added_ids_;  // added content -> id
  AddedTokenMatcher raw_matcher_, normalized_matcher_;
  std::string empty_;
};

// Added tokens for the control, unknown and user-defined entries of a typed vocabulary: the first two are
// special (as HF's Llama tokenizer.json lists <unk>, <s>, </s>), user-defined ones are not.
std::vector<AddedToken> added_from_types(const std::vector<std::string>& tokens, const std::vector<int32_t>& types) {
  std::vector<AddedToken> added;
  for (size_t i = 0; i < types.size(); ++i) {
    const auto t = static_cast<TokenType>(types[i]);
    if (t != TokenType::control && t != TokenType::unknown && t != TokenType::user_defined) continue;
    if (tokens[i].empty()) continue;
    AddedToken a;
    a.id = static_cast<int32_t>(i);
    a.content = tokens[i];
    a.special = t != TokenType::user_defined;
    added.push_back(std::move(a));
  }
  return added;
}

void check_types(const std::string& source, const std::vector<int32_t>& types, size_t n) {
  TQ_CHECK(types.empty() || types.size() == n, source, ": ", types.size(), " token types for ", n, " tokens");
  for (size_t i = 0; i < types.size(); ++i)
    TQ_CHECK(types[i] >= 1 && types[i] <= 6, source, ": token ", i, " has unknown type ", types[i]);
}

}  // namespace

const std::string& byte_level_char(uint8_t b) { return byte_level_table().chars[b]; }

void append_byte_level(std::string_view bytes, std::string& out) {
  const ByteLevelTable& t = byte_level_table();
  for (char c : bytes) out += t.chars[static_cast<unsigned char>(c)];
}

std::unique_ptr<Tokenizer> build_tokenizer(TokenizerSpec spec) { return std::make_unique<BpeTokenizer>(std::move(spec)); }

std::unique_ptr<Tokenizer> make_spm_tokenizer(std::vector<std::string> pieces, std::vector<float> scores,
                                              std::vector<int32_t> types, const SpmOptions& options) {
  const std::string& src = options.source;
  const size_t n = pieces.size();
  TQ_CHECK(n > 0, src, ": empty vocabulary");
  TQ_CHECK(scores.size() == n, src, ": ", scores.size(), " scores for ", n, " pieces");
  check_types(src, types, n);
  if (types.empty()) types.assign(n, static_cast<int32_t>(TokenType::normal));

  TokenizerSpec spec;
  spec.source = src;
  spec.kind = TokenizerKind::sentencepiece_bpe;
  if (options.add_dummy_prefix) spec.normalizer.push_back({NormalizerStep::prepend, std::string(kMetaspace), ""});
  spec.normalizer.push_back({NormalizerStep::replace, " ", std::string(kMetaspace)});
  spec.pre_tokenizer_description = "none (SentencePiece)";
  spec.decoder = DecoderKind::sentencepiece;
  spec.strip_leading_space = options.add_dummy_prefix;

  int32_t unk = options.unk_id;
  std::vector<uint8_t> mergeable(n, 0);
  bool has_bytes = false;
  for (size_t i = 0; i < n; ++i) {
    const auto t = static_cast<TokenType>(types[i]);
    mergeable[i] = t == TokenType::normal || t == TokenType::user_defined;
    if (t == TokenType::unknown && unk < 0) unk = static_cast<int32_t>(i);
    if (t == TokenType::byte) has_bytes = true;
  }
  BpeModel::Options mo;
  mo.priority = BpeModel::Priority::piece_score;
  mo.byte_fallback = options.byte_fallback && has_bytes;
  mo.unk_id = unk;
  spec.added_tokens = added_from_types(pieces, types);
  spec.model = std::make_unique<BpeModel>(std::move(pieces), mo);
  spec.model->set_scores(std::move(scores), std::move(mergeable));

  spec.bos_id = options.bos_id;
  spec.eos_id = options.eos_id;
  spec.pad_id = options.pad_id;
  spec.unk_id = unk;
  if (options.add_bos) {
    TQ_CHECK(options.bos_id >= 0, src, ": add_bos is set but there is no BOS id");
    spec.prefix_ids.push_back(options.bos_id);
  }
  if (options.add_eos) {
    TQ_CHECK(options.eos_id >= 0, src, ": add_eos is set but there is no EOS id");
    spec.suffix_ids.push_back(options.eos_id);
  }
  return build_tokenizer(std::move(spec));
}

std::unique_ptr<Tokenizer> make_bpe_tokenizer_from_vocab(std::vector<std::string> tokens, std::vector<int32_t> types,
                                                         const std::vector<std::string>& merges,
                                                         const ByteLevelBpeOptions& options) {
  const std::string& src = options.source;
  TQ_CHECK(!tokens.empty(), src, ": empty vocabulary");
  check_types(src, types, tokens.size());

  std::vector<std::pair<std::string, std::string>> merge_pairs;
  merge_pairs.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string& m = merges[i];
    const size_t space = m.find(' ');
    TQ_CHECK(space != std::string::npos && space > 0 && space + 1 < m.size() && m.find(' ', space + 1) == std::string::npos,
             src, ": merge ", i, " '", m, "' is not two tokens separated by one space");
    merge_pairs.emplace_back(m.substr(0, space), m.substr(space + 1));
  }

  TokenizerSpec spec;
  spec.source = src;
  spec.kind = TokenizerKind::byte_level_bpe;
  const std::string pattern = options.pattern.empty() ? std::string(known_pattern_text(KnownPattern::gpt2)) : options.pattern;
  try {
    auto matcher = compile_pattern(pattern);
    spec.pre_tokenizer_description = matcher->is_fast() ? "regex (fast matcher)" : "regex (general engine)";
    spec.pre_tokenizer.push_back(make_split_step(std::move(matcher), SplitBehavior::isolated, false));
  } catch (const Error& e) {
    fail(src, ": ", e.what());
  }
  spec.byte_level_input = true;
  spec.decoder = DecoderKind::byte_level;
  if (!types.empty()) spec.added_tokens = added_from_types(tokens, types);

  BpeModel::Options mo;
  mo.priority = BpeModel::Priority::merge_rank;
  mo.ignore_merges = options.ignore_merges;
  mo.unk_id = options.unk_id;
  spec.model = std::make_unique<BpeModel>(std::move(tokens), mo);
  try {
    spec.model->set_merges(merge_pairs);
  } catch (const Error& e) {
    fail(src, ": ", e.what());
  }
  spec.bos_id = options.bos_id;
  spec.eos_id = options.eos_id;
  spec.pad_id = options.pad_id;
  spec.unk_id = options.unk_id;
  if (options.add_bos) {
    TQ_CHECK(options.bos_id >= 0, src, ": add_bos is set but there is no BOS id");
    spec.prefix_ids.push_back(options.bos_id);
  }
  if (options.add_eos) {
    TQ_CHECK(options.eos_id >= 0, src, ": add_eos is set but there is no EOS id");
    spec.suffix_ids.push_back(options.eos_id);
  }
  return build_tokenizer(std::move(spec));
}

// ------------------------------------------------------------------------------------------------ streaming

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens, bool at_text_start)
    : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {
  reset(at_text_start);
}

void StreamDecoder::reset(bool at_text_start) {
  strip_next_space_ = at_text_start && tokenizer_->strips_leading_space();
  pending_.clear();
}

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_ && tokenizer_->is_special(id)) return {};
  std::string_view piece = tokenizer_->token_to_piece(id);
  // The first byte of the text decides the leading-space rule, as HF's Strip sees the whole output.
  if (strip_next_space_ && !piece.empty()) {
    if (piece[0] == ' ') piece.remove_prefix(1);
    strip_next_space_ = false;
  }
  pending_.append(piece);
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const unsigned char b = static_cast<unsigned char>(pending_[i]);
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    const Utf8Step step = decode_utf8_step(std::string_view(pending_).substr(i));
    if (step.truncated) break;  // wait for the rest of the character
    if (step.valid)
      out.append(pending_, i, step.bytes);
    else
      append_utf8(out, kReplacementChar);
    i += step.bytes;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = pending_.empty() ? std::string() : to_valid_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace tq
