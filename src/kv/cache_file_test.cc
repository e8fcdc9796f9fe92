// Prompt cache files (kv/cache_file.h) without a model: every kind of layer cache round-trips bit for bit,
// a file of another model is refused naming the first difference, and cut, flipped or lying files give
// errors that say what is wrong. (Round trips through a model's engine: runtime/prompt_cache_test.cc.)
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/test_util.h"
#include "kv/cache_file.h"

namespace tq {
namespace {

using testing_util::expect_error_mentioning;

std::string temp_path(const std::string& name) { return testing::TempDir() + "/" + name; }

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

constexpr int kHeads = 2, kDim = 64;

StateShape small_state() {
  StateShape s;
  s.conv_channels = 12;
  s.conv_kernel = 4;
  s.state_heads = 2;
  s.state_dk = 8;
  s.state_dv = 8;
  return s;
}

// The layers: TurboQuant K8/V3 with a sink tier of 5, a rotating dense window of 20 (it drops blocks), a
// state, q8_0/q4_0, and f32.
std::vector<LayerSpec> specs() {
  std::vector<LayerSpec> l(5);
  for (LayerSpec& s : l) {
    s.n_kv_heads = kHeads;
    s.head_dim = kDim;
  }
  l[1].kind = LayerKind::sliding_attention;
  l[1].window = 20;
  l[2] = LayerSpec{LayerKind::linear_attention, 0, 0, 0, small_state()};
  return l;
}

ModelFingerprint model() { return model_fingerprint("test_arch", specs()); }

PromptCache make_caches() {
  PromptCache c;
  TurboQuantCacheOptions tq;
  tq.min_tokens_before_quant = 5;
  tq.block_tokens = 16;
  auto k8v3 = std::make_unique<KVCache>(kHeads, kDim, turboquant_cache_options(tq));
  k8v3->set_fused(true);
  c.push_back(std::move(k8v3));
  KVCacheOptions rotating;
  rotating.window = 20;
  rotating.block_tokens = 16;
  c.push_back(std::make_unique<KVCache>(kHeads, kDim, rotating));
  c.push_back(std::make_unique<StateCache>(small_state()));
  KVCacheOptions q;
  q.k.type = KVType::q8_0;
  q.v.type = KVType::q4_0;
  q.block_tokens = 16;
  c.push_back(std::make_unique<KVCache>(kHeads, kDim, q));
  KVCacheOptions f32;
  f32.k.type = f32.v.type = KVType::f32;
  c.push_back(std::make_unique<KVCache>(kHeads, kDim, f32));
  return c;
}

// n random positions appended to sequence seq of every layer (the states get random values).
void append(PromptCache& caches, int seq, int n, uint64_t seed) {
  SplitMix64 rng(seed);
  const std::vector<float> k = testing_util::gaussian(static_cast<size_t>(n) * kHeads * kDim, rng);
  const std::vector<float> v = testing_util::gaussian(k.size(), rng);
  for (auto& c : caches) {
    if (auto* kv = dynamic_cast<KVCache*>(c.get())) {
      kv->append(seq, k.data(), v.data(), n);
      continue;
    }
    auto& state = dynamic_cast<StateCache&>(*c);
    const StateShape& s = state.shape();
    for (int i = 0; i < s.conv_channels * (s.conv_kernel - 1); ++i) state.conv_state(seq)[i] = static_cast<float>(rng.normal());
    for (int i = 0; i < s.state_heads * s.state_dk * s.state_dv; ++i) state.recurrent_state(seq)[i] = static_cast<float>(rng.normal());
    state.advance(seq, n);
  }
}

// Two sequences: 0 of 60 positions, and 1 forked from it at 33 (sharing its blocks) that went on to 41.
// Sequence 0's second append starts past the window of the rotating layer, which drops its first blocks.
PromptCache filled_caches() {
  PromptCache c = make_caches();
  for (auto& l : c) l->add_sequence_with_id(0);
  append(c, 0, 33, 1);
  for (auto& l : c) l->fork_sequence(0, 1);
  append(c, 0, 20, 2);
  append(c, 0, 7, 5);
  append(c, 1, 8, 3);
  return c;
}

void expect_same(const PromptCache& a, const PromptCache& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t l = 0; l < a.size(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    EXPECT_EQ(a[l]->describe(), b[l]->describe());
    ASSERT_EQ(a[l]->sequences(), b[l]->sequences());
    for (int seq : a[l]->sequences()) {
      ASSERT_EQ(a[l]->length(seq), b[l]->length(seq));
      if (const auto* ka = dynamic_cast<const KVCache*>(a[l].get())) {
        const auto& kb = dynamic_cast<const KVCache&>(*b[l]);
        EXPECT_EQ(ka->fused(), kb.fused());
        ASSERT_EQ(ka->first_kept(seq), kb.first_kept(seq));
        std::vector<float> k1(kHeads * kDim), v1(k1.size()), k2(k1.size()), v2(k1.size());
        for (int pos = ka->first_kept(seq); pos < ka->length(seq); ++pos) {
          ka->read(seq, pos, k1.data(), v1.data());
          kb.read(seq, pos, k2.data(), v2.data());
          ASSERT_EQ(std::memcmp(k1.data(), k2.data(), k1.size() * 4), 0) << "sequence " << seq << ", position " << pos;
          ASSERT_EQ(std::memcmp(v1.data(), v2.data(), v1.size() * 4), 0) << "sequence " << seq << ", position " << pos;
        }
        // A rotating cache refuses the same truncations (its window) after the round trip.
        for (int to = 0; to <= ka->length(seq); to += 7) EXPECT_EQ(ka->truncate_problem(seq, to), kb.truncate_problem(seq, to));
      } else {
        const StateSnapshot sa = dynamic_cast<const StateCache&>(*a[l]).snapshot(seq);
        const StateSnapshot sb = dynamic_cast<const StateCache&>(*b[l]).snapshot(seq);
        EXPECT_EQ(sa.length(), sb.length());
        EXPECT_EQ(sa.conv(), sb.conv());
        EXPECT_EQ(sa.recurrent(), sb.recurrent());
      }
    }
  }
}

TEST(PromptCacheFile, EveryKindOfCacheRoundTripsExactly) {
  const std::string path = temp_path("round_trip.tqpc");
  const PromptCache caches = filled_caches();
  ASSERT_GT(dynamic_cast<const KVCache&>(*caches[1]).first_kept(0), 0);  // the window dropped blocks
  save_prompt_cache(path, caches, model(), {{"prompt", "hello"}, {"model", "test"}});
  LoadedPromptCache loaded = load_prompt_cache(path, model());
  expect_same(caches, loaded.caches);
  EXPECT_EQ(loaded.metadata.at("prompt"), "hello");
  EXPECT_EQ(loaded.metadata.size(), 2u);
  // The file's fingerprint names the formats; the model's does not.
  EXPECT_EQ(loaded.fingerprint.layers[0].format, caches[0]->describe());
  EXPECT_EQ(first_difference(loaded.fingerprint, model()), "");
  // The loaded caches go on exactly as the saved ones.
  PromptCache again = std::move(loaded.caches);
  PromptCache original = filled_caches();
  append(original, 1, 30, 4);
  append(again, 1, 30, 4);
  expect_same(original, again);
  std::remove(path.c_str());
}

TEST(PromptCacheFile, AnotherModelIsRefusedNamingTheFirstDifference) {
  const std::string path = temp_path("other_model.tqpc");
  save_prompt_cache(path, filled_caches(), model());
  auto expect_refused = [&](const ModelFingerprint& other, const std::string& needle) {
    expect_error_mentioning([&] { load_prompt_cache(path, other); }, needle);
  };
  ModelFingerprint other = model();
  other.architecture = "llama";
  expect_refused(other, "holds another model's cache: the file is of a test_arch model; this model is llama");
  other = model();
  other.layers.pop_back();
  expect_refused(other, "the file holds 5 layers; this model has 4");
  // The state layer where the model has full attention, as the issue words it.
  std::vector<LayerSpec> s = specs();
  s[2] = LayerSpec{LayerKind::full_attention, 2, 64, 0, {}};
  expect_refused(model_fingerprint("test_arch", s),
                 "layer 2: the file holds a state cache of conv 12x3, recurrent 2x8x8; this model's layer 2 is full attention with 2 KV heads of 64");
  s = specs();
  s[0].head_dim = 128;
  expect_refused(model_fingerprint("test_arch", s),
                 "layer 0: the file holds a full-attention KV cache of 2 KV heads of 64; this model's layer 0 is full attention with 2 KV heads of 128");
  s = specs();
  s[1].window = 32;
  expect_refused(model_fingerprint("test_arch", s), "layer 1: the file holds a sliding-window KV cache (window 20) of 2 KV heads of 64; "
                                                    "this model's layer 1 is sliding-window attention (window 32)");
  s = specs();
  s[2].state.state_dv = 16;
  expect_refused(model_fingerprint("test_arch", s), "this model's layer 2 is linear attention with a state of conv 12x3, recurrent 2x8x16");
  // Formats are compared where both sides name one: caches of another format expected.
  PromptCache f16 = make_caches();
  f16[4] = std::make_unique<KVCache>(kHeads, kDim, KVCacheOptions{});
  expect_refused(cache_fingerprint("test_arch", f16), "layer 4: the file holds a KV cache of f32/f32; the one expected is f16/f16");
  // None of it touched the file.
  EXPECT_EQ(load_prompt_cache(path, model()).caches.size(), 5u);
  std::remove(path.c_str());
}

TEST(PromptCacheFile, SavingCachesThatAreNotTheModelsWritesNothing) {
  const std::string path = temp_path("not_saved.tqpc");
  std::remove(path.c_str());
  std::vector<LayerSpec> s = specs();
  s[3].n_kv_heads = 4;
  expect_error_mentioning([&] { save_prompt_cache(path, filled_caches(), model_fingerprint("test_arch", s)); },
                          "the caches are not this model's: layer 3: the prompt cache holds a full-attention KV cache of 2 KV heads of 64; "
                          "this model's layer 3 is full attention with 4 KV heads of 64");
  PromptCache uneven = filled_caches();
  uneven[4]->remove_sequence(1);
  expect_error_mentioning([&] { save_prompt_cache(path, uneven, model()); }, "layer 4 holds 1 sequences, layer 0 2");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(PromptCacheFile, CorruptAndTruncatedFilesGiveClearErrors) {
  const std::string path = temp_path("corrupt.tqpc");
  save_prompt_cache(path, filled_caches(), model());
  const std::vector<uint8_t> bytes = read_file(path);
  uint32_t len;
  std::memcpy(&len, bytes.data() + 12, 4);
  auto expect_load_error = [&](const std::vector<uint8_t>& b, const std::string& needle) {
    write_file(path, b);
    expect_error_mentioning([&] { load_prompt_cache(path, model()); }, needle);
  };
  // Cut anywhere: in the magic, the preamble, the header, the first record, the last, the checksum.
  for (size_t cut : {size_t{0}, size_t{5}, size_t{15}, size_t{16} + len / 2, size_t{16} + len, size_t{16} + len + 100, bytes.size() / 2,
                     bytes.size() - 9, bytes.size() - 1}) {
    SCOPED_TRACE("cut at " + std::to_string(cut) + " of " + std::to_string(bytes.size()));
    expect_load_error(std::vector<uint8_t>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut)),
                      cut < 24 ? "is truncated" : "is corrupt or truncated (checksum mismatch)");
  }
  auto b = bytes;
  b[1] ^= 0x20;
  expect_load_error(b, "is not a turboquant prompt cache file (bad magic)");
  b = bytes;
  b[8] = 3;
  expect_load_error(b, "has version 3; this build reads version 1 to 2");
  b = bytes;
  b[bytes.size() / 2] ^= 0x01;
  expect_load_error(b, "checksum mismatch");
  // A single layer's KV cache file is named as such.
  const PromptCache caches = filled_caches();
  dynamic_cast<const KVCache&>(*caches[0]).save(path);
  expect_error_mentioning([&] { load_prompt_cache(path, model()); }, "is a single layer's KV cache file");
  std::remove(path.c_str());
  expect_error_mentioning([&] { load_prompt_cache(path, model()); }, "cannot open the prompt cache file");
}

// A file whose checksum is right but whose header lies (written by another tool, or edited).
TEST(PromptCacheFile, ALyingHeaderWithAGoodChecksumGivesClearErrors) {
  const std::string path = temp_path("lying.tqpc");
  save_prompt_cache(path, filled_caches(), model());
  const std::vector<uint8_t> bytes = read_file(path);
  uint32_t len;
  std::memcpy(&len, bytes.data() + 12, 4);
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 16, bytes.begin() + 16 + len);
  const std::vector<uint8_t> payload(bytes.begin() + 16 + len, bytes.end() - 8);
  auto load_with = [&](const nlohmann::json& h) {
    const std::string text = h.dump();
    std::vector<uint8_t> out(bytes.begin(), bytes.begin() + 12);
    const uint32_t n = static_cast<uint32_t>(text.size());
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 4);
    out.insert(out.end(), text.begin(), text.end());
    out.insert(out.end(), payload.begin(), payload.end());
    const uint64_t hash = fnv1a(out.data(), out.size());
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&hash), reinterpret_cast<const uint8_t*>(&hash) + 8);
    write_file(path, out);
    return [&] { load_prompt_cache(path, model()); };
  };
  EXPECT_NO_THROW(load_with(header)());  // the rewriting itself is faithful
  struct Edit {
    const char* pointer;
    nlohmann::json value;
    const char* needle;
  };
  const std::vector<Edit> edits = {
      {"/layer_bytes/0", 1u << 30, "layer 0's record of 1073741824 bytes is past the end of the file"},
      {"/layer_bytes/2", 12, "layer 2 holds 12 bytes; 2 states of conv 12x3, recurrent 2x8x8 are 1312"},
      {"/sequences/1/length", 40, "the header lists sequence 1 of 40 positions, layer 0 does not hold it"},
      {"/sequences/1/id", 0, "it lists sequence 0 twice"},
      {"/sequences/0/length", -3, "sequence 0 of -3 positions"},
      {"/fingerprint/layers/0/format", "f16/f16", "its header says layer 0 holds a full-attention KV cache of 2 KV heads of 64 (f16/f16)"},
      {"/fingerprint/layers/2/kind", "recurrent", "malformed header: unknown layer kind 'recurrent'"},
      {"/metadata", 7, "malformed header"},
      {"/sequences/0/id", 1e300, "'id' must be an integer"},
  };
  for (const Edit& e : edits) {
    SCOPED_TRACE(std::string(e.pointer) + " = " + e.value.dump());
    nlohmann::json h = header;
    h[nlohmann::json::json_pointer(e.pointer)] = e.value;
    expect_error_mentioning(load_with(h), e.needle);
  }
  nlohmann::json h = header;
  h["layer_bytes"].erase(4);
  expect_error_mentioning(load_with(h), "4 layer sizes for 5 layers");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace tq
