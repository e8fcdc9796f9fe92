// libFuzzer target: a model.safetensors file, loaded as turboquant loads a Hugging Face folder
// (model/loader.h open_model): header JSON, dtypes, shapes, data_offsets, overlaps, tied-weight aliases,
// then every weight checked against a fixed small Llama config.json (validate_weights: the shapes the
// model would read), and each tensor's first row converted to float32 (what loading a layer reads).
// The input is the file's bytes; the seeds (fuzz/corpus/fuzz_safetensors) are small real models.
#include <vector>

#include "fuzz/fuzz_util.h"
#include "model/loader.h"

namespace {

// The config of the seed models (fuzz/make_seeds.cc writes the same one): TinyStories-656K's layout
// with every dimension made small.
constexpr const char* kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
  "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8, "num_key_value_heads": 1, "vocab_size": 32,
  "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true,
  "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2
})";

void read_first_rows(const tq::TensorSet& tensors) {
  std::vector<float> row;  // [row_length]
  for (const tq::TensorView& t : tensors.all()) {
    if (tq::is_tq(t.dtype) || t.numel() == 0 || t.row_length() > (1 << 16)) continue;
    row.resize(static_cast<size_t>(t.row_length()));
    tq::read_row_f32(t, 0, row.data());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string config = tq::fuzz::write_scratch("config.json", kConfig);
  const std::string file = tq::fuzz::write_scratch("model.safetensors", {reinterpret_cast<const char*>(data), size});
  tq::fuzz::refused([&] {
    const tq::ModelFiles m = tq::open_model(tq::fuzz::scratch_dir());
    read_first_rows(m.tensors());
  });
  return 0;
}
