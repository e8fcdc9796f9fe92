#include "model/gguf_export.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/read_file.h"
#include "model/writer.h"
#include "ops/dtype.h"
#include "ops/kquant.h"
#include "ops/q3_k.h"

namespace tq {
namespace {

uint32_t ggml_type_of(DType t, const TensorView& where) {
  switch (t) {
    case DType::f32: return kGgmlF32;
    case DType::f16: return kGgmlF16;
    case DType::bf16: return kGgmlBF16;
    default: break;
  }
  fail("'", where.file, "': tensor '", where.name, "' is ", dtype_name(t), ", which this GGUF export does not copy");
}

uint32_t ggml_type_of(ops::DType t, const std::string& what) {
  switch (t) {
    case ops::DType::F32: return kGgmlF32;
    case ops::DType::F16: return kGgmlF16;
    case ops::DType::BF16: return kGgmlBF16;
    case ops::DType::MXFP4: return kGgmlMxfp4;
    default: break;
  }
  fail("GGUF export: ", what, " has a storage type that has no place in a gpt-oss GGUF here");
}

// A tensor copied byte for byte under its GGUF name (same shape, outermost first, same dtype).
void copy_tensor(GgufWriter& w, const std::string& name, const TensorView* t) {
  TQ_CHECK(t != nullptr, "GGUF export: no source tensor for '", name, "'");
  const uint8_t* data = static_cast<const uint8_t*>(t->data);
  w.add_tensor_raw(name, ggml_type_of(t->dtype, *t), t->shape, std::vector<uint8_t>(data, data + t->nbytes));
}

// One role of every expert (the loaded views) as one GGUF tensor [E][rows][cols]. MXFP4 rows become
// ggml blocks (17 bytes per 32 values); other types are their rows' bytes.
void add_experts(GgufWriter& w, const std::string& name, const std::vector<ops::WeightView>& views) {
  TQ_CHECK(!views.empty(), "GGUF export: no experts for '", name, "'");
  const int64_t rows = views[0].rows, cols = views[0].cols;
  const uint32_t type = ggml_type_of(views[0].dtype, name);
  std::vector<uint8_t> out;  // [E][rows][row bytes]
  for (const ops::WeightView& v : views) {
    TQ_CHECK(v.rows == rows && v.cols == cols && v.dtype == views[0].dtype, "GGUF export: the experts of '", name,
             "' differ in shape or type");
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = v.row_bytes(r);
      if (v.dtype == ops::DType::MXFP4) {
        const uint8_t* scales = v.scale_row(r);  // [cols / 32]
        for (int64_t b = 0; b < cols / 32; ++b) {
          uint8_t block[kMxfp4BlockBytes];
          mxfp4_block_to_gguf(row + b * 16, scales[b], block);
          out.insert(out.end(), block, block + kMxfp4BlockBytes);
        }
      } else {
        out.insert(out.end(), row, row + ops::storage_bytes(v.dtype, static_cast<size_t>(cols)));
      }
    }
  }
  w.add_tensor_raw(name, type, {static_cast<int64_t>(views.size()), rows, cols}, std::move(out));
}

void write_metadata(GgufWriter& w, const ModelConfig& c) {
  const std::string p = "gpt-oss.";
  auto u32 = [&](const std::string& key, int64_t v) {
    TQ_CHECK(v >= 0 && v <= 0xffffffffll, "GGUF export: '", c.source, "': ", key, " ", v, " does not fit a u32");
    w.set_u32(p + key, static_cast<uint32_t>(v));
  };
  w.set_string("general.architecture", "gpt-oss");
  u32("block_count", c.num_hidden_layers);
  u32("context_length", c.max_position_embeddings);
  u32("embedding_length", c.hidden_size);
  u32("feed_forward_length", c.intermediate_size);
  u32("expert_feed_forward_length", c.intermediate_size);
  u32("attention.head_count", c.num_attention_heads);
  u32("attention.head_count_kv", c.num_key_value_heads);
  u32("attention.key_length", c.head_dim);
  u32("attention.value_length", c.head_dim);
  w.set_f32(p + "attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  w.set_f32(p + "rope.freq_base", static_cast<float>(c.rope_theta));
  u32("expert_count", c.num_experts);
  u32("expert_used_count", c.num_experts_per_tok);
  u32("vocab_size", c.vocab_size);

  TQ_CHECK(c.sliding_window.has_value(), "GGUF export: '", c.source, "' has no sliding_window");
  u32("attention.sliding_window", *c.sliding_window);
  // llama.cpp's default pattern (2: the even layers slide) as a number, anything else as flags.
  bool even_layers = true;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) even_layers &= c.uses_sliding_window(l) == (l % 2 == 0);
  if (even_layers) {
    u32("attention.sliding_window_pattern", 2);
  } else {
    std::vector<int32_t> flags;  // [num_hidden_layers]
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) flags.push_back(c.uses_sliding_window(l) ? 1 : 0);
    w.set_i32s(p + "attention.sliding_window_pattern", flags);
  }

  const RopeScaling& y = c.rope_scaling;
  if (y.type == RopeScalingType::yarn) {
    // GGUF has no key for these; config_from_gguf (like every GPT-OSS checkpoint) assumes truncate false
    // and the default attention factor, so a model that differs would silently change.
    TQ_CHECK(!y.truncate, "GGUF export: '", c.source, "': yarn truncate true cannot be written to GGUF ",
             "(readers assume false)");
    const double factor = 0.1 * std::log(y.factor) + 1.0;
    TQ_CHECK(std::fabs(y.attention_factor - factor) <= 1e-12 * factor, "GGUF export: '", c.source,
             "': yarn attention_factor ", y.attention_factor, " is not the default 0.1 ln(factor) + 1 = ", factor,
             ", which GGUF cannot say");
    w.set_string(p + "rope.scaling.type", "yarn");
    w.set_f32(p + "rope.scaling.factor", static_cast<float>(y.factor));
    u32("rope.scaling.original_context_length", y.original_max_position_embeddings);
    w.set_f32(p + "rope.scaling.yarn_beta_fast", static_cast<float>(y.beta_fast));
    w.set_f32(p + "rope.scaling.yarn_beta_slow", static_cast<float>(y.beta_slow));
  } else {
    TQ_CHECK(y.type == RopeScalingType::none, "GGUF export: '", c.source, "': only yarn rope scaling is written");
  }
  TQ_CHECK(c.swiglu_limit == 7.0, "GGUF export: '", c.source, "': swiglu_limit ", c.swiglu_limit,
           " cannot be written (GGUF readers hard-code 7)");

  if (c.bos_token_id) w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*c.bos_token_id));
  // GGUF holds one EOS id; the HF config's first is the one llama.cpp's converter keeps.
  if (!c.eos_token_ids.empty()) w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(c.eos_token_ids[0]));
  if (c.pad_token_id) w.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(*c.pad_token_id));
}

}  // namespace

std::vector<uint8_t> gpt_oss_gguf_bytes(const ModelFiles& hf) {
  const ModelConfig& c = hf.config;
  TQ_CHECK(c.arch == ModelArch::gpt_oss && hf.naming == WeightNaming::hf, "GGUF export: '", hf.path,
           "' is not a Hugging Face gpt_oss folder (", architecture_name(c.arch), ")");
  TQ_CHECK(hf.experts.layers.size() == static_cast<size_t>(c.num_hidden_layers), "GGUF export: '", hf.path,
           "': the experts were not built");
  GgufWriter w;
  write_metadata(w, c);
  const ModelWeights& m = hf.weights;
  copy_tensor(w, "token_embd.weight", m.embed);
  if (!c.tie_word_embeddings) copy_tensor(w, "output.weight", m.lm_head);  // absent = tied, for readers
  copy_tensor(w, "output_norm.weight", m.final_norm);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = m.layers[static_cast<size_t>(l)];
    const LayerExperts& X = hf.experts.layers[static_cast<size_t>(l)];
    const std::string b = "blk." + std::to_string(l) + ".";
    copy_tensor(w, b + "attn_norm.weight", L.attn_norm);
    // HF post_attention_layernorm is the norm before the MoE; llama.cpp calls it post_attention_norm.
    copy_tensor(w, b + "post_attention_norm.weight", L.ffn_norm);
    copy_tensor(w, b + "attn_q.weight", L.wq);  // HF row order: NeoX RoPE needs no permutation
    copy_tensor(w, b + "attn_k.weight", L.wk);
    copy_tensor(w, b + "attn_v.weight", L.wv);
    copy_tensor(w, b + "attn_output.weight", L.wo);
    copy_tensor(w, b + "attn_q.bias", L.bq);
    copy_tensor(w, b + "attn_k.bias", L.bk);
    copy_tensor(w, b + "attn_v.bias", L.bv);
    copy_tensor(w, b + "attn_output.bias", L.bo);
    copy_tensor(w, b + "attn_sinks.weight", L.sinks);
    copy_tensor(w, b + "ffn_gate_inp.weight", L.router);
    copy_tensor(w, b + "ffn_gate_inp.bias", L.router_bias);
    add_experts(w, b + "ffn_gate_exps.weight", X.gate);
    add_experts(w, b + "ffn_up_exps.weight", X.up);
    add_experts(w, b + "ffn_down_exps.weight", X.down);
    const int64_t E = c.num_experts, I = c.intermediate_size, H = c.hidden_size;
    w.add_tensor(b + "ffn_gate_exps.bias", DType::f32, {E, I}, X.gate_bias);  // [E][I]
    w.add_tensor(b + "ffn_up_exps.bias", DType::f32, {E, I}, X.up_bias);      // [E][I]
    w.add_tensor(b + "ffn_down_exps.bias", DType::f32, {E, H}, X.down_bias);  // [E][H]
  }
  return w.bytes();
}

void write_gpt_oss_gguf(const ModelFiles& hf, const std::string& path) {
  write_bytes_to_file(path, gpt_oss_gguf_bytes(hf));
}

namespace {

// tokenizer.json (byte-level BPE) as GGUF gpt2 tokenizer keys.
void write_bpe_tokenizer(GgufWriter& w, const ModelFiles& hf) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::is_directory(hf.path) ? fs::path(hf.path) : fs::path(hf.path).parent_path();
  const std::string file = (dir / "tokenizer.json").string();
  const nlohmann::json j = nlohmann::json::parse(read_whole_file(file), nullptr, false);
  TQ_CHECK(j.is_object() && j.contains("model") && j["model"].value("type", "") == "BPE" && j["model"].contains("vocab"),
           "GGUF export: '", file, "' is not a BPE tokenizer.json");
  const size_t vocab = static_cast<size_t>(hf.config.vocab_size);
  std::vector<std::string> tokens(vocab);  // [vocab], by id
  std::vector<int32_t> types(vocab, 1);    // [vocab]: 1 normal, 3 control (special added tokens)
  std::vector<bool> seen(vocab, false);
  auto place = [&](const std::string& text, int64_t id, bool special) {
    TQ_CHECK(id >= 0 && static_cast<size_t>(id) < vocab, "GGUF export: '", file, "': token id ", id,
             " outside the vocabulary of ", vocab);
    tokens[static_cast<size_t>(id)] = text;
    seen[static_cast<size_t>(id)] = true;
    if (special) types[static_cast<size_t>(id)] = 3;
  };
  for (const auto& [text, id] : j["model"]["vocab"].items()) place(text, id.get<int64_t>(), false);
  if (j.contains("added_tokens"))
    for (const auto& t : j["added_tokens"]) place(t.at("content").get<std::string>(), t.at("id").get<int64_t>(), t.value("special", false));
  for (size_t i = 0; i < vocab; ++i) {
    if (!seen[i]) {
      tokens[i] = "[PAD" + std::to_string(i) + "]";  // llama.cpp's converter's name for ids the vocabulary skips
      types[i] = 5;                                   // unused
    }
  }
  std::vector<std::string> merges;
  if (j["model"].contains("merges"))
    for (const auto& m : j["model"]["merges"])
      merges.push_back(m.is_string() ? m.get<std::string>() : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", "default");
  w.set_strings("tokenizer.ggml.tokens", tokens);
  w.set_i32s("tokenizer.ggml.token_type", types);
  w.set_strings("tokenizer.ggml.merges", merges);
  const ModelConfig& c = hf.config;
  if (c.bos_token_id) w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(*c.bos_token_id));
  if (!c.eos_token_ids.empty()) w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(c.eos_token_ids[0]));
  if (c.pad_token_id) w.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(*c.pad_token_id));
  w.set_bool("tokenizer.ggml.add_bos_token", false);
}

// One tensor, its values read as float (rows permuted for attn_q / attn_k when heads > 0), written as `type`
// (or, with `dequantized`, as F32 holding the values `type` stores; with `q3_k`, as F32 holding the values
// of Q3_K blocks, `type` unused).
void add_llama_tensor(GgufWriter& w, const std::string& name, const TensorView* t, DType type, bool dequantized,
                      int64_t heads = 0, int64_t head_dim = 0, bool q3_k = false) {
  TQ_CHECK(t != nullptr, "GGUF export: no source tensor for '", name, "'");
  std::vector<float> v = read_tensor_f32(*t);  // [rows][cols] as float
  const int64_t cols = t->row_length(), rows = t->rows();
  if (heads > 0) {
    TQ_CHECK(rows == heads * head_dim && head_dim % 2 == 0, "GGUF export: '", t->name, "' has ", rows, " rows, not ",
             heads, " heads of ", head_dim);
    std::vector<float> p(v.size());  // [rows][cols], interleaved-RoPE row order
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < 2; ++i)
        for (int64_t j = 0; j < head_dim / 2; ++j)
          std::memcpy(p.data() + (h * head_dim + 2 * j + i) * cols, v.data() + (h * head_dim + i * head_dim / 2 + j) * cols,
                      static_cast<size_t>(cols) * sizeof(float));
    v = std::move(p);
  }
  if (q3_k) {
    TQ_CHECK(dequantized, "GGUF export: Q3_K matrices need dequantized (the engine has no Q3_K tensor type)");
    TQ_CHECK(cols % static_cast<int64_t>(ops::kQ3_KBlockValues) == 0, "GGUF export: '", t->name, "' has rows of ", cols,
             " values, not whole Q3_K blocks of 256");
    std::vector<uint8_t> q(v.size() / ops::kQ3_KBlockValues * ops::kQ3_KBlockBytes);  // the rows as Q3_K blocks
    ops::q3_k_quantize(v.data(), v.size(), q.data());
    ops::q3_k_dequantize(q.data(), v.size(), v.data());
    type = DType::f32;
  } else if (is_kquant(type)) {
    const ops::DType ot = to_ops_kquant(type);
    TQ_CHECK(cols % static_cast<int64_t>(ops::block_values(ot)) == 0, "GGUF export: '", t->name, "' has rows of ", cols,
             " values, not whole ", dtype_name(type), " blocks of ", ops::block_values(ot));
    if (dequantized) {
      std::vector<uint8_t> q(ops::storage_bytes(ot, v.size()));  // the rows as `type` stores them
      ops::kquant_quantize(ot, v.data(), v.size(), q.data());
      ops::kquant_dequantize(ot, q.data(), v.size(), v.data());
      type = DType::f32;
    }
  }
  w.add_tensor(name, type, t->shape, v);
}

}  // namespace

std::vector<uint8_t> llama_gguf_bytes(const ModelFiles& hf, const LlamaGgufOptions& o) {
  const ModelConfig& c = hf.config;
  TQ_CHECK(c.arch == ModelArch::llama && hf.naming == WeightNaming::hf && c.num_experts == 0, "GGUF export: '", hf.path,
           "' is not a Hugging Face Llama folder (", architecture_name(c.arch), ")");
  TQ_CHECK(c.rope_scaling.type == RopeScalingType::none, "GGUF export: '", c.source,
           "': rope scaling is not written by the Llama export");
  TQ_CHECK(!c.qkv_bias && !c.o_bias && !c.qk_norm, "GGUF export: '", c.source, "': biases / q-k norms are not written");
  TQ_CHECK(!o.matrices_q3_k || o.dequantized, "GGUF export: Q3_K matrices are written only dequantized (as F32 holding "
           "their values): the engine has no Q3_K tensor type");
  GgufWriter w;
  const std::string p = "llama.";
  auto u32 = [&](const std::string& key, int64_t v) {
    TQ_CHECK(v >= 0 && v <= 0xffffffffll, "GGUF export: '", c.source, "': ", key, " ", v, " does not fit a u32");
    w.set_u32(p + key, static_cast<uint32_t>(v));
  };
  w.set_string("general.architecture", "llama");
  u32("block_count", c.num_hidden_layers);
  u32("context_length", c.max_position_embeddings);
  u32("embedding_length", c.hidden_size);
  u32("feed_forward_length", c.intermediate_size);
  u32("attention.head_count", c.num_attention_heads);
  u32("attention.head_count_kv", c.num_key_value_heads);
  u32("attention.key_length", c.head_dim);
  u32("attention.value_length", c.head_dim);
  u32("vocab_size", c.vocab_size);
  w.set_f32(p + "attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  w.set_f32(p + "rope.freq_base", static_cast<float>(c.rope_theta));
  write_bpe_tokenizer(w, hf);

  const ModelWeights& m = hf.weights;
  const bool dq = o.dequantized;
  add_llama_tensor(w, "token_embd.weight", m.embed, o.embedding, dq);
  if (!c.tie_word_embeddings) add_llama_tensor(w, "output.weight", m.lm_head, o.embedding, dq);
  add_llama_tensor(w, "output_norm.weight", m.final_norm, DType::f32, dq);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = m.layers[static_cast<size_t>(l)];
    const std::string b = "blk." + std::to_string(l) + ".";
    add_llama_tensor(w, b + "attn_norm.weight", L.attn_norm, DType::f32, dq);
    add_llama_tensor(w, b + "ffn_norm.weight", L.ffn_norm, DType::f32, dq);
    const bool q3 = o.matrices_q3_k;
    add_llama_tensor(w, b + "attn_q.weight", L.wq, o.matrices, dq, c.num_attention_heads, c.head_dim, q3);
    add_llama_tensor(w, b + "attn_k.weight", L.wk, o.matrices, dq, c.num_key_value_heads, c.head_dim, q3);
    add_llama_tensor(w, b + "attn_v.weight", L.wv, o.matrices, dq, 0, 0, q3);
    add_llama_tensor(w, b + "attn_output.weight", L.wo, o.matrices, dq, 0, 0, q3);
    add_llama_tensor(w, b + "ffn_gate.weight", L.w_gate, o.matrices, dq, 0, 0, q3);
    add_llama_tensor(w, b + "ffn_up.weight", L.w_up, o.matrices, dq, 0, 0, q3);
    add_llama_tensor(w, b + "ffn_down.weight", L.w_down, o.matrices, dq, 0, 0, q3);
  }
  return w.bytes();
}

void write_llama_gguf(const ModelFiles& hf, const std::string& path, const LlamaGgufOptions& options) {
  write_bytes_to_file(path, llama_gguf_bytes(hf, options));
}

}  // namespace tq
