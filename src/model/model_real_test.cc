// The real models in ../shared/models (skipped when absent): they open, their configs parse, and
// their weights validate; stories260K.gguf's tensors equal llama2.c's stories260K.bin float for float.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "core/error.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/loader.h"
#include "model/mapped_file.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace tq {
namespace {

std::string shared_model(const std::string& rel) { return std::string(TQ_SHARED_DIR) + "/models/" + rel; }

#define SKIP_UNLESS_EXISTS(path)                                                      \
  do {                                                                                \
    if (!std::filesystem::exists(path)) GTEST_SKIP() << (path) << " is not present"; \
  } while (0)

TEST(RealModels, Stories260KGgufMetadataAndTensors) {
  const std::string path = shared_model("stories260K/stories260K.gguf");
  SKIP_UNLESS_EXISTS(path);
  const GgufFile g = GgufFile::open(path);
  std::cout << path << ": GGUF v" << g.version() << ", alignment " << g.alignment() << ", data at "
            << g.data_offset() << "\n";
  for (const std::string& k : g.keys()) std::cout << "  " << k << " = " << g.find(k)->describe() << "\n";
  for (const TensorView& t : g.tensors().all()) {
    std::cout << "  " << t.name << " " << dtype_name(t.dtype) << " " << shape_string(t.shape) << "\n";
  }
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.get_string("general.architecture"), "llama");
  EXPECT_EQ(g.get_u32("llama.embedding_length"), 64u);
  EXPECT_EQ(g.get_u32("llama.block_count"), 5u);
  EXPECT_EQ(g.get_u32("llama.feed_forward_length"), 172u);
  EXPECT_EQ(g.get_u32("llama.attention.head_count"), 8u);
  EXPECT_EQ(g.get_u32("llama.attention.head_count_kv"), 4u);
  EXPECT_FLOAT_EQ(g.get_f32("llama.attention.layer_norm_rms_epsilon"), 1e-5f);
  EXPECT_EQ(g.get_string("tokenizer.ggml.model"), "llama");
  const std::vector<std::string> tokens = g.get_array<std::string>("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 512u);
  EXPECT_EQ(tokens[0], "<unk>");
  EXPECT_EQ(tokens[1], "<s>");
  EXPECT_EQ(tokens[2], "</s>");
  EXPECT_EQ(tokens[3], "<0x00>");
  EXPECT_EQ(g.get_array<float>("tokenizer.ggml.scores").size(), 512u);
  const std::vector<int32_t> types = g.get_array<int32_t>("tokenizer.ggml.token_type");
  ASSERT_EQ(types.size(), 512u);
  EXPECT_EQ(types[0], 2);  // unknown
  EXPECT_EQ(types[1], 3);  // control
  EXPECT_EQ(types[3], 6);  // byte
  EXPECT_EQ(g.get_u32("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_EQ(g.get_u32("tokenizer.ggml.eos_token_id"), 2u);

  EXPECT_EQ(g.tensors().size(), 48u);
  EXPECT_EQ(g.tensors().at("token_embd.weight").shape, (std::vector<int64_t>{512, 64}));
  EXPECT_EQ(g.tensors().at("blk.0.attn_k.weight").shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(g.tensors().at("blk.4.ffn_down.weight").shape, (std::vector<int64_t>{64, 172}));

  const ModelConfig c = config_from_gguf(g);
  std::cout << c.summary() << "\n";
  EXPECT_EQ(c.arch, ModelArch::llama);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 172);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.rope_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_layout, RopeLayout::interleaved);
  EXPECT_FALSE(c.tie_word_embeddings);  // the file stores output.weight
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2}));

  const ModelWeights w = validate_weights(c, g.tensors(), WeightNaming::gguf);
  EXPECT_TRUE(w.unused.empty());
  EXPECT_EQ(w.layers.size(), 5u);
  EXPECT_EQ(w.lm_head->name, "output.weight");
}

// stories260K.bin is llama2.c's checkpoint of the same model (README: rebuilt from the GGUF and
// byte-identical to Karpathy's original): 7 int32 of header, then fp32 tensors in a fixed order.
// Every GGUF tensor must equal its llama2.c counterpart exactly, which also shows that this GGUF's
// attn_q/attn_k rows are in llama2.c's own (interleaved-RoPE) order, unpermuted.
TEST(RealModels, Stories260KGgufMatchesLlama2cCheckpoint) {
  const std::string gguf_path = shared_model("stories260K/stories260K.gguf");
  const std::string bin_path = shared_model("stories260K/stories260K.bin");
  SKIP_UNLESS_EXISTS(gguf_path);
  SKIP_UNLESS_EXISTS(bin_path);
  const GgufFile g = GgufFile::open(gguf_path);
  const MappedFile bin = MappedFile::open(bin_path);
  int32_t header[7];
  ASSERT_GE(bin.size(), sizeof(header));
  std::memcpy(header, bin.data(), sizeof(header));
  const int64_t dim = header[0], hidden = header[1], layers = header[2], heads = header[3], kv_heads = header[4],
                vocab = header[5];
  EXPECT_EQ(dim, 64);
  EXPECT_EQ(hidden, 172);
  EXPECT_EQ(layers, 5);
  EXPECT_EQ(vocab, 512);
  const int64_t kv_dim = dim / heads * kv_heads;

  size_t offset = sizeof(header);
  // Compares the next `count` floats of the .bin with `tensor`'s bytes.
  auto expect_next = [&](const std::string& tensor, int64_t count) {
    const TensorView& t = g.tensors().at(tensor);
    ASSERT_EQ(t.numel(), count) << tensor;
    ASSERT_LE(offset + count * 4, bin.size());
    EXPECT_EQ(std::memcmp(t.data, bin.data() + offset, count * 4), 0) << tensor << " differs from the .bin";
    offset += count * 4;
  };
  auto per_layer = [&](const char* pattern, int64_t count) {
    for (int64_t l = 0; l < layers; ++l) expect_next("blk." + std::to_string(l) + "." + pattern, count);
  };
  expect_next("token_embd.weight", vocab * dim);
  per_layer("attn_norm.weight", dim);
  per_layer("attn_q.weight", dim * dim);
  per_layer("attn_k.weight", kv_dim * dim);
  per_layer("attn_v.weight", kv_dim * dim);
  per_layer("attn_output.weight", dim * dim);
  per_layer("ffn_norm.weight", dim);
  per_layer("ffn_gate.weight", hidden * dim);  // w1
  per_layer("ffn_down.weight", dim * hidden);  // w2
  per_layer("ffn_up.weight", hidden * dim);    // w3
  expect_next("output_norm.weight", dim);
  // A positive vocab_size in the header means the classifier is the embedding.
  const TensorView& out = g.tensors().at("output.weight");
  EXPECT_EQ(std::memcmp(out.data, g.tensors().at("token_embd.weight").data, out.nbytes), 0);
}

TEST(RealModels, TinyStories656KSafetensorsWithAliasedEmbedding) {
  const std::string dir = shared_model("tinystories-656K");
  SKIP_UNLESS_EXISTS(dir + "/model.safetensors");
  const SafetensorsModel m = SafetensorsModel::open(dir);
  EXPECT_EQ(m.files().size(), 1u);
  EXPECT_EQ(m.tensors().size(), 20u);  // lm_head + 2 x 9 + model.norm
  EXPECT_EQ(m.tensors().aliases().at("model.embed_tokens.weight"), "lm_head.weight");

  const ModelConfig c = load_hf_config(dir);
  std::cout << c.summary() << "\n";
  EXPECT_EQ(c.arch, ModelArch::llama);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 384);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.vocab_size, 2048);
  EXPECT_EQ(c.max_position_embeddings, 512);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_layout, RopeLayout::rotate_half);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, "float32");

  const ModelWeights w = validate_weights(c, m.tensors(), WeightNaming::hf);
  EXPECT_EQ(w.embed->name, "lm_head.weight");
  EXPECT_EQ(w.embed, w.lm_head);
  EXPECT_TRUE(w.unused.empty());
  EXPECT_EQ(w.layers[1].wk->shape, (std::vector<int64_t>{64, 128}));

  // README: the F32 file is the bf16 original widened, so every value has its low 16 bits at zero.
  for (const TensorView& t : m.tensors().all()) {
    ASSERT_EQ(t.dtype, DType::f32);
    const uint8_t* p = static_cast<const uint8_t*>(t.data);
    bool widened = true;
    for (int64_t i = 0; i < t.numel() && widened; ++i) widened = p[4 * i] == 0 && p[4 * i + 1] == 0;
    EXPECT_TRUE(widened) << t.name;
  }

  const GenerationConfig gen = load_generation_config(dir);
  EXPECT_EQ(gen.bos_token_id, 1);
  EXPECT_EQ(gen.eos_token_ids, (std::vector<int64_t>{2}));
  EXPECT_FALSE(gen.temperature.has_value());
}

TEST(RealModels, TqLlamaHd128FiveShards) {
  const std::string dir = shared_model("tq-llama-hd128");
  SKIP_UNLESS_EXISTS(dir + "/model.safetensors.index.json");
  const SafetensorsModel m = SafetensorsModel::open(dir);
  EXPECT_EQ(m.files().size(), 5u);
  EXPECT_EQ(m.tensors().size(), 74u);
  uint64_t total = 0;
  for (const TensorView& t : m.tensors().all()) {
    EXPECT_EQ(t.dtype, DType::bf16) << t.name;
    total += t.nbytes;
  }
  EXPECT_EQ(total, 58737664u);  // the index's metadata.total_size

  const ModelConfig c = load_hf_config(dir + "/config.json");
  std::cout << c.summary() << "\n";
  EXPECT_EQ(c.hidden_size, 512);
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.vocab_size, 8192);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);  // from rope_parameters
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::none);
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{0}));

  const ModelWeights w = validate_weights(c, m.tensors(), WeightNaming::hf);
  EXPECT_EQ(w.embed->name, "model.embed_tokens.weight");
  EXPECT_EQ(w.embed->file, dir + "/model-00001-of-00005.safetensors");
  EXPECT_EQ(w.lm_head, w.embed);
  EXPECT_TRUE(w.unused.empty());
  EXPECT_EQ(w.layers[7].wq->shape, (std::vector<int64_t>{512, 512}));
  EXPECT_EQ(w.layers[7].wk->shape, (std::vector<int64_t>{256, 512}));
  // Values are finite and not all zero (a sanity check that the views point at weights).
  const std::vector<float> norm = read_tensor_f32(*w.final_norm);
  double sum = 0;
  for (float v : norm) {
    ASSERT_TRUE(std::isfinite(v));
    sum += std::fabs(v);
  }
  EXPECT_GT(sum, 0);
}

TEST(RealModels, OpenModelByPath) {
  int opened = 0;
  const std::string gguf = shared_model("stories260K/stories260K.gguf");
  if (std::filesystem::exists(gguf)) {
    ++opened;
    ModelFiles m = open_model(gguf);
    EXPECT_EQ(m.naming, WeightNaming::gguf);
    EXPECT_EQ(m.config.rope_layout, RopeLayout::interleaved);
    ModelFiles moved = std::move(m);  // the weights stay valid across a move
    EXPECT_EQ(moved.weights.embed, moved.tensors().find("token_embd.weight"));
  }
  for (const char* folder : {"tinystories-656K", "tq-llama-hd128"}) {
    const std::string dir = shared_model(folder);
    if (!std::filesystem::exists(dir + "/config.json")) continue;
    ++opened;
    ModelFiles m = open_model(dir);
    EXPECT_EQ(m.naming, WeightNaming::hf);
    EXPECT_EQ(m.weights.layers.size(), static_cast<size_t>(m.config.num_hidden_layers));
    EXPECT_EQ(m.weights.lm_head, m.weights.embed) << folder;
    EXPECT_FALSE(m.generation.eos_token_ids.empty()) << folder;
  }
  if (opened == 0) GTEST_SKIP() << "no model of " << TQ_SHARED_DIR << "/models is present";
}

}  // namespace
}  // namespace tq
