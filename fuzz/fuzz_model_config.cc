// libFuzzer target: a Hugging Face config.json as the loader reads it: parse_hf_config (architecture,
// dimensions and their consistency, rope scaling, layer types, MoE and DeltaNet fields), the TurboQuant
// "quantization" block (parse_tq_quantization), generation_config.json's fields (the same text parsed as
// one), then what a load computes from the config before it allocates: the RoPE table config and the
// sizes of the weights and of one position of KV cache (model_sizes below), which must not overflow.
// Input: the JSON text. Seeds: the configs of tests/fixtures/model/configs, models/ and /work/shared.
#include <nlohmann/json.hpp>

#include "fuzz/fuzz_util.h"
#include "model/config.h"
#include "model/tensor.h"
#include "ops/ops.h"
#include "model/tq_weights.h"

namespace {

// The products a load computes from the config in int64 (UBSan traps a signed overflow), and the bytes
// of each weight matrix as the weight check computes them (tensor_bytes: nullopt rather than overflow).
void model_sizes(const tq::ModelConfig& c) {
  (void)c.q_dim();
  (void)c.kv_dim();
  (void)c.linear_conv_dim();
  (void)tq::tensor_bytes(tq::DType::bf16, {c.vocab_size, c.hidden_size});
  (void)tq::tensor_bytes(tq::DType::bf16, {c.q_dim(), c.hidden_size});
  (void)tq::tensor_bytes(tq::DType::bf16, {c.intermediate_size, c.hidden_size});
  // What every layer loop and per-layer vector assumes of a checked config.
  if (c.num_hidden_layers <= 0 || c.hidden_size <= 0 || c.head_dim <= 0 || c.vocab_size <= 0) __builtin_trap();
  if (!c.linear_layers.empty() && c.linear_layers.size() != static_cast<size_t>(c.num_hidden_layers)) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  tq::fuzz::refused([&] {
    const tq::ModelConfig c = tq::parse_hf_config(text, "config.json");
    (void)c.summary();
    model_sizes(c);
    // The RoPE table every architecture builds first (its dims are ints: a config must not narrow into them).
    const tq::ops::RopeConfig rc = tq::rope_config(c);
    if (rc.head_dim != c.head_dim || rc.rotary_dim != c.rope_dim) __builtin_trap();
    const tq::ops::RopeTable rope(rc);
    std::vector<float> cos(rope.inv_freq().size()), sin(cos.size());  // [rotary_dim / 2]
    rope.cos_sin(c.max_position_embeddings - 1, cos.data(), sin.data());
  });
  tq::fuzz::refused([&] { (void)tq::parse_generation_config(text, "generation_config.json"); });
  const nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_discarded()) tq::fuzz::refused([&] {
      if (const auto q = tq::parse_tq_quantization(j, "config.json")) (void)tq::tq_quantization_json(*q).dump();
    });
  return 0;
}
