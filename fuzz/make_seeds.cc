// Writes the seed corpora of fuzz/corpus whose formats have no real file small enough to keep in the
// repository: small models (safetensors, GGUF, a TurboQuant folder) and cache files, written by the
// project's own writers (model/writer.h, tq_convert, KVCache::to_bytes, save_prompt_cache), so that each
// seed is a file a real run would read. The GGUF seed keeps stories260K.gguf's metadata and vocabulary
// (trimmed to 300 tokens) with its dimensions made small. Every seed is loaded back before it is kept.
//
//   build-asan/bin/tq_fuzz_make_seeds fuzz/corpus /work/shared/models/stories260K/stories260K.gguf
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "core/thread_pool.h"
#include "fuzz/fuzz_seed_model.h"
#include "fuzz/fuzz_util.h"
#include "kv/cache_file.h"
#include "model/loader.h"
#include "model/tq_convert.h"
#include "model/writer.h"
#include "runtime/generate.h"

namespace fs = std::filesystem;
using namespace tq;

namespace {

std::vector<float> noise(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.normal() * 0.1);
  return v;
}

void write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::printf("%s: %zu bytes\n", path.c_str(), bytes.size());
}
std::string as_string(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }
std::string read(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

struct Dims {
  int64_t hidden, inter, layers, heads, kv_heads, head_dim, vocab;
};

// A Llama in Hugging Face names, tied embeddings stored once as lm_head.weight with the alias in
// __metadata__ (as TinyStories-656K's file does).
std::vector<uint8_t> hf_llama(const Dims& d, DType dtype, bool tied) {
  SafetensorsWriter w;
  uint64_t seed = 1;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    w.add(name, name.find("norm") != std::string::npos ? DType::f32 : dtype, shape, noise(n, seed++));
  };
  add("lm_head.weight", {d.vocab, d.hidden});
  if (tied) w.set_metadata("model.embed_tokens.weight", "lm_head.weight");
  else add("model.embed_tokens.weight", {d.vocab, d.hidden});
  add("model.norm.weight", {d.hidden});
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {d.hidden});
    add(p + "post_attention_layernorm.weight", {d.hidden});
    add(p + "self_attn.q_proj.weight", {d.heads * d.head_dim, d.hidden});
    add(p + "self_attn.k_proj.weight", {d.kv_heads * d.head_dim, d.hidden});
    add(p + "self_attn.v_proj.weight", {d.kv_heads * d.head_dim, d.hidden});
    add(p + "self_attn.o_proj.weight", {d.hidden, d.heads * d.head_dim});
    add(p + "mlp.gate_proj.weight", {d.inter, d.hidden});
    add(p + "mlp.up_proj.weight", {d.inter, d.hidden});
    add(p + "mlp.down_proj.weight", {d.hidden, d.inter});
  }
  w.set_metadata("format", "pt");
  return w.bytes();
}

std::string hf_config(const Dims& d, bool tied) {
  nlohmann::ordered_json j = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", d.hidden},
                              {"intermediate_size", d.inter}, {"num_hidden_layers", d.layers}, {"num_attention_heads", d.heads},
                              {"num_key_value_heads", d.kv_heads}, {"head_dim", d.head_dim}, {"vocab_size", d.vocab},
                              {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
                              {"tie_word_embeddings", tied}, {"hidden_act", "silu"}, {"bos_token_id", 1}, {"eos_token_id", 2}};
  return j.dump(2);
}

void safetensors_seeds(const fs::path& out) {
  // fuzz_safetensors.cc's kConfig.
  const Dims d{16, 32, 1, 2, 1, 8, 32};
  const fs::path dir = fuzz::scratch_dir() + "/st";
  fs::create_directories(dir);
  write(dir / "config.json", hf_config(d, true));
  for (auto [dtype, name] : {std::pair{DType::bf16, "llama-tiny-bf16.safetensors"}, std::pair{DType::f16, "llama-tiny-f16.safetensors"}}) {
    const std::string bytes = as_string(hf_llama(d, dtype, true));
    write(dir / "model.safetensors", bytes);
    (void)open_model(dir.string());  // throws if the seed does not load
    write(out / "fuzz_safetensors" / name, bytes);
  }
}

void tq_folder_seeds(const fs::path& out) {
  const Dims d{64, 64, 1, 2, 1, 32, 16};
  for (int bits : {4, 2}) {
    const fs::path src = fuzz::scratch_dir() + "/hf" + std::to_string(bits), dst = fuzz::scratch_dir() + "/tq" + std::to_string(bits);
    fs::create_directories(src);
    write(src / "config.json", hf_config(d, false));
    write(src / "model.safetensors", as_string(hf_llama(d, DType::bf16, false)));
    TqConvertOptions o;
    o.bits = bits;
    o.group_size = 32;
    ThreadPool pool(1);
    convert_to_turboquant(src.string(), dst.string(), o, pool);
    (void)open_model(dst.string());
    write(out / "fuzz_tq_folder" / ("llama-tq" + std::to_string(bits) + ".folder"),
          read(dst / "config.json") + std::string(fuzz::kSeparator) + read(dst / "model.safetensors"));
    // The config with its quantization block is also a seed of the config target.
    write(out / "fuzz_model_config" / ("llama-tq" + std::to_string(bits) + "-config.json"), read(dst / "config.json"));
  }
}

// stories260K.gguf's metadata (its vocabulary cut to the first `vocab` tokens) with small dimensions.
void gguf_seeds(const fs::path& out, const std::string& stories) {
  if (!fs::exists(stories)) {
    std::printf("gguf seeds: %s is absent, skipped\n", stories.c_str());
    return;
  }
  const GgufFile g = GgufFile::open(stories);
  const uint64_t vocab = 300;
  const Dims d{16, 32, 1, 2, 1, 8, static_cast<int64_t>(vocab)};
  GgufWriter w;
  for (const std::string& key : g.keys()) {
    const GgufValue& v = *g.find(key);
    if (key == "llama.embedding_length") w.set_u32(key, d.hidden);
    else if (key == "llama.feed_forward_length") w.set_u32(key, d.inter);
    else if (key == "llama.block_count") w.set_u32(key, d.layers);
    else if (key == "llama.attention.head_count") w.set_u32(key, d.heads);
    else if (key == "llama.attention.head_count_kv") w.set_u32(key, d.kv_heads);
    else if (key == "llama.rope.dimension_count") w.set_u32(key, d.head_dim);
    else if (key == "llama.context_length") w.set_u32(key, 64);
    else if (v.type == GgufType::string) w.set_string(key, v.str);
    else if (v.type == GgufType::array && v.elem_type == GgufType::string) {
      std::vector<std::string> s = v.strings;
      if (s.size() > vocab) s.resize(vocab);
      w.set_strings(key, s);
    } else if (v.type == GgufType::array) {
      const uint64_t n = std::min<uint64_t>(v.count, vocab);
      const size_t width = v.elem_type == GgufType::f32 || v.elem_type == GgufType::i32 || v.elem_type == GgufType::u32 ? 4 : 1;
      w.set_raw(key, GgufType::array, GgufWriter::encode_array(v.elem_type, n, std::vector<uint8_t>(v.elems, v.elems + n * width)));
    } else if (v.type == GgufType::u32) w.set_u32(key, static_cast<uint32_t>(v.u));
    else if (v.type == GgufType::i32) w.set_i32(key, static_cast<int32_t>(v.i));
    else if (v.type == GgufType::f32) w.set_f32(key, static_cast<float>(v.f));
    else if (v.type == GgufType::boolean) w.set_bool(key, v.u != 0);
    else if (v.type == GgufType::u64) w.set_u64(key, v.u);
    else std::printf("gguf seeds: key %s of type %s dropped\n", key.c_str(), gguf_type_name(v.type));
  }
  uint64_t seed = 7;
  auto add = [&](const std::string& name, DType dtype, std::vector<int64_t> shape) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    w.add_tensor(name, dtype, shape, noise(n, seed++));
  };
  add("token_embd.weight", DType::f16, {d.vocab, d.hidden});
  add("output_norm.weight", DType::f32, {d.hidden});
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", DType::f32, {d.hidden});
    add(p + "ffn_norm.weight", DType::f32, {d.hidden});
    add(p + "attn_q.weight", DType::f16, {d.heads * d.head_dim, d.hidden});
    add(p + "attn_k.weight", DType::f16, {d.kv_heads * d.head_dim, d.hidden});
    add(p + "attn_v.weight", DType::f16, {d.kv_heads * d.head_dim, d.hidden});
    add(p + "attn_output.weight", DType::f16, {d.hidden, d.heads * d.head_dim});
    add(p + "ffn_gate.weight", DType::f16, {d.inter, d.hidden});
    add(p + "ffn_up.weight", DType::f16, {d.inter, d.hidden});
    add(p + "ffn_down.weight", DType::f16, {d.hidden, d.inter});
  }
  const std::string bytes = as_string(w.bytes());
  const std::string path = fuzz::write_scratch("seed.gguf", bytes);
  const ModelFiles m = open_model(path);
  (void)load_model_tokenizer(m);
  write(out / "fuzz_gguf" / "stories260K-small.gguf", bytes);
}

void append(LayerCache& c, int seq, int n, uint64_t seed) {
  const std::vector<float> k = noise(static_cast<size_t>(n) * fuzz::kSeedHeads * fuzz::kSeedHeadDim, seed);
  const std::vector<float> v = noise(k.size(), seed + 1);
  if (auto* kv = dynamic_cast<KVCache*>(&c)) {
    kv->append(seq, k.data(), v.data(), n);
    return;
  }
  auto& state = dynamic_cast<StateCache&>(c);
  const StateShape& s = state.shape();
  SplitMix64 rng(seed);
  for (int i = 0; i < s.conv_channels * (s.conv_kernel - 1); ++i) state.conv_state(seq)[i] = static_cast<float>(rng.normal());
  for (int i = 0; i < s.state_heads * s.state_dk * s.state_dv; ++i) state.recurrent_state(seq)[i] = static_cast<float>(rng.normal());
  state.advance(seq, n);
}

void cache_seeds(const fs::path& out) {
  const int H = fuzz::kSeedHeads, D = fuzz::kSeedHeadDim;
  std::vector<std::pair<std::string, KVCacheOptions>> kinds;
  KVCacheOptions dense;
  dense.block_tokens = 4;
  kinds.push_back({"f16.tqkv", dense});
  TurboQuantCacheOptions tq;
  tq.min_tokens_before_quant = 2;
  tq.block_tokens = 4;
  kinds.push_back({"turboquant-k8v3-sink2.tqkv", turboquant_cache_options(tq)});
  KVCacheOptions q;
  q.k.type = KVType::q8_0;
  q.v.type = KVType::q4_0;
  q.block_tokens = 4;
  kinds.push_back({"q8_0-q4_0.tqkv", q});
  KVCacheOptions rotating = dense;
  rotating.window = 4;
  kinds.push_back({"f16-window4.tqkv", rotating});
  for (const auto& [name, o] : kinds) {
    KVCache c(H, D, o);
    c.add_sequence_with_id(0);
    append(c, 0, 6, 3);
    c.fork_sequence(0, 2);
    append(c, 2, 3, 9);
    const std::vector<uint8_t> bytes = c.to_bytes();
    (void)KVCache::from_bytes(bytes, name);
    write(out / "fuzz_cache_file" / name, as_string(bytes));
  }
  PromptCache caches = make_prompt_cache(fuzz::seed_layers(), KVType::f16, 4);
  for (auto& l : caches) l->add_sequence_with_id(0);
  for (auto& l : caches) append(*l, 0, 5, 11);
  const std::string path = fuzz::scratch_dir() + "/prompt.tqcache";
  save_prompt_cache(path, caches, fuzz::seed_model_fingerprint(), {{"text", "Once upon a time"}});
  (void)load_prompt_cache(path, fuzz::seed_model_fingerprint());
  write(out / "fuzz_cache_file" / "prompt-3-layers.tqcache", read(path));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR [stories260K.gguf]\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  try {
    safetensors_seeds(out);
    tq_folder_seeds(out);
    gguf_seeds(out, argc > 2 ? argv[2] : "/work/shared/models/stories260K/stories260K.gguf");
    cache_seeds(out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
