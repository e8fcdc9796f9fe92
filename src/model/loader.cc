#include "model/loader.h"

#include <filesystem>

#include "core/error.h"

namespace tq {

ModelFiles open_model(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TQ_CHECK(fs::exists(path, ec), "model path '", path, "' does not exist");
  ModelFiles m;
  m.path = path;
  if (fs::is_directory(path, ec)) {
    m.config = load_hf_config(path);
    m.generation = load_generation_config(path);
    m.safetensors = std::make_unique<SafetensorsModel>(SafetensorsModel::open(path));
    m.naming = WeightNaming::hf;
  } else {
    const std::string ext = fs::path(path).extension().string();
    TQ_CHECK(ext == ".gguf", "'", path, "' is neither a model folder nor a .gguf file");
    m.gguf = std::make_unique<GgufFile>(GgufFile::open(path));
    m.config = config_from_gguf(*m.gguf);
    m.naming = WeightNaming::gguf;
  }
  m.weights = validate_weights(m.config, m.tensors(), m.naming);
  if (m.config.num_experts > 0) m.experts = build_expert_weights(m.config, m.weights, m.naming);
  return m;
}

}  // namespace tq
