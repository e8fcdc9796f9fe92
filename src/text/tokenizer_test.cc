#include "text/tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "text/bpe.h"
#include "text/pretokenizer.h"
#include "text/unicode.h"

namespace tq {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

const std::string kShared = TQ_SHARED_DIR;
const std::string kFixtures = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/text/";

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_all(const fs::path& path, std::string_view data) {
  std::ofstream f(path, std::ios::binary);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

std::vector<std::string> fixture_texts() {
  const auto j = nlohmann::json::parse(read_all(kFixtures + "tokenizer_texts.json"));
  return j["texts"].get<std::vector<std::string>>();
}

std::string ids_str(const Ids& ids) {
  std::string s;
  for (int32_t id : ids) {
    if (!s.empty()) s.push_back(' ');
    s += std::to_string(id);
  }
  return s;
}

#define REQUIRE_FILE(path)                                                              \
  do {                                                                                  \
    if (!fs::exists(path)) GTEST_SKIP() << "shared file " << (path) << " is absent"; \
  } while (0)

// The tokenizers of the fixture, by the names tools/fixtures/make_tokenizer_fixtures.py uses, with the same
// files. `byte_level` ones must round-trip any text exactly.
struct FixtureTokenizer {
  std::string name;
  std::vector<std::string> files;  // all must exist
  std::function<std::unique_ptr<Tokenizer>()> load;
  bool byte_level;
  bool parse_special = true;  // false where the reference library never matches special tokens in text
};

const std::vector<FixtureTokenizer>& fixture_tokenizers() {
  static const std::vector<FixtureTokenizer> list = [] {
    const std::string m = kShared + "/models/", t = kShared + "/tokenizers/";
    std::vector<FixtureTokenizer> v;
    auto json_tok = [&](const char* name, const std::string& path, bool byte_level) {
      v.push_back({name, {path}, [path] { return load_tokenizer_json(path); }, byte_level});
    };
    json_tok("tq-llama-hd128", m + "tq-llama-hd128/tokenizer.json", true);
    json_tok("tinystories-656K", m + "tinystories-656K/tokenizer.json", false);
    json_tok("llama2-sentencepiece", t + "llama2-sentencepiece/tokenizer.json", false);
    json_tok("mistral-7b-v0.2", t + "mistral-7b-v0.2/tokenizer.json", false);
    json_tok("mistral-7b-v0.3", t + "mistral-7b-v0.3/tokenizer.json", false);
    v.push_back({"gpt2",
                 {t + "gpt2/vocab.json", t + "gpt2/merges.txt"},
                 [t] { return load_vocab_merges(t + "gpt2/vocab.json", t + "gpt2/merges.txt", ""); },
                 true});
    v.push_back({"qwen2.5",
                 {t + "qwen2.5/vocab.json", t + "qwen2.5/merges.txt", t + "qwen2.5/tokenizer_config.json"},
                 [t] {
                   return load_vocab_merges(t + "qwen2.5/vocab.json", t + "qwen2.5/merges.txt",
                                            t + "qwen2.5/tokenizer_config.json");
                 },
                 true});
    for (const char* dir : {"llama2-sentencepiece", "mistral-7b-v0.2"}) {
      const std::string path = t + dir + "/tokenizer.model";
      v.push_back({std::string(dir) + ".model", {path}, [path] { return load_sentencepiece_model(path); }, false, false});
    }
    v.push_back({"llama3-tiktoken", {t + "llama3/tokenizer.model"},
                 [t] { return load_llama3_tiktoken(t + "llama3/tokenizer.model"); }, true});
    v.push_back({"gpt2-r50k-tiktoken", {t + "gpt2/r50k_base.tiktoken"},
                 [t] {
                   return load_tiktoken(t + "gpt2/r50k_base.tiktoken", known_pattern_text(KnownPattern::gpt2),
                                        {{"<|endoftext|>", 50256}}, 50256, 50256, false);
                 },
                 true});
    v.push_back({"o200k-tiktoken", {t + "o200k/o200k_base.tiktoken"},
                 [t] {
                   return load_tiktoken(t + "o200k/o200k_base.tiktoken", known_pattern_text(KnownPattern::o200k),
                                        {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}, -1, 199999, false);
                 },
                 true});
    // gpt-oss: tiktoken's o200k_harmony and the `tokenizers` library on the same ranks (converted by
    // transformers) are both compared with our tiktoken loader; gpt-oss-mini is the repository's own file.
    for (const char* name : {"o200k-harmony-tiktoken", "o200k-harmony-hf"})
      v.push_back({name, {t + "o200k/o200k_base.tiktoken"},
                   [t] { return load_o200k_harmony_tiktoken(t + "o200k/o200k_base.tiktoken"); }, true});
    json_tok("gpt-oss-mini", kFixtures + "gpt-oss-mini/tokenizer.json", true);
    return v;
  }();
  return list;
}

bool available(const FixtureTokenizer& f) {
  for (const auto& p : f.files)
    if (!fs::exists(p)) return false;
  return true;
}

// Loaded once per test binary: the big vocabularies take a moment.
const Tokenizer* get_tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second.get();
  for (const auto& f : fixture_tokenizers()) {
    if (name != f.name) continue;
    if (!available(f)) return nullptr;
    return (cache[name] = f.load()).get();
  }
  ADD_FAILURE() << "unknown fixture tokenizer " << name;
  return nullptr;
}

#define REQUIRE_TOKENIZER(var, name)                                                   \
  const Tokenizer* var = get_tokenizer(name);                                          \
  if (!var) GTEST_SKIP() << "the files of tokenizer " << (name) << " are not in " << kShared

bool contains_special_text(const std::string& s) {
  for (const char* m : {"<|", "<s>", "</s>", "<unk>", "[INST]", "[/INST]"})
    if (s.find(m) != std::string::npos) return true;
  return false;
}

// ------------------------------------------------------------------------------------------------ known ids

TEST(KnownIds, TinyStories656KOnceUponATime) {
  REQUIRE_TOKENIZER(tok, "tinystories-656K");
  // From the model's README (computed with HF there).
  EXPECT_EQ(tok->encode("Once upon a time"), (Ids{1, 80, 147, 201, 282, 57}));
  EXPECT_EQ(tok->decode(Ids{1, 80, 147, 201, 282, 57}), "Once upon a time");
  // As HF: the dummy-prefix space is stripped only at the very start of the output.
  EXPECT_EQ(tok->decode(Ids{1, 80, 147, 201, 282, 57}, false), "<|start_story|> Once upon a time");
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->kind(), TokenizerKind::sentencepiece_bpe);
}

TEST(KnownIds, TqLlamaHd128GoldenPrompt) {
  const std::string golden_path = kShared + "/models/tq-llama-hd128/golden.json";
  REQUIRE_FILE(golden_path);
  REQUIRE_TOKENIZER(tok, "tq-llama-hd128");
  const auto g = nlohmann::json::parse(read_all(golden_path));
  EXPECT_EQ(tok->encode(g["prompt"].get<std::string>()), g["prompt_ids"].get<Ids>());
  EXPECT_EQ(tok->decode(g["greedy_new_ids"].get<Ids>()), g["greedy_text"].get<std::string>());
  EXPECT_EQ(tok->bos_id(), 0);
  EXPECT_EQ(tok->eos_id(), 0);
  EXPECT_EQ(tok->pad_id(), 0);
}

TEST(KnownIds, HelloWorldInSeveralVocabularies) {
  struct Case {
    const char* name;
    Ids ids;
    std::vector<std::string> tokens;  // the vocabulary strings of the ids after any BOS
  };
  const Case cases[] = {
      {"gpt2", {15496, 995}, {"Hello", "\xC4\xA0world"}},
      {"gpt2-r50k-tiktoken", {15496, 995}, {"Hello", "\xC4\xA0world"}},
      {"qwen2.5", {9707, 1879}, {"Hello", "\xC4\xA0world"}},
      {"llama3-tiktoken", {128000, 9906, 1917}, {"Hello", "\xC4\xA0world"}},
      {"llama2-sentencepiece", {1, 15043, 3186}, {"\u2581Hello", "\u2581world"}},
      {"llama2-sentencepiece.model", {1, 15043, 3186}, {"\u2581Hello", "\u2581world"}},
  };
  int ran = 0;
  for (const Case& c : cases) {
    const Tokenizer* tok = get_tokenizer(c.name);
    if (!tok) continue;
    ++ran;
    const Ids ids = tok->encode("Hello world");
    EXPECT_EQ(ids, c.ids) << c.name;
    const size_t first = ids.size() - c.tokens.size();
    for (size_t i = 0; i < c.tokens.size() && first + i < ids.size(); ++i)
      EXPECT_EQ(tok->id_to_token(ids[first + i]), c.tokens[i]) << c.name;
  }
  if (ran == 0) GTEST_SKIP() << "none of the tokenizers is in " << kShared;
}

// llama2.c's encode(), written out as that program does it: BOS, the dummy-prefix " " token, one token per
// UTF-8 character (or its bytes + 3), then repeatedly the pair whose concatenated string has the best score.
Ids llama2c_reference_encode(const std::vector<std::string>& vocab, const std::vector<float>& scores,
                             const std::string& text) {
  std::map<std::string, int32_t> lookup;
  for (size_t i = 0; i < vocab.size(); ++i) lookup.emplace(vocab[i], static_cast<int32_t>(i));
  auto find = [&](const std::string& s) {
    auto it = lookup.find(s);
    return it == lookup.end() ? -1 : it->second;
  };
  Ids t{1};
  if (!text.empty()) t.push_back(find(" "));
  for (size_t i = 0; i < text.size();) {
    size_t len = 1;
    while (i + len < text.size() && len < 4 && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
    const int32_t id = find(text.substr(i, len));
    if (id >= 0) {
      t.push_back(id);
    } else {
      for (size_t k = 0; k < len; ++k) t.push_back(static_cast<unsigned char>(text[i + k]) + 3);
    }
    i += len;
  }
  while (true) {
    float best = -1e10f;
    int32_t best_id = -1;
    size_t best_at = 0;
    for (size_t i = 1; i + 1 < t.size(); ++i) {  // t[0] is BOS
      const int32_t id = find(vocab[static_cast<size_t>(t[i])] + vocab[static_cast<size_t>(t[i + 1])]);
      if (id >= 0 && scores[static_cast<size_t>(id)] > best) best = scores[static_cast<size_t>(id)], best_id = id, best_at = i;
    }
    if (best_id < 0) break;
    t[best_at] = best_id;
    t.erase(t.begin() + static_cast<ptrdiff_t>(best_at) + 1);
  }
  return t;
}

TEST(KnownIds, Stories260KTok512MatchesLlama2c) {
  const std::string path = kShared + "/models/stories260K/tok512.bin";
  REQUIRE_FILE(path);
  const auto tok = load_llama2c_tokenizer(path);
  EXPECT_EQ(tok->vocab_size(), 512);
  // "Once upon a time" is the start of the story the model's README prints: " Once" 403, " upon" 407,
  // " a" 261, " time" 378 (the ids of its greedy continuation from BOS).
  EXPECT_EQ(tok->encode("Once upon a time"), (Ids{1, 403, 407, 261, 378}));
  EXPECT_EQ(tok->decode(Ids{1, 403, 407, 261, 378}), "Once upon a time");

  // Independent reference: llama2.c's algorithm on the raw file.
  const std::string d = read_all(path);
  std::vector<std::string> vocab;
  std::vector<float> scores;
  for (size_t off = 4; off + 8 <= d.size();) {
    float s;
    int32_t len;
    std::memcpy(&s, d.data() + off, 4);
    std::memcpy(&len, d.data() + off + 4, 4);
    vocab.emplace_back(d.data() + off + 8, static_cast<size_t>(len));
    scores.push_back(s);
    off += 8 + static_cast<size_t>(len);
  }
  ASSERT_EQ(vocab.size(), 512u);
  std::vector<std::string> texts = fixture_texts();
  const std::string story = "Lily's mom said, \"Lily, let's go to the park.\" She saw a big, red ball!";
  texts.push_back(story);
  SplitMix64 rng(99);
  const std::string alphabet = "abcdefghijklmnopqrstuvwxyz ABC.,!'\"\n\t0123";
  for (int i = 0; i < 300; ++i) {
    std::string s;
    const int len = static_cast<int>(rng.next() % 40);
    for (int k = 0; k < len; ++k) s.push_back(alphabet[rng.next() % alphabet.size()]);
    texts.push_back(s);
  }
  for (const std::string& text : texts) {
    // llama2.c knows nothing of special tokens; these texts would differ only in "\n<s>\n".
    if (text.find("<s>") != std::string::npos || text.find("</s>") != std::string::npos) continue;
    EXPECT_EQ(ids_str(tok->encode(text)), ids_str(llama2c_reference_encode(vocab, scores, text))) << text;
  }
}

// ------------------------------------------------------------------------------------------------ round trips

TEST(RoundTrip, DecodeOfEncodeGivesTheText) {
  const std::vector<std::string> texts = fixture_texts();
  int tokenizers = 0;
  for (const auto& f : fixture_tokenizers()) {
    const Tokenizer* tok = get_tokenizer(f.name);
    if (!tok) continue;
    ++tokenizers;
    const bool nfc = f.name == "qwen2.5";
    const bool metaspace_first = f.name == "mistral-7b-v0.3";
    const bool has_byte_fallback = tok->token_to_id("<0x41>") >= 0;
    for (const std::string& text : texts) {
      const std::string expected = nfc ? nfc_normalize(text) : text;
      if (f.byte_level) {
        // Byte-level BPE loses nothing, special tokens included (their text is their content).
        const Ids ids = tok->encode(text, false);
        EXPECT_EQ(tok->decode(ids, false), expected) << f.name << ": " << ids_str(ids);
        continue;
      }
      const Ids ids = tok->encode(text);
      // SentencePiece: the text comes back when every character has a piece or byte tokens, no special token
      // inside changes the spacing around it, and (Metaspace "first") it does not start with a space.
      if (!has_byte_fallback || contains_special_text(text) || (metaspace_first && !text.empty() && text[0] == ' '))
        continue;
      EXPECT_EQ(tok->decode(ids), expected) << f.name << ": " << ids_str(ids);
    }
  }
  if (tokenizers == 0) GTEST_SKIP() << "no tokenizer files in " << kShared;
}

TEST(RoundTrip, JaneAustenText) {
  const std::string path = kShared + "/data/janeausten/persuasion.txt";
  REQUIRE_FILE(path);
  const std::string text = read_all(path).substr(0, 60000);
  for (const char* name : {"tq-llama-hd128", "gpt2", "qwen2.5", "llama2-sentencepiece", "mistral-7b-v0.3",
                           "llama2-sentencepiece.model", "llama3-tiktoken"}) {
    const Tokenizer* tok = get_tokenizer(name);
    if (!tok) continue;
    const Ids ids = tok->encode(text, false);
    EXPECT_EQ(tok->decode(ids), text) << name;
    EXPECT_LT(ids.size(), text.size() / 3) << name << ": English should take fewer than a token per 3 bytes";
  }
}

// Two independent views of the same vocabulary must agree: GPT-2 from vocab.json + merges.txt (HF merges)
// and from r50k_base.tiktoken (tiktoken's lowest-rank-concatenation rule); Llama 2 from tokenizer.json
// (HF merges) and from tokenizer.model (SentencePiece scores).
TEST(RoundTrip, IndependentLoadersOfOneVocabularyAgree) {
  const std::string austen = kShared + "/data/janeausten/persuasion.txt";
  std::vector<std::string> texts = fixture_texts();
  if (fs::exists(austen)) {
    const std::string book = read_all(austen);
    for (size_t i = 0; i < 20; ++i) texts.push_back(book.substr(i * 20000, 2000));
  }
  int pairs = 0;
  for (auto [a, b] : {std::pair{"gpt2", "gpt2-r50k-tiktoken"}, std::pair{"llama2-sentencepiece", "llama2-sentencepiece.model"},
                      std::pair{"mistral-7b-v0.2", "mistral-7b-v0.2.model"}}) {
    const Tokenizer* ta = get_tokenizer(a);
    const Tokenizer* tb = get_tokenizer(b);
    if (!ta || !tb) continue;
    ++pairs;
    for (const std::string& text : texts) {
      if (contains_special_text(text)) continue;  // the loaders know different sets of special tokens
      EXPECT_EQ(ids_str(ta->encode(text)), ids_str(tb->encode(text))) << a << " vs " << b << ": " << text;
    }
  }
  if (pairs == 0) GTEST_SKIP() << "no pair of loaders has its files in " << kShared;
}

// ------------------------------------------------------------------------------------------------ special tokens

TEST(SpecialTokens, QwenChatMarkup) {
  REQUIRE_TOKENIZER(tok, "qwen2.5");
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->eos_id(), 151645);
  EXPECT_EQ(tok->pad_id(), 151643);
  EXPECT_EQ(tok->token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok->id_to_token(151645), "<|im_end|>");
  EXPECT_TRUE(tok->is_special(151644));
  EXPECT_FALSE(tok->is_special(151657));  // <tool_call> is added but not special
  EXPECT_EQ(tok->vocab_size(), 151665);

  const std::string chat = "<|im_start|>user\nHi!<|im_end|>\n<tool_call>";
  const Ids ids = tok->encode(chat);
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151657);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 151645), ids.end());
  EXPECT_EQ(tok->decode(ids, false), chat);
  EXPECT_EQ(tok->decode(ids, true), "user\nHi!\n<tool_call>");
  // Not parsing special tokens turns them into plain text, but added non-special tokens still match.
  EncodeOptions plain;
  plain.parse_special = false;
  const Ids as_text = tok->encode(chat, plain);
  EXPECT_EQ(std::find(as_text.begin(), as_text.end(), 151644), as_text.end());
  EXPECT_EQ(as_text.back(), 151657);
  EXPECT_EQ(tok->decode(as_text), chat);
}

TEST(SpecialTokens, EndOfTextIsNeverMergedWithNeighbours) {
  REQUIRE_TOKENIZER(tok, "tq-llama-hd128");
  const Ids ids = tok->encode("Hello<|endoftext|>world", false);
  const Ids left = tok->encode("Hello", false), right = tok->encode("world", false);
  Ids expected = left;
  expected.push_back(0);
  expected.insert(expected.end(), right.begin(), right.end());
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(tok->decode(ids), "Helloworld");
  EXPECT_EQ(tok->decode(ids, false), "Hello<|endoftext|>world");
}

TEST(SpecialTokens, MistralControlTokensAndLegacySpacing) {
  REQUIRE_TOKENIZER(v3, "mistral-7b-v0.3");
  const Ids ids = v3->encode("[INST] Hi [/INST]");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids.back(), 4);
  EXPECT_EQ(v3->vocab_size(), 32768);
  EXPECT_EQ(v3->token_to_id("<0x41>"), 771 + 0x41);
  // Metaspace "first": only the text at the very start gets the U+2581 prefix.
  EXPECT_EQ(v3->id_to_token(v3->encode("Hi", false)[0]).rfind("\u2581", 0), 0u);
  EXPECT_EQ(v3->encode("[INST]Hi", false)[1], v3->token_to_id("Hi"));
}

// ------------------------------------------------------------------------------------------------ fixtures

// Every entry of tests/fixtures/text/tokenizer_ids.json (written by tools/fixtures/make_tokenizer_fixtures.py
// with HF tokenizers/transformers, sentencepiece and tiktoken) against our loaders of the same files.
TEST(TokenizerFixtures, MatchReferenceIds) {
  const std::string path = kFixtures + "tokenizer_ids.json";
  if (!fs::exists(path))
    GTEST_SKIP() << path << " is absent: run tools/fixtures/make_tokenizer_fixtures.py where HF tokenizers is installed";
  const auto j = nlohmann::json::parse(read_all(path));
  // The patterns the script gave tiktoken are the ones our loaders use.
  if (j.contains("__meta__") && j["__meta__"].contains("patterns")) {
    const auto& p = j["__meta__"]["patterns"];
    EXPECT_EQ(p["gpt2"].get<std::string>(), known_pattern_text(KnownPattern::gpt2));
    EXPECT_EQ(p["llama3"].get<std::string>(), known_pattern_text(KnownPattern::llama3));
    EXPECT_EQ(p["o200k"].get<std::string>(), known_pattern_text(KnownPattern::o200k));
  }
  int compared = 0, tokenizers = 0;
  for (const auto& [name, cases] : j.items()) {
    if (name.rfind("__", 0) == 0) continue;
    const Tokenizer* tok = get_tokenizer(name);
    if (!tok) continue;
    ++tokenizers;
    EncodeOptions options;
    for (const auto& f : fixture_tokenizers())
      if (f.name == name) options.parse_special = f.parse_special;
    // gpt-oss-mini holds the first 1536 ranks of o200k and the 21 specials at their real ids 199998..200018
    // (a gap no real gpt-oss file has: those hold all 201088 entries). `tokenizers` renumbers added tokens
    // past such a gap from the vocabulary's end (1536 + their rank by id); map those ids back to the file's.
    std::vector<int32_t> renumbered_specials;
    if (name == "gpt-oss-mini") {
      const auto file = nlohmann::json::parse(std::ifstream(kFixtures + "gpt-oss-mini/tokenizer.json"));
      for (const auto& a : file["added_tokens"]) renumbered_specials.push_back(a["id"].get<int32_t>());
      std::sort(renumbered_specials.begin(), renumbered_specials.end());
      ASSERT_EQ(file["model"]["vocab"].size(), 1536u);
    }
    int mismatches = 0;
    for (const auto& c : cases) {
      const std::string text = c["text"].get<std::string>();
      Ids expected = c["ids"].get<Ids>();
      for (auto& id : expected)
        if (!renumbered_specials.empty() && id >= 1536 && id < 1536 + static_cast<int32_t>(renumbered_specials.size()))
          id = renumbered_specials[static_cast<size_t>(id - 1536)];
      const Ids ids = tok->encode(text, options);
      ++compared;
      if (ids != expected) {
        ++mismatches;
        ADD_FAILURE() << name << ": text " << nlohmann::json(text).dump() << "\n  expected " << ids_str(expected)
                      << "\n  got      " << ids_str(ids);
        continue;
      }
      // Known difference: tokenizers 0.23 decodes special tokens inside the text of SentencePiece
      // tokenizers (Llama 2, TinyStories) with spaces around them; the ids agree, the decoding of
      // special tokens differs. Compared only where no special token follows the first id.
      bool spm_special_inside = false;
      if (tok->kind() == TokenizerKind::sentencepiece_bpe)
        for (size_t i = 1; i < ids.size(); ++i) spm_special_inside |= tok->is_special(ids[i]);
      if (c.contains("decoded") && !spm_special_inside) {
        EXPECT_EQ(tok->decode(ids, false), c["decoded"].get<std::string>()) << name << ": " << text;
      }
      // The fixture's "decoded_skip" is not compared: tokenizers 0.23 keeps the BOS of SentencePiece
      // tokenizers (Llama 2, TinyStories) with skip_special_tokens=True. What skipping means here:
      // the text of the ids without their special tokens.
      Ids plain;
      for (int32_t id : ids)
        if (!tok->is_special(id)) plain.push_back(id);
      EXPECT_EQ(tok->decode(ids, true), tok->decode(plain, false)) << name << ": " << text;
    }
    std::printf("  %-28s %zu texts, %d mismatches\n", name.c_str(), cases.size(), mismatches);
  }
  if (tokenizers == 0) GTEST_SKIP() << "none of the fixture's tokenizers has its files in " << kShared;
  EXPECT_GT(compared, 0);
}

// ------------------------------------------------------------------------------------------------ o200k / gpt-oss

// tests/fixtures/text/o200k_reference.json (tools/fixtures/make_o200k_fixtures.py): the pieces python3-regex
// splits with the o200k pattern, and tiktoken's algorithm (in Python) on the full o200k_base ranks.
const nlohmann::json& o200k_reference() {
  static const nlohmann::json j = nlohmann::json::parse(read_all(kFixtures + "o200k_reference.json"));
  return j;
}

TEST(O200k, PreTokenizerMatchesPythonRegexModule) {
  const auto& ref = o200k_reference();
  ASSERT_EQ(ref["pattern"].get<std::string>(), known_pattern_text(KnownPattern::o200k));
  const auto matcher = compile_pattern(known_pattern_text(KnownPattern::o200k));
  ASSERT_TRUE(matcher->is_fast());
  int chunks = 0;
  for (const auto& c : ref["cases"]) {
    for (const auto& chunk : c["chunks"]) {
      const std::string text = chunk[0].get<std::string>();
      CodePointText cpt;
      cpt.assign(text);
      std::vector<std::pair<uint32_t, uint32_t>> ranges;
      split_by_pattern(cpt, *matcher, SplitBehavior::isolated, false, ranges);
      std::vector<std::string> pieces;
      for (auto [b, e] : ranges) pieces.push_back(text.substr(b, e - b));
      EXPECT_EQ(pieces, chunk[1].get<std::vector<std::string>>()) << nlohmann::json(text).dump();
      ++chunks;
    }
  }
  EXPECT_GT(chunks, 25);
}

TEST(O200k, HarmonySpecialTokens) {
  const std::string path = kShared + "/tokenizers/o200k/o200k_base.tiktoken";
  if (!fs::exists(path)) GTEST_SKIP() << path << " is absent";
  const auto tok = load_o200k_harmony_tiktoken(path);
  EXPECT_EQ(tok->vocab_size(), 201088);
  const std::pair<const char*, int32_t> named[] = {
      {"<|startoftext|>", 199998}, {"<|endoftext|>", 199999}, {"<|reserved_200000|>", 200000},
      {"<|reserved_200001|>", 200001}, {"<|return|>", 200002}, {"<|constrain|>", 200003},
      {"<|reserved_200004|>", 200004}, {"<|channel|>", 200005}, {"<|start|>", 200006}, {"<|end|>", 200007},
      {"<|message|>", 200008}, {"<|reserved_200009|>", 200009}, {"<|call|>", 200012},
      {"<|reserved_200017|>", 200017}, {"<|endofprompt|>", 200018}, {"<|reserved_200018|>", 200018},
      {"<|reserved_201087|>", 201087}};
  for (const auto& [text, id] : named) {
    EXPECT_EQ(tok->token_to_id(text), id) << text;
    EXPECT_TRUE(tok->is_special(id)) << text;
    EXPECT_EQ(tok->encode(text, false), Ids{id}) << text;
  }
  EXPECT_EQ(tok->id_to_token(200018), "<|endofprompt|>");
  EXPECT_EQ(tok->id_to_token(200007), "<|end|>");
  EXPECT_EQ(tok->bos_id(), 199998);
  EXPECT_EQ(tok->eos_id(), 200002);
  EXPECT_EQ(tok->token_to_id("<|reserved_201088|>"), -1);
  EXPECT_EQ(tok->encode("hi", true), (Ids{3686}));  // no BOS: gpt-oss's template writes everything itself
  // Special tokens stay text when parsing them is off.
  EncodeOptions plain;
  plain.add_special_tokens = false;
  plain.parse_special = false;
  const Ids as_text = tok->encode("<|end|>", plain);
  EXPECT_GT(as_text.size(), 1u);
  EXPECT_EQ(tok->decode(as_text, false), "<|end|>");
}

TEST(O200k, HarmonyIdsMatchTiktokenAlgorithm) {
  const std::string path = kShared + "/tokenizers/o200k/o200k_base.tiktoken";
  if (!fs::exists(path)) GTEST_SKIP() << path << " is absent";
  const auto tok = load_o200k_harmony_tiktoken(path);
  EXPECT_NE(tok->describe().find("fast matcher"), std::string::npos) << tok->describe();
  int n = 0;
  for (const auto& c : o200k_reference()["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const Ids ids = tok->encode(text, false);
    EXPECT_EQ(ids, c["ids"].get<Ids>()) << nlohmann::json(text).dump() << "\n  got " << ids_str(ids);
    EXPECT_EQ(tok->decode(ids, false), text);
    ++n;
  }
  EXPECT_GT(n, 20);
}

// A small tokenizer.json in the shape of gpt-oss's (Split with the o200k regex, then ByteLevel without its
// own regex; specials 199998..200018 far above the 1536-token vocabulary), with tokenizer_config.json.
TEST(O200k, GptOssShapedTokenizerJson) {
  const std::string dir = kFixtures + "gpt-oss-mini";
  const auto tok = load_tokenizer_dir(dir);
  EXPECT_EQ(tok->kind(), TokenizerKind::byte_level_bpe);
  EXPECT_NE(tok->describe().find("fast matcher"), std::string::npos) << tok->describe();
  EXPECT_EQ(tok->vocab_size(), 200019);
  EXPECT_EQ(tok->bos_id(), 199998);
  EXPECT_EQ(tok->eos_id(), 200002);
  EXPECT_EQ(tok->pad_id(), 199999);
  EXPECT_EQ(tok->token_to_id("<|channel|>"), 200005);
  EXPECT_EQ(tok->token_to_id("<|call|>"), 200012);
  EXPECT_EQ(tok->id_to_token(200018), "<|endofprompt|>");
  const auto expected = nlohmann::json::parse(read_all(dir + "/expected.json"));
  int n = 0;
  for (const auto& c : expected["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const Ids ids = tok->encode(text, true);  // no post-processor: nothing is added
    EXPECT_EQ(ids, c["ids"].get<Ids>()) << nlohmann::json(text).dump() << "\n  got " << ids_str(ids);
    EXPECT_EQ(tok->decode(ids, false), text);
    ++n;
  }
  EXPECT_GT(n, 20);

  // The same vocabulary as a GGUF file holds it (tokenizer.ggml.pre "gpt-4o", the token list dense up to
  // the last special, merges as "left right"), through the vocabulary constructor.
  const auto j = nlohmann::json::parse(read_all(dir + "/tokenizer.json"));
  std::vector<std::string> tokens(200019);
  std::vector<int32_t> types(200019, static_cast<int32_t>(TokenType::unused));
  for (const auto& [t, id] : j["model"]["vocab"].items()) {
    tokens[id.get<size_t>()] = t;
    types[id.get<size_t>()] = static_cast<int32_t>(TokenType::normal);
  }
  for (const auto& a : j["added_tokens"]) {
    tokens[a["id"].get<size_t>()] = a["content"].get<std::string>();
    types[a["id"].get<size_t>()] = static_cast<int32_t>(TokenType::control);
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i].empty()) tokens[i] = "<unused_" + std::to_string(i) + ">";
  std::vector<std::string> merges;
  for (const auto& m : j["model"]["merges"]) merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  ByteLevelBpeOptions o;
  o.source = "gpt-oss-mini as GGUF";
  o.pattern = std::string(gguf_pre_tokenizer_pattern("gpt-4o"));
  o.bos_id = 199998;
  o.eos_id = 200002;
  const auto gguf = make_bpe_tokenizer_from_vocab(std::move(tokens), std::move(types), merges, o);
  for (const auto& c : expected["cases"]) {
    const std::string text = c["text"].get<std::string>();
    EXPECT_EQ(gguf->encode(text, false), c["ids"].get<Ids>()) << "GGUF vocabulary: " << nlohmann::json(text).dump();
  }
}

// ------------------------------------------------------------------------------------------------ streaming

TEST(StreamDecoder, GivesCompleteCharactersAndTheWholeText) {
  const std::vector<std::string> texts = fixture_texts();
  int tokenizers = 0;
  for (const auto& f : fixture_tokenizers()) {
    const Tokenizer* tok = get_tokenizer(f.name);
    if (!tok) continue;
    ++tokenizers;
    for (const std::string& text : texts) {
      const Ids ids = tok->encode(text);
      StreamDecoder stream(*tok);
      std::string streamed;
      for (int32_t id : ids) {
        const std::string part = stream.push(id);
        EXPECT_TRUE(is_valid_utf8(part)) << f.name << ": " << text;
        streamed += part;
      }
      EXPECT_FALSE(stream.has_pending()) << f.name << ": " << text;
      streamed += stream.flush();
      EXPECT_EQ(streamed, tok->decode(ids)) << f.name << ": " << text;
    }
  }
  if (tokenizers == 0) GTEST_SKIP() << "no tokenizer files in " << kShared;
}

TEST(StreamDecoder, HoldsBytesOfASplitCharacter) {
  REQUIRE_TOKENIZER(tok, "llama2-sentencepiece");
  // U+1F916 is not a Llama 2 piece: it becomes the four byte tokens <0xF0> <0x9F> <0xA4> <0x96>.
  const Ids ids = tok->encode("\U0001F916", false);
  ASSERT_EQ(ids.size(), 5u);  // "▁" then the four bytes
  StreamDecoder stream(*tok);
  EXPECT_EQ(stream.push(ids[0]), "");  // the dummy-prefix space is dropped at the start of a text
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.push(ids[2]), "");
  EXPECT_EQ(stream.push(ids[3]), "");
  EXPECT_EQ(stream.push(ids[4]), "\U0001F916");
  // A character that never completes is flushed as U+FFFD.
  stream.reset(false);
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.flush(), "\uFFFD");
  // Continuing a text keeps the space between words.
  stream.reset(false);
  EXPECT_EQ(stream.push(tok->token_to_id("\u2581world")), " world");
  stream.reset(true);
  EXPECT_EQ(stream.push(tok->token_to_id("\u2581world")), "world");
}

// ------------------------------------------------------------------------------------------------ BPE model

// A random BPE vocabulary over a small alphabet: merges of random existing pairs, in rank order.
struct SyntheticVocab {
  std::vector<std::string> tokens;
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<float> scores;
};
SyntheticVocab synthetic_vocab(uint64_t seed, int merge_count) {
  SyntheticVocab v;
  SplitMix64 rng(seed);
  for (const char* c : {"a", "b", "c", "d", "\u00e9", "\u65e5"}) v.tokens.push_back(c);
  std::set<std::string> seen(v.tokens.begin(), v.tokens.end());
  while (static_cast<int>(v.merges.size()) < merge_count) {
    const std::string l = v.tokens[rng.next() % v.tokens.size()];
    const std::string r = v.tokens[rng.next() % v.tokens.size()];
    if (l.size() + r.size() > 12 || seen.count(l + r)) continue;
    v.merges.emplace_back(l, r);
    v.tokens.push_back(l + r);
    seen.insert(l + r);
  }
  for (size_t i = 0; i < v.tokens.size(); ++i) v.scores.push_back(i < 6 ? 0.0f : -static_cast<float>(rng.next() % 50));
  return v;
}

std::string random_word(SplitMix64& rng, int max_chars) {
  const char* alphabet[] = {"a", "b", "c", "d", "\u00e9", "\u65e5", "x"};  // "x" is not in the vocabulary
  std::string w;
  const int len = static_cast<int>(rng.next() % static_cast<uint64_t>(max_chars + 1));
  for (int k = 0; k < len; ++k) w += alphabet[rng.next() % 7];
  return w;
}

TEST(BpeModel, HeapMergeMatchesQuadraticReference) {
  SplitMix64 rng(5);
  for (int vocab_seed = 0; vocab_seed < 6; ++vocab_seed) {
    const SyntheticVocab v = synthetic_vocab(100 + vocab_seed, 60);
    for (int mode = 0; mode < 4; ++mode) {
      BpeModel::Options o;
      o.priority = mode < 2 ? BpeModel::Priority::merge_rank : BpeModel::Priority::piece_score;
      o.unk_id = mode % 2 == 0 ? 0 : -1;  // with an unknown token ("a" stands in) and without (dropped)
      o.fuse_unk = mode == 0;
      BpeModel model(v.tokens, o);
      if (o.priority == BpeModel::Priority::merge_rank)
        model.set_merges(v.merges);
      else
        model.set_scores(v.scores, std::vector<uint8_t>(v.tokens.size(), 1));
      BpeModel::Scratch scratch;
      std::vector<std::string_view> chunks;
      for (int iter = 0; iter < 400; ++iter) {
        const std::string w = random_word(rng, 40);
        Ids fast, slow, chunked;
        model.encode_word(w, fast, scratch);
        model.encode_word_reference(w, slow);
        ASSERT_EQ(fast, slow) << "vocab " << vocab_seed << " mode " << mode << " word " << w;
        model.split_chunks(w, chunks);
        for (std::string_view c : chunks) model.encode_word(c, chunked, scratch);
        ASSERT_EQ(chunked, slow) << "chunked, vocab " << vocab_seed << " mode " << mode << " word " << w;
      }
    }
  }
}

TEST(BpeModel, RealVocabulariesHeapMatchesReference) {
  // The models of real tokenizer.json files, in both merge modes (the file's merge ranks, and scores that
  // rank pieces by id as SentencePiece vocabularies roughly do), on long "words": snippets of real text and
  // character soup as SentencePiece tokenizers without a pre-tokenizer hand them over whole.
  const std::string austen = kShared + "/data/janeausten/persuasion.txt";
  REQUIRE_FILE(austen);
  const std::string book = read_all(austen).substr(100000, 60000);
  int ran = 0;
  for (const std::string rel : {"/models/tq-llama-hd128/tokenizer.json", "/tokenizers/llama2-sentencepiece/tokenizer.json"}) {
    const std::string path = kShared + rel;
    if (!fs::exists(path)) continue;
    ++ran;
    const auto j = nlohmann::json::parse(read_all(path));
    const bool byte_level = j["decoder"]["type"] == "ByteLevel";
    std::vector<std::string> vocab(j["model"]["vocab"].size());
    for (const auto& [t, id] : j["model"]["vocab"].items()) vocab[id.get<size_t>()] = t;
    std::vector<std::pair<std::string, std::string>> merges;
    for (const auto& m : j["model"]["merges"]) {
      if (m.is_array()) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        const std::string x = m.get<std::string>();
        merges.emplace_back(x.substr(0, x.find(' ')), x.substr(x.find(' ') + 1));
      }
    }
    std::vector<float> scores(vocab.size());
    for (size_t i = 0; i < vocab.size(); ++i) scores[i] = -static_cast<float>(i);
    SplitMix64 rng(21);
    for (int mode = 0; mode < 2; ++mode) {
      BpeModel::Options o;
      o.priority = mode == 0 ? BpeModel::Priority::merge_rank : BpeModel::Priority::piece_score;
      o.byte_fallback = !byte_level;
      o.unk_id = byte_level ? -1 : 0;
      BpeModel model(vocab, o);
      if (mode == 0)
        model.set_merges(merges);
      else
        model.set_scores(scores, std::vector<uint8_t>(vocab.size(), 1));
      BpeModel::Scratch scratch;
      std::vector<std::string_view> chunks;
      for (int iter = 0; iter < 40; ++iter) {
        std::string text = book.substr(rng.next() % (book.size() - 400), 20 + rng.next() % 250);
        if (iter % 4 == 3) {  // character soup: byte fallback, unknowns, CJK
          text.clear();
          const std::u32string_view soup = U"ab \u00e9\u65e5\U0001F916\n,.'9";
          for (int k = 0; k < 60; ++k) append_utf8(text, soup[rng.next() % soup.size()]);
        }
        std::string word;
        if (byte_level) {
          for (char ch : text) word += byte_level_char(static_cast<uint8_t>(ch));
        } else {
          word = "\u2581";
          for (char ch : text) word += ch == ' ' ? std::string("\u2581") : std::string(1, ch);
        }
        Ids fast, slow, chunked;
        model.encode_word(word, fast, scratch);
        model.encode_word_reference(word, slow);
        ASSERT_EQ(fast, slow) << rel << " mode " << mode << ": " << text;
        model.split_chunks(word, chunks);
        for (std::string_view c : chunks) model.encode_word(c, chunked, scratch);
        ASSERT_EQ(chunked, slow) << "chunked, " << rel << " mode " << mode << ": " << text;
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no tokenizer.json files in " << kShared;
}

// ------------------------------------------------------------------------------------------------ synthetic files

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("tq_text_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string write(const std::string& name, std::string_view data) const {
    write_all(path / name, data);
    return (path / name).string();
  }
};

template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected a tq::Error";
  } catch (const Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

// A small byte-level tokenizer.json exercising the loader: list-form merges, a custom Split regex (run by the
// general engine), added tokens with lstrip/rstrip/single_word, and a template with BOS and EOS.
std::string small_byte_level_json(const std::string& merges_json, const std::string& pattern_json) {
  std::string vocab = "{";
  for (int b = 0; b < 256; ++b) {
    nlohmann::json key = byte_level_char(static_cast<uint8_t>(b));
    vocab += key.dump() + ": " + std::to_string(b) + ", ";
  }
  vocab += "\"ab\": 256, \"abc\": 257, \"\xC4\xA0" "ab\": 258, \"<bos>\": 259, \"<eos>\": 260, \"<mask>\": 261, \"<w>\": 262}";
  return R"({"version": "1.0",
    "added_tokens": [
      {"id": 259, "content": "<bos>", "special": true, "normalized": false, "lstrip": false, "rstrip": false, "single_word": false},
      {"id": 260, "content": "<eos>", "special": true, "normalized": false, "lstrip": false, "rstrip": false, "single_word": false},
      {"id": 261, "content": "<mask>", "special": true, "normalized": false, "lstrip": true, "rstrip": true, "single_word": false},
      {"id": 262, "content": "<w>", "special": false, "normalized": true, "lstrip": false, "rstrip": false, "single_word": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
       {"type": "Split", "pattern": {"Regex": )" + pattern_json + R"(}, "behavior": "Isolated", "invert": false},
       {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
    "post_processor": {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
       "special_tokens": {"<bos>": {"id": "<bos>", "ids": [259], "tokens": ["<bos>"]},
                          "<eos>": {"id": "<eos>", "ids": [260], "tokens": ["<eos>"]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false, "byte_fallback": false,
              "vocab": )" + vocab + R"(, "merges": )" + merges_json + "}}";
}

TEST(SyntheticTokenizerJson, LoaderFeatures) {
  TempDir dir;
  // Pieces are runs of letters with an optional leading space, or single other characters ([^a-z ]).
  const std::string path = dir.write(
      "tokenizer.json", small_byte_level_json(R"([["a", "b"], "ab c", ["\u0120", "ab"]])", R"(" ?[a-z]+|[^a-z ]| ")"));
  const auto tok = load_tokenizer_json(path);
  EXPECT_EQ(tok->bos_id(), 259);  // no tokenizer_config.json: BOS is the template's first token
  const int32_t a = 'a', b = 'b', c = 'c';  // byte b has id b in this vocabulary
  EXPECT_EQ(tok->encode("abc ab", false), (Ids{257, 258}));
  EXPECT_EQ(tok->encode("abc ab"), (Ids{259, 257, 258, 260}));
  EXPECT_EQ(tok->encode("ba", false), (Ids{b, a}));
  EXPECT_EQ(tok->encode("abcab", false), (Ids{257, 256}));
  EXPECT_EQ(tok->encode("cab", false), (Ids{c, 256}));
  // <mask> swallows the spaces around it (lstrip/rstrip).
  const Ids mask = tok->encode("ab  <mask>  c", false);
  EXPECT_EQ(mask, (Ids{256, 261, c}));
  // <w> only matches as a whole word.
  EXPECT_EQ(tok->encode("<w>", false), (Ids{262}));
  EXPECT_NE(tok->encode("a<w>", false), (Ids{a, 262}));
  EXPECT_EQ(tok->decode(tok->encode("abc ab <w> x")), "abc ab <w> x");
  EXPECT_FALSE(tok->is_special(262));
  EXPECT_TRUE(tok->is_special(261));
  EXPECT_EQ(tok->token_to_piece(258), " ab");
}

TEST(Errors, MalformedFilesNameTheFileAndTheProblem) {
  TempDir dir;
  expect_error([&] { load_tokenizer_json((dir.path / "missing.json").string()); }, {"missing.json", "cannot open"});
  const std::string bad_json = dir.write("bad.json", "{\"model\": ");
  expect_error([&] { load_tokenizer_json(bad_json); }, {"bad.json", "not valid JSON"});
  const std::string wordpiece = dir.write("wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}, "decoder": null})");
  expect_error([&] { load_tokenizer_json(wordpiece); }, {"wp.json", "WordPiece", "not supported"});
  const std::string bad_merge =
      dir.write("merge.json", small_byte_level_json(R"(["a b", "ab zz"])", R"(" ?[a-z]+")"));
  expect_error([&] { load_tokenizer_json(bad_merge); }, {"merge.json", "merge 1", "'zz' is not in the vocabulary"});
  const std::string bad_merge_form = dir.write("merge2.json", small_byte_level_json(R"(["a b c"])", R"("a")"));
  expect_error([&] { load_tokenizer_json(bad_merge_form); }, {"merge2.json", "merges[0]"});
  // An added token's id no vocabulary has is refused before the id tables are sized by it (it ran out
  // of memory: fuzz/corpus/fuzz_tokenizer_json/regression-added-token-id-2e9.json).
  std::string far_id = small_byte_level_json("[]", R"(" ?[a-z]+")");
  far_id.replace(far_id.find(R"({"id": 262)"), 10, R"({"id": 2000000000)");
  expect_error([&] { load_tokenizer_json(dir.write("far.json", far_id)); }, {"far.json", "added token '<w>' has id 2000000000", "more than the 4194304 ids"});
  const std::string lookbehind = dir.write("re.json", small_byte_level_json("[]", R"("(?<=a)b")"));
  expect_error([&] { load_tokenizer_json(lookbehind); }, {"re.json", "lookbehind"});

  const std::string vocab_dup = dir.write("vocab.json", R"({"a": 0, "b": 0})");
  const std::string merges = dir.write("merges.txt", "#version: 0.2\na b\n");
  expect_error([&] { load_vocab_merges(vocab_dup, merges, ""); }, {"vocab.json", "id 0 is used by both"});
  const std::string vocab_ok = dir.write("vocab2.json", R"({"a": 0, "b": 1, "ab": 2})");
  const std::string merges_bad = dir.write("merges2.txt", "a b\na b c\n");
  expect_error([&] { load_vocab_merges(vocab_ok, merges_bad, ""); }, {"merges2.txt", "line 2"});
  EXPECT_EQ(load_vocab_merges(vocab_ok, merges, "")->encode("ab", false), (Ids{2}));

  // llama2.c tokenizer: a header only, a token running past the end, a length over the maximum.
  std::string tok512(4, '\0');
  tok512[0] = 7;
  const std::string header_only = dir.write("t0.bin", tok512);
  expect_error([&] { load_llama2c_tokenizer(header_only); }, {"t0.bin", "only 0 tokens"});
  std::string cut = tok512 + std::string("\0\0\0\0\x05\0\0\0ab", 10);
  expect_error([&] { load_llama2c_tokenizer(dir.write("t1.bin", cut)); }, {"t1.bin", "truncated at token 0"});
  std::string too_long = tok512 + std::string("\0\0\0\0\x09\0\0\0abcdefghi", 17);
  expect_error([&] { load_llama2c_tokenizer(dir.write("t2.bin", too_long)); }, {"t2.bin", "more than max_token_length"});
  const std::string real512 = kShared + "/models/stories260K/tok512.bin";
  if (fs::exists(real512)) {
    const std::string d = read_all(real512);
    expect_error([&] { load_llama2c_tokenizer(dir.write("t3.bin", d.substr(0, d.size() - 3))); }, {"t3.bin", "truncated"});
  }
  const std::string spm = kShared + "/tokenizers/llama2-sentencepiece/tokenizer.model";
  if (fs::exists(spm)) {
    const std::string d = read_all(spm);
    expect_error([&] { load_sentencepiece_model(dir.write("cut.model", d.substr(0, 1000))); }, {"cut.model", "truncated"});
  }
  expect_error([&] { load_sentencepiece_model(dir.write("empty.model", "")); }, {"empty.model", "no pieces"});
  const std::string tiktoken = dir.write("x.tiktoken", "YQ== 0\nYg== 2\n");
  expect_error([&] { load_tiktoken(tiktoken, "a", {}, -1, -1, false); }, {"x.tiktoken", "line 2", "rank 2"});
}

TEST(Errors, VocabularyConstructorsCheckTheirInput) {
  SpmOptions so;
  so.source = "gguf test.gguf";
  expect_error([&] { make_spm_tokenizer({"<unk>", "a"}, {0.0f}, {}, so); }, {"gguf test.gguf", "1 scores for 2 pieces"});
  expect_error([&] { make_spm_tokenizer({"<unk>", "a"}, {0.0f, 0.0f}, {2, 9}, so); }, {"gguf test.gguf", "unknown type 9"});
  so.bos_id = 5;
  expect_error([&] { make_spm_tokenizer({"<unk>", "a"}, {0.0f, 0.0f}, {2, 1}, so); }, {"gguf test.gguf", "id 5"});
  ByteLevelBpeOptions bo;
  bo.source = "gguf gpt2";
  expect_error([&] { make_bpe_tokenizer_from_vocab({"a", "b"}, {}, {"a c"}, bo); }, {"gguf gpt2", "'c' is not in the vocabulary"});
  expect_error([&] { make_bpe_tokenizer_from_vocab({"a", "b"}, {}, {"ab"}, bo); }, {"gguf gpt2", "merge 0"});
}

// The vocabulary constructors the GGUF loader uses, on the vocabularies of real files.
TEST(VocabularyConstructors, SpmAndByteLevelFromPlainLists) {
  // SentencePiece pieces as a GGUF file lists them (U+2581, scores, types).
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    pieces.push_back(name);
    types.push_back(6);
  }
  for (const char* p : {"\u2581", "h", "i", "\u2581h", "\u2581hi", "!"}) pieces.push_back(p), types.push_back(1);
  std::vector<float> scores(pieces.size(), 0.0f);
  scores[pieces.size() - 3] = -1.0f;  // ▁h
  scores[pieces.size() - 2] = -2.0f;  // ▁hi
  SpmOptions o;
  o.bos_id = 1;
  o.eos_id = 2;
  o.add_eos = true;
  const auto spm = make_spm_tokenizer(pieces, scores, types, o);
  const int32_t hi = static_cast<int32_t>(pieces.size()) - 2;
  EXPECT_EQ(spm->encode("hi"), (Ids{1, hi, 2}));
  EXPECT_EQ(spm->encode("hi \u00e9", false), (Ids{hi, 259, 3 + 0xC3, 3 + 0xA9}));  // é by byte fallback
  EXPECT_EQ(spm->decode(spm->encode("hi \u00e9!")), "hi \u00e9!");
  EXPECT_EQ(spm->encode("<s>hi", false)[0], 1);  // control pieces are matched in text
  EXPECT_TRUE(spm->is_special(2));

  // Byte-level, from a real vocabulary's token list and merges (as GGUF "gpt2" stores them).
  const std::string vj = kShared + "/tokenizers/gpt2/vocab.json", mt = kShared + "/tokenizers/gpt2/merges.txt";
  REQUIRE_FILE(vj);
  const auto vocab = nlohmann::json::parse(read_all(vj));
  std::vector<std::string> tokens(vocab.size());
  for (const auto& [t, id] : vocab.items()) tokens[id.get<size_t>()] = t;
  std::vector<std::string> merges;
  std::istringstream lines(read_all(mt));
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] != '#') merges.push_back(line);
  std::vector<int32_t> token_types(tokens.size(), 1);
  token_types[50256] = 3;
  ByteLevelBpeOptions bo;
  bo.bos_id = bo.eos_id = 50256;
  const auto gguf_like = make_bpe_tokenizer_from_vocab(tokens, token_types, merges, bo);
  const Tokenizer* reference = get_tokenizer("gpt2");
  ASSERT_NE(reference, nullptr);
  for (const std::string& text : fixture_texts()) EXPECT_EQ(gguf_like->encode(text), reference->encode(text)) << text;
  EXPECT_TRUE(gguf_like->is_special(50256));
}

// ------------------------------------------------------------------------------------------------ speed

TEST(Speed, EncodeJaneAustenWithTqLlamaHd128) {
  const std::string path = kShared + "/data/janeausten/persuasion.txt";
  REQUIRE_FILE(path);
  REQUIRE_TOKENIZER(tok, "tq-llama-hd128");
  const std::string text = read_all(path);
  double best = 1e9;
  size_t tokens = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = tok->encode(text, false).size();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double mb_per_s = static_cast<double>(text.size()) / best / 1e6;
  std::printf("  tq-llama-hd128: %zu bytes -> %zu tokens in %.1f ms: %.1f MB/s\n", text.size(), tokens, best * 1e3,
              mb_per_s);
  EXPECT_GT(mb_per_s, 1.0) << "encoding is far slower than expected";
}

}  // namespace
}  // namespace tq
