// Loaders: Hugging Face tokenizer.json, vocab.json + merges.txt (+ tokenizer_config.json), llama2.c
// tokenizer.bin, SentencePiece .model (protobuf), tiktoken files.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/parse.h"
#include "core/read_file.h"
#include "text/tokenizer.h"
#include "text/tokenizer_impl.h"
#include "text/unicode.h"

namespace tq {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581

json parse_json_file(const std::string& path) {
  const std::string text = read_whole_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
}

// Typed access to JSON members with errors that say where: "<file>: <where>.<key> ...".
struct JsonReader {
  const std::string& path;

  const json& member(const json& obj, const char* key, const std::string& where) const {
    TQ_CHECK(obj.is_object(), path, ": ", where, " is not an object");
    const auto it = obj.find(key);
    TQ_CHECK(it != obj.end(), path, ": ", where, " has no \"", key, "\"");
    return *it;
  }
  std::string str(const json& obj, const char* key, const std::string& where) const {
    const json& v = member(obj, key, where);
    TQ_CHECK(v.is_string(), path, ": ", where, ".", key, " is not a string");
    return v.get<std::string>();
  }
  bool flag(const json& obj, const char* key, bool fallback, const std::string& where) const {
    if (!obj.is_object()) return fallback;
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    TQ_CHECK(it->is_boolean(), path, ": ", where, ".", key, " is not a boolean");
    return it->get<bool>();
  }
  int32_t id(const json& v, const std::string& where) const {
    TQ_CHECK(v.is_number_integer(), path, ": ", where, " is not an integer");
    const auto x = v.get<int64_t>();
    TQ_CHECK(x >= 0 && x < std::numeric_limits<int32_t>::max(), path, ": ", where, " = ", x, " is not a valid id");
    return static_cast<int32_t>(x);
  }
};

// A special token named in tokenizer_config.json / special_tokens_map.json: a string, {"content": ...} or null.
std::optional<std::string> special_token_name(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object()) {
    const auto it = v.find("content");
    if (it != v.end() && it->is_string()) return it->get<std::string>();
  }
  return std::nullopt;
}

// Ids of the vocabulary strings and added tokens of a spec being built.
int32_t find_token(const TokenizerSpec& spec, const std::string& text) {
  for (const AddedToken& t : spec.added_tokens)
    if (t.content == text) return t.id;
  return spec.model ? spec.model->find(text) : -1;
}

// BOS/EOS/PAD/UNK from tokenizer_config.json (and special_tokens_map.json) in `dir`, when present.
void read_special_ids(const std::string& dir, TokenizerSpec& spec) {
  for (const char* name : {"special_tokens_map.json", "tokenizer_config.json"}) {
    const std::string path = (fs::path(dir) / name).string();
    if (!fs::exists(path)) continue;
    const json cfg = parse_json_file(path);
    if (!cfg.is_object()) fail(path, ": not a JSON object");
    const std::pair<const char*, int32_t*> fields[] = {
        {"bos_token", &spec.bos_id}, {"eos_token", &spec.eos_id}, {"pad_token", &spec.pad_id}, {"unk_token", &spec.unk_id}};
    for (const auto& [key, target] : fields) {
      const auto it = cfg.find(key);
      if (it == cfg.end()) continue;
      const std::optional<std::string> token = special_token_name(*it);
      if (!token) continue;
      const int32_t id = find_token(spec, *token);
      TQ_CHECK(id >= 0, path, ": ", key, " '", *token, "' is not in the vocabulary");
      *target = id;
    }
  }
}

AddedToken parse_added_token(const JsonReader& r, const json& t, int32_t id, const std::string& where) {
  AddedToken a;
  a.id = id;
  a.content = r.str(t, "content", where);
  a.special = r.flag(t, "special", false, where);
  // HF's default: special tokens are not normalized, others are.
  a.normalized = r.flag(t, "normalized", !a.special, where);
  a.lstrip = r.flag(t, "lstrip", false, where);
  a.rstrip = r.flag(t, "rstrip", false, where);
  a.single_word = r.flag(t, "single_word", false, where);
  return a;
}

// ------------------------------------------------------------------------------------------------ tokenizer.json

void parse_normalizer(const JsonReader& r, const json& n, TokenizerSpec& spec) {
  if (n.is_null()) return;
  const std::string type = r.str(n, "type", "normalizer");
  if (type == "Sequence") {
    const json& list = r.member(n, "normalizers", "normalizer");
    TQ_CHECK(list.is_array(), r.path, ": normalizer.normalizers is not a list");
    for (const json& item : list) parse_normalizer(r, item, spec);
  } else if (type == "NFC") {
    spec.normalizer.push_back({NormalizerStep::nfc, "", ""});
  } else if (type == "Prepend") {
    spec.normalizer.push_back({NormalizerStep::prepend, r.str(n, "prepend", "normalizer"), ""});
  } else if (type == "Replace") {
    const json& pattern = r.member(n, "pattern", "Replace normalizer");
    TQ_CHECK(pattern.is_object() && pattern.contains("String") && pattern["String"].is_string(), r.path,
             ": Replace normalizer: only a {\"String\": ...} pattern is supported");
    spec.normalizer.push_back(
        {NormalizerStep::replace, pattern["String"].get<std::string>(), r.str(n, "content", "Replace normalizer")});
  } else {
    fail(r.path, ": unsupported normalizer '", type, "'");
  }
}

SplitBehavior parse_behavior(const JsonReader& r, const std::string& b) {
  if (b == "Isolated") return SplitBehavior::isolated;
  if (b == "Removed") return SplitBehavior::removed;
  if (b == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (b == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (b == "Contiguous") return SplitBehavior::contiguous;
  fail(r.path, ": unknown Split behavior '", b, "'");
}

PrependScheme parse_prepend_scheme(const JsonReader& r, const json& m) {
  const auto it = m.find("prepend_scheme");
  if (it != m.end() && it->is_string()) {
    const std::string s = it->get<std::string>();
    if (s == "always") return PrependScheme::always;
    if (s == "first") return PrependScheme::first;
    if (s == "never") return PrependScheme::never;
    fail(r.path, ": unknown Metaspace prepend_scheme '", s, "'");
  }
  // Files older than prepend_scheme have add_prefix_space.
  return r.flag(m, "add_prefix_space", true, "Metaspace") ? PrependScheme::always : PrependScheme::never;
}

void parse_pre_tokenizer(const JsonReader& r, const json& p, TokenizerSpec& spec, std::string& description) {
  if (p.is_null()) return;
  const std::string type = r.str(p, "type", "pre_tokenizer");
  auto describe = [&](const std::string& s) { description += (description.empty() ? "" : " + ") + s; };
  if (type == "Sequence") {
    const json& list = r.member(p, "pretokenizers", "pre_tokenizer");
    TQ_CHECK(list.is_array(), r.path, ": pre_tokenizer.pretokenizers is not a list");
    for (const json& item : list) parse_pre_tokenizer(r, item, spec, description);
  } else if (type == "ByteLevel") {
    const bool use_regex = r.flag(p, "use_regex", true, "ByteLevel pre_tokenizer");
    spec.pre_tokenizer.push_back(make_byte_level_step(r.flag(p, "add_prefix_space", false, "ByteLevel"), use_regex));
    spec.byte_level_input = true;
    describe(use_regex ? "ByteLevel (GPT-2 regex, fast matcher)" : "ByteLevel");
  } else if (type == "Split") {
    const json& pattern = r.member(p, "pattern", "Split pre_tokenizer");
    std::unique_ptr<PatternMatcher> matcher;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      try {
        matcher = compile_pattern(pattern["Regex"].get<std::string>());
      } catch (const Error& e) {
        fail(r.path, ": ", e.what());
      }
      describe(matcher->is_fast() ? "Split (regex, fast matcher)" : "Split (regex, general engine)");
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      matcher = literal_pattern(pattern["String"].get<std::string>());
      describe("Split (string)");
    } else {
      fail(r.path, ": Split pre_tokenizer: the pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
    }
    const SplitBehavior behavior = parse_behavior(r, r.str(p, "behavior", "Split pre_tokenizer"));
    spec.pre_tokenizer.push_back(make_split_step(std::move(matcher), behavior, r.flag(p, "invert", false, "Split")));
  } else if (type == "Metaspace") {
    std::string replacement = p.contains("replacement") ? r.str(p, "replacement", "Metaspace") : std::string(kMetaspace);
    spec.pre_tokenizer.push_back(
        make_metaspace_step(std::move(replacement), parse_prepend_scheme(r, p), r.flag(p, "split", true, "Metaspace")));
    describe("Metaspace");
  } else if (type == "Digits") {
    spec.pre_tokenizer.push_back(make_digits_step(r.flag(p, "individual_digits", false, "Digits")));
    describe("Digits");
  } else {
    fail(r.path, ": unsupported pre_tokenizer '", type, "'");
  }
}

// Collects the decoder's effect: byte-level, or SentencePiece-like (U+2581 -> space, byte fallback, strip).
void parse_decoder(const JsonReader& r, const json& d, TokenizerSpec& spec, bool& seen_byte_level, bool& seen_spm) {
  const std::string type = r.str(d, "type", "decoder");
  if (type == "Sequence") {
    const json& list = r.member(d, "decoders", "decoder");
    TQ_CHECK(list.is_array(), r.path, ": decoder.decoders is not a list");
    for (const json& item : list) parse_decoder(r, item, spec, seen_byte_level, seen_spm);
  } else if (type == "ByteLevel") {
    seen_byte_level = true;
  } else if (type == "Replace") {
    const json& pattern = r.member(d, "pattern", "Replace decoder");
    const bool ok = pattern.is_object() && pattern.contains("String") && pattern["String"] == std::string(kMetaspace) &&
                    r.str(d, "content", "Replace decoder") == " ";
    TQ_CHECK(ok, r.path, ": only the Replace decoder U+2581 -> ' ' is supported");
    seen_spm = true;
  } else if (type == "ByteFallback" || type == "Fuse") {
    seen_spm = seen_spm || type == "ByteFallback";
  } else if (type == "Strip") {
    const std::string content = r.str(d, "content", "Strip decoder");
    const json& start = r.member(d, "start", "Strip decoder");
    const json& stop = r.member(d, "stop", "Strip decoder");
    TQ_CHECK(content == " " && start.is_number_integer() && stop == 0 && start.get<int64_t>() <= 1, r.path,
             ": only the Strip decoder of one leading space is supported");
    spec.strip_leading_space = start.get<int64_t>() == 1;
  } else if (type == "Metaspace") {
    seen_spm = true;
    spec.strip_leading_space = parse_prepend_scheme(r, d) != PrependScheme::never;
  } else {
    fail(r.path, ": unsupported decoder '", type, "'");
  }
}

void parse_post_processor(const JsonReader& r, const json& p, TokenizerSpec& spec) {
  if (p.is_null()) return;
  const std::string type = r.str(p, "type", "post_processor");
  if (type == "Sequence") {
    const json& list = r.member(p, "processors", "post_processor");
    TQ_CHECK(list.is_array(), r.path, ": post_processor.processors is not a list");
    for (const json& item : list) parse_post_processor(r, item, spec);
  } else if (type == "ByteLevel") {
    // Only adjusts offsets.
  } else if (type == "TemplateProcessing") {
    const json& single = r.member(p, "single", "TemplateProcessing");
    const json& specials = r.member(p, "special_tokens", "TemplateProcessing");
    TQ_CHECK(single.is_array(), r.path, ": TemplateProcessing.single is not a list");
    bool after_sequence = false;
    for (const json& item : single) {
      if (item.contains("Sequence")) {
        after_sequence = true;
        continue;
      }
      TQ_CHECK(item.contains("SpecialToken"), r.path, ": TemplateProcessing item is neither Sequence nor SpecialToken");
      const std::string name = r.str(item["SpecialToken"], "id", "TemplateProcessing SpecialToken");
      const json& entry = r.member(specials, name.c_str(), "TemplateProcessing.special_tokens");
      const json& ids = r.member(entry, "ids", "TemplateProcessing.special_tokens." + name);
      TQ_CHECK(ids.is_array(), r.path, ": TemplateProcessing.special_tokens.", name, ".ids is not a list");
      for (const json& id : ids) (after_sequence ? spec.suffix_ids : spec.prefix_ids).push_back(r.id(id, name));
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    const json& cls = r.member(p, "cls", type);
    const json& sep = r.member(p, "sep", type);
    TQ_CHECK(cls.is_array() && cls.size() == 2 && sep.is_array() && sep.size() == 2, r.path, ": ", type,
             " cls/sep are not [token, id]");
    spec.prefix_ids.push_back(r.id(cls[1], type + ".cls"));
    spec.suffix_ids.push_back(r.id(sep[1], type + ".sep"));
  } else {
    fail(r.path, ": unsupported post_processor '", type, "'");
  }
}

// A JSON reader that builds the document as nlohmann::json would, except for the two big members of a
// tokenizer file: the vocabulary object {token: id} and the merges list, which it collects straight into
// vectors (building them as JSON maps costs several times the parse). Where they are: `vocab_path` /
// `merges_path` are the keys leading to them ({} for a vocab.json whose root is the vocabulary).
class TokenizerJsonSax final : public nlohmann::json_sax<json> {
 public:
  using Path = std::optional<std::vector<std::string>>;
  TokenizerJsonSax(Path vocab_path, Path merges_path)
      : vocab_path_(std::move(vocab_path)), merges_path_(std::move(merges_path)) {}

  json root;
  bool has_vocab = false, has_merges = false;
  std::vector<std::pair<std::string, int64_t>> vocab;       // [entries] in file order
  std::vector<std::pair<std::string, std::string>> merges;  // [merges] in rank order
  std::string error;                                        // set when a captured member is malformed

  bool null() override { return value(json()); }
  bool boolean(bool v) override { return value(json(v)); }
  bool number_integer(number_integer_t v) override {
    if (mode_ == Mode::vocab) return vocab.emplace_back(std::move(key_), v), true;
    return value(json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (mode_ == Mode::vocab) {
      if (v > static_cast<number_unsigned_t>(std::numeric_limits<int64_t>::max())) return bad("an id out of range");
      return vocab.emplace_back(std::move(key_), static_cast<int64_t>(v)), true;
    }
    return value(json(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return value(json(v)); }
  bool string(string_t& v) override {
    if (mode_ == Mode::merges) {
      if (pair_depth_ == 1) {
        pair_.push_back(std::move(v));
        return true;
      }
      const size_t space = v.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 >= v.size() || v.find(' ', space + 1) != std::string::npos)
        return bad("model.merges[" + std::to_string(merges.size()) + "] '" + v + "' is not two tokens separated by one space");
      merges.emplace_back(v.substr(0, space), v.substr(space + 1));
      return true;
    }
    return value(json(std::move(v)));
  }
  bool binary(binary_t&) override { return bad("binary data"); }
  bool start_object(std::size_t) override {
    if (mode_ != Mode::build) return bad(mode_ == Mode::vocab ? "a vocabulary value is not an id" : "a merge is not a string or a pair");
    if (path_matches(vocab_path_)) return enter(Mode::vocab);
    json* obj = insert(json::object());
    stack_.push_back(obj);
    keys_.push_back(std::move(key_));
    return true;
  }
  bool end_object() override {
    if (mode_ == Mode::vocab) return leave();
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::merges) {
      if (pair_depth_ != 0) return bad("a merge is not a string or a pair");
      pair_depth_ = 1;
      pair_.clear();
      return true;
    }
    if (mode_ == Mode::vocab) return bad("a vocabulary value is not an id");
    if (path_matches(merges_path_)) return enter(Mode::merges);
    json* arr = insert(json::array());
    stack_.push_back(arr);
    keys_.push_back(std::move(key_));
    return true;
  }
  bool end_array() override {
    if (mode_ == Mode::merges) {
      if (pair_depth_ == 1) {
        pair_depth_ = 0;
        if (pair_.size() != 2)
          return bad("model.merges[" + std::to_string(merges.size()) + "] is neither \"a b\" nor [\"a\", \"b\"]");
        merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
        return true;
      }
      return leave();
    }
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    error = "not valid JSON (" + std::string(e.what()) + ", at byte " + std::to_string(position) + ")";
    return false;
  }

 private:
  enum class Mode { build, vocab, merges };

  bool bad(const std::string& what) {
    if (error.empty()) error = what;
    return false;
  }
  bool value(json v) {
    if (mode_ != Mode::build) return bad(mode_ == Mode::vocab ? "a vocabulary value is not an id" : "a merge is not a string or a pair");
    insert(std::move(v));
    return true;
  }
  // Adds a value to the open container (or as the root). Containers on the stack stay valid: objects are
  // std::map nodes, and an array gets no new element while a child of it is open.
  json* insert(json v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[key_];
    slot = std::move(v);
    return &slot;
  }
  // True when the container about to open sits at `path` (keys from the root; empty: the root itself).
  bool path_matches(const Path& path) const {
    if (!path) return false;
    if (path->empty()) return stack_.empty();
    if (stack_.size() != path->size() || !stack_.back()->is_object()) return false;
    for (size_t i = 1; i < path->size(); ++i)
      if (keys_[i] != (*path)[i - 1]) return false;
    return key_ == path->back();
  }
  bool enter(Mode m) {
    mode_ = m;
    (m == Mode::vocab ? has_vocab : has_merges) = true;
    return true;
  }
  bool leave() {
    mode_ = Mode::build;
    return true;
  }

  Path vocab_path_, merges_path_;
  Mode mode_ = Mode::build;
  std::vector<json*> stack_;       // open containers
  std::vector<std::string> keys_;  // the key each open container was opened under ("" at the root)
  std::string key_;
  int pair_depth_ = 0;
  std::vector<std::string> pair_;
};

void sax_parse_file(const std::string& path, TokenizerJsonSax& sax) {
  const std::string text = read_whole_file(path);
  bool ok = false;
  try {
    ok = json::sax_parse(text, &sax);
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  if (!ok) fail(path, ": ", sax.error.empty() ? "not valid JSON" : sax.error);
}

// The vocabulary {token: id} as [size] strings.
std::vector<std::string> vocab_by_id(const std::string& path, const std::vector<std::pair<std::string, int64_t>>& entries,
                                     const std::string& where) {
  TQ_CHECK(!entries.empty(), path, ": ", where, " is empty");
  int64_t max_id = -1;
  for (const auto& [token, id] : entries) {
    TQ_CHECK(id >= 0 && id < std::numeric_limits<int32_t>::max(), path, ": ", where, " entry '", token, "' has id ", id);
    max_id = std::max(max_id, id);
  }
  TQ_CHECK(static_cast<size_t>(max_id) < entries.size() * 2 + 1024, path, ": ", where, ": id ", max_id,
           " is far beyond the ", entries.size(), " entries");
  std::vector<std::string> out(static_cast<size_t>(max_id) + 1);
  for (const auto& [token, id] : entries) {
    std::string& slot = out[static_cast<size_t>(id)];
    TQ_CHECK(slot.empty(), path, ": ", where, ": id ", id, " is used by both '", slot, "' and '", token, "'");
    TQ_CHECK(!token.empty(), path, ": ", where, ": an empty token");
    slot = token;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ helpers

uint32_t read_u32_le(const std::string& d, size_t off) {
  uint32_t v;
  std::memcpy(&v, d.data() + off, 4);
  return v;
}

// Protocol-buffer reading for SentencePiece's ModelProto.
struct ProtoReader {
  const std::string& path;
  std::string_view data;
  size_t pos = 0;

  bool done() const { return pos >= data.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      TQ_CHECK(pos < data.size(), path, ": truncated protobuf (varint at byte ", pos, ")");
      const auto b = static_cast<unsigned char>(data[pos++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail(path, ": malformed protobuf varint at byte ", pos);
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    TQ_CHECK(n <= data.size() - pos, path, ": truncated protobuf (a field of ", n, " bytes at byte ", pos, ")");
    const std::string_view v = data.substr(pos, n);
    pos += n;
    return v;
  }
  float fixed32_float() {
    TQ_CHECK(data.size() - pos >= 4, path, ": truncated protobuf (float at byte ", pos, ")");
    float f;
    std::memcpy(&f, data.data() + pos, 4);
    pos += 4;
    return f;
  }
  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case 0: varint(); break;
      case 1:
        TQ_CHECK(data.size() - pos >= 8, path, ": truncated protobuf");
        pos += 8;
        break;
      case 2: bytes(); break;
      case 5:
        TQ_CHECK(data.size() - pos >= 4, path, ": truncated protobuf");
        pos += 4;
        break;
      default: fail(path, ": unsupported protobuf wire type ", wire_type, " at byte ", pos);
    }
  }
};

std::string base64_decode(const std::string& path, size_t line, std::string_view s) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    if (c == '=') break;
    const int v = value(c);
    TQ_CHECK(v >= 0, path, ": line ", line, ": invalid base64 character");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------------------------ public loaders

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path) {
  TokenizerJsonSax sax(std::vector<std::string>{"model", "vocab"}, std::vector<std::string>{"model", "merges"});
  sax_parse_file(path, sax);
  const json& root = sax.root;
  const JsonReader r{path};
  TQ_CHECK(root.is_object(), path, ": not a JSON object");
  const json& model = r.member(root, "model", "the file");
  const std::string type = model.contains("type") ? r.str(model, "type", "model") : "BPE";
  TQ_CHECK(type == "BPE", path, ": model type '", type, "' is not supported (only BPE)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = model.find(key);
    TQ_CHECK(it == model.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty()), path,
             ": model.", key, " is not supported");
  }
  if (const auto it = model.find("dropout"); it != model.end() && !it->is_null())
    TQ_CHECK(it->is_number() && it->get<double>() == 0.0, path, ": BPE dropout is not supported");

  TokenizerSpec spec;
  spec.source = path;
  parse_normalizer(r, root.value("normalizer", json()), spec);
  parse_pre_tokenizer(r, root.value("pre_tokenizer", json()), spec, spec.pre_tokenizer_description);
  spec.kind = spec.byte_level_input ? TokenizerKind::byte_level_bpe : TokenizerKind::sentencepiece_bpe;
  if (spec.pre_tokenizer_description.empty()) spec.pre_tokenizer_description = "none";

  const json decoder = root.value("decoder", json());
  TQ_CHECK(!decoder.is_null(), path, ": no decoder (a tokenizer.json without one is not supported)");
  bool seen_byte_level = false, seen_spm = false;
  parse_decoder(r, decoder, spec, seen_byte_level, seen_spm);
  TQ_CHECK(seen_byte_level != seen_spm, path,
           seen_byte_level ? ": the decoder mixes ByteLevel with SentencePiece steps"
                           : ": the decoder has neither ByteLevel nor SentencePiece (Replace/ByteFallback) steps");
  spec.decoder = seen_byte_level ? DecoderKind::byte_level : DecoderKind::sentencepiece;
  TQ_CHECK(seen_byte_level == spec.byte_level_input, path,
           ": a ByteLevel decoder needs a ByteLevel pre_tokenizer and the other way round");

  BpeModel::Options mo;
  mo.priority = BpeModel::Priority::merge_rank;
  mo.byte_fallback = r.flag(model, "byte_fallback", false, "model");
  mo.fuse_unk = r.flag(model, "fuse_unk", false, "model");
  mo.ignore_merges = r.flag(model, "ignore_merges", false, "model");
  TQ_CHECK(sax.has_vocab, path, ": model has no \"vocab\" object");
  std::vector<std::string> vocab = vocab_by_id(path, sax.vocab, "model.vocab");
  sax.vocab.clear();
  if (const auto it = model.find("unk_token"); it != model.end() && it->is_string()) {
    const std::string unk = it->get<std::string>();
    for (size_t i = 0; i < vocab.size(); ++i)
      if (vocab[i] == unk) mo.unk_id = static_cast<int32_t>(i);
    TQ_CHECK(mo.unk_id >= 0, path, ": model.unk_token '", unk, "' is not in the vocabulary");
  }
  spec.unk_id = mo.unk_id;
  spec.model = std::make_unique<BpeModel>(std::move(vocab), mo);
  try {
    spec.model->set_merges(sax.merges);
  } catch (const Error& e) {
    fail(path, ": model.", e.what());
  }

  if (const auto it = root.find("added_tokens"); it != root.end() && !it->is_null()) {
    TQ_CHECK(it->is_array(), path, ": added_tokens is not a list");
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      spec.added_tokens.push_back(parse_added_token(r, t, r.id(r.member(t, "id", where), where + ".id"), where));
    }
  }
  parse_post_processor(r, root.value("post_processor", json()), spec);

  if (!spec.prefix_ids.empty()) spec.bos_id = spec.prefix_ids.front();
  read_special_ids(fs::path(path).parent_path().string(), spec);
  return build_tokenizer(std::move(spec));
}

std::unique_ptr<Tokenizer> load_vocab_merges(const std::string& vocab_json, const std::string& merges_txt,
                                             const std::string& tokenizer_config_json) {
  TokenizerJsonSax sax(std::vector<std::string>{}, std::nullopt);
  sax_parse_file(vocab_json, sax);
  TQ_CHECK(sax.has_vocab, vocab_json, ": not a JSON object of token -> id");
  std::vector<std::string> vocab = vocab_by_id(vocab_json, sax.vocab, "the vocabulary");
  sax.vocab.clear();

  // merges.txt: an optional "#version" line, then "left right" per line.
  const std::string text = read_whole_file(merges_txt);
  std::vector<std::pair<std::string, std::string>> merges;
  size_t line_no = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t space = line.find(' ');
    TQ_CHECK(space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                 line.find(' ', space + 1) == std::string_view::npos,
             merges_txt, ": line ", line_no, " '", line, "' is not two tokens separated by one space");
    merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
  }

  json config = json::object();
  std::string config_dir;
  if (!tokenizer_config_json.empty()) {
    config = parse_json_file(tokenizer_config_json);
    TQ_CHECK(config.is_object(), tokenizer_config_json, ": not a JSON object");
    config_dir = fs::path(tokenizer_config_json).parent_path().string();
  }
  const JsonReader cr{tokenizer_config_json};
  const std::string tokenizer_class = config.value("tokenizer_class", std::string());
  const bool qwen = tokenizer_class.rfind("Qwen2Tokenizer", 0) == 0;

  TokenizerSpec spec;
  spec.source = vocab_json;
  spec.kind = TokenizerKind::byte_level_bpe;
  if (qwen) spec.normalizer.push_back({NormalizerStep::nfc, "", ""});
  const bool add_prefix_space = cr.flag(config, "add_prefix_space", false, "tokenizer_config");
  if (qwen) {
    spec.pre_tokenizer.push_back(
        make_split_step(compile_pattern(known_pattern_text(KnownPattern::qwen2)), SplitBehavior::isolated, false));
    spec.pre_tokenizer.push_back(make_byte_level_step(add_prefix_space, false));
    spec.pre_tokenizer_description = "Split (Qwen2 regex, fast matcher) + ByteLevel";
  } else {
    spec.pre_tokenizer.push_back(make_byte_level_step(add_prefix_space, true));
    spec.pre_tokenizer_description = "ByteLevel (GPT-2 regex, fast matcher)";
  }
  spec.byte_level_input = true;
  spec.decoder = DecoderKind::byte_level;

  BpeModel::Options mo;
  spec.model = std::make_unique<BpeModel>(std::move(vocab), mo);
  try {
    spec.model->set_merges(merges);
  } catch (const Error& e) {
    fail(merges_txt, ": ", e.what());
  }

  if (const auto it = config.find("added_tokens_decoder"); it != config.end() && it->is_object()) {
    for (const auto& [key, t] : it->items()) {
      int32_t id = -1;
      try {
        id = parse_integer<int32_t>(key, "added_tokens_decoder key");
      } catch (const std::exception&) {
        fail(tokenizer_config_json, ": added_tokens_decoder key '", key, "' is not an id");
      }
      spec.added_tokens.push_back(parse_added_token(cr, t, id, "added_tokens_decoder." + key));
    }
  } else if (tokenizer_config_json.empty()) {
    // GPT-2's own convention: <|endoftext|> is BOS, EOS and UNK, and a special token.
    const int32_t eot = spec.model->find("<|endoftext|>");
    if (eot >= 0) {
      AddedToken a;
      a.id = eot;
      a.content = "<|endoftext|>";
      a.special = true;
      spec.added_tokens.push_back(a);
      spec.bos_id = spec.eos_id = eot;
    }
  }
  // Added tokens must agree with the vocabulary where they overlap.
  for (const AddedToken& a : spec.added_tokens) {
    if (a.id < spec.model->vocab_size()) {
      const std::string& v = spec.model->token(a.id);
      TQ_CHECK(v.empty() || v == a.content, tokenizer_config_json, ": added token ", a.id, " '", a.content,
               "' differs from the vocabulary's '", v, "'");
    }
  }
  if (!config_dir.empty()) read_special_ids(config_dir, spec);
  if (cr.flag(config, "add_bos_token", false, "tokenizer_config")) {
    TQ_CHECK(spec.bos_id >= 0, tokenizer_config_json, ": add_bos_token is true but there is no bos_token");
    spec.prefix_ids.push_back(spec.bos_id);
  }
  if (cr.flag(config, "add_eos_token", false, "tokenizer_config")) {
    TQ_CHECK(spec.eos_id >= 0, tokenizer_config_json, ": add_eos_token is true but there is no eos_token");
    spec.suffix_ids.push_back(spec.eos_id);
  }
  return build_tokenizer(std::move(spec));
}

std::unique_ptr<Tokenizer> load_tokenizer_dir(const std::string& dir) {
  const fs::path d(dir);
  if (fs::exists(d / "tokenizer.json")) return load_tokenizer_json((d / "tokenizer.json").string());
  if (fs::exists(d / "vocab.json") && fs::exists(d / "merges.txt")) {
    const fs::path cfg = d / "tokenizer_config.json";
    return load_vocab_merges((d / "vocab.json").string(), (d / "merges.txt").string(),
                             fs::exists(cfg) ? cfg.string() : std::string());
  }
  fail(dir, ": no tokenizer.json, nor vocab.json with merges.txt");
}

std::unique_ptr<Tokenizer> load_llama2c_tokenizer(const std::string& path) {
  const std::string d = read_whole_file(path);
  TQ_CHECK(d.size() >= 4, path, ": truncated llama2.c tokenizer (", d.size(), " bytes, no header)");
  const uint32_t max_len = read_u32_le(d, 0);
  TQ_CHECK(max_len > 0 && max_len < 4096, path, ": implausible max_token_length ", max_len);
  std::vector<std::string> pieces;
  std::vector<float> scores;
  size_t off = 4;
  while (off < d.size()) {
    TQ_CHECK(d.size() - off >= 8, path, ": truncated at token ", pieces.size(), " (byte ", off, ")");
    float score;
    std::memcpy(&score, d.data() + off, 4);
    const uint32_t len = read_u32_le(d, off + 4);
    off += 8;
    TQ_CHECK(len <= max_len, path, ": token ", pieces.size(), " is ", len, " bytes, more than max_token_length ", max_len);
    TQ_CHECK(d.size() - off >= len, path, ": truncated at token ", pieces.size(), " (byte ", off, ")");
    pieces.emplace_back(d.data() + off, len);
    scores.push_back(score);
    off += len;
  }
  TQ_CHECK(pieces.size() >= 3 + 256, path, ": only ", pieces.size(), " tokens (expected <unk>, BOS, EOS, 256 bytes, ...)");
  // llama2.c's export writes spaces for U+2581; types follow from the fixed layout.
  std::vector<int32_t> types(pieces.size(), static_cast<int32_t>(TokenType::normal));
  types[0] = static_cast<int32_t>(TokenType::unknown);
  types[1] = types[2] = static_cast<int32_t>(TokenType::control);
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::string& p = pieces[i];
    if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>') {
      types[i] = static_cast<int32_t>(TokenType::byte);
      continue;
    }
    if (types[i] != static_cast<int32_t>(TokenType::normal)) continue;
    std::string q;
    for (char c : p) {
      if (c == ' ')
        q += kMetaspace;
      else
        q.push_back(c);
    }
    p = std::move(q);
  }
  // The ids llama2.c gives BOS and EOS (its pieces read "\n<s>\n" and "\n</s>\n").
  SpmOptions o;
  o.source = path;
  o.unk_id = 0;
  o.bos_id = 1;
  o.eos_id = 2;
  o.add_bos = true;
  return make_spm_tokenizer(std::move(pieces), std::move(scores), std::move(types), o);
}

std::unique_ptr<Tokenizer> load_sentencepiece_model(const std::string& path) {
  const std::string d = read_whole_file(path);
  ProtoReader top{path, d};
  std::vector<std::string> pieces;
  std::vector<float> scores;
  std::vector<int32_t> types;
  int64_t model_type = 1;  // UNIGRAM is the default
  bool byte_fallback = false, add_dummy_prefix = true, remove_extra_whitespaces = true;
  std::string normalizer_name;
  int32_t unk_id = 0, bos_id = 1, eos_id = 2, pad_id = -1;
  while (!top.done()) {
    const uint64_t key = top.varint();
    const auto field = static_cast<uint32_t>(key >> 3), wire = static_cast<uint32_t>(key & 7);
    if (wire != 2 || (field != 1 && field != 2 && field != 3)) {
      top.skip(wire);
      continue;
    }
    ProtoReader sub{path, top.bytes()};
    if (field == 1) {  // SentencePiece { piece = 1; score = 2; type = 3 }
      std::string piece;
      float score = 0;
      int32_t type = 1;
      while (!sub.done()) {
        const uint64_t k = sub.varint();
        const auto f = static_cast<uint32_t>(k >> 3), w = static_cast<uint32_t>(k & 7);
        if (f == 1 && w == 2) {
          piece = std::string(sub.bytes());
        } else if (f == 2 && w == 5) {
          score = sub.fixed32_float();
        } else if (f == 3 && w == 0) {
          type = static_cast<int32_t>(sub.varint());
        } else {
          sub.skip(w);
        }
      }
      TQ_CHECK(type >= 1 && type <= 6, path, ": piece ", pieces.size(), " has unknown type ", type);
      pieces.push_back(std::move(piece));
      scores.push_back(score);
      types.push_back(type);
    } else if (field == 2) {  // TrainerSpec
      while (!sub.done()) {
        const uint64_t k = sub.varint();
        const auto f = static_cast<uint32_t>(k >> 3), w = static_cast<uint32_t>(k & 7);
        if (w != 0) {
          sub.skip(w);
          continue;
        }
        const auto v = sub.varint();
        if (f == 3) model_type = static_cast<int64_t>(v);
        if (f == 35) byte_fallback = v != 0;
        if (f == 40) unk_id = static_cast<int32_t>(v);
        if (f == 41) bos_id = static_cast<int32_t>(v);
        if (f == 42) eos_id = static_cast<int32_t>(v);
        if (f == 43) pad_id = static_cast<int32_t>(v);
      }
    } else {  // NormalizerSpec
      while (!sub.done()) {
        const uint64_t k = sub.varint();
        const auto f = static_cast<uint32_t>(k >> 3), w = static_cast<uint32_t>(k & 7);
        if (f == 1 && w == 2) {
          normalizer_name = std::string(sub.bytes());
        } else if (w == 0) {
          const auto v = sub.varint();
          if (f == 3) add_dummy_prefix = v != 0;
          if (f == 4) remove_extra_whitespaces = v != 0;
        } else {
          sub.skip(w);
        }
      }
    }
  }
  TQ_CHECK(!pieces.empty(), path, ": no pieces (not a SentencePiece model?)");
  TQ_CHECK(model_type == 2, path, ": SentencePiece model type ", model_type, " is not supported (only BPE = 2)");
  TQ_CHECK(normalizer_name.empty() || normalizer_name == "identity", path, ": SentencePiece normalizer '",
           normalizer_name, "' is not supported (only identity)");
  TQ_CHECK(!remove_extra_whitespaces, path, ": SentencePiece remove_extra_whitespaces is not supported");
  const auto n = static_cast<int32_t>(pieces.size());
  auto valid = [&](int32_t id) { return id >= 0 && id < n ? id : -1; };
  SpmOptions o;
  o.source = path;
  o.unk_id = valid(unk_id);
  o.bos_id = valid(bos_id);
  o.eos_id = valid(eos_id);
  o.pad_id = valid(pad_id);
  o.add_bos = o.bos_id >= 0;
  o.add_dummy_prefix = add_dummy_prefix;
  o.byte_fallback = byte_fallback;
  return make_spm_tokenizer(std::move(pieces), std::move(scores), std::move(types), o);
}

std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, std::string_view pattern,
                                         const std::vector<TiktokenSpecial>& specials, int32_t bos_id,
                                         int32_t eos_id, bool add_bos) {
  const std::string text = read_whole_file(path);
  std::vector<std::string> vocab;
  size_t line_no = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    TQ_CHECK(space != std::string_view::npos, path, ": line ", line_no, " is not 'base64 rank'");
    const std::string bytes = base64_decode(path, line_no, line.substr(0, space));
    const std::string_view rank_text = line.substr(space + 1);
    int64_t rank = 0;
    for (char c : rank_text) {
      TQ_CHECK(c >= '0' && c <= '9' && rank < (1 << 30), path, ": line ", line_no, ": bad rank '", rank_text, "'");
      rank = rank * 10 + (c - '0');
    }
    TQ_CHECK(!rank_text.empty() && rank == static_cast<int64_t>(vocab.size()), path, ": line ", line_no, ": rank ",
             rank_text, " where ", vocab.size(), " was expected (ranks must be 0, 1, 2, ...)");
    TQ_CHECK(!bytes.empty(), path, ": line ", line_no, ": empty token");
    std::string token;
    append_byte_level(bytes, token);
    vocab.push_back(std::move(token));
  }
  TQ_CHECK(!vocab.empty(), path, ": no tokens");

  TokenizerSpec spec;
  spec.source = path;
  spec.kind = TokenizerKind::byte_level_bpe;
  try {
    auto matcher = compile_pattern(pattern);
    spec.pre_tokenizer_description = matcher->is_fast() ? "regex (fast matcher)" : "regex (general engine)";
    spec.pre_tokenizer.push_back(make_split_step(std::move(matcher), SplitBehavior::isolated, false));
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
  spec.byte_level_input = true;
  spec.decoder = DecoderKind::byte_level;
  for (const TiktokenSpecial& s : specials) {
    AddedToken a;
    a.id = s.id;
    a.content = s.content;
    a.special = true;
    TQ_CHECK(s.id >= static_cast<int32_t>(vocab.size()), path, ": special token '", s.content, "' id ", s.id,
             " collides with the ", vocab.size(), " ranks");
    spec.added_tokens.push_back(std::move(a));
  }
  BpeModel::Options mo;
  mo.ignore_merges = true;  // tiktoken looks a whole piece up before merging
  spec.model = std::make_unique<BpeModel>(std::move(vocab), mo);
  spec.model->set_merges_from_vocab_ranks();
  spec.bos_id = bos_id;
  spec.eos_id = eos_id;
  if (add_bos) spec.prefix_ids.push_back(bos_id);
  return build_tokenizer(std::move(spec));
}

std::unique_ptr<Tokenizer> load_llama3_tiktoken(const std::string& path) {
  const char* named[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                         "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                         "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                         "<|python_tag|>", "<|image|>"};
  constexpr int32_t kBase = 128000, kCount = 256;
  std::vector<TiktokenSpecial> specials;
  for (const char* s : named) specials.push_back({s, kBase + static_cast<int32_t>(specials.size())});
  for (int32_t i = 2; specials.size() < kCount; ++i)
    specials.push_back({"<|reserved_special_token_" + std::to_string(i) + "|>", kBase + static_cast<int32_t>(specials.size())});
  return load_tiktoken(path, known_pattern_text(KnownPattern::llama3), specials, kBase, kBase + 1, true);
}

std::unique_ptr<Tokenizer> load_o200k_harmony_tiktoken(const std::string& path) {
  // The ids are tiktoken's o200k_harmony (and gpt-oss's tokenizer.json, for 199998..200018).
  const std::pair<const char*, int32_t> named[] = {
      {"<|startoftext|>", 199998}, {"<|endoftext|>", 199999}, {"<|return|>", 200002}, {"<|constrain|>", 200003},
      {"<|channel|>", 200005},     {"<|start|>", 200006},     {"<|end|>", 200007},    {"<|message|>", 200008},
      {"<|call|>", 200012}};
  constexpr int32_t kFirst = 199998, kEnd = 201088;
  std::vector<TiktokenSpecial> specials;
  for (int32_t id = kFirst; id < kEnd; ++id) {
    std::string content = "<|reserved_" + std::to_string(id) + "|>";
    for (const auto& [name, named_id] : named)
      if (named_id == id) content = name;
    specials.push_back({std::move(content), id});
  }
  // Listed after <|reserved_200018|>: the tokenizer decodes an id as the last added token that has it.
  specials.push_back({"<|endofprompt|>", 200018});
  return load_tiktoken(path, known_pattern_text(KnownPattern::o200k), specials, 199998, 200002, false);
}

}  // namespace tq
