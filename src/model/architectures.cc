// The architecture table: which file builds which checkpoint.
#include "core/error.h"
#include "model/architecture.h"
#include "model/gpt_oss.h"
#include "model/llama.h"
#include "model/qwen3_5.h"

namespace tq {

std::vector<LayerSpec> layer_specs_for(const ModelConfig& c) {
  TQ_CHECK(c.num_hidden_layers >= 0, c.source, ": num_hidden_layers is negative");
  std::vector<LayerSpec> specs(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerSpec& s = specs[static_cast<size_t>(l)];
    if (c.arch == ModelArch::qwen3_5 && c.is_linear_layer(l)) {
      s.kind = LayerKind::linear_attention;
      s.state = StateShape{static_cast<int>(c.linear_conv_dim()), static_cast<int>(c.linear_conv_kernel_dim),
                           static_cast<int>(c.linear_num_value_heads), static_cast<int>(c.linear_key_head_dim),
                           static_cast<int>(c.linear_value_head_dim)};
      continue;
    }
    s.n_kv_heads = static_cast<int>(c.num_key_value_heads);
    s.head_dim = static_cast<int>(c.head_dim);
    // Qwen3.5's attention layers never slide; Llama-family and GPT-OSS layers do where the config says so.
    if (c.arch != ModelArch::qwen3_5 && c.uses_sliding_window(l) && c.sliding_window && *c.sliding_window > 0) {
      s.kind = LayerKind::sliding_attention;
      s.window = static_cast<int>(*c.sliding_window);
    }
  }
  return specs;
}

std::unique_ptr<Architecture> build_architecture(const ModelFiles& files, Device& device) {
  switch (files.config.arch) {
    case ModelArch::llama:
    case ModelArch::mistral:
    case ModelArch::qwen2:
    case ModelArch::qwen3: return std::make_unique<Llama>(files, device);
    case ModelArch::gpt_oss:
    case ModelArch::qwen3_5: break;
  }
  // Only the Llama family is split for tensor parallelism so far (docs/ARCHITECTURE.md).
  TQ_CHECK(device.tensor_parallel().world == 1, files.path, ": tensor parallelism over ", device.tensor_parallel().world,
           " devices is not implemented for '", files.config.architecture_class, "' yet (the Llama family is)");
  switch (files.config.arch) {
    case ModelArch::gpt_oss: return std::make_unique<GptOss>(files, device);
    case ModelArch::qwen3_5: return std::make_unique<Qwen35>(files, device);
    default: break;
  }
  fail(files.path, ": no architecture file builds '", files.config.architecture_class, "'");
}

}  // namespace tq
